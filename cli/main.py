"""The `vcpo` command: the composition root. Parses arguments, reads config files, wires objects.

Subcommands import their modules lazily so `vcpo --help` and `vcpo config check` stay instant and
work without the heavy stack. Only this module reads the environment or config files.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

log = logging.getLogger("vcpo")
T = TypeVar("T", bound=BaseModel)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    # `a.b.c=value` overrides may stand anywhere (also after options such as --config): argparse
    # stops filling a positional list at the first option, so collect leftover overrides here.
    args, extra = parser.parse_known_args(argv)
    overrides = [item for item in extra if "=" in item and not item.startswith("-")]
    unknown = [item for item in extra if item not in overrides]
    if unknown or (overrides and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or overrides)}")
    if overrides:
        args.overrides = [*args.overrides, *overrides]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from agent_env.datasets import DatasetError
    from agent_env.rewards import RewardConfigError
    from configs.loader import ConfigError
    from rollout.errors import EngineError, EngineUnavailable
    from rollout.models import ModelLoadError
    from run.observability.console import terminal
    from run.train.checkpointing import CheckpointWriteError
    from tools.base import ToolConfigError, ToolUnavailableError

    user_errors = (ConfigError, ModelLoadError, DatasetError, RewardConfigError, ToolConfigError,
                   ToolUnavailableError, EngineUnavailable, CheckpointWriteError)
    try:
        return int(args.handler(args) or 0)
    except (*user_errors, EngineError) as exc:
        # a server's HTTP error answer (any status) is the user's to fix: one line, no traceback
        http = getattr(exc, "http", None)
        if http is None and not isinstance(exc, user_errors):
            raise
        print(f"error: {http or exc}", file=terminal())
        return 2


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vcpo", description="Stable asynchronous RL for tool-using LLM agents.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    check = commands.add_parser("config", help="validate a config file and print it resolved")
    check.add_argument("action", choices=["check"])
    check.add_argument("file", type=Path)
    check.add_argument("overrides", nargs="*", help="a.b.c=value overrides")
    check.set_defaults(handler=_config_check)

    model = commands.add_parser("model", help="prepare the default model (GGUF → cached safetensors)")
    model.add_argument("action", choices=["prepare"])
    model.add_argument("--model", default="default", help="model spec (default: the shipped SmolLM2)")
    model.set_defaults(handler=_model_prepare)

    bench = commands.add_parser("bench", help="benchmarks (JSON on stdout)")
    bench.add_argument("name", choices=["opob", "sandbox", "engine", "async", "staleness", "learner",
                                        "main_job"])
    bench.add_argument("--config", type=Path, default=None, help="benchmark config YAML")
    bench.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    bench.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the benchmark config")
    bench.set_defaults(handler=_bench)

    sandbox = commands.add_parser("sandbox", help="sandbox services")
    sandbox.add_argument("action", choices=["serve"])
    sandbox.add_argument("--host", default="127.0.0.1")
    sandbox.add_argument("--port", type=int, default=8080)
    sandbox.add_argument("--config", type=Path, default=None, help="YAML of local sandbox settings")
    sandbox.add_argument("--allow-non-loopback", action="store_true",
                         help="permit binding a non-loopback address (expose the sandbox to a network)")
    sandbox.set_defaults(handler=_sandbox_serve)

    plot = commands.add_parser("plot", help="draw a run's dashboard PNG from its metrics.jsonl; several "
                                            "run dirs: one comparison PNG (reward, ESS, lr scale, grad norm)")
    plot.add_argument("run_dir", type=Path, nargs="+")
    plot.add_argument("--out", type=Path, default=None,
                      help="PNG path (default: RUN_DIR/dashboard.png; with several runs: ./compare.png)")
    plot.set_defaults(handler=_plot)

    trend = commands.add_parser("trend", help="is a run learning? per-block reward and success rate, and the "
                                              "success-rate trend with a bootstrap CI (a table; --json: "
                                              "JSON); several runs (seeds): each one's, pooled")
    trend.add_argument("run_dirs", type=Path, nargs="+", metavar="run_dir")
    trend.add_argument("--block", type=int, default=10, help="steps per block (default 10)")
    trend.add_argument("--success", type=float, default=1.0,
                       help="an episode succeeds when its reward is at least this (default 1.0)")
    trend.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    trend.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    trend.set_defaults(handler=_trend)

    train = commands.add_parser(
        "train", help="train asynchronously (resumes from RUN_DIR's newest checkpoint)")
    train.add_argument("config", type=Path, nargs="?", default=Path("configs/default.yaml"),
                       help="run config YAML (default: configs/default.yaml)")
    train.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the run config")
    train.add_argument("--no-progress", action="store_true", help="no live progress line")
    train.add_argument("--stop-after-step", type=int, default=None,
                       help="exit after this step (a checkpoint is written first if it is a checkpoint "
                            "step); 0: evaluate the starting policy (trainer.eval_every, trainer.eval_sets) "
                            "and exit")
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser("eval", help="evaluate a model on a task (avg@k, pass@k, maj@k)")
    evaluate.add_argument("task", type=Path, help="task YAML, e.g. configs/tasks/gsm8k.yaml")
    evaluate.add_argument("overrides", nargs="*", help="a.b.c=value overrides of the task")
    evaluate.add_argument("--model", default="default",
                          help="model spec: 'default', a local HF directory, a LoRA adapter directory "
                               "(a LoRA run's export/adapter: merged into its base once) or a hub id. "
                               "hf/vllm/auto: the "
                               "model evaluated. openai: only where the tokenizer comes from (it must be "
                               "the served model's); the name sent to the server is --served-model")
    evaluate.add_argument("--backend", default="auto", choices=["auto", "hf", "vllm", "openai"],
                          help="engine backend (openai = any OpenAI-compatible server, see --url)")
    evaluate.add_argument("--url", default=None,
                          help="openai: the server's API root, e.g. http://127.0.0.1:8000/v1")
    evaluate.add_argument("--served-model", default=None, metavar="NAME",
                          help="openai: the model name sent in requests (vLLM's --served-model-name). "
                               "Default: from the server's URL/models, its only model or the id equal "
                               "to --model")
    evaluate.add_argument("--k", type=int, default=None,
                          help="samples per problem (default: the task's eval.k)")
    evaluate.add_argument("--limit", type=int, default=None, help="first N problems (default: the task's)")
    evaluate.add_argument("--out", type=Path, default=None,
                          help="samples JSONL (default: evals/<task>-<model>.jsonl; openai: the served name)")
    evaluate.add_argument("--seed", type=int, default=0, help="sampling seed")
    evaluate.add_argument("--no-progress", action="store_true", help="no progress bar")
    evaluate.set_defaults(handler=_eval)
    return parser


def _trend(args: argparse.Namespace) -> int:
    from run.observability.trend import TrendError, format_trend, pooled_trend, reward_trend

    options = {"block": args.block, "success": args.success, "resamples": args.resamples}
    try:
        if len(args.run_dirs) == 1:
            result = reward_trend(args.run_dirs[0], **options)
        else:
            result = pooled_trend(args.run_dirs, **options)
    except (TrendError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if args.json else format_trend(result))
    return 0


def _cache_dir() -> Path:
    from rollout.models import default_cache_dir

    return default_cache_dir()


def _config_check(args: argparse.Namespace) -> int:
    import yaml

    from cli.config_catalog import bench_schema_of, is_bench_config
    from configs.loader import load_config, read_yaml_tree
    from configs.schema import RunConfig
    from run.train.wiring import engine_settings, load_task

    raw = read_yaml_tree(args.file)
    if isinstance(raw, dict) and "prompt" in raw and "reward" in raw:  # a task file
        config, _ = load_task(args.file, args.overrides)
    elif is_bench_config(args.file):  # benchmarks/configs/*.yaml
        config = load_config(args.file, bench_schema_of(args.file), args.overrides)
    else:  # a run config: its task and engine sections are checked too
        config = load_config(args.file, RunConfig, args.overrides)
        load_task(config.task, config.task_overrides, relative_to=args.file.parent)
        engine_settings(config.engine, str(args.file))
        _check_algorithm(config, args.file)
    print(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _check_algorithm(config: Any, source: Path) -> None:
    """The run's objective and correction stages built once (a `type: custom` one imported): a ConfigError
    naming the file and the field, before any model is loaded."""
    from configs.loader import ConfigError
    from learner.backends.algorithm_from_config import PluginError, check_algorithm

    try:
        check_algorithm(config.algo)
    except PluginError as exc:
        raise ConfigError(str(source), [str(exc)]) from None


def _model_prepare(args: argparse.Namespace) -> int:
    from rollout.models import resolve_model

    print(resolve_model(args.model, _cache_dir()).name_or_path)
    return 0


def _bench_config(args: argparse.Namespace, schema: type[T]) -> T:
    """The benchmark's config: `--config FILE` (if given) plus the command line's overrides."""
    from configs.loader import apply_overrides, load_config, validate_config

    if args.config is not None:
        return load_config(args.config, schema, args.overrides)
    raw: dict[str, Any] = {}
    paths = apply_overrides(raw, args.overrides, source="<command line>")
    return validate_config(raw, schema, "<command line>", paths)


def _bench(args: argparse.Namespace) -> int:
    from benchmarks.schema import EngineBenchConfig, OpobBenchConfig, SandboxBenchConfig

    result: dict[str, Any]
    if args.name == "opob":
        from benchmarks.opob_step import run_opob_bench

        config = _bench_config(args, OpobBenchConfig)
        _set_threads()
        result = run_opob_bench(config, cache_dir=_cache_dir(), progress=_progress)
    elif args.name == "async":
        from benchmarks.asynchrony import run_async_bench
        from benchmarks.schema import AsyncBenchConfig

        result = run_async_bench(_bench_config(args, AsyncBenchConfig), _cache_dir(), progress=_progress)
    elif args.name == "engine":
        from benchmarks.engine import run_engine_bench

        engine = _bench_config(args, EngineBenchConfig)
        result = run_engine_bench(engine.model, _cache_dir(), concurrencies=tuple(engine.concurrencies),
                                  max_new_tokens=engine.max_new_tokens, backends=tuple(engine.backends),
                                  min_requests=engine.min_requests, rounds=engine.rounds, dtype=engine.dtype,
                                  vllm_use_eager=engine.vllm_use_eager, progress=_progress)
    elif args.name == "learner":
        from benchmarks.learner_step import run_learner_bench
        from benchmarks.schema import LearnerBenchConfig

        _set_threads()
        result = run_learner_bench(_bench_config(args, LearnerBenchConfig))
    elif args.name == "staleness":
        from benchmarks import BENCH_CONFIG_ROOT
        from benchmarks.staleness.bench import run_staleness_bench
        from benchmarks.staleness.schema import StalenessRealBenchConfig, StalenessTimedBenchConfig
        from cli.config_catalog import bench_command_schema

        if args.config is None:  # the methods and their lrs live in the shipped file
            args.config = BENCH_CONFIG_ROOT / "staleness.yaml"
        bench = _bench_config(args, bench_command_schema("staleness", args.config))
        if isinstance(bench, StalenessRealBenchConfig):
            from benchmarks.staleness.real import run_real_staleness_bench
            from run.train.wiring import PACKAGE_ROOT

            result = run_real_staleness_bench(bench, PACKAGE_ROOT, _cache_dir(), progress=_progress)
        elif isinstance(bench, StalenessTimedBenchConfig):
            from benchmarks.staleness.timed import run_timed_staleness_bench

            result = run_timed_staleness_bench(bench, progress=_progress)
        else:
            result = run_staleness_bench(bench, progress=_progress)
        print(Path(result["config"]["run_root"], "summary.md").read_text(), file=sys.stderr)
    elif args.name == "main_job":
        from benchmarks import BENCH_CONFIG_ROOT
        from benchmarks.main_job import run_main_job_bench
        from benchmarks.schema import MainJobBenchConfig
        from run.train.wiring import PACKAGE_ROOT

        if args.config is None:  # the seeds and the settings of the claim live in the shipped file
            args.config = BENCH_CONFIG_ROOT / "main_job.yaml"
        result = run_main_job_bench(_bench_config(args, MainJobBenchConfig), PACKAGE_ROOT, progress=_progress)
    else:
        from benchmarks.sandbox import run_sandbox_bench

        bench = _bench_config(args, SandboxBenchConfig)
        result = run_sandbox_bench(num_calls=bench.num_calls, concurrencies=tuple(bench.concurrencies))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


def _sandbox_serve(args: argparse.Namespace) -> int:
    from configs.loader import load_config
    from tools.sandbox_fusion.server import serve
    from tools.settings import SandboxServerSettings

    settings = load_config(args.config, SandboxServerSettings) if args.config else SandboxServerSettings()
    if args.allow_non_loopback:
        settings = settings.model_copy(update={"use_non_loopback_host": True})
    serve(args.host, args.port, settings)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from run.observability.metrics_log import MetricsFileError
    from run.observability.plot import plot_compare, plot_run

    try:
        if len(args.run_dir) == 1:
            print(plot_run(args.run_dir[0], args.out))
        else:
            print(plot_compare(args.run_dir, args.out or Path("compare.png")))
    except (MetricsFileError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _train(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib

    from cli.interrupts import woken_by_signals
    from configs.loader import load_config, write_resolved_config
    from configs.schema import RunConfig
    from run.launch.allocator import active_allocator
    from run.launch.run_dir_lock import RunDirBusy, run_dir_lock
    from run.launch.training import run_training
    from run.observability.console import divert_library_output
    from run.train.wiring import engine_settings, load_task

    config = load_config(args.config, RunConfig, args.overrides)
    task, task_path = load_task(config.task, config.task_overrides, relative_to=args.config.parent)
    settings = engine_settings(config.engine, str(args.config))
    _check_algorithm(config, args.config)
    run_dir = Path(config.run_dir)
    cache_dir = Path(config.model.cache_dir) if config.model.cache_dir else _cache_dir()
    library_log = None if args.verbose else run_dir / "logs" / "libraries.log"
    try:
        with contextlib.ExitStack() as stack:
            try:  # before anything is written: a second process on this run_dir is refused untouched
                stack.enter_context(run_dir_lock(run_dir))
            except RunDirBusy as exc:
                print(f"vcpo train: {exc}", file=sys.stderr)
                return 2
            write_resolved_config(config, run_dir)
            write_resolved_config(task, run_dir, name="task.yaml")
            if library_log is not None:  # engine and library output to a file; -v keeps it on the terminal
                console = stack.enter_context(divert_library_output(library_log))
                print(f"vcpo train: engine and library output → {library_log} (-v shows it here); "
                      f"memory allocator: {active_allocator()}", file=console)
            summary = asyncio.run(woken_by_signals(run_training(
                config, task, task_path, settings, cache_dir, run_dir, progress=not args.no_progress,
                stop_after_step=args.stop_after_step)))
    except KeyboardInterrupt:
        print(_interrupted_message(config, task, run_dir, cache_dir), file=sys.stderr, flush=True)
        # a learner step may still be running on its thread: the checkpoints are whole (written atomically),
        # so leave now rather than let the interpreter wait for it at exit
        os._exit(130)
    except BaseException:
        if library_log is not None:  # the terminal again: the libraries' last words are in the file
            print(f"(engine and library output of this run: {library_log})", file=sys.stderr)
        raise
    first = sum(summary.first_rewards) / max(1, len(summary.first_rewards))
    last = sum(summary.last_rewards) / max(1, len(summary.last_rewards))
    print(f"trained {summary.steps} steps in {summary.wall_s:.0f} s; reward (mean of step means) first "
          f"{len(summary.first_rewards)} steps {first:.3f} → last {len(summary.last_rewards)} steps "
          f"{last:.3f}; "
          f"metrics: {run_dir / 'metrics.jsonl'}; dashboard: vcpo plot {run_dir}")
    if summary.heldout_change is not None:
        print(summary.heldout_change.line())
    for change in summary.eval_set_changes.values():
        print(change.line())
    if summary.phases:
        print("time: " + " · ".join(f"{name} {seconds:.0f} s" for name, seconds in summary.phases.items()))
    return 0


def _interrupted_message(config: Any, task: Any, run_dir: Path, cache_dir: Path) -> str:
    """What a Ctrl-C'd run keeps, and how to go on."""
    from run.train.checkpointing import latest_checkpoint
    from run.train.warm_start import warm_start_dir

    lines = ["vcpo train: stopped (Ctrl-C)."]
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is not None:
        lines.append(f"  kept: the newest checkpoint, {checkpoint}; metrics and trajectories up to it")
    else:
        lines.append("  no checkpoint was written yet (every trainer.checkpoint_every steps)")
    warm = warm_start_dir(config, task, cache_dir)
    if config.warm_start.enabled and (warm / "config.json").is_file():
        lines.append(f"  kept: the warm-started model, {warm} (not redone)")
    lines.append("  to go on, run the same command again: it resumes from the newest checkpoint")
    return "\n".join(lines)


def _eval(args: argparse.Namespace) -> int:
    import asyncio

    from cli.eval_command import run_evaluation
    from cli.interrupts import woken_by_signals

    return asyncio.run(woken_by_signals(run_evaluation(args, _cache_dir())))


def _set_threads() -> None:
    """Use every core for torch unless the user chose (OMP_NUM_THREADS)."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)

