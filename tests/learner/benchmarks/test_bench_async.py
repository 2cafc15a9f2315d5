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
