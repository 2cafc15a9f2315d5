"""`vcpo bench staleness`: does an objective stay stable as the lag k grows? Methods × k × seeds.

Every run goes through the real pipeline of `vcpo train`: the rollout manager (in its stress mode
`rollout.saturate_lag`, so each batch lags by exactly min(k, step) — the worst case the bound
allows, independent of how fast engine and learner are), the HF engine, the agent loop, the reward,
the torch learner with the method's objective and step-size rule, weight sync by version.

The policy is a tiny byte-level Llama *pre-taught* on the task "a+b=" (a, b in 0..max_operand):
supervised on the right sums and stopped once its exact success probability reaches
`pretrain_success` (0.3), so RL starts from a policy that knows the format and leans towards the
answer, and moves quickly under RL (0.31 → 0.75 in 160 on-policy steps at a good lr) — fast
enough for k to matter. Reward: 1 for exactly the sum, else 0.

Per run we record the curves of `metrics.jsonl` (training reward, ESS ratio, lr scale, grad norm,
clipped and masked token fractions, lag) and the final policy's exact success probability: the
teacher-forced probability of the right answer followed by end-of-turn, averaged over all prompts
(no sampling noise). Collapse: the first step whose trailing-10-step training reward falls below
`collapse_fraction` × its first 10 steps' reward, or a non-finite loss / grad norm.

Learning rates: each method has its own, chosen by `mode: lr_sweep` — every method at k = 0 (on
policy, where lag plays no part) with each lr of `lr_grid` on a seed not used by the matrix; the lr
with the best final success probability wins (ties → the smaller lr). The chosen values live in
configs/bench/staleness.yaml with the sweep's numbers.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import yaml

from configs.schema import RunConfig, StalenessBenchConfig, StalenessMethodConfig
from learner import metric_names as names

WINDOW = 10
"""Steps averaged for the first/last reward and the collapse test."""

CURVE_KEYS = {
    "reward": names.REWARD_MEAN,
    "ess_ratio": names.IS_ESS_RATIO,
    "w_max": names.IS_W_MAX,
    "lr_scale": names.LR_SCALE,
    "grad_norm": names.GRAD_NORM,
    "clip_frac": names.PG_CLIP_FRAC,
    "masked_frac": names.PG_MASKED_FRAC,
    "lag": names.STALENESS_MEAN,
    "loss": names.TRAIN_LOSS,
}
"""Curve name in the JSON → metrics.jsonl key."""

_TASK_NAME = "addition"


def _prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def _problems(bench: StalenessBenchConfig) -> list[tuple[int, int]]:
    return [(a, b) for a in range(bench.max_operand + 1) for b in range(bench.max_operand + 1)]


def _fingerprint(bench: StalenessBenchConfig) -> str:
    fields = ("max_operand", "pretrain_success", "pretrain_steps", "hidden_size", "num_layers")
    text = json.dumps({name: getattr(bench, name) for name in fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def prepare(bench: StalenessBenchConfig, root: Path) -> tuple[Path, Path]:
    """The task file (its dataset written beside it) and the pre-taught policy (cached by settings)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"id": f"{a}+{b}", "question": _prompt_text(a, b), "answer": str(a + b)}
            for a, b in _problems(bench)]
    (root / "addition.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    task = {
        "name": _TASK_NAME,
        "dataset": {"type": "file", "path": "addition.jsonl"},
        "fields": {"id": "id", "answer": "answer", "template_fields": {"question": "question"}},
        "prompt": {"user": "{question}"},
        "loop": {"max_turns": 0, "max_total_tokens": 64, "max_new_tokens_per_turn": 4, "temperature": 1.0},
        "answer": {"pattern": r"\A(\d+)\Z"},
        "reward": {"type": "exact_match"},
    }
    task_path = root / "task.yaml"
    task_path.write_text(yaml.safe_dump(task, sort_keys=False))
    model_dir = root / f"policy0-{_fingerprint(bench)}"
    if not (model_dir / "config.json").is_file():
        _pretrain(bench, model_dir)
    return task_path, model_dir


