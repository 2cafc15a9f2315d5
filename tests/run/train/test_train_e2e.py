"""`vcpo train` end to end on a tiny random model: the real HF engine, the real sandbox, the real
learner; k = 0 is on-policy; the lag bound holds; SIGKILL + resume loses and doubles nothing; a
poisoned sample is counted and the run goes on. (The default-model run is marked `default_model`.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from run.launch.allocator import find_tcmalloc
from run.observability.metrics_log import read_metrics
from run.train.checkpointing import latest_checkpoint, load_checkpoint
from run.train.wiring import load_task

ROOT = Path(__file__).resolve().parents[3]
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def digit_fraction(response: str, sample: object) -> float:
    """A reward a random byte-level model can improve: the share of digits in its response."""
    return sum(c.isdigit() for c in response) / max(1, len(response))


def flat_on_even_targets(response: str, sample: object) -> float:
    """Every episode of an even-target prompt scores 1 (a group with no signal); others as digit_fraction."""
    if sample.answer["target"] % 2 == 0:  # type: ignore[attr-defined]
        return 1.0
    return digit_fraction(response, sample)


def poisoned_reward(response: str, sample: object) -> float:
    """Raises for about a third of the prompts (a crashing custom reward); the run must count it and go on."""
    if sample.answer["target"] % 3 == 0:  # type: ignore[attr-defined]
        raise RuntimeError("reward crashed on this sample")
    return digit_fraction(response, sample)


def _write_configs(tmp_path: Path, model_dir: Path, *, max_lag: int, steps: int,
                   reward: str = "digit_fraction", tool: bool = True, extra: dict | None = None) -> Path:
    task = {
        "name": "tiny-countdown",
        "dataset": {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 0},
        "fields": {"answer": {"target": "target", "numbers": "nums"},
                   "template_fields": {"numbers": "nums", "target": "target"}},
        "prompt": {"system": "Use python.", "user": "Make {target} from {numbers}."},
        "tool": {"type": "python", "timeout_s": 5, "warm_pool_size": 0} if tool else None,
        "loop": {"max_turns": 2, "max_total_tokens": 96, "max_new_tokens_per_turn": 24},
        "reward": {"type": "custom", "function": f"tests.run.train.test_train_e2e:{reward}"},
    }
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    run = {
        "run_dir": str(tmp_path / "run"),
        "seed": 0,
        "model": {"path": str(model_dir)},
        "task": str(tmp_path / "task.yaml"),
        "engine": {"backend": "hf", "max_batch_size": 16},
        "algo": {"objective": {"type": "vcpo", "is_cap": 8.0}, "group_size": 4,
                 "ess_lr": {"enabled": True, "rule": "sqrt", "base_ess_ratio": 0.55}},
        "optim": {"lr": 1e-3},
        "rollout": {"max_lag": max_lag, "groups_per_step": 2},
        "learner": {"device": "cpu", "micro_batch_tokens": 1024},
        "trainer": {"total_steps": steps, "checkpoint_every": 2, "use_tensorboard": True},
        **(extra or {}),
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def _vcpo(*args: str, timeout: float = 500) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@needs_bwrap
@pytest.mark.parametrize("max_lag", [0, 2])
def test_train_runs_logs_every_metric_and_respects_the_lag_bound(tmp_path: Path, tiny_model_dir: Path,
                                                                 max_lag: int) -> None:
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=max_lag, steps=4)
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3, 4]
    required = ["staleness/mean", "staleness/max", "staleness/hist", "is/ess_ratio", "is/ess_ratio_clipped",
                "is/w_max", "is/w_p99", "is/log_w_mean", "is/kl_k3", "lr/base", "lr/scale",
                "opob/baseline_mean", "opob/gap_to_group_mean", "grad/norm", "pg/clip_frac", "pg/masked_frac",
                "reward/mean", "reward/std", "tokens/generated", "tokens/trained", "time/generate",
                "time/train", "time/weight_sync", "time/idle_learner", "time/idle_rollout"]
    for record in records:
        missing = [key for key in required if key not in record]
        assert not missing, missing
        assert record["staleness/max"] <= max_lag
    if max_lag == 0:
        # on-policy: every trajectory was sampled by the weights it is trained at; the only
        # difference between engine and learner log-probs is fp32 kernel rounding
        assert all(r["staleness/max"] == 0 for r in records)
        assert all(r["is/ess_ratio"] > 0.999 and abs(r["is/log_w_mean"]) < 1e-3 for r in records)
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step_000004"
    assert (tmp_path / "run" / "tensorboard").is_dir()
    # the run's own dumps load again as they are (a generator dataset's every field included)
    check = _vcpo("config", "check", str(tmp_path / "run" / "config.yaml"))
    assert check.returncode == 0, check.stderr[-2000:]
    load_task(tmp_path / "run" / "task.yaml")
    export = tmp_path / "run" / "export"  # the trained policy as an HF directory, loadable by any engine
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    assert (export / "tokenizer.json").is_file()
    plot = _vcpo("plot", str(tmp_path / "run"))
    assert plot.returncode == 0 and Path(plot.stdout.strip()).stat().st_size > 10_000


@needs_bwrap
def test_sigkill_then_resume_loses_no_group_and_uses_none_twice(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=6)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "cli", "train", str(config), "--no-progress"],
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run_dir = tmp_path / "run"
    deadline = time.monotonic() + 400
    while latest_checkpoint(run_dir) is None or len(read_metrics(run_dir)) < 3:  # past checkpoint 2
        assert process.poll() is None, process.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL  # killed mid-run, not finished
    killed_at = latest_checkpoint(run_dir)
    _, meta = load_checkpoint(killed_at)
    assert 2 <= meta["step"] < 6
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == [1, 2, 3, 4, 5, 6]  # no step lost or logged twice
    assert all(r["staleness/max"] <= 1 for r in records)
    final, _ = load_checkpoint(latest_checkpoint(run_dir))
    rollout = final["rollout"]
    # every admitted slot is either consumed (6 steps × 2 groups), completed in the buffer or pending;
    # prompt positions of the consumed groups are exactly 0..11 (each once) — checked via trajectories
    consumed = rollout["next_batch_index"] * 2
    assert consumed == 12
    lines = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == sorted(line["step"] for line in lines)
    positions = {(line["step"], line["group"]): line["prompt_position"] for line in lines}
    assert len(positions) == 12  # 6 steps × 2 groups, each consumed once
    assert sorted(positions.values()) == list(range(12))  # every prompt exactly once, none skipped
    assert all(line["lag"] <= 1 for line in lines)


def test_an_auto_lag_bound_is_logged_checkpointed_and_resumed(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rollout.max_lag: auto` through `vcpo train` (with VCPO under two correction stages): every step logs
    the bound in force and its moves and the corrections' shares, the checkpoint holds the controller's
    state, a resume with more steps continues its counts, and no trajectory lags beyond auto_lag.max_lag."""
    auto = {"min_lag": 0, "max_lag": 2, "target_ess_ratio": 0.05, "patience": 1, "min_idle_fraction": 0.0}
    algo = {"objective": {"type": "vcpo", "is_cap": 8.0}, "group_size": 4,
            "corrections": [{"type": "token_reject", "lower": 0.5, "upper": 2.0}, {"type": "opsm"}]}
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=0, steps=3, tool=False,
                            extra={"rollout": {"max_lag": "auto", "groups_per_step": 2, "auto_lag": auto},
                                   "algo": algo})
    first = _vcpo("train", str(config), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    records = read_metrics(tmp_path / "run")
    assert state["lag_control"]["bound"] == records[-1]["rollout/max_lag"]
    assert records[0]["rollout/lag_move"] == 1.0  # batch 0 was judged (ρ ≥ 0.05) and the bound raised
    resumed = _vcpo("train", str(config), "--no-progress", "trainer.total_steps=5")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3, 4, 5]
    raises = [r["rollout/lag_raises"] for r in records]
    assert raises == sorted(raises) and raises[-1] >= state["lag_control"]["raises"]
    assert all(r["staleness/max"] <= 2 and 0 <= r["rollout/max_lag"] <= 2 for r in records)
    assert all(0 <= r["correction/rejected_tokens"] <= 1 and len(r["correction/rejected_tokens_by_lag"]) == 9
               and "correction/opsm/rejected_trajectories" in r for r in records)
    plot = _vcpo("plot", str(tmp_path / "run"))
    assert plot.returncode == 0


