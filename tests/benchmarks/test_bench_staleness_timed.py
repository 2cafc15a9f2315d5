"""`vcpo bench staleness` with `kind: timed` at toy size: fixed bounds and `auto` on the simulated clock
through the real pipeline (pre-taught tiny policy, HF engine, rollout manager on the timeline, torch
learner); every lag is the timeline's, the score is measured at every checkpoint against simulated time,
rows are reused; the summary's time to score and the goal's verdict on hand-made rows; the shipped preset's
clock is the fit of the shipped episode lengths; the committed summary is recomputed from its rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from benchmarks import BENCH_CONFIG_ROOT
from benchmarks.staleness.schema import StalenessTimedBenchConfig
from benchmarks.staleness.timed import (
    EPISODE_TOKENS,
    fit_episode_times,
    learner_seconds,
    run_timed_staleness_bench,
    time_to_score,
    timed_summary,
)
from rollout.sim_clock import ClockSettings, SimulatedClock

ROOT = Path(__file__).resolve().parents[2]
PRESET = BENCH_CONFIG_ROOT / "staleness_timed.yaml"


def _bench(tmp_path: Path, **changes: object) -> StalenessTimedBenchConfig:
    raw = yaml.safe_load((BENCH_CONFIG_ROOT / "staleness_tiny.yaml").read_text())
    raw.update({"kind": "timed", "only": None, "lags": [0, 2, "auto"], "seeds": [0], "steps": 6,
                "eval_every": 3, "groups_per_step": 2, "group_size": 4, "max_operand": 3,
                "pretrain_steps": 30,
                "hidden_size": 32, "workers": 1, "run_root": str(tmp_path / "bench"),
                "clock": {"episode_median_s": 1.0, "episode_sigma": 0.8, "learner_s": 1.5,
                          "concurrent_groups": 4},
                "auto_lag": {"min_lag": 0, "max_lag": 3, "patience": 1, "target_ess_ratio": 0.05},
                "methods": [{"name": "vcpo", "algo": {"objective": {"type": "vcpo"}}, "lr": 1e-3}]})
    raw.update(changes)
    return StalenessTimedBenchConfig.model_validate(raw)


def test_fixed_and_auto_bounds_run_on_the_timeline_and_are_scored_against_simulated_time(
        tmp_path: Path) -> None:
    bench = _bench(tmp_path)
    result = run_timed_staleness_bench(bench)
    json.dumps(result)
    runs = {r["lag"]: r for r in result["runs"]}
    assert set(runs) == {0, 2, "auto"}
    for lag, run in runs.items():
        assert "error" not in run, run.get("error")
        assert [p["step"] for p in run["score_curve"]] == [0, 3, 6]  # the start, then every eval_every steps
        assert run["score_curve"][-1]["score"] == run["final_success"]
        times = run["curves"]["sim_time"]
        assert times == sorted(times) and run["sim_time_s"] == times[-1]
        assert [p["time"] for p in run["score_curve"][1:]] == [times[2], times[5]]
        # the timeline, replayed from the clock's settings (seed = the run's) and the bounds in force
        settings = ClockSettings(**bench.clock.model_dump(exclude={"seed"}), seed=0)
        replay = SimulatedClock(settings, groups_per_batch=2, group_size=4, total_batches=6)
        bounds = [0 if lag == "auto" else lag] + [int(b) for b in run["curves"]["max_lag"]]
        for version, bound in enumerate(bounds):
            replay.open_version(version, bound)
        assert [round(t.end, 9) for t in replay.steps] == [round(t, 9) for t in times]
        expected = [sum(step - replay.admission_version(g) for g in (2 * step, 2 * step + 1)) / 2
                    for step in range(6)]
        assert run["curves"]["lag"] == pytest.approx(expected)
    assert runs[0]["curves"]["lag"] == [0.0] * 6
    assert runs[0]["sim_time_s"] > runs[2]["sim_time_s"]  # asynchrony buys simulated time
    summary = {e["lag"]: e for e in result["summary"]["table"]}
    assert summary[0]["target"] == pytest.approx(0.95 * runs[0]["final_success"])
    assert result["summary"]["verdicts"][0]["status"] == "ok"
    text = (tmp_path / "bench" / "summary.md").read_text()
    assert "| vcpo | auto |" in text and "goal met" in text
    # a rerun reuses every stored row
    again = run_timed_staleness_bench(bench)
    assert all(r.get("reused") for r in again["runs"])


def test_a_bf16_engine_runs_on_the_timeline_and_its_mismatch_is_measured_apart(tmp_path: Path) -> None:
    """numerics: [bf16_engine] — the engine samples from bf16 weights while the learner trains in fp32, so
    lag-0 trajectories carry the numerics mismatch alone; each run keeps it apart from the lag (the
    mismatch ESS ratio below 1, the ratio the controller judged), and the summary labels the numerics."""
    bench = _bench(tmp_path, lags=[0, "auto"], numerics=["bf16_engine"])
    result = run_timed_staleness_bench(bench)
    assert {(r["lag"], r["numerics"]) for r in result["runs"]} == {(0, "bf16_engine"),
                                                                    ("auto", "bf16_engine")}
    for run in result["runs"]:
        assert "error" not in run, run.get("error")
        mismatch = [v for v in run["curves"]["mismatch_ess_ratio"] if v is not None and math.isfinite(v)]
        assert mismatch and min(mismatch) < 1.0  # bf16 rounding: w ≠ 1 at lag 0
        assert run["min_mismatch_ess_ratio"] == min(mismatch)
    k0 = next(r for r in result["runs"] if r["lag"] == 0)
    assert len([v for v in k0["curves"]["mismatch_ess_ratio"] if v is not None]) == 6  # every batch is lag 0
    auto = next(r for r in result["runs"] if r["lag"] == "auto")
    assert any(v is not None and math.isfinite(v) for v in auto["curves"]["lag_judged_ess_ratio"])
    table = {e["lag"]: e for e in result["summary"]["table"]}
    assert table[0]["numerics"] == "bf16_engine" and table[0]["min_mismatch_ess_ratio"] < 1.0
    assert result["summary"]["verdicts"][0]["numerics"] == "bf16_engine"
    text = (tmp_path / "bench" / "summary.md").read_text()
    assert "| vcpo (bf16_engine) | auto |" in text and "mismatch ESS median" in text


def _row(lag: object, seed: int, final: float, curve: list[tuple[float, float]]) -> dict[str, object]:
    return {"method": "m", "lag": lag, "seed": seed, "final_success": final, "sim_time_s": curve[-1][0],
            "mean_lag": 0.0, "mean_bound": 0.0, "median_ess_ratio": 1.0,
            "score_curve": [{"step": i, "time": t, "score": s} for i, (t, s) in enumerate(curve)]}


def test_time_to_score_and_the_goal_verdict_on_hand_made_rows(tmp_path: Path) -> None:
    bench = _bench(tmp_path, lags=[0, 4, "auto"], seeds=[0, 1],
                   methods=[{"name": "m", "algo": {"objective": {"type": "vcpo"}}, "lr": 1e-3}])
    rows = [_row(0, 0, 0.40, [(0, 0.1), (10, 0.3), (20, 0.40)]), _row(0, 1, 0.40, [(0, 0.1), (10, 0.39),
                                                                                       (20, 0.40)]),
            _row(4, 0, 0.40, [(0, 0.1), (5, 0.38), (10, 0.40)]), _row(4, 1, 0.40, [(0, 0.1), (5, 0.2),
                                                                                     (10, 0.40)]),
            _row("auto", 0, 0.39, [(0, 0.1), (6, 0.385), (11, 0.39)]),
            _row("auto", 1, 0.39, [(0, 0.1), (6, 0.2), (11, 0.39)])]
    assert time_to_score([{"time": 1.0, "score": 0.1}], 0.5) == math.inf
    summary = timed_summary(bench, rows)
    cells = {e["lag"]: e for e in summary["table"]}
    assert cells[0]["target"] == pytest.approx(0.38)
    assert cells[0]["time_to_target_per_seed"] == [20, 10] and cells[0]["time_to_target"] == 15
    assert cells[4]["time_to_target_per_seed"] == [5, 10] and cells[4]["time_to_target"] == 7.5
    assert cells["auto"]["time_to_target_per_seed"] == [6, 11] and cells["auto"]["time_to_target"] == 8.5
    verdict = summary["verdicts"][0]
    assert verdict["score_within_tolerance"]  # 0.39 ≥ 0.95 × 0.40
    assert verdict["fastest_fixed_lag"] == 4 and not verdict["time_within_tolerance"]  # 8.5 > 1.1 × 7.5
    assert not verdict["goal_met"]
    never = timed_summary(bench, [*rows[:4], _row("auto", 0, 0.3, [(0, 0.1), (9, 0.3)]),
                                  _row("auto", 1, 0.39, [(0, 0.1), (6, 0.385)])])
    auto = {e["lag"]: e for e in never["table"]}["auto"]
    assert auto["never_reached"] == 1 and auto["time_to_target"] == math.inf
    assert not never["verdicts"][0]["goal_met"]


def test_the_preset_is_valid_and_its_clock_is_the_fit_of_the_shipped_episode_lengths() -> None:
    from cli.config_catalog import bench_command_schema

    assert bench_command_schema("staleness", PRESET) is StalenessTimedBenchConfig
    bench = StalenessTimedBenchConfig.model_validate(yaml.safe_load(PRESET.read_text()))
    assert bench.lags == [0, 4, 32, 128, "auto"] and len(bench.seeds) >= 3
    assert bench.steps >= 2.5 * 128 and bench.auto_lag.max_lag == 128
    data = json.loads(EPISODE_TOKENS.read_text())
    assert len(data["tokens"]) == data["episodes"] == 160
    median, sigma = fit_episode_times(data["tokens"], tokens_per_s=100.0)
    assert bench.clock.episode_median_s == pytest.approx(median, abs=5e-4)
    assert bench.clock.episode_sigma == pytest.approx(sigma, abs=5e-4)
    learner = learner_seconds(median, sigma, bench.groups_per_step * bench.group_size)
    assert bench.clock.learner_s == pytest.approx(learner, abs=5e-4)
    assert bench.clock.concurrent_groups == 2 * bench.groups_per_step


def test_a_preset_without_k0_or_with_a_step_count_off_the_evaluation_grid_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs k = 0"):
        _bench(tmp_path, lags=[2, "auto"])
    with pytest.raises(ValueError, match="multiple of eval_every"):
        _bench(tmp_path, steps=7)


COMMITTED = ROOT / "docs" / "results" / "staleness_timed.json"


@pytest.mark.skipif(not COMMITTED.is_file(), reason="docs/results/staleness_timed.json is not committed yet")
def test_the_committed_summary_is_recomputed_from_its_stored_rows() -> None:
    bench = StalenessTimedBenchConfig.model_validate(yaml.safe_load(PRESET.read_text()))
    rows = [json.loads(p.read_text()) for p in sorted(Path(ROOT / bench.results_dir).glob("*.json"))]
    committed = json.loads(COMMITTED.read_text())
    recomputed = json.loads(json.dumps(timed_summary(bench, rows), allow_nan=True))
    assert recomputed == committed["summary"]


@pytest.mark.parametrize("judge", ["staleness", "total"])
def test_each_bf16_engine_arm_is_recomputed_from_its_own_stored_rows(judge: str) -> None:
    """staleness_timed_bf16.yaml's two arms share their k = 0 rows and store their `auto` rows apart (the
    controller's settings are in an auto run's key): each committed summary is its own jobs' rows."""
    from benchmarks.staleness.bench import policy_digest, policy_store, results_dir, run_key
    from benchmarks.staleness.tasks import policy_fingerprint
    from benchmarks.staleness.timed import jobs

    path = ROOT / "docs" / "results" / "staleness_timed_bf16.json"
    if not path.is_file():
        pytest.skip("docs/results/staleness_timed_bf16.json is written when both arms have run (docs/log.md)")
    raw = yaml.safe_load((BENCH_CONFIG_ROOT / "staleness_timed_bf16.yaml").read_text())
    raw["auto_lag"] = {**raw["auto_lag"], "judge": judge}
    bench = StalenessTimedBenchConfig.model_validate(raw)
    weights = policy_digest(ROOT / policy_store(bench) / f"policy-{policy_fingerprint(bench)}")
    rows = [json.loads((ROOT / results_dir(bench) / f"{run_key(bench, job, weights)}.json").read_text())
            for job in jobs(bench)]
    assert {r["numerics"] for r in rows} == {"bf16_engine"} and len(rows) == 12
    recomputed = json.loads(json.dumps(timed_summary(bench, rows), allow_nan=True))
    arm = json.loads(path.read_text())["arms"][judge]
    assert arm["config"]["auto_lag"]["judge"] == judge and recomputed == arm["summary"]
