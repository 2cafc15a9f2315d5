"""The GPU check (scripts/gpu_check.sh, scripts/gpu_check.py) fails on the GPU only for what only a GPU can
show: every part's command line is a valid config here, in both its GPU and its rehearsal form, and the
rehearsal's first part runs end to end and writes the report. The whole rehearsal (a fresh venv from the
carried wheels, no network) is `bash scripts/gpu_check.sh --rehearse` (minutes; README "On a GPU")."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cli.config_catalog import bench_schema_of
from configs.loader import load_config
from configs.schema import RunConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _config_and_overrides(argv: list[str]) -> tuple[str, Path, list[str]]:
    """(command, config file, overrides) of a `python -m cli train|bench ...` command line."""
    args = [arg for arg in argv[argv.index("cli") + 1:] if arg not in ("-v", "--verbose")]
    if "--out" in args:
        at = args.index("--out")
        del args[at:at + 2]
    if args[0] == "train":
        rest = [a for a in args[1:] if not a.startswith("--")]
        return "train", REPO / rest[0], rest[1:]
    at = args.index("--config")
    return f"bench {args[1]}", REPO / args[at + 1], args[at + 2:]


@pytest.mark.parametrize("rehearse", [False, True], ids=["cuda_form", "rehearsal_form"])
def test_every_part_command_is_a_valid_config(gpu_check: ModuleType, tmp_path: Path, rehearse: bool) -> None:
    checked = []
    for part in gpu_check.PARTS:
        argv = part.argv(tmp_path, rehearse)
        if "cli" not in argv:
            continue
        command, config, overrides = _config_and_overrides(argv)
        schema = RunConfig if command == "train" else bench_schema_of(config)
        assert schema is not None, (part.name, config)
        loaded = load_config(config, schema, overrides)
        device = getattr(loaded, "device", None) or getattr(getattr(loaded, "learner", None), "device", None)
        assert device == ("cpu" if rehearse else "cuda"), (part.name, device)
        checked.append(part.name)
    assert {"main_job", "train_lag0_fp32", "bench_learner_bf16", "bench_megatron_bf16",
            "bench_opob_fp32", "staleness_tiny"} <= set(checked)


def test_the_lag0_part_trains_at_lag_0_in_fp32(gpu_check: ModuleType, tmp_path: Path) -> None:
    part = next(p for p in gpu_check.PARTS if p.name == "train_lag0_fp32")
    _, config, overrides = _config_and_overrides(part.argv(tmp_path, False))
    run = load_config(config, RunConfig, overrides)
    assert run.rollout.max_lag == 0 and run.learner.autocast == "none" and run.model.dtype == "float32"


def test_the_main_job_part_is_the_default_run_whole_on_the_gpu(gpu_check: ModuleType, tmp_path: Path) -> None:
    """The GPU form changes only where the run happens and how many held-out episodes share a batch:
    the default run's steps, held-out prompts, algorithm and numerics are the main job's."""
    part = next(p for p in gpu_check.PARTS if p.name == "main_job")
    _, config, overrides = _config_and_overrides(part.argv(tmp_path, False))
    run, default = load_config(config, RunConfig, overrides), load_config(config, RunConfig, [])
    assert run.engine["device"] == run.learner.device == "cuda" and run.engine["max_batch_size"] >= 128
    assert run.trainer.eval_concurrency >= run.trainer.eval_samples == default.trainer.eval_samples
    assert (run.trainer.total_steps, run.trainer.eval_every) == (default.trainer.total_steps,
                                                                 default.trainer.eval_every)
    assert run.algo == default.algo and run.optim == default.optim and run.warm_start == default.warm_start


def test_the_main_job_part_reads_held_out_success_and_renders_one_figure(gpu_check: ModuleType,
                                                                         tmp_path: Path) -> None:
    from benchmarks.results_page import _gpu_part_figure

    run_dir = tmp_path / "main_job"
    run_dir.mkdir()
    steps = [{"trainer_step": step, "train/trajectories": 16, "time/step": 4.0, "reward/mean": 0.5,
              "staleness/max": min(step - 1, 2)} for step in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    heldout = [{"step": 0, "success": 0.125, "prompts": 128}, {"step": 10, "success": 0.875, "prompts": 128}]
    (run_dir / "summary.json").write_text(json.dumps({
        "wall_s": 200.0, "phases_s": {"RL": 40.0}, "heldout": heldout,
        "heldout_change": {"gain": 0.75, "low": 0.68, "high": 0.82}}))
    result = gpu_check._main_job_summary(tmp_path, False)
    assert result["steps"] == 10 and result["heldout"] == heldout and result["wall_s"] == 200.0
    assert _gpu_part_figure("main_job", result) == (
        "held-out 12.5% → 87.5% (+75.0 points, +68.0 to +82.0); 10 steps, 4.0 s per step; 200 s in all")
    assert _gpu_part_figure("main_job", {"steps": 3, "step_s_mean": 4.0}) == "3 steps, 4.0 s per step"


def test_rehearsal_env_part_writes_the_report(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--rehearse", "--parts", "env", "--out", str(tmp_path)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    env = report["parts"]["env"]
    assert report["rehearse"] and env["status"] == "ok"
    assert env["result"]["device"] == "cpu" and env["result"]["matmul_peak_gflops"]["float32"] > 0
    assert "not carried" in env["result"]["not_carried"] and "bwrap" in env["result"]
    assert "===== env" in (tmp_path / "gpu_check.log").read_text()


def test_an_unknown_part_is_refused_with_the_known_ones(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--parts", "nope", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown parts ['nope']" in done.stderr and "main_job" in done.stderr


PRODUCT_PACKAGES = ("agent_env", "benchmarks", "cli", "configs", "learner", "rollout", "run", "tools",
                    "vcpo")


def _module_level_imports(package: str) -> dict[str, str]:
    """Top-level third-party module → one file importing it at module level (what `import vcpo…` needs)."""
    found: dict[str, str] = {}
    for path in sorted((REPO / package).rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in (*PRODUCT_PACKAGES, "__future__"):
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _travelling_or_on_the_image() -> set[str]:
    """The distributions gpu_wheels.sh carries (WHEELS) and those its --base stand-in lists as the image's."""
    script = (REPO / "scripts" / "gpu_wheels.sh").read_text()
    wheels = re.search(r"^WHEELS=\((.*?)^\)", script, re.S | re.M)
    base = re.search(r"base-venv/bin/pip install -q --disable-pip-version-check (.*?)\n\s*fi", script, re.S)
    assert wheels and base, "scripts/gpu_wheels.sh: the WHEELS list or the --base install line moved"
    names = (wheels.group(1) + " " + base.group(1).replace("\\", " ")).split()
    return {_normalised(re.split(r"[=<>]", name)[0]) for name in names if not name.startswith("#")}


def test_every_module_level_import_travels_to_the_gpu_or_is_on_its_image() -> None:
    """A module-level import of a package the GPU machine lacks fails every part at import there (as a new
    dependency once did): each must be carried by gpu_wheels.sh or be on the image."""
    have = _travelling_or_on_the_image()
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for package in PRODUCT_PACKAGES:
        for module, path in _module_level_imports(package).items():
            names = {_normalised(name) for name in distributions.get(module, [module])}
            if not names & have:
                missing.append(f"{module} ({path})")
    assert not missing, f"add to scripts/gpu_wheels.sh's WHEELS (or --base, if the image has it): {missing}"


def test_the_import_check_reads_both_lists() -> None:
    have = _travelling_or_on_the_image()
    assert {"jsonschema", "torch", "pyyaml", "megatron-core"} <= have
    assert "vllm" not in have  # not carried: the check would flag a module-level vllm import