def test_a_simulated_clock_decides_the_lags_and_the_waiting_auto_acts_on(tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    """`rollout.simulated_clock` through `vcpo train` with `max_lag: auto`: every step logs the timeline's
    time and waiting, the controller acts on the timeline's waiting (not the machine's), and every
    trajectory's lag is the one the timeline gives — replayed here from the settings and the logged bounds."""
    auto = {"min_lag": 0, "max_lag": 3, "target_ess_ratio": 0.05, "patience": 1, "min_idle_fraction": 0.1}
    clock = {"episode_median_s": 1.0, "episode_sigma": 0.8, "learner_s": 0.5, "concurrent_groups": 6}
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=0, steps=5, tool=False,
                            extra={"rollout": {"max_lag": "auto", "groups_per_step": 2, "auto_lag": auto,
                                               "simulated_clock": clock}})
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    times = [r["sim/time"] for r in records]
    assert times == sorted(times) and times[0] > 0
    assert all(r["rollout/learner_idle_fraction"] == r["sim/learner_idle_fraction"] for r in records)
    assert records[0]["rollout/lag_move"] == 1.0  # the learner waited for batch 0 (u = 1/(1 + 0.5 s)...)
    from rollout.sim_clock import ClockSettings, SimulatedClock

    replay = SimulatedClock(ClockSettings(**clock, seed=0), groups_per_batch=2, group_size=4, total_batches=5)
    for version, bound in enumerate([0] + [int(r["rollout/max_lag"]) for r in records]):
        replay.open_version(version, bound)
    assert [round(t.end, 9) for t in replay.steps] == [round(t, 9) for t in times]
    logged = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    for row in logged:
        assert row["lag"] == row["step"] - 1 - replay.admission_version(row["group"])
    assert max(row["lag"] for row in logged) >= 1  # the timeline let generation run ahead


