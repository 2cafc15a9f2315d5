"""`vcpo bench opob` runs every step kind on a tiny model and reports a well-formed table."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.opob_step import run_opob_bench
from benchmarks.schema import OpobBenchConfig
from cli import main


def test_opob_bench_reports_every_step_and_ratio(tmp_path: Path) -> None:
    config = OpobBenchConfig(model="tiny", lengths=[16, 24], repeats=1, per_trajectory_max_length=16)
    result = run_opob_bench(config, cache_dir=tmp_path)
    json.dumps(result)  # JSON-able
    first, second = result["rows"]
    for row in (first, second):
        for key in ("old_forward_s", "grpo_step_s", "vcpo_fast_step_s", "vcpo_fast_over_grpo"):
            assert row[key] > 0 and math.isfinite(row[key])
        assert 0 < row["ess_ratio"] <= 1
    assert first["vcpo_per_trajectory_over_fast"] > 0
    assert second["vcpo_per_trajectory_over_fast"] is None  # above per_trajectory_max_length: skipped
    assert result["target"]["vcpo_fast_over_grpo_max"] == 1.15


def test_bench_cli_writes_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "bench.json"
    code = main(["bench", "opob", "--out", str(out), "model=tiny", "lengths=[16]", "repeats=1"])
    assert code == 0
    assert json.loads(out.read_text())["rows"][0]["length"] == 16


def test_bench_cli_rejects_bad_override(capsys) -> None:
    assert main(["bench", "opob", "lenghts=[16]"]) == 2
    assert "did you mean 'lengths'" in capsys.readouterr().err


def test_padding_puts_each_targets_value_in_its_trajectory_row() -> None:
    import torch

    from learner.forward.packing import TargetPadding, TrajectoryTokens, build_microbatch

    # trajectory 0: 4 tokens, loss on the last 2 → 2 targets; trajectory 1: 3 tokens, loss on the last 1 → 1
    batch = build_microbatch([TrajectoryTokens([1, 2, 3, 4], [False, False, True, True], group_id=0),
                              TrajectoryTokens([5, 6, 7], [False, False, True], group_id=0)], [0, 1])
    pad = TargetPadding(batch)
    assert batch.target_counts == (2, 1)
    assert torch.equal(pad(torch.tensor([10.0, 11.0, 20.0])), torch.tensor([[10.0, 11.0], [20.0, 0.0]]))
    assert torch.equal(pad.mask, torch.tensor([[True, True], [True, False]]))
