"""Held-out evaluation during training: a fixed set of prompts the run never trains on, scored by the
live engine at a fixed policy version, with an interval for the success rate and for its change.

The set comes from the task's `heldout_dataset`; any prompt whose rendered messages equal a training
prompt's is dropped (counted), and the first `size` of the rest are kept, so "held out" is checked,
not assumed. Each evaluation runs every (prompt, j < k) through the agent loop with its own sampling
settings and writes one resumable JSONL file per policy version (`agent_env.evaluation.evaluate`): an
interrupted evaluation continues where it stopped, and the summary is computed from the file.

Intervals (95%): for k = 1 the Wilson score interval of the success rate over prompts; for k > 1 a
t-interval over the prompts' mean successes (the k samples of a prompt are not independent). The change
between two evaluations is paired by prompt: the mean and t-interval of the per-prompt differences.

Deliberately not here: when to evaluate and where the figures go (the trainer), how an episode runs
(`agent_env.loop`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_env.evaluation.evaluate import EvalFileError, evaluate, read_finished, summary_of
from agent_env.loop import EpisodeSettings
from agent_env.prompts import render_messages
from agent_env.runtime import ProgramEpisodes
from agent_env.samples import Sample
from rollout.base import InferenceEngine
from tools.base import Tool
from tools.functions import Toolbox

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Z_95 = 1.959963984540054
"""The standard normal's 97.5% quantile."""

# t quantiles (97.5%) by degrees of freedom; beyond the table the normal's is within 1%
_T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
          10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000,
          120: 1.980}

log = logging.getLogger(__name__)


def t_quantile_975(dof: int) -> float:
    """The t distribution's 97.5% quantile for `dof` ≥ 1 degrees of freedom (the nearest tabulated dof
    at or below it; the normal's beyond 120)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    if dof > 120:
        return Z_95
    return _T_975[max(d for d in _T_975 if d <= dof)]


def wilson_interval(successes: int, total: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (0, 1 for total = 0)."""
    if total <= 0:
        return 0.0, 1.0
    p = successes / total
    z2 = Z_95 * Z_95
    centre = (p + z2 / (2 * total)) / (1 + z2 / total)
    half = Z_95 * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
    return max(0.0, centre - half), min(1.0, centre + half)


def mean_t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean and 95% t-interval of `values` (the mean twice for fewer than 2)."""
    if not values:
        raise ValueError("no values to average")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, mean, mean
    half = t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class HeldoutSet:
    """The held-out prompts and how they were chosen."""

    samples: list[Sample]
    overlapping: int
    """Prompts of the held-out source dropped because a training prompt renders to the same messages."""
    source: str


def _prompt_key(system: str | None, user: str, sample: Sample) -> str:
    return json.dumps(render_messages(system, user, sample), sort_keys=True)


def select_heldout(candidates: Sequence[Sample], training: Sequence[Sample], system: str | None, user: str,
                   size: int, source: str = "") -> HeldoutSet:
    """The first `size` of `candidates` whose prompt no training sample has (raises with the fix when
    fewer remain)."""
    seen = {_prompt_key(system, user, sample) for sample in training}
    kept, overlapping, keys = [], 0, set()
    for sample in candidates:
        key = _prompt_key(system, user, sample)
        if key in seen:
            overlapping += 1
            continue
        if key in keys:  # the same prompt twice in the held-out source counts once
            continue
        keys.add(key)
        kept.append(sample)
        if len(kept) == size:
            break
    if len(kept) < size:
        raise ValueError(f"heldout_dataset ({source}) has {len(kept)} prompts that are not training prompts "
                         f"({overlapping} overlap), fewer than trainer.eval_samples={size}; give the task's "
                         "heldout_dataset more samples or lower trainer.eval_samples")
    return HeldoutSet(kept, overlapping, source)


@dataclass(frozen=True)
class HeldoutResult:
    """One evaluation of one policy version."""

    version: int
    success: float
    """Mean correctness over every (prompt, sample)."""
    low: float
    high: float
    """The 95% interval of `success` (Wilson for k = 1, a t-interval over prompts otherwise)."""
    per_prompt: dict[str, float]
    """sample_id → the prompt's mean correctness over its k samples."""
    summary: dict[str, Any]
    """`agent_env.evaluation.evaluate.summary_of` of the file (tool calls, truncation, no answer, tokens)."""
    seconds: float
    label: str = "held-out"
    """Which set: 'held-out', or an eval set's name (trainer.eval_sets)."""

    def line(self) -> str:
        """A line for a person: success with its interval."""
        return (f"{self.label} success at step {self.version}: {100 * self.success:.1f}% "
                f"(95% interval {100 * self.low:.1f}–{100 * self.high:.1f}%, {len(self.per_prompt)} prompts, "
                f"{self.seconds:.0f} s)")


