"""`vcpo eval TASK.yaml`: wire a task, a model and an engine (any backend, or an OpenAI-compatible
URL) into `agent_env.evaluation.evaluate`, with a progress bar showing live accuracy and a summary table.

With `--backend openai`, `--model` is only where the tokenizer comes from (prompts are rendered
and answers read with it) and `--served-model` is the name sent to the server; without it the
server's `GET /models` decides: its only model, else the listed id equal to `--model`. When that
listing gives the model's context length (vLLM's `max_model_len`) and it is shorter than the
task's episode budget, the command stops before the first request: the server would refuse every
turn whose prompt + `max_tokens` passes it, part-way through the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_env.evaluation.evaluate import EvalFileError, evaluate
from agent_env.runtime import episode_settings
from run.train.wiring import engine_settings, load_task, task_runtime

if TYPE_CHECKING:
    from rollout.engines.openai_engine import ServedModel


class EvalArgumentError(ValueError):
    """The command line cannot work as given (e.g. which served model to use is unclear)."""


def choose_served_model(served: list[str], model: str, url: str) -> str:
    """The name to send: the server's only model, else the served id equal to `model`."""
    if len(served) == 1:
        return served[0]
    if model in served:
        return model
    listing = ", ".join(repr(name) for name in served) if served else "no model"
    raise EvalArgumentError(f"{url}/models lists {listing}, none of them is --model {model!r}; pass the "
                            "name to send as --served-model NAME")


def check_context_length(served: list[ServedModel], name: str, max_total_tokens: int, url: str) -> None:
    """Refuse an episode budget longer than the context the server gives `name` (when it says).

    The agent loop asks each turn for up to `max_total_tokens` − prompt tokens, so a budget within the
    server's `max_model_len` is never refused for length; a longer one is, turn by turn, mid-run."""
    lengths = [model.max_model_len for model in served if model.id == name and model.max_model_len]
    if lengths and lengths[0] < max_total_tokens:
        raise EvalArgumentError(
            f"{url}/models gives {name!r} a context of {lengths[0]} tokens (max_model_len), less than this "
            f"task's episode budget of {max_total_tokens} tokens; restart the server with --max-model-len "
            f"{max_total_tokens} or lower the budget with the override eval.max_total_tokens={lengths[0]}")


async def _served_model(args: argparse.Namespace, max_total_tokens: int) -> str | None:
    """`--served-model`, or the one `GET {url}/models` names (None for the in-process backends)."""
    if args.backend != "openai":
        if args.served_model is not None:
            raise EvalArgumentError("--served-model is the name sent to an OpenAI-compatible server; it "
                                    "needs --backend openai --url URL")
        return None
    if args.url is None:
        raise EvalArgumentError("--backend openai needs --url (e.g. http://127.0.0.1:8000/v1)")
    from rollout.engines.openai_engine import served_models
    from rollout.errors import InvalidRequest, MalformedResponse

    url = args.url.rstrip("/")
    try:
        served = await served_models(args.url, os.environ.get("OPENAI_API_KEY"))
    except MalformedResponse as exc:
        if args.served_model is not None:
            return str(args.served_model)  # a server with an odd listing may still complete; no checks
        raise EvalArgumentError(f"{url}/models did not answer a model list ({exc}); pass "
                                "the name to send as --served-model NAME") from None
    except InvalidRequest as exc:
        if exc.http is None or exc.http.status != 404:
            raise
        # vLLM's routes live under /v1: a bare host:port URL finds no /models (a plain "Not Found")
        raise EvalArgumentError(f"{exc.http}; --url must be the server's API root, e.g. "
                                "http://127.0.0.1:8000/v1") from None
    name = str(args.served_model) if args.served_model is not None else choose_served_model(
        [model.id for model in served], str(args.model), url)
    check_context_length(served, name, max_total_tokens, url)
    return name


def _settings(args: argparse.Namespace, served_model: str | None) -> Any:
    if args.backend == "openai":
        return engine_settings({"backend": "openai", "base_url": args.url, "model": served_model,
                                "api_key": os.environ.get("OPENAI_API_KEY")}, "--backend/--url")
    return engine_settings({"backend": args.backend}, "--backend")


def _load_tokenizer(args: argparse.Namespace, cache_dir: Path) -> Any:
    from rollout.models import ModelLoadError, load_tokenizer

    try:
        return load_tokenizer(args.model, cache_dir)
    except ModelLoadError as exc:
        if args.backend != "openai":
            raise
        raise ModelLoadError(f"{exc}. With --backend openai, --model is where the tokenizer comes from "
                             "('default', a local HF directory or a hub id); the name the server knows "
                             "goes in --served-model") from None


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
    from rollout.models import resolve_model

    task, task_path = load_task(args.task, args.overrides)
    k = args.k or task.eval.k
    limit = args.limit if args.limit is not None else task.eval.limit
    settings = episode_settings(task, seed=args.seed, for_eval=True)
    try:
        served_model = await _served_model(args, settings.max_total_tokens)
    except EvalArgumentError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    label = served_model or str(args.model)  # what is evaluated: the served name, else the model spec
    out = args.out or Path("evals") / f"{task.name}-{Path(label).name}.jsonl"
    tokenizer = _load_tokenizer(args, cache_dir)
    model_dir = None if args.backend == "openai" else resolve_model(args.model, cache_dir).name_or_path
    meta = {"task": task.model_dump(mode="json"), "model": str(args.model), "k": k, "seed": args.seed,
            "limit": limit}
    if served_model is not None:
        meta["served_model"] = served_model
    async with task_runtime(task, task_path, model_dir=model_dir, tokenizer=tokenizer,
                            settings=_settings(args, served_model), which="eval", limit=limit) as runtime:
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
                meta=meta, task_name=task.name, on_sample=on_sample, program=runtime.program)
        except EvalFileError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            if bar is not None:
                bar.close()
    summary["skipped_rows"] = runtime.skipped_samples
    out.with_suffix(".summary.json").write_text(json.dumps(summary, indent=1))
    print(format_summary(task.name, label if served_model is None else f"{label} (tokenizer: {args.model})",
                         summary))
    print(f"samples: {out}  summary: {out.with_suffix('.summary.json')}")
    return 0
