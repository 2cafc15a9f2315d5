"""One `vcpo train` per run directory: a second process is refused before it writes, naming the holder;
the lock of a process that died is taken over."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from run.launch.run_dir_lock import LOCK_FILE, RunDirBusy, run_dir_lock

ROOT = Path(__file__).resolve().parents[3]
HOLD = ("import sys, time; from pathlib import Path; from run.launch.run_dir_lock import run_dir_lock\n"
        "with run_dir_lock(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)\n")


def _holder(run_dir: Path) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=ROOT, stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert child.stdout is not None and child.stdout.readline().strip() == "held"
    return child


def test_a_second_process_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(
        tmp_path: Path) -> None:
    child = _holder(tmp_path)
    try:
        busy = pytest.raises(RunDirBusy, match=rf"pid {child.pid} on .*kill that pid.*run_dir=")
        with busy as refused, run_dir_lock(tmp_path):
            pass
        assert str(tmp_path) in str(refused.value)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    with run_dir_lock(tmp_path) as path:  # the kernel dropped the dead process's lock: taken over
        assert path.read_text().split("\n")[0] == str(os.getpid())
    with run_dir_lock(tmp_path):  # and released again on exit
        pass


def test_vcpo_train_on_a_busy_run_dir_exits_2_without_touching_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(f"extends: {ROOT / 'configs' / 'default.yaml'}\nrun_dir: {run_dir}\n")
    child = _holder(run_dir)
    try:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "cli", "train", str(config), "--no-progress"], cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"is in use by another `vcpo train` (pid {child.pid}" in done.stderr
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # no config.yaml, no logs written
        assert time.perf_counter() - started < 60  # refused up front, no model loaded
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