@needs_bwrap
def test_a_crashing_reward_is_counted_and_the_run_continues(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3, reward="poisoned_reward")
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert len(records) == 3
    assert records[-1]["rollout/reward_errors"] > 0


@needs_bwrap
@pytest.mark.default_model
@pytest.mark.timeout(900)
def test_default_model_trains_on_the_shipped_countdown_task(tmp_path: Path, default_model_dir: Path) -> None:
    """The main job, shrunk: the real default model, the best engine here, the shipped Countdown task
    with the Python tool, VCPO at k = 1 — two steps, every metric logged, weights pushed."""
    run_dir = tmp_path / "run"
    result = _vcpo("train", "configs/default.yaml", "--no-progress", f"run_dir={run_dir}",
                   f"model.path={default_model_dir}", "trainer.total_steps=2", "rollout.max_lag=1",
                   "rollout.groups_per_step=1", "algo.group_size=4", "warm_start.enabled=false",
                   "trainer.eval_samples=8",
                   "task_overrides=[loop.max_turns=1, loop.max_total_tokens=384, "
                   "loop.max_new_tokens_per_turn=96, reward.format_score=0.1]", timeout=850)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == [0, 1, 2]  # 0: the held-out evaluation before RL
    assert records[0]["eval/prompts"] == 8 and "eval/success" in records[2]  # and after the last step
    for record in records[1:]:
        assert record["staleness/max"] <= 1 and record["tokens/generated"] > 0
        assert record["grad/norm"] is None or record["grad/norm"] >= 0
    lines = (run_dir / "trajectories.jsonl").read_text().splitlines()
    assert len(lines) == 8  # 2 steps × 1 group × 4 episodes


