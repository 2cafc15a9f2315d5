"""`vcpo bench async` on the tiny workload: JSON rows per k with the time split; the bound holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.learner.train.test_train_e2e import _vcpo, _write_configs


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
    # utilisation from the steps' CPU-seconds, and the most overlap could give over k = 0
    for row in rows.values():
        assert row["cores"] >= 1 and 0 < row["utilization"] <= 1.05  # CPU-s ≤ wall × cores (+ rounding)
    bound = report["overlap_bound"]
    assert bound["speedup"] == pytest.approx(min(bound["by_cores"], bound["by_overlap"]))
    assert bound["by_cores"] == pytest.approx(1 / rows[0]["utilization"])
    assert 1.0 <= bound["by_overlap"] <= 2.0
    assert rows[2]["gap_to_bound"] == pytest.approx(bound["speedup"] / rows[2]["speedup_vs_k0"])


def test_the_overlap_bound_is_the_tighter_of_the_cores_and_the_two_sides() -> None:
    from learner.benchmarks.asynchrony import overlap_bound

    # 60% busy on the cores → at most 1.67×; 10 s generating + 30 s training → at most 1.33×
    bound = overlap_bound({"utilization": 0.6, "generate_s": 10.0, "train_s": 30.0})
    assert bound == pytest.approx({"by_cores": 1 / 0.6, "by_overlap": 40 / 30, "speedup": 40 / 30})
