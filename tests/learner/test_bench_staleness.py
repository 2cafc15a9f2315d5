"""`vcpo bench staleness` at toy size: the real pipeline (pre-taught tiny policy, HF engine, rollout
manager in saturate mode, torch learner) for two methods × two lags; the JSON, the exact lags, the
not-run rows, the plots; the lr sweep's choice; the collapse rule on hand-made curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from configs.schema import StalenessBenchConfig
from learner.bench_staleness import choose_lrs, run_staleness_bench, summarize_curves

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, **changes: object) -> StalenessBenchConfig:
    raw = yaml.safe_load((ROOT / "configs" / "bench" / "staleness.yaml").read_text())
    raw.update({"only": ["grpo", "vcpo"], "lags": [0, 3], "seeds": [0], "steps": 6, "groups_per_step": 2,
                "group_size": 4, "max_operand": 3, "pretrain_steps": 30, "hidden_size": 32, "workers": 1,
                "run_root": str(tmp_path / "bench")})
    raw.update(changes)
    return StalenessBenchConfig.model_validate(raw)


def test_the_matrix_runs_the_real_pipeline_with_exact_lags_and_writes_json_table_and_plots(
        tmp_path: Path) -> None:
    bench = _bench(tmp_path)
    result = run_staleness_bench(bench)
    json.dumps(result)
    runs = {(r["method"], r["lag"]): r for r in result["runs"]}
    assert set(runs) == {("grpo", 0), ("grpo", 3), ("vcpo", 0), ("vcpo", 3)}
    for (_, lag), run in runs.items():
        assert "error" not in run, run.get("error")
        assert run["steps"] == 6
        assert run["curves"]["lag"] == [float(min(lag, step)) for step in range(6)]  # saturate: exactly
        assert 0.0 <= run["final_success"] <= 1.0
        if lag == 0:
            assert run["curves"]["ess_ratio"] == [pytest.approx(1.0)] * 6  # on-policy: all weights 1
    assert runs[("vcpo", 3)]["min_ess_ratio"] < 1.0  # stale batches do carry non-trivial weights
    summary = {(e["method"], e["lag"]): e for e in result["summary"]}
    assert len(summary) == len(bench.methods) * 2  # every method keeps its rows
    assert summary[("seq_tis", 3)]["status"] == "not run"
    assert summary[("vcpo", 3)]["status"] == "ok"
    table = (tmp_path / "bench" / "summary.md").read_text()
    assert "| vcpo | 3 |" in table and "| mis | 0 | " in table
    for name in ("staleness_k0.png", "staleness_k3.png", "staleness_final_vs_lag.png"):
        assert (tmp_path / "bench" / name).stat().st_size > 10_000


def test_lr_sweep_runs_each_method_at_k0_on_its_own_seed_and_picks_the_best_lr(tmp_path: Path) -> None:
    result = run_staleness_bench(_bench(tmp_path, mode="lr_sweep", only=["vcpo"], lr_grid=[1e-4, 1e-2],
                                        steps=4))
    assert [(r["lag"], r["seed"], r["lr"]) for r in result["runs"]] == [(0, 1000, 1e-4), (0, 1000, 1e-2)]
    best = max(result["runs"], key=lambda r: r["final_success"])
    assert result["chosen_lr"] == {"vcpo": best["lr"]}


def test_collapse_is_the_first_step_the_trailing_reward_halves_or_a_value_is_not_finite() -> None:
    steps = 30
    flat = {"loss": [0.0] * steps, "grad_norm": [1.0] * steps, "ess_ratio": [1.0] * steps,
            "clip_frac": [0.0] * steps, "masked_frac": [0.0] * steps, "lag": [0.0] * steps}
    healthy = summarize_curves({**flat, "reward": [0.4] * steps}, 0.5)
    assert healthy["collapse_step"] is None and healthy["reward_last10"] == pytest.approx(0.4)
    falling = summarize_curves({**flat, "reward": [0.4] * 15 + [0.0] * 15}, 0.5)
    assert falling["collapse_step"] == 21  # trailing 10 = 4×0.4 + 6×0 → 0.16 < 0.2 first at step 21
    nan = summarize_curves({**flat, "reward": [0.4] * steps,
                            "grad_norm": [1.0] * 5 + [math.nan] + [1.0] * 24}, 0.5)
    assert nan["collapse_step"] == 6


def test_choose_lrs_prefers_the_smaller_lr_on_a_tie_and_skips_errors() -> None:
    rows = [{"method": "a", "lr": 1e-2, "final_success": 0.5},
            {"method": "a", "lr": 1e-3, "final_success": 0.5},
            {"method": "b", "lr": 1e-3, "error": "boom"},
            {"method": "b", "lr": 1e-2, "final_success": 0.1}]
    assert choose_lrs(rows) == {"a": 1e-3, "b": 1e-2}


def test_a_bad_method_or_name_is_refused_at_load_time(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="only"):
        _bench(tmp_path, only=["nope"])
    with pytest.raises(ValueError, match="objective"):
        _bench(tmp_path, methods=[{"name": "x", "algo": {"objective": {"type": "nope"}}, "lr": 1e-3}],
               only=None)