@needs_bwrap
def test_the_terminal_shows_our_progress_and_the_libraries_go_to_the_run_log(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    """Without -v, model loading bars, torch/transformers warnings and engine logs go to
    run_dir/logs/libraries.log; the terminal (here a pipe: one line per step) shows vcpo's own lines."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=2)
    result = _vcpo("train", str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    library_log = tmp_path / "run" / "logs" / "libraries.log"
    lines = result.stderr.splitlines()
    allocator = "tcmalloc" if find_tcmalloc() else "glibc (tuned)"  # run/launch/allocator.py
    assert lines[0] == (f"vcpo train: engine and library output → {library_log} (-v shows it here); "
                        f"memory allocator: {allocator}")
    assert lines[1] == "starting the rollout engine (hf), the learner and the tool sandbox", lines
    assert [line.split(" |")[0] for line in lines[2:]] == ["step 1/2 (50%)", "step 2/2 (100%)"], lines
    assert "reward (mean of step means) first 1 steps" in result.stdout  # a short run: its two halves
    assert "Loading weights" in library_log.read_text()  # the model loads, at least twice (engine, learner)
    verbose = _vcpo("-v", "train", str(config), "trainer.total_steps=3")  # resumes at 2; -v: all here
    assert verbose.returncode == 0, verbose.stderr[-3000:]
    assert "Loading weights" in verbose.stderr and "libraries.log" not in verbose.stderr
    reshaped = _vcpo("train", str(config), "trainer.total_steps=4", "algo.group_size=3")  # refused up front
    assert reshaped.returncode == 2 and "algo.group_size: 3, but " in reshaped.stderr, reshaped.stderr[-3000:]
    assert "Loading weights" not in reshaped.stderr and "Traceback" not in reshaped.stderr


def test_the_live_line_counts_this_phases_episodes_and_tokens() -> None:
    from agent_env.runtime import LiveCounts
    from run.observability.live_activity import LiveActivity
    from run.observability.progress import ProgressLine

    class Runtime:
        counts = LiveCounts(episodes_finished=5, episodes_running=3, tokens_sampled=1000)

        def live_counts(self) -> LiveCounts:
            return self.counts

    runtime = Runtime()
    live = LiveActivity(ProgressLine(4), runtime, episodes_per_step=16)  # type: ignore[arg-type]
    live.begin(2, "rollouts")
    runtime.counts = LiveCounts(episodes_finished=9, episodes_running=7, tokens_sampled=3500)
    text = live.text()
    assert text.startswith("step 2: rollouts 4 episodes done (16 per step), 7 running, 2.5k tokens sampled")
    live.begin(2, "learner step")
    assert live.text() == "step 2: learner step, 0:00:00"


@needs_bwrap
def test_held_out_prompts_are_evaluated_logged_and_resumed(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`trainer.eval_every`: the live engine scores held-out prompts (none of them a training prompt)
    before the first step, every 2 steps and after the last; `eval/*` in metrics.jsonl (the first as
    trainer_step 0), one file per version; a resumed run keeps the earlier evaluations and the final
    line pairs first → last."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=2, extra={})
    task = yaml.safe_load((tmp_path / "task.yaml").read_text())
    task["heldout_dataset"] = {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 1}
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    evaluation = ["trainer.eval_every=2", "trainer.eval_samples=6", "trainer.eval_k=2"]
    first = _vcpo("train", str(config), "--no-progress", *evaluation)
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "run"
    resumed = _vcpo("train", str(config), "--no-progress", "trainer.total_steps=3", *evaluation)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == [0, 1, 2, 3]
    evaluated = {r["trainer_step"]: r for r in records if "eval/success" in r}
    assert sorted(evaluated) == [0, 2, 3]
    for record in evaluated.values():
        assert record["eval/prompts"] == 6 and 0 <= record["eval/success_low"] <= record["eval/success"]
        assert record["eval/success"] <= record["eval/success_high"] <= 1 and record["time/eval"] > 0
    assert "reward/mean" not in records[0] and "eval/success" not in records[1]
    files = sorted(p.name for p in (run_dir / "eval").glob("*.jsonl"))
    assert files == ["version_000000.jsonl", "version_000002.jsonl", "version_000003.jsonl"]
    for name in files:
        lines = (run_dir / "eval" / name).read_text().splitlines()
        assert len(lines) == 1 + 6 * 2  # meta + 6 prompts × k = 2
    assert "held-out success" in resumed.stdout and "(step 0) →" in resumed.stdout, resumed.stdout
    assert "(step 3)" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())  # the resumed process's own record
    assert summary["steps_this_process"] == 1 and [e["step"] for e in summary["heldout"]] == [3]
    assert summary["heldout"][0]["success"] == evaluated[3]["eval/success"]
    assert summary["heldout_change"]["start_step"] == 0 and summary["heldout_change"]["end_step"] == 3
    assert set(summary["phases_s"]) >= {"startup", "RL", "held-out eval"}
    assert summary["wall_s"] >= sum(summary["phases_s"].values()) * 0.99
    assert summary["host"]["cpu"] and "threads" in summary["host"]
    plot = _vcpo("plot", str(run_dir))
    assert plot.returncode == 0, plot.stderr[-3000:]
    trend = _vcpo("trend", str(run_dir))
    assert trend.returncode == 0, trend.stderr[-3000:]


@needs_bwrap
def test_eval_sets_are_evaluated_when_due_logged_summarised_and_resumed(tmp_path: Path,
                                                                        tiny_model_dir: Path) -> None:
    """`trainer.eval_sets` beside the held-out set: a test set from the run's task (an unused generator seed,
    at the start and the end only) and a benchmark with a task file of its own (its prompt, no tool, its
    `eval.k`, every step); `eval/<name>/*` metrics, files under eval/<name>/, summary.json's `eval_sets` with
    each start → end change, the closing lines, the dashboard; a resumed run keeps version 0's files."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=2, extra={})
    task = yaml.safe_load((tmp_path / "task.yaml").read_text())
    task["heldout_dataset"] = {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 1}
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    bench = {**task, "name": "tiny-bench", "tool": None, "eval": {"k": 2, "max_turns": 1, "temperature": 0.8},
             "prompt": {"system": "Answer.", "user": "What makes {target} from {numbers}?"},
             "eval_dataset": {"type": "generator", "name": "countdown", "num_samples": 8, "seed": 3}}
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(bench))
    run = yaml.safe_load(config.read_text())
    run["trainer"].update({"eval_every": 2, "eval_samples": 4, "eval_sets": [
        {"name": "test", "dataset": {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 2},
         "samples": 5},
        {"name": "bench", "task": str(tmp_path / "bench.yaml"), "samples": 3, "every": 1}]})
    config.write_text(yaml.safe_dump(run))
    first = _vcpo("train", str(config), "--no-progress")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = tmp_path / "run"
    resumed = _vcpo("train", str(config), "--no-progress", "trainer.total_steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = {r["trainer_step"]: r for r in read_metrics(run_dir)}
    assert sorted(s for s, r in records.items() if "eval/test/success" in r) == [0, 2, 3]  # start and ends
    assert sorted(s for s, r in records.items() if "eval/bench/success" in r) == [0, 1, 2, 3]  # every step
    assert sorted(s for s, r in records.items() if "eval/success" in r) == [0, 2, 3]  # held-out, as before
    assert records[0]["eval/test/prompts"] == 5 and records[0]["eval/bench/prompts"] == 3
    sets_s = records[0]["eval/test/seconds"] + records[0]["eval/bench/seconds"]
    assert 0 < sets_s < records[0]["time/eval"]  # time/eval: the held-out set's and the eval sets' seconds
    for name, k, count in (("test", 1, 5), ("bench", 2, 3)):
        files = sorted(p.name for p in (run_dir / "eval" / name).glob("*.jsonl"))
        assert "version_000000.jsonl" in files
        lines = (run_dir / "eval" / name / "version_000000.jsonl").read_text().splitlines()
        meta = json.loads(lines[0])["meta"]
        assert len(lines) == 1 + count * k and meta["k"] == k
        assert meta["task"] == ("tiny-bench" if name == "bench" else "tiny-countdown")
    def puzzles(path: Path, seed: int) -> set[str]:  # the evaluated puzzles' fields
        from agent_env.datasets import load_samples
        from configs.task_schema import TaskConfig

        ids = set(json.loads(path.read_text().splitlines()[0])["meta"]["prompts"])
        dataset = {**task["heldout_dataset"], "seed": seed}
        source = TaskConfig.model_validate({**task, "heldout_dataset": dataset})
        loaded = load_samples(source, which="heldout", task_dir=tmp_path)
        return {json.dumps(s.fields, sort_keys=True) for s in loaded.samples if s.sample_id in ids}

    held = puzzles(run_dir / "eval" / "version_000000.jsonl", 1)
    tested = puzzles(run_dir / "eval" / "test" / "version_000000.jsonl", 2)
    assert len(held) == 4 and len(tested) == 5 and not held & tested  # no held-out puzzle in the test set
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["eval_sets"]) == {"test", "bench"}
    assert [e["step"] for e in summary["eval_sets"]["test"]["evaluations"]] == [3]
    assert summary["eval_sets"]["test"]["change"]["start_step"] == 0
    assert summary["eval_sets"]["bench"]["change"]["end_step"] == 3
    assert "test success" in resumed.stdout and "bench success" in resumed.stdout, resumed.stdout
    plot = _vcpo("plot", str(run_dir))
    assert plot.returncode == 0, plot.stderr[-3000:]


