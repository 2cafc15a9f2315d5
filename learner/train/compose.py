"""Wiring for `vcpo train` and `vcpo eval`: config sections → model, engine, tool, samples, reward.

Part of the composition root (the CLI calls it). It resolves files and validates the untyped
sections (`engine`, the task's `tool`) with their owners' schemas, so every mistake surfaces as a
ConfigError naming the file and field before any model is loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

import configs
from agent_env.datasets import load_samples
from agent_env.rewards import RewardConfigError, build_reward
from agent_env.runtime import TaskRuntime
from configs.loader import ConfigError
from configs.task_schema import TaskConfig, load_task_config
from rollout.settings import EngineSettings
from tools.base import ToolConfigError, has_sessions
from tools.registry import build_tool, validate_tool_settings

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(configs.__file__).resolve().parent.parent
"""The checkout / installed tree that holds `configs/` (shipped task files are found there too)."""


def resolve_task_path(spec: str | Path, relative_to: Path | None = None) -> Path:
    """A task file from a path: as given, then beside the run config, then inside the package."""
    path = Path(spec).expanduser()
    candidates = [path] if path.is_absolute() else [
        Path.cwd() / path, *([relative_to / path] if relative_to else []), PACKAGE_ROOT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    shipped = sorted(p.name for p in (PACKAGE_ROOT / "configs" / "tasks").glob("*.yaml"))
    raise ConfigError(str(spec), [f"task: no such file (looked in: {', '.join(str(c) for c in candidates)}); "
                                  f"shipped tasks: configs/tasks/{{{','.join(shipped)}}}"])


def load_task(spec: str | Path, overrides: Sequence[str] = (), relative_to: Path | None = None
              ) -> tuple[TaskConfig, Path]:
    """The validated task and its file, with what its schema cannot check: the tool spec
    (tools.registry) and that the reward builds (a custom `reward.function` imports and is callable) —
    so a broken task fails here, naming the file and the field, before any model is loaded."""
    path = resolve_task_path(spec, relative_to)
    task = load_task_config(path, overrides)
    problems = []
    if task.tool is not None:
        try:
            tool_class, _ = validate_tool_settings(task.tool)
        except ToolConfigError as exc:
            problems.append(f"tool: {exc}")
        else:
            if task.loop.use_session and not has_sessions(tool_class):
                problems.append(f"loop.use_session: true, but tool type {task.tool['type']!r} keeps no state "
                                "between calls; set loop.use_session: false, or use type: python (the local "
                                "sandbox) or type: e2b for a stateful interpreter")
    try:
        build_reward(task.reward, task.answer)
    except RewardConfigError as exc:
        problems.append(f"reward.function: {exc}")
    if problems:
        raise ConfigError(str(path), problems)
    return task, path


def engine_settings(raw: dict[str, Any], source: str) -> Any:
    """The `engine` section validated against rollout/settings.py (ConfigError naming the fields)."""
    try:
        return TypeAdapter(EngineSettings).validate_python(raw)
    except ValidationError as exc:
        problems = [f"engine.{'.'.join(str(p) for p in error['loc'])}: {error['msg']} "
                    f"(got {error.get('input')!r})" for error in exc.errors()]
        problems.append("backends: auto | hf | vllm | sglang | openai (fields: rollout/settings.py)")
        raise ConfigError(source, problems) from None


@contextlib.asynccontextmanager
async def task_runtime(
    task: TaskConfig,
    task_path: Path,
    *,
    model_dir: Path | str,
    tokenizer: Any,
    settings: Any,
    which: Literal["train", "eval"],
    limit: int | None = None,
    data_dir: Path | None = None,
) -> AsyncIterator[TaskRuntime]:
    """Samples, reward, a started engine and tool for `task`; everything is closed on exit."""
    from rollout.engines.factory import start_engine

    loaded = load_samples(task, which=which, task_dir=task_path.parent, data_dir=data_dir, limit=limit)
    if loaded.skipped:
        log.warning("%s: skipped %d bad rows of %s: %s", task.name, loaded.skipped, loaded.source,
                    loaded.skip_reasons)
    reward = build_reward(task.reward, task.answer)
    engine = await start_engine(settings, model_dir, tokenizer)
    try:
        async with contextlib.AsyncExitStack() as stack:
            tool = await stack.enter_async_context(build_tool(task.tool)) if task.tool is not None else None
            yield TaskRuntime(task, loaded.samples, reward, tokenizer, engine, tool,
                              skipped_samples=loaded.skipped)
    finally:
        await engine.close()
