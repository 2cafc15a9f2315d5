"""What generation alone costs per step of the default run: the learner's work taken out of the process.

    .venv/bin/python scripts/probe_generation_alone.py [--steps 6] [--sleep 12] [--model DIR] [a.b=c ...]

Runs `vcpo train configs/default.yaml` (from the cached warm start, like compare_default_steps.py) with
the learner's step replaced, after its first real step, by a sleep of `--sleep` seconds that returns that
first step's metrics: the engine, the agent loops, the sandbox and the weight pushes (same weights, every
step) run as in the real run, but nothing else wants the cores. Prints one JSON object: per step after
the first, the wall time the step's generation took (`time/generate`) and the process CPU-seconds
(`time/cpu`, tool-call children included), their medians, and per vLLM engine step (when the engine is
vLLM) its wall time against the tokens it scheduled: decode-only steps (≤ 64 tokens) by batch size and
the steps that prefilled. A sleep shorter than generation makes the learner wait (generation is then
the step); longer, the engine idles at the lag bound between steps. The default run's step
cannot be shorter than (generation's CPU-seconds + the learner's) / cores; this measures the first term.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _patch_learner(sleep_s: float) -> None:
    from learner.backends import torch_learner

    real_step = torch_learner.TorchLearner.step
    first: dict[str, Any] = {}

    def step(self: torch_learner.TorchLearner, batch: torch_learner.StepInput) -> dict[str, Any]:
        if not first:
            first.update(real_step(self, batch))
        else:
            time.sleep(sleep_s)
            self.step_count += 1
        return dict(first)

    torch_learner.TorchLearner.step = step  # type: ignore[method-assign]


def _patch_engine(records: list[dict[str, float]]) -> None:
    """Time vLLM's engine steps, noting the tokens each scheduled (vLLM 0.32 internals; none: skipped)."""
    try:
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError:
        return
    schedule, engine_step = Scheduler.schedule, LLMEngine.step

    def timed_schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = schedule(self, *args, **kwargs)
        records.append({"tokens": float(out.total_num_scheduled_tokens)})
        return out

    def timed_step(self: Any) -> Any:
        started = time.perf_counter()
        result = engine_step(self)
        if records:
            records[-1]["seconds"] = time.perf_counter() - started
        return result

    Scheduler.schedule, LLMEngine.step = timed_schedule, timed_step  # type: ignore[method-assign]


def _engine_summary(records: list[dict[str, float]]) -> dict[str, Any]:
    steps = [r for r in records if "seconds" in r and r["tokens"] > 0]
    if not steps:
        return {}
    decode = [r for r in steps if r["tokens"] <= 64]
    by_batch: dict[int, list[float]] = {}
    for r in decode:
        by_batch.setdefault(int(r["tokens"]), []).append(r["seconds"])
    prefill = [r for r in steps if r["tokens"] > 64]
    return {
        "engine_steps": len(steps), "engine_seconds": sum(r["seconds"] for r in steps),
        "decode_steps": len(decode), "decode_seconds": sum(r["seconds"] for r in decode),
        "decode_tokens": sum(r["tokens"] for r in decode),
        "decode_ms_by_batch": {b: round(1000 * statistics.median(v), 1) for b, v in sorted(by_batch.items())},
        "prefill_steps": len(prefill), "prefill_seconds": sum(r["seconds"] for r in prefill),
        "prefill_tokens": sum(r["tokens"] for r in prefill),
    }


def _child(args: argparse.Namespace, out: Path) -> int:
    from cli.main import main

    records: list[dict[str, float]] = []
    _patch_learner(args.sleep)
    _patch_engine(records)
    code = main(["train", str(ROOT / "configs" / "default.yaml"), f"run_dir={out / 'run'}",
                 f"model.path={args.model}", "warm_start.enabled=false", f"trainer.total_steps={args.steps}",
                 "--no-progress", *args.overrides])
    (out / "engine.json").write_text(json.dumps(_engine_summary(records)))
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="RL steps (the first trains for real, untimed)")
    parser.add_argument("--sleep", type=float, default=12.0, help="seconds each later learner step sleeps")
    parser.add_argument("--model", default=None, help="starting weights (default: the cached warm start)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="a.b.c=value overrides of configs/default.yaml")
    args = parser.parse_args()
    if args.child:
        return _child(args, Path(args.child))
    if args.model is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from compare_default_steps import _warm_start_model

        args.model = _warm_start_model()
    from learner.launch.allocator import find_tcmalloc

    tcmalloc = find_tcmalloc()  # as `vcpo train` would run (it re-executes itself on tcmalloc where found)
    env = {**os.environ, **({"LD_PRELOAD": tcmalloc} if tcmalloc else {})}
    with tempfile.TemporaryDirectory(prefix="vcpo-generation-") as tmp:
        command = [str(ROOT / ".venv" / "bin" / "python"), __file__, "--child", tmp,
                   "--steps", str(args.steps), "--sleep", str(args.sleep), "--model", args.model,
                   *args.overrides]
        subprocess.run(command, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        metrics = (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in metrics]
        engine = json.loads((Path(tmp) / "engine.json").read_text())
    timed = [r for r in records[1:] if float(r.get("time/generate") or 0) > 0]
    generate = [float(r["time/generate"]) for r in timed]
    cpu = [float(r["time/cpu"]) for r in timed]
    print(json.dumps({
        "model": args.model, "sleep_s": args.sleep, "overrides": args.overrides,
        "generate_s": generate, "cpu_s": cpu,
        "median_generate_s": statistics.median(generate) if generate else None,
        "median_cpu_s": statistics.median(cpu) if cpu else None,
        "tokens_generated": [r.get("tokens/generated") for r in timed],
        "engine": engine,
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