@needs_bwrap
def test_lora_trains_through_the_real_engine_on_policy_resumes_and_its_adapter_evaluates(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    """learner.lora: the HF engine samples from the merged policy the learner pushes after every step, so
    k = 0 stays on-policy (ratio 1 up to fp32 kernel rounding) before and after a resume; checkpoints hold
    the adapters, not the base; the export's adapter is what `vcpo eval --model` takes."""
    learner = {"device": "cpu", "micro_batch_tokens": 1024, "lora": {"rank": 4, "alpha": 16}}
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=0, steps=2,
                            extra={"learner": learner, "optim": {"lr": 1e-2}})
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "run"
    state, _ = load_checkpoint(latest_checkpoint(run_dir))
    assert "adapter" in state["learner"] and "model" not in state["learner"]
    assert state["learner"]["adapter"] and all(".lora_" in k for k in state["learner"]["adapter"])
    result = _vcpo("train", str(config), "trainer.total_steps=4", "--no-progress")  # resumes at step 2
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == [1, 2, 3, 4]
    assert all(r["staleness/max"] == 0 for r in records)
    assert all(r["is/ess_ratio"] > 0.999 and abs(r["is/log_w_mean"]) < 1e-3 for r in records), [
        (r["is/ess_ratio"], r["is/log_w_mean"]) for r in records]
    base = load_file(tiny_model_dir / "model.safetensors")
    trained = load_file(run_dir / "export" / "model.safetensors")
    assert trained.keys() == base.keys()
    assert any(not torch.equal(trained[k], base[k]) for k in base if "q_proj" in k)  # the adapters moved
    assert all(torch.equal(trained[k], base[k]) for k in base if "norm" in k or "embed" in k)  # frozen
    refused = _vcpo("train", str(config), "learner.lora.rank=8", "trainer.total_steps=5", "--no-progress")
    assert refused.returncode != 0 and "learner.lora" in refused.stderr
    out = tmp_path / "eval.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "VCPO_CACHE_DIR": str(tmp_path / "cache")}
    evaluated = subprocess.run(
        [sys.executable, "-m", "cli", "eval", str(tmp_path / "task.yaml"), "--model",
         str(run_dir / "export" / "adapter"), "--backend", "hf", "--limit", "2", "--k", "1",
         "--out", str(out), "--no-progress"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("kind") for r in rows].count("meta") == 1 and len(rows) == 3  # the meta line, 2 samples
    assert list((tmp_path / "cache").rglob("merged_adapters/*/model.safetensors"))


@needs_bwrap
def test_dynamic_sampling_trains_only_on_groups_with_signal(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`rollout.dynamic_sampling`: a group whose episodes all scored alike (here every even-target prompt)
    is dropped and refilled by a fresh prompt, within the lag bound; the refills and their tokens are
    counted per step and in total."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3, reward="flat_on_even_targets",
                            tool=False)
    result = _vcpo("train", str(config), "--no-progress", "rollout.dynamic_sampling=true",
                   "rollout.max_refills_per_step=20")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3]
    assert all(r["staleness/max"] <= 1 for r in records)
    assert records[-1]["rollout/refilled_groups"] == sum(r["rollout/refills"] for r in records) > 0
    assert records[-1]["rollout/refill_tokens"] > 0
    for record in records:  # every dropped group's episodes counted; without any, the two means agree
        assert record["rollout/dropped_episodes"] == 4 * record["rollout/refills"]
        if record["rollout/refills"] == 0:
            assert record["rollout/reward_mean_generated"] == pytest.approx(record["reward/mean"])
    groups: dict[tuple[int, int], list[float]] = {}
    for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines():
        record = json.loads(line)
        groups.setdefault((record["step"], record["group"]), []).append(record["reward"])
    assert len(groups) == 6 and all(len(set(rewards)) > 1 for rewards in groups.values())