def _pretrain(bench: StalenessBenchConfig, model_dir: Path) -> None:
    """Supervised training on the right sums, stopped as soon as the policy's exact success
    probability reaches `pretrain_success` (checked after every step): a policy that knows the format
    and leans towards the right answer without being sure of it — where RL starts in practice."""
    from rollout.tiny import TinyModelSpec, make_tiny_model_dir, teach_tiny_model

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_model_dir(tmp, TinyModelSpec(hidden_size=bench.hidden_size, num_layers=bench.num_layers,
                                           intermediate_size=2 * bench.hidden_size, seed=0))
    batch = _answer_batch(bench)  # built once, scored after every step
    teach_tiny_model(tmp, _answer_examples(bench), steps=bench.pretrain_steps, lr=3e-3, check_every=1,
                     until=lambda model: _success(model, batch) >= bench.pretrain_success)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)


def _answer_examples(bench: StalenessBenchConfig) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, right sum + end-of-turn ids) for every problem."""
    from agent_env.prompts import render_prompt_ids
    from rollout.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    return [(render_prompt_ids(tokenizer, [{"role": "user", "content": _prompt_text(a, b)}]),
             [*tokenizer.encode(str(a + b), add_special_tokens=False), tokenizer.eos_token_id])
            for a, b in _problems(bench)]


def _answer_batch(bench: StalenessBenchConfig) -> tuple[Any, Any, Any]:
    """Every problem's (prompt + right sum + end-of-turn) as one padded batch, the answer as labels."""
    from rollout.tiny import padded_sft_batch

    return padded_sft_batch([(prompt + answer, [False] * len(prompt) + [True] * len(answer))
                             for prompt, answer in _answer_examples(bench)])


def _success(model: Any, batch: tuple[Any, Any, Any]) -> float:
    """Mean over rows of P(labelled tokens | the rest): exp of each row's summed label log-probs."""
    import torch

    ids, attention, labels = batch
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = labels[:, 1:]
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (targets != -100)
    return float(picked.sum(dim=1).exp().mean())


