"""Which schema validates which shipped YAML file, for `vcpo config check` and the tests.

Lives in the composition layer because it joins schemas from several layers (run configs from
`configs/`, benchmark configs from `benchmarks/`, tool specs from `tools/`, rewards from `agent_env/`);
`configs/` itself stays pydantic-only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import configs
from benchmarks import BENCH_CONFIG_ROOT
from benchmarks.schema import (
    AsyncBenchConfig,
    EngineBenchConfig,
    LearnerBenchConfig,
    MainJobBenchConfig,
    OpobBenchConfig,
    SandboxBenchConfig,
)
from benchmarks.staleness.schema import (
    StalenessBenchConfig,
    StalenessRealBenchConfig,
    StalenessTimedBenchConfig,
    staleness_schema,
)
from configs.loader import ConfigError, load_config, read_yaml_tree
from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from tools.base import ToolConfigError
from tools.registry import validate_tool_settings
from tools.settings import SandboxServerSettings

CONFIG_ROOT = Path(configs.__file__).resolve().parent


def _tool_spec(path: Path) -> Any:
    try:
        return validate_tool_settings(read_yaml_tree(path))[1]
    except ToolConfigError as exc:
        raise ConfigError(str(path), [str(exc)]) from None


BENCH_SCHEMAS: dict[str, type] = {"opob": OpobBenchConfig, "async": AsyncBenchConfig,
                                   "engine": EngineBenchConfig, "sandbox": SandboxBenchConfig,
                                   "staleness": StalenessBenchConfig,
                                   "staleness_real": StalenessRealBenchConfig,
                                   "staleness_timed": StalenessTimedBenchConfig,
                                   "learner": LearnerBenchConfig,
                                   "main_job": MainJobBenchConfig}
"""benchmarks/configs/<name>.yaml (or a preset <name>_<variant>.yaml) → the schema of `vcpo bench <name>`."""


def _in_bench_configs(path: Path) -> bool:
    return Path(path).resolve().parent == BENCH_CONFIG_ROOT


def is_bench_config(path: Path) -> bool:
    """Whether `path` is one of the shipped benchmark configs (benchmarks/configs/), with a known schema."""
    return _in_bench_configs(path) and bench_schema_of(Path(path)) is not None


def bench_schema_of(path: Path) -> type | None:
    """The `vcpo bench` schema of a bench YAML, by its name (a preset's `_<variant>` suffix ignored)."""
    for name in sorted(BENCH_SCHEMAS, key=len, reverse=True):  # the longest name first: main_job, not main
        if path.stem == name or path.stem.startswith(name + "_"):
            return BENCH_SCHEMAS[name]
    return None


def bench_command_schema(name: str, config: Path | None) -> type:
    """The schema `vcpo bench <name> [--config FILE]` validates with: by the bench's name, and for
    `staleness` by the file's `kind` (`real`: the real-model preset, `timed`: the simulated-clock one)."""
    if name == "staleness" and config is not None:
        return staleness_schema(read_yaml_tree(config))
    schema = BENCH_SCHEMAS.get(name)
    if schema is None:
        raise ValueError(f"no bench named {name!r}; known: {', '.join(sorted(BENCH_SCHEMAS))}")
    return schema


def check_task_config(path: str | Path, overrides: Sequence[str] = ()) -> TaskConfig:
    """Load a task YAML and check what its schema cannot (`run.train.wiring.load_task`: the tool
    spec and that the reward builds). Raises ConfigError listing every problem."""
    from run.train.wiring import load_task

    return load_task(path, overrides)[0]


_VALIDATORS: dict[str, Callable[[Path], Any]] = {
    "sandbox": lambda path: load_config(path, SandboxServerSettings),
    "tasks": check_task_config,
    "tools": _tool_spec,
}


def check_run_config(path: Path) -> RunConfig:
    """A run config, with its task file (plus `task_overrides`) and its engine section checked too."""
    from run.train.wiring import engine_settings, resolve_task_path

    config = load_config(path, RunConfig)
    task_path = resolve_task_path(config.task, Path(path).parent)
    check_task_config(task_path, config.task_overrides)
    for eval_set in config.trainer.eval_sets:  # a benchmark's task file, checked as the run's own is
        if eval_set.task is not None:
            check_task_config(resolve_task_path(eval_set.task, task_path.parent), eval_set.task_overrides)
    engine_settings(config.engine, str(path))
    if config.launcher == "ray":
        from run.launch.ray_launcher import RayLaunchError, check_layout

        try:
            check_layout(config)
        except RayLaunchError as exc:
            raise ConfigError(str(path), [f"ray: {exc}"]) from None
    return config


def validate_shipped_file(path: Path) -> Any:
    """Validate a shipped YAML file: a benchmark's with its bench schema, one under configs/ with the schema
    of its first sub-folder (else a run)."""
    if _in_bench_configs(path):
        schema = bench_schema_of(Path(path))
        if schema is None:
            raise ConfigError(str(path), [f"no `vcpo bench` is named like this file; name it after one of "
                                          f"{sorted(BENCH_SCHEMAS)} (or <name>_<variant>.yaml)"])
        return load_config(path, schema)
    relative = Path(path).resolve().relative_to(CONFIG_ROOT)
    folder = relative.parts[0] if len(relative.parts) > 1 else ""
    return _VALIDATORS.get(folder, check_run_config)(path)


def shipped_config_files() -> list[Path]:
    """Every YAML file shipped under configs/ and benchmarks/configs/."""
    return sorted(p for root in (CONFIG_ROOT, BENCH_CONFIG_ROOT) for p in root.rglob("*.yaml") if p.is_file())
