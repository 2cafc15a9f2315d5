"""`vcpo bench main_job`: each seed is a real `vcpo train` process (tiny model, HF engine), run once, its
small files kept as evidence; the summary is recomputed from the evidence alone — paired start → end
gains, the lowest evaluation, the claim per seed — and the committed summary is what its evidence gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks import BENCH_CONFIG_ROOT
from benchmarks.main_job import (
    TIMING_FILE,
    keep_trajectory_log,
    run_main_job_bench,
    summarize_main_job,
    summarize_seed,
)
from benchmarks.schema import MainJobBenchConfig
from run.train.warm_start import SEARCH_PROGRAM
from tests.benchmarks.tiny_countdown import tiny_countdown_run

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "docs" / "results" / "main_job.json"
needs_the_committed_summary = pytest.mark.skipif(
    not COMMITTED.is_file(), reason="docs/results/main_job.json is written when the three fixed "
    "seeds of benchmarks/configs/main_job.yaml have run (`vcpo bench main_job --out "
    "docs/results/main_job.json`); not yet")


def _tiny_run_config(tmp_path: Path, model_dir: Path) -> Path:
    """A two-step run of the tiny random model on generated Countdown, held-out evaluation at 0 and 2."""
    return tiny_countdown_run(tmp_path, model_dir, max_total_tokens=64,
                              rollout={"max_lag": 1, "groups_per_step": 2},
                              trainer={"total_steps": 2, "checkpoint_every": 2, "eval_every": 2,
                                       "eval_samples": 6})


def test_each_seed_trains_once_keeps_its_evidence_and_is_summarized_from_it(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    config = _tiny_run_config(tmp_path, tiny_model_dir)
    bench = MainJobBenchConfig(config=str(config), seeds=[3, 4], runs_dir=str(tmp_path / "runs"),
                               evidence_dir=str(tmp_path / "evidence"))
    lines: list[str] = []
    result = run_main_job_bench(bench, ROOT, progress=lines.append)
    assert set(result["seeds"]) == {"3", "4"}
    for seed in ("3", "4"):
        evidence = tmp_path / "evidence" / f"seed_{seed}"
        assert sorted(p.name for p in (evidence / "eval").iterdir()) == ["version_000000.jsonl",
                                                                          "version_000002.jsonl"]
        assert not (evidence / "checkpoints").exists()
        row = result["seeds"][seed]
        assert [e["step"] for e in row["heldout"]] == [0, 2] and row["heldout"][0]["prompts"] == 6
        assert row["gain_low"] <= row["gain"] <= row["gain_high"]
        assert row["process_wall_s"] >= row["run_wall_s"] > 0
        assert {"startup", "RL", "held-out eval"} <= set(row["phases_s"]) and row["host"]["cpu"]
        config_used = yaml.safe_load((evidence / "config.yaml").read_text())
        assert config_used["seed"] == int(seed)
        logged = (tmp_path / "runs" / f"seed_{seed}" / "trajectories.jsonl").read_text().splitlines()
        kept = (evidence / "trajectories.jsonl").read_text().splitlines()
        assert len(kept) == len(logged) > 0
        for full, trimmed in zip(logged, kept, strict=True):
            assert "text" in json.loads(full) and json.loads(trimmed) == {
                key: value for key, value in json.loads(full).items() if key != "text"}
    stamp = (tmp_path / "evidence" / "seed_3" / TIMING_FILE).stat().st_mtime_ns
    again = run_main_job_bench(bench.model_copy(update={"run": False}), ROOT, progress=lines.append)
    assert again == result  # recomputed from the evidence alone, nothing rerun
    assert (tmp_path / "evidence" / "seed_3" / TIMING_FILE).stat().st_mtime_ns == stamp
    assert any("not run again" in line for line in lines)
    with pytest.raises(FileNotFoundError, match="seed 5"):
        run_main_job_bench(bench.model_copy(update={"run": False, "seeds": [3, 5]}), ROOT)


def _eval_file(folder: Path, version: int, correct: list[bool], searched: int = 0) -> None:
    """An evaluation file; the first `searched` episodes call the tool with the search program."""
    prompts = [str(i) for i in range(len(correct))]
    lines = [{"kind": "meta", "meta": {"kind": "heldout", "version": version, "k": 1, "prompts": prompts}}]
    lines += [{"kind": "sample", "sample_id": p, "index": 0, "is_correct": c, "extracted": "1 + 2",
               "tool_calls": 1, "tool_errors": 0, "is_truncated": False, "response_tokens": 70,
               "turns": [{"text": "…", "code": SEARCH_PROGRAM if i < searched else "print(1 + 2)"},
                         {"text": "…"}]}
              for i, (p, c) in enumerate(zip(prompts, correct, strict=True))]
    (folder / f"version_{version:06d}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _evidence(folder: Path, evaluations: dict[int, list[bool]],
              searched: dict[int, int] | None = None) -> Path:
    (folder / "eval").mkdir(parents=True)
    for version, correct in evaluations.items():
        _eval_file(folder / "eval", version, correct, (searched or {}).get(version, 0))
    (folder / "summary.json").write_text(json.dumps({"wall_s": 100.0, "phases_s": {"RL": 90.0},
                                                     "host": {"cpu": "test"}}))
    (folder / TIMING_FILE).write_text(json.dumps({"process_wall_s": 104.0}))
    trajectories = [{"step": step, "reward": float(i < step)} for step in (1, 2, 3) for i in range(4)]
    (folder / "trajectories.jsonl").write_text("".join(json.dumps(t) + "\n" for t in trajectories))
    return folder


def test_the_kept_trajectory_log_drops_only_the_text_and_keeps_a_torn_line_as_it_was(tmp_path: Path) -> None:
    records = [{"step": 1, "reward": 1.0, "turns": 7, "text": "Hop 1 of 7 …",
                "segments": [{"context_tokens": 130, "sampled_tokens": 200, "text": "Hop 1 …"},
                             {"context_tokens": 250, "sampled_tokens": 90, "text": "Hop 6 …"}]},
               {"step": 2, "reward": 0.0, "turns": 2, "text": "no segments"}]
    source = tmp_path / "trajectories.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 3, "rew')
    keep_trajectory_log(source, tmp_path / "kept.jsonl")
    lines = (tmp_path / "kept.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines[:2]] == [
        {"step": 1, "reward": 1.0, "turns": 7, "segments": [{"context_tokens": 130, "sampled_tokens": 200},
                                                            {"context_tokens": 250, "sampled_tokens": 90}]},
        {"step": 2, "reward": 0.0, "turns": 2}]
    assert lines[2] == '{"step": 3, "rew'  # `vcpo trend` drops a torn last line; it is not rewritten


def test_the_gain_is_paired_by_prompt_and_a_significant_fall_fails_the_seed(tmp_path: Path) -> None:
    # 20 prompts: 2 right at the start; the end gets 8 more right and loses none → gain 0.4, and the
    # t-interval of twenty 0/1 differences with eight 1s: 0.4 ± t * sqrt(0.4 * 0.6 * 20 / 19) / sqrt(20), t of
    # 19 dof taken from the table's nearest row at or below (15: 2.131, a slightly wider interval)
    start = [True, True] + [False] * 18
    end = [True, True] + [True] * 8 + [False] * 10
    rising = summarize_seed(_evidence(tmp_path / "seed_1", {0: start, 10: start, 20: end}), 0.10)
    half = 2.131 * (0.4 * 0.6 * 20 / 19) ** 0.5 / 20 ** 0.5
    assert rising["gain"] == 0.4 and rising["gain_low"] == pytest.approx(0.4 - half, abs=1e-3)
    assert rising["meets_target"] and not rising["collapsed"] and rising["lowest_change"]["step"] == 10
    # a middle evaluation that loses all ten start successes (−0.5, interval wholly below 0) fails the
    # seed however well it ends
    start_high = [True] * 10 + [False] * 10
    dipped = summarize_seed(_evidence(tmp_path / "seed_2", {0: start_high, 10: [False] * 20,
                                                            20: [True] * 14 + [False] * 6}), 0.10)
    assert dipped["gain"] == 0.2 and dipped["collapsed"] and not dipped["meets_target"]
    assert dipped["lowest_change"] == {"step": 10, "gain": -0.5, "high": dipped["lowest_change"]["high"]}
    assert dipped["lowest_change"]["high"] < 0
    one_more = [*start[:2], True, *start[3:]]
    small = summarize_seed(_evidence(tmp_path / "seed_3", {0: start, 20: one_more}), 0.10)
    assert small["gain"] == 0.05 and not small["meets_target"] and not small["collapsed"]
    overall = summarize_main_job(tmp_path, [1, 3], 0.10)
    assert not overall["every_seed_meets_target"] and overall["gain_mean"] == 0.225
    assert summarize_main_job(tmp_path, [1], 0.10)["every_seed_meets_target"]
    assert summarize_main_job(tmp_path, [3], 0.05)["every_seed_meets_target"] is False  # interval spans 0


def test_each_evaluation_counts_the_episodes_that_searched_with_a_program_and_how_many_solved(
        tmp_path: Path) -> None:
    start = [True, True] + [False] * 18
    end = [True] * 12 + [False] * 8
    row = summarize_seed(_evidence(tmp_path / "seed_1", {0: start, 20: end}, searched={0: 3, 20: 15}), 0.10)
    assert row["heldout"][0]["strategies"] == {"search_program": {"episodes": 3, "correct": 2},
                                               "other": {"episodes": 17, "correct": 0}}
    assert row["heldout"][1]["strategies"] == {"search_program": {"episodes": 15, "correct": 12},
                                               "other": {"episodes": 5, "correct": 0}}


@pytest.mark.parametrize(("preset", "summary"), [
    ("main_job.yaml", "main_job.json"), ("main_job_long_horizon.yaml", "long_horizon.json"),
    ("main_job_long_horizon_truncate.yaml", "long_horizon_truncate.json"),
    ("main_job_long_horizon_truncate_tuned.yaml", "long_horizon_truncate_tuned.json"),
    ("main_job_long_horizon_endpoints.yaml", "long_horizon_endpoints.json"),
    ("main_job_test.yaml", "main_job_test.json"), ("main_job_lora.yaml", "main_job_lora.json"),
    ("main_job_openai_loop.yaml", "main_job_openai_loop.json")])
def test_a_committed_main_job_summary_is_what_its_evidence_gives(preset: str, summary: str) -> None:
    path = ROOT / "docs" / "results" / summary
    if not path.is_file():
        pytest.skip(f"docs/results/{summary} is written when every seed of benchmarks/configs/{preset} has "
                    f"run (`vcpo bench main_job --config benchmarks/configs/{preset} --out "
                    f"docs/results/{summary}`)")
    bench = MainJobBenchConfig.model_validate(yaml.safe_load((BENCH_CONFIG_ROOT / preset).read_text()))
    baselines = {name: ROOT / folder for name, folder in bench.baselines.items()}
    recomputed = summarize_main_job(ROOT / bench.evidence_dir, bench.seeds, bench.min_gain, baselines)
    assert recomputed == json.loads(path.read_text())


@needs_the_committed_summary
def test_the_bench_command_summarizes_without_running() -> None:
    """The README's command, with run=false: no training, the committed summary on stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "cli", "bench", "main_job", "run=false"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == json.loads(COMMITTED.read_text())