def success_probability(model_dir: Path, bench: StalenessBenchConfig) -> float:
    """Mean over all prompts of P(the right sum, then end-of-turn) under the policy in model_dir —
    the exact expected reward of one temperature-1 sample (teacher forcing, no sampling noise)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return _success(model, _answer_batch(bench))


# ---------------------------------------------------------------------------------------------
# One run (in a worker process)


def _run_config(bench: StalenessBenchConfig, method: StalenessMethodConfig, lag: int, seed: int,
                model_dir: Path, task_path: Path, run_dir: Path) -> RunConfig:
    return RunConfig.model_validate({
        "run_dir": str(run_dir),
        "seed": seed,
        "model": {"path": str(model_dir)},
        "task": str(task_path),
        "engine": {"backend": "hf", "max_batch_size": 256},
        "algo": {**method.algo, "group_size": bench.group_size},
        "optim": {"lr": method.lr, "grad_clip": 1.0},
        "rollout": {"max_lag": lag, "groups_per_step": bench.groups_per_step, "saturate_lag": True},
        "learner": {"device": "cpu", "micro_batch_tokens": 8192},
        "trainer": {"total_steps": bench.steps, "checkpoint_every": bench.steps, "keep_checkpoints": 1,
                    "use_tensorboard": False, "save_trajectories": False},
    })


def _worker_init() -> None:
    import torch

    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def run_one(bench: StalenessBenchConfig, method: StalenessMethodConfig, lag: int, seed: int,
            model_dir: Path, task_path: Path, run_dir: Path) -> dict[str, Any]:
    """Train one (method, k, seed) and return its curves and summary numbers."""
    from learner.compose import engine_settings, load_task
    from learner.metrics_log import read_metrics
    from learner.run_train import run_training

    shutil.rmtree(run_dir, ignore_errors=True)
    config = _run_config(bench, method, lag, seed, model_dir, task_path, run_dir)
    task, resolved_task = load_task(task_path)
    settings = engine_settings(config.engine, str(task_path))
    started = time.perf_counter()
    summary = asyncio.run(run_training(config, task, resolved_task, settings, run_dir / "cache", run_dir,
                                       progress=False))
    records = read_metrics(run_dir)
    curves = {name: [_number(record.get(key)) for record in records] for name, key in CURVE_KEYS.items()}
    final = success_probability(run_dir / "export", bench)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # only the curves are kept
    shutil.rmtree(run_dir / "export", ignore_errors=True)
    return {"method": method.name, "lag": lag, "seed": seed, "lr": method.lr, "steps": summary.steps,
            "wall_s": round(time.perf_counter() - started, 1), "final_success": final,
            "curves": curves, **summarize_curves(curves, bench.collapse_fraction)}


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else float("nan")


def summarize_curves(curves: dict[str, list[float | None]], collapse_fraction: float) -> dict[str, Any]:
    """first/last-10 reward, collapse step, min ESS ratio, max grad norm, mean clipped/masked fraction."""
    reward = [r for r in curves["reward"] if r is not None]

    def finite(name: str) -> list[float]:
        return [v for v in curves[name] if v is not None and math.isfinite(v)]

    first = statistics.fmean(reward[:WINDOW]) if reward else float("nan")
    collapse = None
    for step in range(len(reward)):
        bad = any(curves[name][step] is not None and not math.isfinite(curves[name][step])  # type: ignore[arg-type]
                  for name in ("loss", "grad_norm"))
        trailing = reward[max(0, step + 1 - WINDOW): step + 1]
        if bad or (step + 1 >= WINDOW and statistics.fmean(trailing) < collapse_fraction * first):
            collapse = step + 1
            break
    ess, grad, lags = finite("ess_ratio"), finite("grad_norm"), finite("lag")
    clip, masked = finite("clip_frac"), finite("masked_frac")
    return {
        "reward_first10": first,
        "reward_last10": statistics.fmean(reward[-WINDOW:]) if reward else float("nan"),
        "collapse_step": collapse,
        "min_ess_ratio": min(ess) if ess else None,
        "max_grad_norm": max(grad) if grad else None,
        "clip_frac_mean": statistics.fmean(clip) if clip else None,
        "masked_frac_mean": statistics.fmean(masked) if masked else None,
        "mean_lag": statistics.fmean(lags) if lags else None,
    }


# ---------------------------------------------------------------------------------------------
# The matrix


def _jobs(bench: StalenessBenchConfig) -> list[tuple[StalenessMethodConfig, int, int]]:
    chosen = [m for m in bench.methods if bench.only is None or m.name in bench.only]
    if bench.mode == "lr_sweep":
        return [(m.model_copy(update={"lr": lr}), 0, bench.sweep_seed)
                for m in chosen for lr in bench.lr_grid]
    # the largest lags first: the longest runs start early, so the pool's two workers stay busy
    return [(m, lag, seed)
            for lag in sorted(bench.lags, reverse=True) for m in chosen for seed in bench.seeds]


def run_staleness_bench(bench: StalenessBenchConfig, progress: Callable[[str], None] = lambda _m: None
                        ) -> dict[str, Any]:
    """Run the matrix (or the lr sweep); JSON-able result with every run's curves and the summaries.
    Also writes `result.json`, `summary.md` and the PNG plots into `bench.run_root`."""
    root = Path(bench.run_root)
    started = time.perf_counter()
    task_path, model_dir = prepare(bench, root)
    initial = success_probability(model_dir, bench)
    progress(f"[bench staleness] pre-taught policy: success probability {initial:.3f}")
    jobs = _jobs(bench)
    rows: list[dict[str, Any]] = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=bench.workers, mp_context=context, initializer=_worker_init) as pool:
        futures = {
            pool.submit(run_one, bench, method, lag, seed, model_dir, task_path,
                        root / "runs" / f"{method.name}-lr{method.lr:g}-k{lag}-s{seed}"): (method, lag, seed)
            for method, lag, seed in jobs}
        for future in as_completed(futures):
            method, lag, seed = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # one broken run keeps its row with the error, the rest go on
                row = {"method": method.name, "lag": lag, "seed": seed, "lr": method.lr,
                       "error": f"{type(exc).__name__}: {exc}"}
            rows.append(row)
            progress(f"[bench staleness] {len(rows)}/{len(jobs)} {method.name} lr={method.lr:g} k={lag} "
                     f"seed={seed}: " + (row.get("error") or
                                        f"final success {row['final_success']:.3f} ({row['wall_s']} s)"))
    order = [m.name for m in bench.methods]
    rows.sort(key=lambda r: (order.index(r["method"]), r["lr"], r["lag"], r["seed"]))
    result: dict[str, Any] = {
        "benchmark": "staleness", "mode": bench.mode, "config": bench.model_dump(mode="json"),
        "initial_success": initial, "wall_s": round(time.perf_counter() - started, 1),
        "cpu_count": os.cpu_count(), "runs": rows}
    if bench.mode == "lr_sweep":
        result["chosen_lr"] = choose_lrs(rows)
    else:
        result["summary"] = summary_table(bench, rows)
    (root / "result.json").write_text(json.dumps(result, indent=1, allow_nan=True))
    (root / "summary.md").write_text(format_summary(result))
    if bench.mode == "matrix":
        result["plots"] = [str(p) for p in plot_staleness(result, root)]
    return result


def choose_lrs(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per method: the lr with the best final success probability at k = 0 (ties → the smaller lr)."""
    best: dict[str, tuple[float, float]] = {}
    for row in rows:
        if "error" in row:
            continue
        score = row["final_success"]
        current = best.get(row["method"])
        is_tie = current is not None and abs(score - current[0]) <= 1e-9
        if current is None or score > current[0] + 1e-9 or (is_tie and row["lr"] < current[1]):
            best[row["method"]] = (score, row["lr"])
    return {name: lr for name, (_, lr) in best.items()}


