"""Library output (Python logging, warnings, bare writes to file descriptor 2 as C++ code does) goes to
the run's log file; vcpo's own progress and messages stay on the terminal. Run in a child process,
since the diversion rewires the process's fd 2 (pytest's own capture lives there too)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHILD = textwrap.dedent("""
    import logging, os, sys, warnings
    from pathlib import Path
    from run.observability.console import divert_library_output, terminal

    logging.basicConfig(level=logging.WARNING)  # as `vcpo` sets it up without -v
    log_path = Path(sys.argv[1])
    with divert_library_output(log_path) as console:
        assert terminal() is console
        os.write(2, b"W1124 torch/_library/triton.py:53] Triton not available\\n")  # C++ style, raw fd 2
        logging.getLogger("vllm.model_executor").warning("RotaryEmbedding: Failed to load weights")
        logging.getLogger("transformers").info("Loading weights")
        warnings.warn("`torch.distributed.reduce_op` is deprecated", FutureWarning)
        print("tqdm-like bar", file=sys.stderr)
        logging.getLogger("run.train.trainer").warning("our own warning")
        logging.getLogger("run.train.trainer").info("our own info: file only")
        print("step 1/2 | reward 0.1", file=terminal())
    print("after the block", file=sys.stderr)  # fd 2 is the terminal again
    assert terminal() is sys.stderr
    if len(sys.argv) > 2:
        with divert_library_output(log_path):
            raise RuntimeError("boom")
""")


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    log_path = tmp_path / "logs" / "libraries.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(log_path), *extra], env=env, capture_output=True,
                          text=True, timeout=60)
    return done, log_path.read_text()


def test_library_output_goes_to_the_file_and_ours_to_the_terminal(tmp_path: Path) -> None:
    done, logged = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    terminal = done.stderr.splitlines()
    assert terminal == ["WARNING run.train.trainer: our own warning", "step 1/2 | reward 0.1",
                        "after the block"]
    for line in ("Triton not available", "RotaryEmbedding: Failed to load weights", "Loading weights",
                 "FutureWarning", "tqdm-like bar", "our own warning", "our own info: file only"):
        assert line in logged, line
    assert "step 1/2" not in logged and "after the block" not in logged


def test_a_crash_inside_prints_its_traceback_on_the_terminal(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, "crash")
    assert done.returncode == 1
    assert "RuntimeError: boom" in done.stderr  # restored fd 2 before the traceback was printed


def test_the_start_up_says_it_is_alive_at_least_every_heartbeat(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Starting the engine and the learner can take minutes (vLLM compiling its graphs): run_local reports a
    line every HEARTBEAT_S while it does, and stops once the run's own progress takes over."""
    import asyncio
    import time as clock

    import rollout.models
    from configs.schema import RunConfig
    from run.launch import local
    from run.observability import live_activity
    from run.train.wiring import load_task

    class Stop(Exception):
        pass

    def slow_learner(*args: object) -> None:
        clock.sleep(0.45)
        raise Stop

    monkeypatch.setattr(live_activity, "HEARTBEAT_S", 0.1)
    monkeypatch.setattr(rollout.models, "resolve_model", lambda *args: None)
    monkeypatch.setattr(rollout.models, "load_tokenizer", lambda *args: None)
    monkeypatch.setattr(local, "build_learner", slow_learner)
    lines: list[str] = []
    task, task_path = load_task(Path(__file__).resolve().parents[3] / "configs" / "tasks" / "countdown.yaml")
    with pytest.raises(Stop):
        asyncio.run(local.run_local(RunConfig(), task, task_path, None, tmp_path, tmp_path,
                                    report=lines.append))
    count = len(lines)
    assert count >= 3 and all(line.startswith("  ... starting the rollout engine, the learner and the tool "
                                              "sandbox, 0:00:0") for line in lines)
    clock.sleep(0.3)
    assert len(lines) == count  # the heartbeat stopped with the start-up
