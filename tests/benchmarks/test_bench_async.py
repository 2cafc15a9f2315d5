"""`vcpo bench async` on the tiny workload: JSON rows per k with the time split; the bound holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.run.train.test_train_e2e import _vcpo, _write_configs


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_bench_async_reports_each_lag_with_its_time_split(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_config = _write_configs(tmp_path, tiny_model_dir, max_lag=0, steps=3)
    bench = tmp_path / "bench.yaml"
    bench.write_text(yaml.safe_dump({"run_config": str(run_config), "lags": [0, 2], "steps": 3,
                                     "run_root": str(tmp_path / "bench-runs")}))
    result = _vcpo("bench", "async", "--config", str(bench), "--out", str(tmp_path / "out.json"))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out.json").read_text())
    rows = {row["max_lag"]: row for row in report["rows"]}
    assert set(rows) == {0, 2}
    for lag, row in rows.items():
        assert row["steps"] == 3 and row["wall_s"] > 0 and row["tokens"] > 0
        assert row["max_lag_seen"] <= lag
        assert row["train_s"] > 0 and row["generate_s"] > 0
        # learner time adds up to (at most) the wall clock
        assert row["train_s"] + row["weight_sync_s"] + row["idle_learner_s"] <= row["wall_s"] * 1.01
    assert rows[0]["speedup_vs_k0"] == 1.0
    assert rows[0]["mean_lag"] == 0.0
    # utilisation from the steps' CPU-seconds; the pipeline fill (k + 1 steps) and drain (k) apart
    for lag, row in rows.items():
        assert row["cores"] >= 1 and 0 < row["utilization"] <= 1.05  # CPU-s ≤ wall × cores (+ rounding)
        assert (row["fill_steps"], row["steady"]["steps"]) == ((1, 2) if lag == 0 else (2, 1))
        assert row["steady"]["step_wall_s"] <= row["step_wall_s"]
        assert row["steady_step_s"] == pytest.approx(row["steady"]["step_wall_s"] / row["steady"]["steps"])
        assert row["gen_tokens_per_s"] == pytest.approx(row["tokens"] / row["generate_s"])
        assert row["pipeline_gap"] >= 0.99  # a step cannot be shorter than its slower side's busy time
        assert row["degenerate_groups"] >= row["skipped_groups"] >= 0
        for kept in ("checkpoints", "export"):  # no 1.6 GB checkpoint, no 0.5 GB policy
            assert not (tmp_path / "bench-runs" / f"k{lag}" / kept).exists()
    bound = report["overlap_bound"]
    assert bound["speedup"] == pytest.approx(min(bound["by_cores"], bound["by_overlap"]))
    assert bound["by_cores"] == pytest.approx(1 / rows[0]["steady_utilization"])
    assert 1.0 <= bound["by_overlap"] <= 2.0
    steady_ratio = rows[0]["steady_step_s"] / rows[2]["steady_step_s"]
    assert rows[2]["steady_speedup_vs_k0"] == pytest.approx(steady_ratio)
    measured = rows[2]["mixed_speedup_vs_k0"] or rows[2]["steady_speedup_vs_k0"]
    assert rows[2]["gap_to_bound"] == pytest.approx(bound["speedup"] / measured)


def _record(step: int, seconds: float, degenerate: int, generate: float, train: float) -> dict[str, float]:
    return {"trainer_step": step, "time/step": seconds, "train/degenerate_groups": degenerate,
            "time/generate": generate, "time/train": train, "time/weight_sync": 0.5,
            "time/cpu": 1.5 * seconds, "tokens/generated": 1000}


def test_the_steady_steps_are_compared_on_k0s_mix_of_degenerate_and_informative_steps() -> None:
    """k = 0 drew four informative steps (12 s) and two all-degenerate ones (8 s) after its fill; k = 2 drew
    the reverse and is no faster per kind of step, so its raw steady mean reads as a speedup (1.2×) that
    its mix-adjusted one (1.0×) does not. The bound: 1 / utilisation (1.33× on 2 cores) or the overlap's."""
    from benchmarks.asynchrony import compare_lags, lag_row

    kinds0 = [2, 1, 1, 2, 1, 1]
    k0 = [_record(1, 20.0, 2, 15.0, 5.0)] + [
        _record(i + 2, 12.0 if d == 1 else 8.0, d, 6.0, 5.5 if d == 1 else 1.5) for i, d in enumerate(kinds0)]
    kinds2 = [1, 2, 2, 1, 2, 2]
    k2 = [_record(i + 1, 3.0, 2, 0.0, 2.0) for i in range(3)] + [
        _record(i + 4, 12.0 if d == 1 else 8.0, d, 8.0, 11.0 if d == 1 else 7.0) for i, d in enumerate(kinds2)
    ] + [_record(i + 10, 2.0, 2, 0.0, 1.5) for i in range(2)]
    report = compare_lags([lag_row(0, k0, len(k0), 90.0), lag_row(2, k2, len(k2), 80.0)])
    base, row = report["rows"]
    assert (row["fill_steps"], row["steady"]["steps"], row["drain_steps"]) == (3, 6, 2)
    assert base["steady_step_s"] == pytest.approx(64 / 6) and row["steady_step_s"] == pytest.approx(56 / 6)
    assert row["steady_speedup_vs_k0"] == pytest.approx(64 / 56)
    assert row["steady_step_s_on_k0_mix"] == pytest.approx(64 / 6)
    assert row["mixed_speedup_vs_k0"] == pytest.approx(1.0)
    bound = report["overlap_bound"]
    assert bound["by_cores"] == pytest.approx(base["cores"] / 1.5)  # CPU-seconds = 1.5 × wall
    assert bound["by_overlap"] == pytest.approx((36 + 28) / 36)  # 6 × 6 s generating, 25 + 3 s learning
    assert row["gap_to_bound"] == pytest.approx(bound["speedup"])


def test_the_overlap_bound_is_the_tighter_of_both_sides_overlapped_and_the_cores() -> None:
    from benchmarks.asynchrony import overlap_bound

    # 10 s generating + 28 s training + 2 s syncing weights → at most 40 / 30 = 1.33×; 60% busy cores → 1.67×
    k0 = {"steady_utilization": 0.6, "steady": {"generate_s": 10.0, "train_s": 28.0, "weight_sync_s": 2.0}}
    expected = {"by_overlap": 40 / 30, "by_cores": 1 / 0.6, "speedup": 40 / 30}
    assert overlap_bound(k0) == pytest.approx(expected)


@pytest.mark.parametrize(("lag", "steps", "window"), [
    (0, 12, (1, 12)), (2, 12, (3, 10)), (4, 16, (5, 12)), (2, 3, (2, 3)), (0, 1, (0, 1))])
def test_the_steady_steps_lie_between_the_fill_and_the_drain(lag: int, steps: int,
                                                             window: tuple[int, int]) -> None:
    from benchmarks.asynchrony import steady_window

    assert steady_window(lag, steps) == window
