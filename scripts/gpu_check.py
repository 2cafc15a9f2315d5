"""The GPU check's parts, each a subprocess with its own time limit, inside one overall budget.

Run by scripts/gpu_check.sh (which builds the environment first); by hand:

    python scripts/gpu_check.py --out DIR [--rehearse] [--parts env,train,...] [--budget 470]

Writes DIR/report.json after every part (a killed check keeps what it measured) and appends each
part's output to DIR/gpu_check.log. A failed or timed-out part is recorded and the next one runs.
`--rehearse` runs the same parts on this machine's CPU with tiny sizes: every path, override and
report field is exercised, no figure means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NOT_CARRIED = ("vLLM and SGLang are not carried to the GPU machine (each is gigabytes of CUDA wheels, over "
               "the 64 MiB a loan carries); their GPU tests skip with that reason")


@dataclass
class Part:
    """One measured piece: the command (GPU and rehearsal forms), its limit, how to read its result."""

    name: str
    limit_s: int
    argv: Callable[[Path, bool], list[str]]
    summarize: Callable[[Path, bool], dict[str, Any]] = field(default=lambda work, rehearse: {})


def _vcpo(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli", *args]


# ---------------------------------------------------------------------------------------------
# env: the card, the software, the measured matmul peaks, whether the sandbox can start


def env_probe(rehearse: bool) -> dict[str, Any]:
    import torch
    import transformers

    from benchmarks.learner_step import matmul_peak_gflops

    device = "cuda" if torch.cuda.is_available() and not rehearse else "cpu"
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "transformers": transformers.__version__, "device": device,
        "cuda_available": torch.cuda.is_available(), "not_carried": NOT_CARRIED,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}")
    for module in ("megatron.core", "mbridge", "vllm", "sglang", "transformer_engine"):
        try:
            __import__(module)
            info[f"import_{module}"] = "ok"
        except Exception as exc:  # a missing or broken package is a finding, not a crash
            info[f"import_{module}"] = f"{type(exc).__name__}: {exc}"[:200]
    size = 512 if rehearse else 8192
    info["matmul_peak_gflops"] = {name: matmul_peak_gflops(getattr(torch, name), device, size)
                                  for name in ("float32", "bfloat16")}
    info["matmul_peak_size"] = size
    bwrap = shutil.which("bwrap")
    probe = subprocess.run([bwrap or "bwrap", "--ro-bind", "/", "/", "--unshare-all", "true"],
                           capture_output=True, text=True) if bwrap else None
    info["bwrap"] = bwrap and ("ok" if probe.returncode == 0 else f"fails: {probe.stderr.strip()[:200]}")
    return info


# ---------------------------------------------------------------------------------------------
# readers of each part's output


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _pytest_summary(work: Path, rehearse: bool) -> dict[str, Any]:
    junit = work / "junit.xml"
    if not junit.is_file():
        return {}
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure") if case.find("failure") is not None else case.find("error")
        if failure is not None:
            outcomes["failed"].append(f"{name}: {(failure.get('message') or '')[:300]}")
        elif case.find("skipped") is not None:
            outcomes["skipped"].append(f"{name}: {(case.find('skipped').get('message') or '')[:200]}")
        else:
            outcomes["passed"].append(name)
    return {**outcomes, **{f"n_{key}": len(value) for key, value in outcomes.items()},
            "not_run": [f"{name}: {NOT_CARRIED}" for name in NOT_CARRIED_TESTS]}


def _learner_summary(work: Path, rehearse: bool, name: str) -> dict[str, Any]:
    results = _json(work / f"{name}.json").get("results", {})
    keep = ("device", "dtype", "matmul_dtype", "step_s_mean", "phases_s_mean", "tokens_per_s", "mfu",
            "model_gflops_per_s", "matmul_peak_gflops", "peak_memory_mib", "roofline_fraction",
            "step_over_floor", "vs_torch", "trained_parameters", "vs_full_weights", "error", "skipped")
    return {backend: {k: row[k] for k in keep if k in row} for backend, row in results.items()}


def _sweep_summary(work: Path, rehearse: bool, name: str) -> dict[str, Any]:
    data = _json(work / f"{name}.json")
    keep = ("backend", "row", "length", "recompute", "step_s_mean", "phases_s_mean", "tokens_per_s", "mfu",
            "model_gflops_per_s", "matmul_peak_gflops", "peak_memory_mib", "error", "skipped")
    return {"rows": [{k: row[k] for k in keep if k in row} for row in data.get("rows", [])],
            "ratios": data.get("ratios", [])}


def _opob_summary(work: Path, rehearse: bool, name: str) -> dict[str, Any]:
    data = _json(work / f"{name}.json")
    return {key: data.get(key) for key in ("dtype", "device", "parameters", "peak_memory_mib", "rows")}


def _train_summary(work: Path, rehearse: bool, name: str) -> dict[str, Any]:
    path = work / name / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "train/trajectories" in r]
    evals = [r for r in records if "eval/success" in r]
    on_policy = [r for r in steps if r.get("staleness/max") == 0]
    log_w = [abs(r[key]) for r in on_policy for key in ("is/log_w_min", "is/log_w_max") if key in r]
    return {
        "steps": len(steps),
        "step_s_mean": sum(r.get("time/step", 0.0) for r in steps) / max(1, len(steps)),
        "reward_mean": [round(r.get("reward/mean", float("nan")), 4) for r in steps],
        "ess_ratio": [round(r.get("is/ess_ratio", float("nan")), 4) for r in steps],
        "staleness_max": [r.get("staleness/max") for r in steps],
        "eval_success": [(r.get("trainer_step"), r.get("eval/success")) for r in evals],
        "lag0_steps": len(on_policy),
        "lag0_max_abs_log_ratio": max(log_w) if log_w else None,
        "lag0_ratio_exactly_1": bool(log_w) and max(log_w) == 0.0,
        "nonfinite_trajectories": sum(r.get("train/nonfinite_trajectories", 0) for r in steps),
    }


def _main_job_summary(work: Path, rehearse: bool) -> dict[str, Any]:
    summary = _json(work / "main_job" / "summary.json")
    keys = ("wall_s", "phases_s", "heldout", "heldout_change")
    kept = {key: summary[key] for key in keys if key in summary}
    return {**_train_summary(work, rehearse, "main_job"), **kept}


def _staleness_summary(work: Path, rehearse: bool) -> dict[str, Any]:
    data = _json(work / "staleness.json")
    return {key: data.get(key) for key in ("summary", "table", "methods", "regime") if key in data}


# ---------------------------------------------------------------------------------------------
# the parts, in the order they run (the most telling first: a tight budget cuts the tail)

_TINY_LEARNER = ["kind=llama", "hidden_size=64", "intermediate_size=128", "num_hidden_layers=2",
                 "num_attention_heads=4", "num_key_value_heads=2", "vocab_size=512", "tokens=64",
                 "prompt=32", "sampled=16", "micro_batch_tokens=512", "steps=1", "peak_gemm_size=256"]


def _train_argv(name: str, extra: list[str], rehearse_steps: int) -> Callable[[Path, bool], list[str]]:
    def argv(work: Path, rehearse: bool) -> list[str]:
        device = "cpu" if rehearse else "cuda"
        sizes = ([f"trainer.total_steps={rehearse_steps}", "trainer.eval_samples=4", "warm_start.examples=8",
                  "warm_start.epochs=1"] if rehearse else [])
        return _vcpo("train", "--no-progress", "configs/default.yaml", f"run_dir={work / name}",
                     "engine.backend=hf", f"engine.device={device}", f"learner.device={device}",
                     "trainer.checkpoint_every=1000", *extra, *sizes)
    return argv


def _learner_argv(dtype: str, backends: str, name: str) -> Callable[[Path, bool], list[str]]:
    def argv(work: Path, rehearse: bool) -> list[str]:
        sizes = _TINY_LEARNER if rehearse else ["peak_gemm_size=8192"]
        # -v: the bench logs each step, so a part cut at its limit still says how far it got
        return _vcpo("-v", "bench", "learner", "--config", "benchmarks/configs/learner.yaml",
                     f"device={'cpu' if rehearse else 'cuda'}", f"dtype={dtype}", f"backends={backends}",
                     *sizes, "--out", str(work / f"{name}.json"))
    return argv


_TINY_SWEEP = ["dtype=float32", "hidden_size=64", "intermediate_size=128", "num_hidden_layers=2",
               "num_attention_heads=4", "num_key_value_heads=2", "vocab_size=512", "group_size=2", "steps=1",
               "peak_gemm_size=256", "sweep.lengths=[128]", "logits_chunk_mib=0.01"]


def _lora_argv(work: Path, rehearse: bool) -> list[str]:
    sizes = [*_TINY_LEARNER, "dtype=float32"] if rehearse else []
    return _vcpo("-v", "bench", "learner", "--config", "benchmarks/configs/learner_lora_gpu.yaml",
                 f"device={'cpu' if rehearse else 'cuda'}", *sizes, "--out", str(work / "learner_lora.json"))


def _sweep_argv(backends: str, name: str, extra: tuple[str, ...] = ()) -> Callable[[Path, bool], list[str]]:
    def argv(work: Path, rehearse: bool) -> list[str]:
        sizes = _TINY_SWEEP if rehearse else []
        return _vcpo("-v", "bench", "learner", "--config", "benchmarks/configs/learner_long_gpu.yaml",
                     f"device={'cpu' if rehearse else 'cuda'}", f"backends={backends}", *extra, *sizes,
                     "--out", str(work / f"{name}.json"))
    return argv


def _opob_argv(dtype: str) -> Callable[[Path, bool], list[str]]:
    def argv(work: Path, rehearse: bool) -> list[str]:
        sizes = ["model=tiny", "lengths=[64]", "repeats=1"] if rehearse else []
        return _vcpo("bench", "opob", "--config", "benchmarks/configs/opob.yaml",
                     f"device={'cpu' if rehearse else 'cuda'}", f"dtype={dtype}", *sizes,
                     "--out", str(work / f"opob_{dtype}.json"))
    return argv


# GPU test modules that need what is not carried (SGLang, and fastapi for its fake server)
NOT_CARRIED_TESTS = ("tests/rollout/engines/test_sglang_engine.py",)


def _pytest_argv(work: Path, rehearse: bool) -> list[str]:
    files = sorted({str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                    if "mark.gpu" in path.read_text()} - set(NOT_CARRIED_TESTS))
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider",
            f"--junitxml={work / 'junit.xml'}", *files]


def _staleness_argv(work: Path, rehearse: bool) -> list[str]:
    sizes = ["steps=20", "lags=[0,4]"] if rehearse else ["lags=[0,16]"]
    return _vcpo("bench", "staleness", "--config", "benchmarks/configs/staleness_tiny.yaml",
                 f"device={'cpu' if rehearse else 'cuda'}", "only=[grpo,vcpo]", "seeds=[0]", *sizes,
                 f"run_root={work / 'staleness_root'}", f"results_dir={work / 'staleness_runs'}",
                 "--out", str(work / "staleness.json"))


PARTS = [
    Part("env", 45, lambda work, rehearse: [sys.executable, __file__, "--probe"]
         + (["--rehearse"] if rehearse else []),
         lambda work, rehearse: _json(work / "env.json")),
    # the main job whole (`bash scripts/run.sh`'s run: warm start from the carried GGUF, 10 steps of VCPO at
    # k = 2, held-out success on 128 prompts before, at step 5 and after), engine and learner on the GPU;
    # every held-out episode in one engine batch (on 2 CPU cores 32 at a time is what pays)
    # long trajectories (16k tokens, a Qwen2.5-1.5B shape in bf16): GRPO, VCPO fast, VCPO per trajectory,
    # recompute off/on, each row in its own process; megatron at TP = 1 with its full recompute (its local
    # attention's dense (N, N) scores grow with the square of the micro-batch: without recompute every
    # layer's stay alive, 96 GiB at 16k on the last loan)
    Part("bench_learner_long", 330, _sweep_argv("[torch]", "learner_long"),
         lambda work, rehearse: _sweep_summary(work, rehearse, "learner_long")),
    Part("bench_megatron_long", 170, _sweep_argv("[megatron]", "megatron_long", (
        "sweep.recompute=[true]", "sweep.rows=[grpo,vcpo_fast]", "sweep.lengths=[16384]")),
         lambda work, rehearse: _sweep_summary(work, rehearse, "megatron_long")),
    Part("main_job", 330, _train_argv("main_job", ["trainer.eval_concurrency=128",
                                                   "engine.max_batch_size=160"], 2),
         _main_job_summary),
    Part("pytest_gpu", 90, _pytest_argv, _pytest_summary),
    # the torch learner apart from megatron's: a bench writes its JSON at its end, so one backend that
    # overruns would take the other's figures with it
    Part("bench_learner_bf16", 60, _learner_argv("bfloat16", "[torch]", "learner_bf16"),
         lambda work, rehearse: _learner_summary(work, rehearse, "learner_bf16")),
    # LoRA beside full fine-tuning at 4k tokens on the Qwen2.5-1.5B shape (bf16): step time and peak memory,
    # each row in its own process
    Part("bench_learner_lora", 120, _lora_argv,
         lambda work, rehearse: _learner_summary(work, rehearse, "learner_lora")),
    Part("bench_opob_bf16", 45, _opob_argv("bfloat16"),
         lambda work, rehearse: _opob_summary(work, rehearse, "opob_bfloat16")),
    # lag 0, fp32 everywhere: is π_old / μ exactly 1 when the engine samples with the learner's weights?
    Part("train_lag0_fp32", 75, _train_argv("lag0", ["trainer.total_steps=3", "trainer.eval_every=0",
                                                     "rollout.max_lag=0", "learner.autocast=none"], 1)
         , lambda work, rehearse: _train_summary(work, rehearse, "lag0")),
    Part("staleness_tiny", 90, _staleness_argv, _staleness_summary),
    Part("bench_megatron_bf16", 150, _learner_argv("bfloat16", "[megatron]", "megatron_bf16"),
         lambda work, rehearse: _learner_summary(work, rehearse, "megatron_bf16")),
    Part("bench_learner_fp32", 100, _learner_argv("float32", "[torch,torch-autocast]", "learner_fp32"),
         lambda work, rehearse: _learner_summary(work, rehearse, "learner_fp32")),
    Part("bench_opob_fp32", 75, _opob_argv("float32"),
         lambda work, rehearse: _opob_summary(work, rehearse, "opob_float32")),
]


def run_parts(out: Path, rehearse: bool, names: list[str] | None, budget_s: float) -> dict[str, Any]:
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"rehearse": rehearse, "budget_s": budget_s, "parts": {}}
    report_path, log_path = out / "report.json", out / "gpu_check.log"
    started = time.monotonic()
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    for part in PARTS:
        if names and part.name not in names:
            continue
        left = budget_s - (time.monotonic() - started)
        if left < 20:
            report["parts"][part.name] = {"status": "not run: the check's time budget is spent"}
            continue
        limit = min(part.limit_s * (3 if rehearse else 1), left)
        argv = part.argv(work, rehearse)
        if part.name == "env":
            argv = [*argv, "--json-out", str(work / "env.json")]
        entry: dict[str, Any] = {"argv": " ".join(argv), "limit_s": round(limit)}
        t0 = time.monotonic()
        with log_path.open("a") as log:
            log.write(f"\n===== {part.name} (limit {limit:.0f} s): {entry['argv']}\n")
            log.flush()
            try:
                code = subprocess.run(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=limit, start_new_session=True).returncode
                entry["status"] = "ok" if code == 0 else f"failed (exit {code})"
            except subprocess.TimeoutExpired:
                entry["status"] = f"timed out after {limit:.0f} s"
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        try:
            entry["result"] = part.summarize(work, rehearse)
        except Exception as exc:  # a half-written result is reported, not fatal
            entry["result_error"] = f"{type(exc).__name__}: {exc}"
        if not entry["status"].startswith("ok"):
            entry["log_tail"] = _tail(log_path, 40)
        report["parts"][part.name] = entry
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        report_path.write_text(json.dumps(report, indent=1, default=str))
        print(f"[gpu_check] {part.name}: {entry['status']} in {entry['wall_s']} s", flush=True)
    return report


def _tail(path: Path, lines: int) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu_check")
    parser.add_argument("--rehearse", action="store_true", help="CPU as the device, tiny sizes")
    parser.add_argument("--parts", default="", help="comma-separated part names (default: all)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all parts together (default 480; x3 with --rehearse)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        sys.path.insert(0, str(REPO))
        info = env_probe(args.rehearse)
        args.json_out.write_text(json.dumps(info, indent=1))
        print(json.dumps(info, indent=1))
        return 0
    names = [name for name in args.parts.split(",") if name]
    unknown = set(names) - {part.name for part in PARTS}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; known: {[part.name for part in PARTS]}")
    budget = args.budget if args.budget is not None else 480.0 * (3 if args.rehearse else 1)
    report = run_parts(args.out, args.rehearse, names or None, budget)
    failed = [name for name, entry in report["parts"].items() if entry["status"] != "ok"]
    print(f"[gpu_check] report: {args.out / 'report.json'}; not ok: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
