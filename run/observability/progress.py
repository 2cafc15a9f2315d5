"""A one-line live view of training for the terminal: step/total, reward, ESS, lr scale, policy lag,
throughput and elapsed time — and, between steps, what is happening now (episodes done and running,
tokens sampled, or the learner step), so a long step still shows movement.

`format_progress` and `format_activity` are the pure formatting; `ProgressLine` decides when and how
to write: on a TTY tqdm redraws one line in place, cut to the terminal's width; elsewhere (log files,
CI) it writes a plain line at most every `interval_s` seconds plus the final step. It records nothing:
metrics.jsonl is the record (run.observability.metrics_log).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TextIO

from tqdm import tqdm

from run.observability.console import terminal
from run.observability.metric_names import (
    IS_ESS_RATIO,
    LR_SCALE,
    PERF_TOKENS_PER_S,
    REWARD_MEAN,
    STALENESS_MAX,
    STALENESS_MEAN,
    TREND_SUCCESS,
    TREND_SUCCESS_HIGH,
    TREND_SUCCESS_LOW,
    WALL_S,
)

MISSING = "-"


def _number(value: Any, spec: str) -> str:
    if value is None:
        return MISSING
    value = float(value)
    return format(value, spec) if math.isfinite(value) else str(value)


def _rate(tokens_per_s: Any) -> str:
    """850 → '850', 1234 → '1.2k', 2_500_000 → '2.5M'."""
    if tokens_per_s is None or not math.isfinite(float(tokens_per_s)):
        return MISSING
    value = float(tokens_per_s)
    for threshold, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= threshold:
            return f"{value / threshold:.1f}{suffix}"
    return f"{value:.0f}"


def format_elapsed(seconds: float) -> str:
    """312.7 → '0:05:12' (hours grow past 99 as needed)."""
    whole = int(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def format_progress(step: int, total_steps: int, metrics: Mapping[str, Any], *,
                    elapsed_s: float | None = None) -> str:
    """One line, e.g. 'step 12/500 (2%) | reward 0.425 | ess 0.87 | lr scale 0.50 | lag 1.3 (max 4)
    | 1.2k tok/s | 0:05:12'. Missing metrics show as '-'. elapsed_s: defaults to metrics['wall_s'];
    omitted when neither is given."""
    percent = f" ({100 * step / total_steps:.0f}%)" if total_steps > 0 else ""
    parts = [
        f"step {step}/{total_steps}{percent}",
        f"reward {_number(metrics.get(REWARD_MEAN), '.3f')}",
        f"ess {_number(metrics.get(IS_ESS_RATIO), '.2f')}",
        f"lr scale {_number(metrics.get(LR_SCALE), '.2f')}",
        f"lag {_number(metrics.get(STALENESS_MEAN), '.1f')}"
        f" (max {_number(metrics.get(STALENESS_MAX), '.0f')})",
        f"{_rate(metrics.get(PERF_TOKENS_PER_S))} tok/s",
    ]
    if metrics.get(TREND_SUCCESS) is not None:
        parts.append(f"success {100 * float(metrics[TREND_SUCCESS]):+.1f}/100 steps "
                     f"({100 * float(metrics[TREND_SUCCESS_LOW]):+.1f} to "
                     f"{100 * float(metrics[TREND_SUCCESS_HIGH]):+.1f})")
    elapsed = elapsed_s if elapsed_s is not None else metrics.get(WALL_S)
    if elapsed is not None:
        parts.append(format_elapsed(float(elapsed)))
    return " | ".join(parts)


def format_activity(step: int, *, phase: str, since_s: float, episodes_done: int | None = None,
                    episodes_total: int | None = None, episodes_running: int | None = None,
                    tokens: int | None = None) -> str:
    """What step `step` is doing now, e.g. 'step 4: rollouts 10 episodes done (16 per step), 6 running,
    12.3k tokens sampled (93 tok/s), 0:02:13' or 'step 4: learner step, 0:00:20'. Counts are since the
    phase began (with k > 0 some episodes belong to later steps); None (not known in this process,
    e.g. Ray's remote workers) is left out."""
    parts: list[str] = []
    if phase == "rollouts":
        if episodes_done is not None:
            parts.append(f"{episodes_done} episodes done" + (f" ({episodes_total} per step)"
                                                               if episodes_total else ""))
        if episodes_running is not None:
            parts.append(f"{episodes_running} running")
        if tokens is not None:
            rate = f" ({_rate(tokens / since_s)} tok/s)" if since_s > 0 else ""
            parts.append(f"{_rate(tokens)} tokens sampled{rate}")
    detail = (" " + ", ".join(parts)) if parts else ""
    return f"step {step}: {phase}{detail}, {format_elapsed(since_s)}"


class ProgressLine:
    """Writes `format_progress` to `stream` (default: the terminal at construction, `console.terminal()`).

    On a TTY one line is redrawn in place by tqdm, cut to the terminal's width (read at every redraw, so
    a resized or narrow terminal never wraps it into a trail of stale lines); `message` puts a line
    above it. Otherwise a line is written at the first update, then once `interval_s` has passed since
    the last written one, and at the final step. Elapsed time counts from construction, by `clock`
    (seconds; injectable for tests). columns: a fixed width instead of the terminal's (tests).
    """

    def __init__(self, total_steps: int, stream: TextIO | None = None, *, interval_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, columns: int | None = None) -> None:
        self.total_steps = total_steps
        self._stream = stream if stream is not None else terminal()
        self._is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._interval_s = interval_s
        self._clock = clock
        self._start_s = clock()
        self._last_written_s: float | None = None  # any line
        self._last_step_written_s: float | None = None  # a step's line (activity never delays one)
        self._last_step_text = ""
        self._bar: tqdm | None = None
        if self._is_tty:
            self._bar = tqdm(total=total_steps, file=self._stream, bar_format="{desc}", leave=True,
                             dynamic_ncols=columns is None, ncols=columns, mininterval=0)

    def _draw(self, text: str) -> None:
        assert self._bar is not None
        self._bar.set_description_str(text, refresh=True)

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        now = self._clock()
        text = format_progress(step, self.total_steps, metrics, elapsed_s=now - self._start_s)
        self._last_step_text = text
        if self._bar is not None:
            self._draw(text)
        elif (self._last_step_written_s is None or now - self._last_step_written_s >= self._interval_s
              or step >= self.total_steps):
            self._stream.write(text + "\n")
            self._last_step_written_s = now
            self._stream.flush()
        else:
            return
        self._last_written_s = now

    def activity(self, text: str) -> None:
        """Show what is happening inside a step (`format_activity`): on a TTY in place, before the last
        step's line; elsewhere as its own line, at most every `interval_s` (as step lines)."""
        now = self._clock()
        if self._bar is not None:
            # what is happening now first: on a narrow terminal the cut falls on the last step's figures
            self._draw(f"{text} | {self._last_step_text}" if self._last_step_text else text)
        else:  # after `interval_s` with no line at all (counting from the start), not at once
            quiet_since = self._last_written_s if self._last_written_s is not None else self._start_s
            if now - quiet_since < self._interval_s:
                return
            self._stream.write(f"  ... {text}\n")
            self._stream.flush()
        self._last_written_s = now

    def message(self, text: str) -> None:
        """A line that stays (an evaluation's result): on a TTY above the live line, which is redrawn."""
        if self._bar is not None:
            self._bar.write(text, file=self._stream)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()
        self._last_written_s = self._clock()

    def close(self) -> None:
        """End the live line so later output starts on a fresh line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