def _ctrl_c_enabled() -> None:
    """In the child: SIGINT handled as at a terminal, even when the suite itself was started in the background
    by a shell without job control (which ignores SIGINT for it, and a child Python keeps it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_when(process: subprocess.Popen, seen: str, timeout: float = 300) -> tuple[list[str], float]:
    """Read the run's terminal lines until one contains `seen`, send Ctrl-C (SIGINT); return the lines
    read so far and the monotonic time of the signal."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stderr is not None
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if seen in line:
            process.send_signal(signal.SIGINT)
            return lines, time.monotonic()
    process.kill()
    raise AssertionError(f"never saw {seen!r}: {''.join(lines)[-3000:]}")


def _signal_a_worker_thread(pid: int, signum: int) -> int:
    """Send `signum` to one thread of `pid` other than its main one (Linux tgkill): what the kernel does with
    a process-directed signal when the main thread already has one pending. The chosen thread id."""
    import ctypes

    tids = sorted(int(p.name) for p in Path(f"/proc/{pid}/task").iterdir() if int(p.name) != pid)
    assert tids, "the run has no thread besides its main one"
    if ctypes.CDLL(None, use_errno=True).syscall(234, pid, tids[0], signum) != 0:  # SYS_tgkill on x86-64
        raise OSError(ctypes.get_errno(), "tgkill failed")
    return tids[0]


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64",
                    reason="sends a signal to one thread with the x86-64 Linux tgkill syscall")
