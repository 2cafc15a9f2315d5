"""`vcpo eval TASK.yaml`: wire a task, a model and an engine (any backend, or an OpenAI-compatible
URL) into `agent_env.evaluate`, with a progress bar showing live accuracy and a summary table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from agent_env.evaluate import EvalFileError, evaluate
from learner.compose import engine_settings, load_task, task_runtime
from learner.trainer import episode_settings


def _settings(args: argparse.Namespace) -> Any:
    if args.backend == "openai":
        if args.url is None:
            raise SystemExit("error: --backend openai needs --url (e.g. http://127.0.0.1:8000/v1)")
        return engine_settings({"backend": "openai", "base_url": args.url, "model": args.model,
                                "api_key": os.environ.get("OPENAI_API_KEY")}, "--backend/--url")
    return engine_settings({"backend": args.backend}, "--backend")


def format_summary(task: str, model: str, summary: dict[str, Any]) -> str:
    """A small table for the terminal (fractions as percentages)."""
    rows = [("task", task), ("model", model)]
    for key, value in summary.items():
        if isinstance(value, float) and ("@" in key or key.endswith("_frac")):
            rows.append((key, f"{100 * value:.1f}%"))
        elif isinstance(value, float):
            rows.append((key, f"{value:.2f}"))
        else:
            rows.append((key, str(value)))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key.ljust(width)}  {value}" for key, value in rows)


async def run_evaluation(args: argparse.Namespace, cache_dir: Path) -> int:
    from rollout.models import load_tokenizer, resolve_model

    task, task_path = load_task(args.task, args.overrides)
    k = args.k or task.eval.k
    limit = args.limit if args.limit is not None else task.eval.limit
    settings = episode_settings(task, seed=args.seed, for_eval=True)
    out = args.out or Path("evals") / f"{task.name}-{Path(str(args.model)).name}.jsonl"
    tokenizer = load_tokenizer(args.model, cache_dir)
    model_dir = None if args.backend == "openai" else resolve_model(args.model, cache_dir).name_or_path
    meta = {"task": task.model_dump(mode="json"), "model": str(args.model), "k": k, "seed": args.seed,
            "limit": limit}
    async with task_runtime(task, task_path, model_dir=model_dir, tokenizer=tokenizer,
                            settings=_settings(args), which="eval", limit=limit) as runtime:
        total = len(runtime.samples) * k
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=task.name, unit="sample", file=sys.stderr)
        correct = [0, 0]

        def on_sample(record: dict[str, Any]) -> None:
            correct[0] += record["is_correct"]
            correct[1] += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(acc=f"{correct[0] / correct[1]:.3f}", tools=record["tool_calls"])

        try:
            summary = await evaluate(
                runtime.engine, tokenizer, runtime.tool, system=task.prompt.system, user=task.prompt.user,
                samples=runtime.samples, reward=runtime.reward, settings=settings, k=k, out_path=out,
                meta=meta, task_name=task.name, on_sample=on_sample)
        except EvalFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            if bar is not None:
                bar.close()
    summary["skipped_rows"] = runtime.skipped_samples
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    print(format_summary(task.name, str(args.model), summary))
    print(f"samples: {out}  summary: {out.with_suffix('.summary.json')}")
    return 0
