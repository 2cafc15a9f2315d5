"""The learner step's top kernels at two commits, back to back (a before/after table).

    .venv/bin/python scripts/profile_learner_step.py --before <rev> [--backend torch-autocast]
        [--steps 2] [--top 20] [--tokens 240 --prompt 150 --sampled 70 --groups 2 --group-size 8]
        [--proximal auto|separate|reuse] [--fused-elementwise]

Checks `<rev>` out into a temporary git worktree and, in a fresh process per side (that checkout's code
on its own `PYTHONPATH`), builds `vcpo bench learner`'s learner on the same random SmolLM2-135M-shaped
model and minibatch (VCPO, fast exact norms, 2048-token micro-batches; default shape: the default run's),
runs `--steps` untimed steps, then one step under torch.profiler. Each side runs on the memory allocator
its own `vcpo bench` would pick (tcmalloc where that checkout re-executes on it, glibc before), so the
table shows what a user of each commit gets. Prints one JSON object: per side the profiled step's wall
time and phases, and its top operators by self CPU time (seconds, calls); then `table`, the union of both
sides' top operators with before / after seconds, as Markdown. Profiling adds its own overhead to small
operators; read the wall times from `vcpo bench learner`, this is for where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
sys.path.insert(0, str(ROOT / "scripts"))
from compare_default_steps import checkout  # noqa: E402  (a sibling script: the shared worktree helper)

# Runs inside each side's checkout; only APIs that exist at both ends (70f0a7c .. now).
_CHILD = r"""
import inspect, json, sys, tempfile, time
from pathlib import Path
args = json.loads(sys.argv[1])
try:
    from learner.launch.allocator import prefer_tcmalloc
except ImportError:
    allocator = "glibc (this checkout predates the allocator choice)"
else:
    prefer_tcmalloc(["bench"])  # re-executes this process on tcmalloc where `vcpo bench` would
    from learner.launch.allocator import active_allocator
    allocator = active_allocator()
import torch
from torch.profiler import ProfilerActivity, profile
from configs.schema import AlgoConfig, MegatronConfig
from learner.benchmarks.learner_step import (BenchBatch, BenchShape, _build, random_batch,
                                             write_random_checkpoint)

shape = BenchShape()
batch = BenchBatch(groups=args["groups"], group_size=args["group_size"], tokens=args["tokens"],
                   sampled=args["sampled"], prompt=args["prompt"])
algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "group_size": args["group_size"]})
# options a side's `_build` does not take (an older checkout) are left out: that side runs without them
options = {"proximal": args["proximal"], "share_prompts": True,
           "fused_elementwise": args["fused_elementwise"]}
accepted = inspect.signature(_build).parameters
with tempfile.TemporaryDirectory() as tmp:
    hf = write_random_checkpoint(shape, Path(tmp) / "model")
    learner = _build(args["backend"], hf, "cpu", algo, torch.float32, 2048, MegatronConfig(),
                     **{k: v for k, v in options.items() if k in accepted})
inputs = random_batch(batch, shape.vocab_size)
for _ in range(args["steps"]):
    learner.step(inputs)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    start = time.perf_counter()
    metrics = learner.step(inputs)
    wall = time.perf_counter() - start
ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
print(json.dumps({
    "allocator": allocator, "threads": torch.get_num_threads(), "step_s": wall,
    "phases_s": {k: v for k, v in metrics.items() if k.startswith("time/learner_")},
    "ops": [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "calls": e.count}
            for e in ops[:args["top"]]],
}))
"""


def _profile(tree: Path, args: argparse.Namespace) -> dict[str, object]:
    child_args = {k: getattr(args, k) for k in ("backend", "steps", "top", "tokens", "prompt", "sampled",
                                                 "proximal", "fused_elementwise",
                                                 "groups", "group_size")}
    done = subprocess.run([str(PYTHON), "-c", _CHILD, json.dumps(child_args)], cwd=tree, check=True,
                          env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(before: dict[str, object], after: dict[str, object]) -> str:
    """Markdown: every operator in either side's top list, by the larger of its two times."""
    seconds = {side: {o["op"]: o for o in result["ops"]}  # type: ignore[index, union-attr]
               for side, result in (("before", before), ("after", after))}
    names = sorted(set(seconds["before"]) | set(seconds["after"]),
                   key=lambda n: -max(seconds[s].get(n, {"self_s": 0.0})["self_s"] for s in seconds))

    def cell(side: str, name: str) -> str:
        op = seconds[side].get(name)
        return f"{op['self_s']:.2f} s ({op['calls']})" if op else "—"

    lines = ["| operator (self CPU) | before (calls) | after (calls) |", "| --- | ---: | ---: |"]
    lines += [f"| `{name}` | {cell('before', name)} | {cell('after', name)} |" for name in names]
    lines.append(f"| **profiled step (wall)** | {before['step_s']:.2f} s | {after['step_s']:.2f} s |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit to compare this checkout with")
    parser.add_argument("--backend", default="torch-autocast", choices=("torch", "torch-autocast"))
    parser.add_argument("--steps", type=int, default=2, help="untimed steps before the profiled one")
    parser.add_argument("--top", type=int, default=20, help="operators per side")
    parser.add_argument("--tokens", type=int, default=240)
    parser.add_argument("--prompt", type=int, default=150)
    parser.add_argument("--sampled", type=int, default=70)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--proximal", default="auto", choices=("auto", "separate", "reuse"),
                        help="learner.proximal of both sides (auto: the exact default's separate fp32 pass)")
    parser.add_argument("--fused-elementwise", action="store_true",
                        help="learner.fused_elementwise on, where the side's code has it")
    args = parser.parse_args()
    result: dict[str, object] = {"before": args.before, "after": "working tree", "backend": args.backend}
    with checkout(args.before) as before_tree:
        result["before_profile"] = _profile(before_tree, args)
    result["after_profile"] = _profile(ROOT, args)
    result["table"] = _table(result["before_profile"], result["after_profile"])  # type: ignore[arg-type]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