def test_a_test_set_and_the_base_model_are_summarized_beside_the_held_out_set(tmp_path: Path) -> None:
    """eval/test/ (an eval set) and base/eval/ (the model before its warm start): each set's paired start →
    end change, and the base model's success on every set, from the evidence alone."""
    evidence = _evidence(tmp_path / "seed_1", {0: [False] * 10, 10: [True] * 5 + [False] * 5})
    (evidence / "eval" / "test").mkdir()
    for version, correct in {0: [True] + [False] * 9, 10: [True] * 4 + [False] * 6}.items():
        _eval_file(evidence / "eval" / "test", version, correct)
    (evidence / "base" / "eval" / "test").mkdir(parents=True)
    _eval_file(evidence / "base" / "eval", 0, [False] * 10)
    _eval_file(evidence / "base" / "eval" / "test", 0, [True] + [False] * 9)
    row = summarize_seed(evidence, 0.10)
    assert row["gain"] == pytest.approx(0.5)
    test = row["eval_sets"]["test"]
    assert [e["step"] for e in test["evaluations"]] == [0, 10] and test["gain"] == pytest.approx(0.3)
    assert test["gain_low"] <= test["gain"] <= test["gain_high"]
    assert row["base_model"]["heldout"]["success"] == 0.0 and row["base_model"]["test"]["success"] == 0.1
    plain = summarize_seed(_evidence(tmp_path / "seed_2", {0: [False] * 4, 10: [True] * 4}), 0.10)
    assert "eval_sets" not in plain and "base_model" not in plain  # the first protocol's evidence, unchanged


