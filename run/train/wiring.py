"""Wiring for `vcpo train` and `vcpo eval`: config sections → model, engine, tool, samples, reward.

Part of the composition root (the CLI calls it). It resolves files and validates the untyped
sections (`engine`, the task's tools) with their owners' schemas, so every mistake surfaces as a
ConfigError naming the file and field before any model is loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

import configs
from agent_env.datasets import load_samples
from agent_env.function_calls import ParserConfigError, resolve_parser
from agent_env.rewards import RewardConfigError, build_reward
from agent_env.runtime import TaskRuntime, episode_settings
from agent_env.samples import Sample
from agent_env.tool_messages import ToolTemplateError, check_tools_template
from configs.loader import ConfigError
from configs.schema import EvalSetConfig
from configs.task_schema import TaskConfig, load_task_config
from rollout.settings import EngineSettings
from tools.base import Tool, ToolConfigError, has_sessions, offers_functions
from tools.functions import Toolbox
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
    """The validated task and its file, with what its schema cannot check: the tool specs
    (tools.registry) and that they fit the tool format, the tool parser, the chat template file, and
    that the reward builds (a custom `reward.function` imports and is callable) — so a broken task fails
    here, naming the file and the field, before any model is loaded."""
    path = resolve_task_path(spec, relative_to)
    task = load_task_config(path, overrides)
    problems = [*_tool_problems(task)]
    if task.loop.tool_format == "function_call":
        try:
            resolve_parser(task.loop.tool_parser)
        except ParserConfigError as exc:
            problems.append(f"loop.tool_parser: {exc}")
    if task.prompt.chat_template is not None and not chat_template_path(task, path).is_file():
        problems.append(f"prompt.chat_template: no such file {chat_template_path(task, path)} (a relative "
                        "path is taken from the task file's folder)")
    try:
        build_reward(task.reward, task.answer)
    except RewardConfigError as exc:
        problems.append(f"reward.function: {exc}")
    if task.loop.program is not None:
        problems += _program_problems(task)
    if problems:
        raise ConfigError(str(path), problems)
    return task, path


def _program_problems(task: TaskConfig) -> list[str]:
    """An agent program must import, and its tool calls be readable (the endpoint parses them)."""
    from agent_env.programs.runner import ProgramConfigError, import_program

    problems = []
    try:
        import_program(task.loop.program or "")
    except ProgramConfigError as exc:
        problems.append(str(exc))
    if task.loop.tool_format != "function_call":
        try:
            resolve_parser(task.loop.tool_parser)
        except ParserConfigError as exc:
            problems.append(f"loop.tool_parser: {exc}")
    return problems


def _tool_problems(task: TaskConfig) -> list[str]:
    problems = []
    for index, spec in enumerate(task.tool_specs()):
        where = "tool" if task.tool is not None else f"tools.{index}"
        try:
            tool_class, _ = validate_tool_settings(spec)
        except ToolConfigError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if task.loop.use_session and not has_sessions(tool_class):
            problems.append(f"loop.use_session: true, but tool type {spec['type']!r} keeps no state "
                            "between calls; set loop.use_session: false, or use type: python (the local "
                            "sandbox) or type: e2b for a stateful interpreter")
        if task.loop.tool_format == "code_fence" and offers_functions(tool_class):
            problems.append(f"{where}: tool type {spec['type']!r} offers functions, not a code fence; set "
                            "loop.tool_format: function_call")
    return problems


def chat_template_path(task: TaskConfig, task_path: Path) -> Path:
    """The task's `prompt.chat_template` file (relative to the task file's folder)."""
    return (task_path.parent / Path(task.prompt.chat_template or "").expanduser()).resolve()


async def _enter_tools(stack: contextlib.AsyncExitStack, task: TaskConfig, task_path: Path, tokenizer: Any
                       ) -> Tool | Toolbox | None:
    """The task's tools, started on `stack`: the one tool of a code-fence task, or a toolbox of every
    tool for function calling, checked against the chat template (ConfigError naming the task file)."""
    tools = []
    for index, spec in enumerate(task.tool_specs()):
        try:
            tools.append(await stack.enter_async_context(build_tool(spec)))
        except ToolConfigError as exc:  # found as it starts: e.g. a tool name an MCP server does not list
            where = "tool" if task.tool is not None else f"tools.{index}"
            raise ConfigError(str(task_path), [f"{where}: {exc}"]) from None
    if task.loop.tool_format == "code_fence":
        return tools[0] if tools else None
    try:
        toolbox = Toolbox(tools)
        check_tools_template(tokenizer, toolbox.template_tools())
    except (ToolConfigError, ToolTemplateError) as exc:
        field = "tools" if isinstance(exc, ToolConfigError) else "loop.tool_format"
        raise ConfigError(str(task_path), [f"{field}: {exc}"]) from None
    return toolbox


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

    loaded, reward = _samples_and_reward(task, task_path, tokenizer, which, limit, data_dir)
    async with contextlib.AsyncExitStack() as stack:
        # the tools first: a tool that cannot start (a name its MCP server does not list) is refused in
        # seconds, not after the engine has loaded the model and compiled
        tool = await _enter_tools(stack, task, task_path, tokenizer)
        engine = await start_engine(settings, model_dir, tokenizer)
        try:
            program = None
            if task.loop.program is not None:
                program = await _program_runner(stack, task, engine, tokenizer, reward)
            yield TaskRuntime(task, loaded.samples, reward, tokenizer, engine, tool,
                              skipped_samples=loaded.skipped, program=program)
        finally:
            await engine.close()


def _samples_and_reward(task: TaskConfig, task_path: Path, tokenizer: Any, which: Literal["train", "eval"],
                        limit: int | None = None, data_dir: Path | None = None) -> tuple[Any, Any]:
    """The task's samples (bad rows skipped and logged) and reward; the tokenizer takes the task's chat
    template if it names one (the run's template: prompts, tool messages, the export)."""
    loaded = load_samples(task, which=which, task_dir=task_path.parent, data_dir=data_dir, limit=limit)
    if loaded.skipped:
        log.warning("%s: skipped %d bad rows of %s: %s", task.name, loaded.skipped, loaded.source,
                    loaded.skip_reasons)
    reward = build_reward(task.reward, task.answer)
    if task.prompt.chat_template is not None:
        tokenizer.chat_template = chat_template_path(task, task_path).read_text(encoding="utf-8")
    return loaded, reward


async def remote_engine_runtime(stack: contextlib.AsyncExitStack, task: TaskConfig, task_path: Path, *,
                                tokenizer: Any, engine: Any, tool: Tool | None = None) -> TaskRuntime:
    """A TaskRuntime around an engine that runs elsewhere (launcher=ray's rollout workers): the task's
    training samples and reward, and `tool` — or the task's tools started here on `stack`. The driver's
    evaluations run their episodes through it."""
    loaded, reward = _samples_and_reward(task, task_path, tokenizer, "train")
    runner = tool if tool is not None else await _enter_tools(stack, task, task_path, tokenizer)
    program = None  # a program task's evaluations run the program, here as in local mode
    if task.loop.program is not None:
        program = await _program_runner(stack, task, engine, tokenizer, reward)
    return TaskRuntime(task, loaded.samples, reward, tokenizer, engine, runner,
                       skipped_samples=loaded.skipped, program=program)


async def _program_runner(stack: contextlib.AsyncExitStack, task: TaskConfig, engine: Any,
                          tokenizer: Any, reward: Any) -> Any:
    """`loop.program`'s runner: the endpoint of `engine` served on `stack`, the run's sampling and budgets."""
    from agent_env.programs.endpoint import EndpointSettings, ProgramEndpoint
    from agent_env.programs.runner import ProgramRunner, import_program

    settings = EndpointSettings.of_episode(episode_settings(task))
    endpoint = await stack.enter_async_context(ProgramEndpoint(engine, tokenizer, settings))
    program = import_program(task.loop.program or "")
    return ProgramRunner(endpoint, program, reward, task.loop.program_timeout_s)


@dataclass(frozen=True)
class EvalSetParts:
    """What an evaluation of one set needs besides the engine: its task (the run's or its own), prompts,
    reward and tool (started on the caller's stack)."""

    task: TaskConfig
    task_path: Path
    samples: list[Sample]
    source: str
    reward: Callable[[str, Sample], Any]
    tool: Tool | Toolbox | None
    own_task: bool


async def eval_set_parts(stack: contextlib.AsyncExitStack, spec: EvalSetConfig, runtime: TaskRuntime,
                         run_task_path: Path, tokenizer: Any) -> EvalSetParts:
    """The parts of `trainer.eval_sets` entry `spec`: with `spec.task`, that task file (its tool started on
    `stack`); else the run's task, reward and tool. Prompts from `spec.dataset`, else the task's eval_dataset
    (else its dataset); a bad task file or dataset is a ConfigError naming `trainer.eval_sets`."""
    if spec.task is not None:
        task, task_path = load_task(spec.task, spec.task_overrides, relative_to=run_task_path.parent)
        if task.prompt.chat_template is not None:
            raise ConfigError(str(task_path), [f"trainer.eval_sets[{spec.name}]: prompt.chat_template — an "
                                               "eval set shares the run's model and its chat template; "
                                               "remove it"])
        tool = await _enter_tools(stack, task, task_path, tokenizer)
        reward = build_reward(task.reward, task.answer)
    else:
        task, task_path, tool, reward = runtime.task, run_task_path, runtime.tool, runtime.reward
    if spec.dataset is not None:
        task = task.model_copy(update={"eval_dataset": spec.dataset})
    try:
        loaded = load_samples(task, which="eval", task_dir=task_path.parent)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"trainer.eval_sets[{spec.name}]", [f"its prompts ({task.name}): {exc}"]) from None
    return EvalSetParts(task, task_path, list(loaded.samples), loaded.source, reward, tool,
                        own_task=spec.task is not None)