def summary_table(bench: StalenessBenchConfig, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, k): means over seeds; methods not run keep their rows (status 'not run')."""
    table = []
    for method in bench.methods:
        for lag in bench.lags:
            runs = [r for r in rows if r["method"] == method.name and r["lag"] == lag]
            good = [r for r in runs if "error" not in r]
            entry: dict[str, Any] = {"method": method.name, "lag": lag, "lr": method.lr, "seeds": len(good)}
            if not runs:
                entry["status"] = "not run"
            elif not good:
                entry["status"] = "error: " + runs[0]["error"]
            else:
                entry["status"] = "ok"
                for key in ("final_success", "reward_first10", "reward_last10", "min_ess_ratio",
                            "max_grad_norm", "clip_frac_mean", "masked_frac_mean", "mean_lag"):
                    values = [r[key] for r in good if r.get(key) is not None]
                    entry[key] = statistics.fmean(values) if values else None
                finals = [r["final_success"] for r in good]
                entry["final_success_sd"] = statistics.stdev(finals) if len(finals) > 1 else None
                collapsed = [r["collapse_step"] for r in good if r["collapse_step"] is not None]
                entry["collapsed_runs"] = len(collapsed)
                entry["collapse_step_min"] = min(collapsed) if collapsed else None
            table.append(entry)
    return table


def _fmt(value: Any, spec: str = ".3f") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, spec) if math.isfinite(value) else str(value)
    return str(value)


def _mean_sd(entry: dict[str, Any]) -> str:
    if entry["status"] != "ok":
        return entry["status"]
    sd = entry.get("final_success_sd")
    return _fmt(entry["final_success"], ".2f") + (f" ± {sd:.2f}" if sd is not None else "")


def format_summary(result: dict[str, Any]) -> str:
    """Markdown: the summary table (matrix) or the lr sweep's table and choices."""
    lines = [f"initial policy success probability: {result['initial_success']:.3f}", ""]
    if result["mode"] == "lr_sweep":
        lines += ["| method | lr | final success (k=0) | last-10 reward |", "|---|---|---|---|"]
        for row in result["runs"]:
            lines.append(f"| {row['method']} | {row['lr']:g} | {_fmt(row.get('final_success'))} | "
                         f"{_fmt(row.get('reward_last10'))} |")
        lines += ["", "chosen: " + ", ".join(f"{m}={lr:g}" for m, lr in result["chosen_lr"].items())]
        return "\n".join(lines) + "\n"
    lags = sorted({e["lag"] for e in result["summary"]})
    methods = list(dict.fromkeys(e["method"] for e in result["summary"]))
    cell = {(e["method"], e["lag"]): e for e in result["summary"]}
    lines += ["Final policy's success probability, mean ± sd over seeds (the pre-taught policy's is above):",
              "",
              "| method | " + " | ".join(f"k={lag}" for lag in lags) + " |",
              "|---|" + "---|" * len(lags)]
    for method in methods:
        values = [cell[(method, lag)] for lag in lags]
        lines.append(f"| {method} | " + " | ".join(_mean_sd(e) for e in values) + " |")
    lines += ["", "Per (method, k): means over seeds.", ""]
    lines += ["| method | k | lr | final success | reward first→last 10 | collapsed runs (first step) | "
              "min ESS ratio | max grad norm | clipped frac | masked frac |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for e in result["summary"]:
        if e["status"] != "ok":
            lines.append(f"| {e['method']} | {e['lag']} | {e['lr']:g} | {e['status']} | | | | | | |")
            continue
        collapsed = f"{e['collapsed_runs']}/{e['seeds']}" + (
            f" ({e['collapse_step_min']})" if e["collapse_step_min"] is not None else "")
        lines.append(
            f"| {e['method']} | {e['lag']} | {e['lr']:g} | {_fmt(e['final_success'])} | "
            f"{_fmt(e['reward_first10'], '.2f')}→{_fmt(e['reward_last10'], '.2f')} | {collapsed} | "
            f"{_fmt(e['min_ess_ratio'])} | {_fmt(e['max_grad_norm'], '.2f')} | {_fmt(e['clip_frac_mean'])} | "
            f"{_fmt(e['masked_frac_mean'])} |")
    return "\n".join(lines) + "\n"


def plot_staleness(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """Per lag: training reward and ESS ratio vs step, one line per method (mean over seeds); plus
    final success probability vs k per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "error" not in r]
    methods = list(dict.fromkeys(r["method"] for r in runs))
    lags = sorted({r["lag"] for r in runs})
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    paths = []
    for lag in lags:
        fig, axes = plt.subplots(1, 2, figsize=(14, 5))
        for method in methods:
            mine = [r for r in runs if r["method"] == method and r["lag"] == lag]
            if not mine:
                continue
            for ax, curve in zip(axes, ("reward", "ess_ratio"), strict=True):
                series = _mean_curve([r["curves"][curve] for r in mine])
                smooth = _moving_average(series, 5) if curve == "reward" else series
                style = "-" if method.startswith("vcpo") else "--"
                ax.plot(range(1, len(smooth) + 1), smooth, style, color=colors[method], label=method, lw=1.4)
        axes[0].set(title=f"training reward (5-step mean), k={lag}", xlabel="step", ylim=(-0.02, 1.02))
        axes[1].set(title=f"ESS ratio of the minibatch, k={lag}", xlabel="step", ylim=(0, 1.05))
        axes[1].legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = out_dir / f"staleness_k{lag}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for method in methods:
        points = []
        for lag in lags:
            finals = [r["final_success"] for r in runs if r["method"] == method and r["lag"] == lag]
            if finals:
                points.append((str(lag), statistics.fmean(finals)))
        ax.plot([p[0] for p in points], [p[1] for p in points],
                "o-" if method.startswith("vcpo") else "s--", color=colors[method], label=method)
    ax.axhline(result["initial_success"], color="grey", lw=0.8, ls=":", label="pre-taught policy")
    ax.set(title="final policy: success probability vs lag k", xlabel="k", ylabel="P(correct)",
           ylim=(0, 1.02))
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path = out_dir / "staleness_final_vs_lag.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    paths.append(path)
    return paths


def _mean_curve(curves: list[list[float | None]]) -> list[float]:
    length = min(len(c) for c in curves)
    out = []
    for step in range(length):
        values = [c[step] for c in curves if c[step] is not None and math.isfinite(c[step])]  # type: ignore[arg-type]
        out.append(statistics.fmean(values) if values else float("nan"))
    return out


def _moving_average(values: list[float], width: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - width): i + 1]) for i in range(len(values))]