def test_an_arm_is_compared_with_a_baseline_paired_by_prompt_at_each_arms_last_evaluation(
        tmp_path: Path) -> None:
    """Per set both arms evaluated: this arm's final success minus the baseline's final success, the
    differences taken prompt by prompt (ten prompts; this arm right on 0-5, the baseline on 0-1 and 6: +1
    on four prompts, −1 on one → 0.3), with the t-interval of those ten differences."""
    arm = _evidence(tmp_path / "arm" / "seed_1", {0: [False] * 10, 10: [True] * 6 + [False] * 4})
    base = _evidence(tmp_path / "base" / "seed_1",
                     {0: [False] * 10, 10: [True] * 2 + [False] * 4 + [True] + [False] * 3})
    for folder, end in ((arm, [True] * 3 + [False] * 7), (base, [False] * 10)):
        (folder / "eval" / "test").mkdir()
        _eval_file(folder / "eval" / "test", 0, [False] * 10)
        _eval_file(folder / "eval" / "test", 10, end)
    summary = summarize_main_job(tmp_path / "arm", [1], 0.10, {"truncate": tmp_path / "base"})
    versus = summary["seeds"]["1"]["versus"]["truncate"]
    assert set(versus) == {"heldout", "test"}
    held = versus["heldout"]
    assert (held["success"], held["baseline_success"], held["difference"]) == (0.6, 0.3, 0.3)
    differences = [1.0] * 4 + [-1.0] + [0.0] * 5
    sd = (sum((d - 0.3) ** 2 for d in differences) / 9) ** 0.5
    assert held["low"] == pytest.approx(0.3 - 2.262 * sd / 10 ** 0.5, abs=2e-3)  # t of 9 degrees of freedom
    assert held["prompts"] == 10 and held["step"] == held["baseline_step"] == 10
    assert versus["test"]["difference"] == 0.3 and versus["test"]["baseline_success"] == 0.0
    assert "versus" not in summarize_main_job(tmp_path / "arm", [1], 0.10)["seeds"]["1"]
    with pytest.raises(FileNotFoundError, match="no evidence of this seed"):
        summarize_main_job(tmp_path / "arm", [1], 0.10, {"missing": tmp_path / "nowhere"})