@dataclass(frozen=True)
class HeldoutChange:
    """Success at a later evaluation minus an earlier one, paired by prompt."""

    start: HeldoutResult
    end: HeldoutResult
    gain: float
    low: float
    high: float

    def line(self) -> str:
        return (f"{self.start.label} success {100 * self.start.success:.1f}% (step {self.start.version}) → "
                f"{100 * self.end.success:.1f}% (step {self.end.version}): {100 * self.gain:+.1f} points "
                f"(95% interval {100 * self.low:+.1f} to {100 * self.high:+.1f}, paired over prompts)")


def paired_change(start: HeldoutResult, end: HeldoutResult) -> HeldoutChange:
    """The change of held-out success from `start` to `end` over the prompts both evaluated."""
    common = sorted(set(start.per_prompt) & set(end.per_prompt))
    if not common:
        raise ValueError("the two evaluations share no prompt")
    gain, low, high = mean_t_interval([end.per_prompt[p] - start.per_prompt[p] for p in common])
    return HeldoutChange(start, end, gain, low, high)


def falling_warning(start: HeldoutResult | None, result: HeldoutResult) -> str | None:
    """A warning when `result` is significantly below `start` (the paired change's whole interval below 0)."""
    if start is None or result.version <= start.version:
        return None
    change = paired_change(start, result)
    if change.high >= 0:
        return None
    return f"warning: {result.label} success fell significantly: {change.line()}"


def result_from_records(version: int, records: Sequence[dict[str, Any]], samples: Sequence[Sample], k: int,
                        seconds: float) -> HeldoutResult:
    """A `HeldoutResult` from an evaluation file's finished records (every (prompt, j < k) present)."""
    wanted = {s.sample_id for s in samples}
    per_prompt: dict[str, list[float]] = {}
    seen: set[tuple[str, int]] = set()
    repeated = 0
    for record in records:
        key = (record["sample_id"], int(record["index"]))
        if key[0] in wanted and key[1] < k:
            if key in seen:
                repeated += 1
                continue
            seen.add(key)
            per_prompt.setdefault(key[0], []).append(float(bool(record["is_correct"])))
    expected = len(wanted) * k
    if repeated or len(seen) != expected:
        found = f"{len(seen)} of its {expected} samples ({len(wanted)} prompts × k = {k})"
        twice = (f" and {repeated} records of samples it already held (two processes evaluated into one "
                 "file)") if repeated else ""
        raise ValueError(f"the evaluation of version {version} holds {found}{twice}; delete its file to "
                         "evaluate that version again")
    means = {sample_id: statistics.fmean(values) for sample_id, values in per_prompt.items()}
    if k == 1:
        successes = int(sum(means.values()))
        success = successes / len(means)
        low, high = wilson_interval(successes, len(means))
    else:
        success, low, high = mean_t_interval(list(means.values()))
        low, high = max(0.0, low), min(1.0, high)
    return HeldoutResult(version, success, low, high, means, summary_of(records, wanted, k), seconds)


