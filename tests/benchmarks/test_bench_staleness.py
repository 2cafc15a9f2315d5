"""`vcpo bench staleness` at toy size: the real pipeline (pre-taught tiny policy, HF engine, rollout
manager in saturate mode, torch learner) for two methods × two lags, on both presets' tasks; the JSON,
the exact lags, the not-run rows, the plots; the paper preset's regime properties, diagnostics, bf16
engine numerics and resume; the lr sweep's cap and choice; the collapse rule on hand-made curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks import BENCH_CONFIG_ROOT
from benchmarks.staleness import tasks as staleness_tasks
from benchmarks.staleness.bench import (
    choose_lrs,
    policy_digest,
    prepare,
    run_key,
    run_staleness_bench,
    summarize_curves,
)
from benchmarks.staleness.schema import StalenessBenchConfig

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path: Path, **changes: object) -> StalenessBenchConfig:
    raw = yaml.safe_load((BENCH_CONFIG_ROOT / "staleness_tiny.yaml").read_text())
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
        assert run["host"]["cpu"] and run["host"]["torch"] == torch.__version__  # which kernels it ran on
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


def test_lr_sweep_caps_the_grid_by_the_k1_ess_then_picks_each_methods_best_lr_at_k0(tmp_path: Path) -> None:
    result = run_staleness_bench(_bench(tmp_path, mode="lr_sweep", only=["vcpo"], lr_grid=[1e-4, 1e-2],
                                        steps=4, ess_floor=0.01))
    cap = result["lr_cap"]
    assert cap["method"] == "seq_tis" and set(cap["median_ess_ratio_per_lr"]) == {"0.0001", "0.01"}
    assert cap["cap"] == 1e-2  # a floor of 0.01 keeps both lrs
    assert [(r["lag"], r["seed"], r["lr"]) for r in result["runs"]] == [(0, 1000, 1e-4), (0, 1000, 1e-2)]
    best = max(result["runs"], key=lambda r: r["final_success"])
    assert result["chosen_lr"] == {"vcpo": best["lr"]}
    # an unreachable floor leaves no lr under the cap, so nothing is swept
    capped = run_staleness_bench(_bench(tmp_path, mode="lr_sweep", only=["vcpo"], lr_grid=[1e-4, 1e-2],
                                        steps=4, ess_floor=1.0, run_root=str(tmp_path / "capped")))
    assert capped["lr_cap"]["cap"] in (None, 1e-4, 1e-2) and all(
        r["lr"] <= (capped["lr_cap"]["cap"] or 0.0) for r in capped["runs"])


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


def test_the_paper_preset_reports_regime_diagnostics_bf16_numerics_and_resumes(tmp_path: Path) -> None:
    raw = yaml.safe_load((BENCH_CONFIG_ROOT / "staleness.yaml").read_text())
    raw.update({"only": ["seq_tis", "vcpo_reference"], "lags": [0, 2], "seeds": [0], "steps": 4,
                "groups_per_step": 2, "group_size": 4, "count_max": 8, "hidden_size": 32, "num_layers": 1,
                "intermediate_size": 64, "pretrain_steps": 20, "workers": 1,
                "numerics": ["matched", "bf16_engine"], "numerics_lags": [0],
                "run_root": str(tmp_path / "paper")})
    bench = StalenessBenchConfig.model_validate(raw)
    result = run_staleness_bench(bench)
    properties = result["properties"]
    assert properties["task"] == "alphabet" and properties["held_out_eval"]
    assert properties["train_prompts"] > properties["eval_prompts"] > 0
    assert set(properties["sampled_response_tokens"]) == {"samples", "median", "p10", "p90", "success_rate"}
    assert properties["targets_met"]["B >= 64 in groups >= 8"] is False  # reported as measured, not assumed
    runs = {(r["method"], r["lag"], r["numerics"]): r for r in result["runs"]}
    assert set(runs) == {(m, lag, n) for m in ("seq_tis", "vcpo_reference") for lag, n in
                         ((0, "matched"), (0, "bf16_engine"), (2, "matched"))}
    for run in runs.values():
        assert "error" not in run, run.get("error")
    # matched numerics: w = 1 exactly at k = 0; a bf16 engine makes w ≠ 1 at k = 0
    assert runs[("seq_tis", 0, "matched")]["curves"]["ess_ratio"] == [pytest.approx(1.0)] * 4
    assert runs[("seq_tis", 0, "bf16_engine")]["min_ess_ratio"] < 1.0 - 1e-6
    # OPOB's diagnostics exist for VCPO and not for sequence TIS; corr(log w, R) for both
    vcpo_curves = runs[("vcpo_reference", 2, "matched")]["curves"]
    assert all(v is not None and 0.0 < v <= 1.0 for v in vcpo_curves["omega_max_share"])
    assert all(v is None for v in runs[("seq_tis", 2, "matched")]["curves"]["omega_max_share"])
    assert all(v is not None for v in vcpo_curves["log_w_reward_corr"])
    summary = json.loads((tmp_path / "paper" / "summary.json").read_text())
    assert {(e["method"], e["lag"], e["numerics"]) for e in summary["summary"]} >= set(runs)
    assert {r["lag"] for r in summary["retention"]} == {2}
    # an interrupted or repeated matrix reuses every stored run instead of training again
    again = run_staleness_bench(bench)
    assert all(r.get("reused") for r in again["runs"]) and len(again["runs"]) == len(result["runs"])
    # a fresh run root (another machine, a new clone) takes the policy kept beside the stored runs and so
    # reuses them; runs stored on another policy's weights are not taken for this one's
    kept = tmp_path / "paper" / "results" / f"policy-{staleness_tasks.policy_fingerprint(bench)}"
    assert (kept / "model.safetensors").is_file()
    elsewhere = bench.model_copy(update={"run_root": str(tmp_path / "clone"),
                                         "results_dir": str(tmp_path / "paper" / "results")})
    _task, model_dir = prepare(elsewhere, tmp_path / "clone")
    assert policy_digest(model_dir) == policy_digest(kept)
    job = (bench.methods[0], 0, 0, "matched")
    assert run_key(bench, job, policy_digest(kept)) != run_key(bench, job, "another-policy")
    assert all(r.get("reused") for r in run_staleness_bench(elsewhere)["runs"])


def test_the_lr_cap_stops_below_the_first_lr_that_loses_ess_or_collapses(tmp_path: Path) -> None:
    from benchmarks.staleness.bench import _lr_cap

    bench = _bench(tmp_path, ess_floor=0.9)

    def row(lr: float, ess: float, collapse: int | None = None) -> dict[str, object]:
        return {"lr": lr, "median_ess_ratio": ess, "collapse_step": collapse}

    # a collapsed policy samples deterministically, so its ESS is 1: it must not pass the cap
    rows = [row(3e-5, 0.9999), row(1e-4, 0.998), row(3e-4, 0.976), row(1e-3, 1.0, collapse=11)]
    assert _lr_cap(bench, rows)["cap"] == 3e-4
    # the cap is monotone: a larger lr that happens to pass above a failing one is not taken
    rows = [row(3e-5, 0.99), row(1e-4, 0.5), row(3e-4, 0.95)]
    assert _lr_cap(bench, rows)["cap"] == 3e-5
    assert _lr_cap(bench, [row(3e-5, 0.5)])["cap"] is None


def _cell(method: str, lag: int, seeds: list[float]) -> dict:
    from benchmarks.staleness.bench import mean_interval

    mean, sd, half = mean_interval(seeds)
    return {"method": method, "lag": lag, "numerics": "matched", "status": "ok", "final_success": mean,
            "final_success_sd": sd, "final_success_ci95": half, "final_success_per_seed": seeds}


def test_retention_answers_loses_5_and_20_percent_with_welch_intervals_and_the_kept_gain() -> None:
    from benchmarks.staleness.bench import retention_table

    summary = [_cell("a", 0, [0.431, 0.429, 0.43]), _cell("a", 32, [0.432, 0.43, 0.431]),
               _cell("a", 128, [0.20, 0.25, 0.22]), _cell("b", 0, [0.44, 0.30, 0.50]),
               _cell("b", 128, [0.40, 0.28, 0.45])]
    rows = {(r["method"], r["lag"]): r for r in retention_table(summary, initial=0.32)}
    same, collapsed, noisy = rows[("a", 32)], rows[("a", 128)], rows[("b", 128)]
    assert same["retention"] == pytest.approx(1.0, abs=0.01) and not same["loses_more_than_5pct"]
    assert same["resolved"]  # the interval of (k − 0.95·k0) lies above 0: no 5% loss, resolved
    assert collapsed["loses_at_least_20pct"] and collapsed["resolved"] and collapsed["resolved_20pct"]
    assert collapsed["gain_retention"] == pytest.approx((0.22333 - 0.32) / (0.43 - 0.32), rel=1e-3)
    assert collapsed["difference_vs_k0"] == pytest.approx(0.22333 - 0.43, rel=1e-3)
    assert noisy["loses_more_than_5pct"] and not noisy["resolved"]  # sd 0.1 over 3 seeds: unresolved


@pytest.mark.parametrize(("summary", "overrides"), [
    ("staleness.json", {}),
    ("staleness_5seeds.json", {"lags": [0, 128], "seeds": [0, 1, 2, 3, 4]}),
    ("staleness_10seeds.json", {"lags": [0, 128], "seeds": list(range(10)),
                                "only": ["seq_tis", "m2po", "vcpo_spec", "vcpo_reference"]}),
    ("staleness_common_lr.json", {"common_lr": 1e-4}),
    ("staleness_common_lr_5seeds.json", {"common_lr": 1e-4, "lags": [0, 128], "seeds": [0, 1, 2, 3, 4]}),
    ("staleness_bf16_engine.json", {"numerics": ["bf16_engine"], "lags": [0, 32], "seeds": [0],
                                    "only": ["grpo", "seq_tis", "vcpo_spec", "vcpo_reference"]}),
])
def test_the_committed_summary_is_what_the_committed_runs_give(tmp_path: Path, summary: str,
                                                               overrides: dict[str, object]) -> None:
    """docs/results/<summary> (the numbers docs/results.md quotes) is recomputed from the stored runs in
    docs/results/staleness_runs — every run reused, none trained — and must agree."""
    from benchmarks.staleness import bench as staleness

    stored = ROOT / "docs" / "results" / "staleness_runs"
    raw = yaml.safe_load((BENCH_CONFIG_ROOT / "staleness.yaml").read_text())
    raw.update({"numerics": ["matched"], "results_dir": str(stored), "run_root": str(tmp_path / "bench"),
                **overrides})
    bench = StalenessBenchConfig.model_validate(raw)
    weights = policy_digest(stored / f"policy-{staleness_tasks.policy_fingerprint(bench)}")
    missing = [job[0].name for job in staleness._matrix_jobs(bench)
               if not (stored / f"{run_key(bench, job, weights)}.json").is_file()]
    assert not missing, f"runs not stored (the test would train them): {missing}"
    result = run_staleness_bench(bench)
    committed = json.loads((ROOT / "docs" / "results" / summary).read_text())
    recomputed = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert recomputed["summary"] == committed["summary"]
    assert len(recomputed["retention"]) == len(committed["retention"])
    for got, want in zip(recomputed["retention"], committed["retention"], strict=True):
        assert set(got) == set(want)
        for key, value in want.items():  # gain_retention uses the re-measured initial success
            assert got[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key
    assert all(row.get("reused") for row in result["runs"] if row.get("status", "ok") != "not run")