def test_ctrl_c_caught_by_a_worker_thread_still_stops_the_warm_start(tmp_path: Path, tiny_model_dir: Path
                                                                       ) -> None:
    """Python runs signal handlers in the main thread only; a SIGINT the kernel hands to another thread
    used to wait for the main thread's next wake-up — the warm start's end — so the run trained on and
    cached the model (a flake of the test below). The loop's wakeup fd ends it at once."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=400, tool=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    warm = ["warm_start.enabled=true", "warm_start.examples=64", "warm_start.epochs=50",
            "warm_start.batch_size=2", f"model.cache_dir={tmp_path / 'cache'}"]
    process = subprocess.Popen([sys.executable, "-m", "cli", "train", str(config), *warm], cwd=ROOT, env=env,
                               stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_enabled)
    assert process.stderr is not None
    while "[warm start] step 1/" not in (line := process.stderr.readline()):
        assert line, "the run ended before its warm start"
    _signal_a_worker_thread(process.pid, signal.SIGINT)
    sent = time.monotonic()
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 130 and time.monotonic() - sent < 30, rest[-3000:]
    assert not list((tmp_path / "cache" / "warm_start").glob("*/config.json")), rest[-3000:]  # not trained on


@needs_bwrap
def test_ctrl_c_stops_the_warm_start_and_the_run_quickly_and_says_what_is_kept(tmp_path: Path,
                                                                               tiny_model_dir: Path) -> None:
    """One Ctrl-C: during the warm start it stops within an SFT step (nothing cached); during RL after a
    checkpoint the run ends within seconds, names the checkpoint, and the same command resumes."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=400, tool=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "cli", "train", str(config)]
    warm = ["warm_start.enabled=true", "warm_start.examples=64", "warm_start.epochs=50",
            "warm_start.batch_size=2", f"model.cache_dir={tmp_path / 'cache'}"]
    process = subprocess.Popen([*command, *warm], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_ctrl_c_enabled)
    _, sent = _interrupt_when(process, "[warm start] step 1/")
    _, rest = process.communicate(timeout=60)
    assert process.returncode == 130 and time.monotonic() - sent < 30, rest[-3000:]
    assert "stopped (Ctrl-C)" in rest and "no checkpoint was written yet" in rest, rest[-3000:]
    assert not list((tmp_path / "cache" / "warm_start").glob("*/config.json"))  # nothing half-cached

    process = subprocess.Popen([*command, "trainer.total_steps=400"], cwd=ROOT, env=env,
                               stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_enabled)
    deadline = time.monotonic() + 300
    while latest_checkpoint(tmp_path / "run") is None and time.monotonic() < deadline:
        time.sleep(0.2)  # until step 2's checkpoint is whole
    process.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, rest = process.communicate(timeout=60)
    assert process.returncode == 130 and time.monotonic() - sent < 30, rest[-3000:]
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and f"kept: the newest checkpoint, {checkpoint}" in rest, rest[-3000:]
    assert "run the same command again" in rest
    kept = int(load_checkpoint(checkpoint, map_location="cpu")[1]["step"])
    resumed = _vcpo("train", str(config), "--no-progress", f"trainer.total_steps={kept + 2}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["trainer_step"] for r in read_metrics(tmp_path / "run")] == list(range(1, kept + 3))