def result_from_file(path: Path) -> HeldoutResult:
    """The `HeldoutResult` of a finished evaluation file (`run_dir/eval/version_*.jsonl`), read on its own:
    the prompts and k come from its meta line. Raises ValueError naming the file when it is not a whole
    held-out evaluation."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        records = [json.loads(line) for line in lines]
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a JSON-lines evaluation file ({exc})") from None
    if not records or records[0].get("kind") != "meta" or records[0]["meta"].get("kind") != "heldout":
        raise ValueError(f"{path}: no held-out meta line first; is it a `vcpo train` evaluation file?")
    meta = records[0]["meta"]
    samples = [Sample(sample_id=sample_id, fields={}, answer=None) for sample_id in meta["prompts"]]
    finished = [record for record in records[1:] if record.get("kind") == "sample"]
    try:
        return result_from_records(int(meta["version"]), finished, samples, int(meta["k"]), 0.0)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


class HeldoutEvaluator:
    """Evaluates the engine's current policy on the held-out set; one file per version in `out_dir`."""

    def __init__(self, heldout: HeldoutSet, *, engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                 tool: Tool | Toolbox | None, system: str | None, user: str,
                 reward: Callable[[str, Sample], Any], settings: EpisodeSettings, k: int, out_dir: Path,
                 concurrency: int, task_name: str, label: str = "held-out",
                 program: ProgramEpisodes | None = None) -> None:
        self.heldout, self.engine, self.tokenizer, self.tool = heldout, engine, tokenizer, tool
        self.program = program
        """The task's agent program, whose runs the episodes are (`loop.program`); None: the built-in loop."""
        self.system, self.user, self.reward, self.settings = system, user, reward, settings
        self.k, self.out_dir, self.concurrency, self.task_name = k, out_dir, concurrency, task_name
        self.label = label
        """What its lines call the set ('held-out', or an eval set's name)."""

    def path(self, version: int) -> Path:
        return self.out_dir / f"version_{version:06d}.jsonl"

    def meta(self, version: int) -> dict[str, Any]:
        settings = {key: value for key, value in vars(self.settings).items()
                    if key not in ("seed", "context")}
        if self.settings.context.manages:  # absent when appended: files written before it existed match
            settings["context"] = dataclasses.asdict(self.settings.context)
        return {"kind": "heldout", "version": version, "k": self.k, "task": self.task_name,
                "prompts": [s.sample_id for s in self.heldout.samples], "settings": settings}

    def _set_aside_if_other(self, version: int) -> None:
        """An existing file of `version` written with other settings (the task, the sampling, the prompts
        changed since, or a stored start evaluation copied in from elsewhere) is renamed aside, with a
        warning naming what differs, and the version is evaluated afresh — a resumed run or a reused start
        never dies of it, and never mixes two evaluations."""
        path = self.path(version)
        try:
            read_finished(path, self.meta(version))
        except EvalFileError as exc:
            aside = path.with_name(f"{path.stem}.other-settings-{int(time.time())}{path.suffix}")
            path.rename(aside)
            log.warning("%s: evaluating version %d again: %s (kept as %s)", self.label, version, exc,
                        aside.name)

    def discard_after(self, version: int) -> None:
        """Delete the evaluations of versions after `version` (a resumed run retrains those versions)."""
        if not self.out_dir.is_dir():
            return
        for path in self.out_dir.glob("version_*.jsonl"):
            if int(path.stem.split("_")[1]) > version:
                path.unlink()

    def stored(self, version: int) -> HeldoutResult | None:
        """The finished evaluation of `version` from its file, or None when it is absent, partial or made with
        other settings."""
        path = self.path(version)
        if not path.is_file():
            return None
        try:
            records = read_finished(path, self.meta(version))
        except EvalFileError:
            return None
        try:
            result = result_from_records(version, records, self.heldout.samples, self.k, 0.0)
        except ValueError:
            return None
        return dataclasses.replace(result, label=self.label)

    async def run(self, version: int) -> HeldoutResult:
        """Evaluate the policy the engine holds now, which must be `version` (the caller does not push
        weights until this returns); resumes a partial file of the same version."""
        started = time.perf_counter()
        self._set_aside_if_other(version)
        await evaluate(self.engine, self.tokenizer, self.tool, system=self.system, user=self.user,
                       samples=self.heldout.samples, reward=self.reward, settings=self.settings, k=self.k,
                       out_path=self.path(version), meta=self.meta(version), concurrency=self.concurrency,
                       task_name=self.task_name, program=self.program)
        records = read_finished(self.path(version), self.meta(version))
        seconds = time.perf_counter() - started
        result = result_from_records(version, records, self.heldout.samples, self.k, seconds)
        return dataclasses.replace(result, label=self.label)
