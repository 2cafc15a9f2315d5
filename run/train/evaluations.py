"""The run's evaluations on the live engine: the task's held-out set every `trainer.eval_every` steps and each
of `trainer.eval_sets` when it is due — before the first step, at the steps asked and after the last —
with their `eval/*` metrics, the lines a person sees, and each set's start → end change for the summary.
A resumed run drops the evaluations of the versions it trains again."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from agent_env.evaluation.heldout import (
    HeldoutChange,
    HeldoutEvaluator,
    HeldoutResult,
    falling_warning,
    paired_change,
)
from run.observability import metric_names as names
from run.observability.live_activity import LiveActivity
from run.observability.progress import ProgressLine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSetRun:
    """One of `trainer.eval_sets`, ready: its name, how often (0: before the first step and after the last
    only) and its evaluator on the live engine (run/launch/local.py)."""

    name: str
    every: int
    evaluator: HeldoutEvaluator

    def due(self, version: int, total_steps: int) -> bool:
        return version == total_steps or (self.every > 0 and version % self.every == 0)


def is_eval_version(version: int, every: int, total_steps: int) -> bool:
    """Whether the held-out set is evaluated at `version`: 0, every `every` versions, and the last."""
    return every > 0 and (version % every == 0 or version == total_steps)


def heldout_metrics(result: HeldoutResult, eval_set: str | None = None) -> dict[str, float]:
    """The `eval/*` metrics of one held-out evaluation (with `time/eval`), or `eval/<eval_set>/*` of an
    eval set's (with `eval/<eval_set>/seconds`)."""
    metrics = {names.EVAL_SUCCESS: result.success, names.EVAL_SUCCESS_LOW: result.low,
               names.EVAL_SUCCESS_HIGH: result.high, names.EVAL_PROMPTS: float(len(result.per_prompt)),
               names.EVAL_NO_ANSWER_FRAC: float(result.summary["no_answer_frac"]),
               names.EVAL_TOOL_CALLS_MEAN: float(result.summary["tool_calls_mean"]),
               names.EVAL_TRUNCATED_FRAC: float(result.summary["truncated_frac"]),
               names.EVAL_RESPONSE_TOKENS_MEAN: float(result.summary["response_tokens_mean"])}
    if eval_set is None:
        return {**metrics, names.TIME_EVAL: result.seconds}
    return {**{names.eval_set_metric(eval_set, key): value for key, value in metrics.items()},
            names.eval_set_metric(eval_set, "eval/seconds"): result.seconds}


async def evaluate_one(heldout: HeldoutEvaluator, version: int, live: LiveActivity | None,
                    display: ProgressLine | None) -> HeldoutResult:
    if live is not None:
        live.begin(version, f"{heldout.label} eval")
    result = await heldout.run(version)
    lines = [result.line()]
    falling = falling_warning(heldout.stored(0) if version > 0 else None, result)
    if falling is not None:
        lines.append(falling)
    for line in lines:
        if display is not None:
            display.message(line)
        else:
            log.info("%s", line)
    return result


class Evaluations:
    """Every evaluation of one run (module docstring), kept for the closing summary."""

    def __init__(self, heldout: HeldoutEvaluator | None, eval_every: int, eval_sets: Sequence[EvalSetRun],
                 total_steps: int) -> None:
        self.heldout = heldout if eval_every > 0 else None
        self.eval_every, self.eval_sets, self.total_steps = eval_every, list(eval_sets), total_steps
        self.heldout_results: list[HeldoutResult] = []
        self.set_results: dict[str, list[HeldoutResult]] = {}

    @property
    def any(self) -> bool:
        return self.heldout is not None or bool(self.eval_sets)

    def discard_after(self, version: int) -> None:
        """Delete the evaluations of the versions after `version` (a resumed run trains those again)."""
        for evaluator in self._evaluators():
            evaluator.discard_after(version)

    def _evaluators(self) -> list[HeldoutEvaluator]:
        return [*([self.heldout] if self.heldout is not None else []), *(s.evaluator for s in self.eval_sets)]

    async def run(self, version: int, live: LiveActivity | None, display: ProgressLine | None
                  ) -> dict[str, float]:
        """Every evaluation due at `version` (all of them at 0, the policy RL starts from): their metrics,
        with `time/eval` the seconds of them all; {} when none is due."""
        metrics: dict[str, float] = {}
        seconds = 0.0
        if self.heldout is not None and (version == 0 or is_eval_version(version, self.eval_every,
                                                                         self.total_steps)):
            result = await evaluate_one(self.heldout, version, live, display)
            self.heldout_results.append(result)
            metrics.update(heldout_metrics(result))
            seconds += result.seconds
        for eval_set in self.eval_sets:
            if version == 0 or eval_set.due(version, self.total_steps):
                result = await evaluate_one(eval_set.evaluator, version, live, display)
                self.set_results.setdefault(eval_set.name, []).append(result)
                metrics.update(heldout_metrics(result, eval_set.name))
                seconds += result.seconds
        if metrics:
            metrics[names.TIME_EVAL] = seconds
        return metrics

    def heldout_change(self) -> HeldoutChange | None:
        """The held-out set's first evaluation (the policy RL started from) → this process's last."""
        return _change(self.heldout, self.heldout_results)

    def set_changes(self) -> dict[str, HeldoutChange]:
        """The same for every eval set that has both."""
        changes = {s.name: _change(s.evaluator, self.set_results.get(s.name, [])) for s in self.eval_sets}
        return {name: change for name, change in changes.items() if change is not None}

    def seconds(self) -> float:
        """Wall seconds of every evaluation of this process."""
        results = [*self.heldout_results, *(r for rs in self.set_results.values() for r in rs)]
        return sum(result.seconds for result in results)


def _change(evaluator: HeldoutEvaluator | None, results: list[HeldoutResult]) -> HeldoutChange | None:
    if evaluator is None or not results or results[-1].version == 0:
        return None
    first = evaluator.stored(0)
    return None if first is None else paired_change(first, results[-1])
