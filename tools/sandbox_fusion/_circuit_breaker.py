"""A circuit breaker for a remote sandbox service: stop hammering a service that is down.

closed -> (failure_threshold consecutive failed attempts) -> open: every attempt fails fast
open -> (cooldown_s passed) -> half-open: exactly one trial attempt is let through
half-open -> trial succeeds -> closed; trial fails -> open again (for another cooldown)

Single event loop, no locks: state changes happen between awaits. The clock is injectable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from tools.base import ToolUnavailableError

BreakerState = Literal["closed", "open", "half_open"]


class CircuitOpenError(ToolUnavailableError):
    """The breaker refused an attempt without contacting the service."""


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        failure_threshold: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._name = name
        self._failure_threshold = failure_threshold
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._state: BreakerState = "closed"
        self._consecutive_failures = 0
        self._opened_at = 0.0
        self._is_trial_in_flight = False
        self.times_opened = 0
        self.rejections = 0

    @property
    def state(self) -> BreakerState:
        return self._state

    def before_attempt(self) -> None:
        """Call before each attempt; raises CircuitOpenError when the attempt must not be made."""
        if self._state == "open":
            remaining_s = self._opened_at + self._cooldown_s - self._clock()
            if remaining_s > 0:
                self.rejections += 1
                raise CircuitOpenError(
                    f"{self._name}: circuit open after {self._consecutive_failures} consecutive failures; "
                    f"next trial in {remaining_s:.1f} s (is the service up?)"
                )
            self._state = "half_open"
        if self._state == "half_open":
            if self._is_trial_in_flight:
                self.rejections += 1
                raise CircuitOpenError(
                    f"{self._name}: circuit half-open and its one trial request is in flight"
                )
            self._is_trial_in_flight = True

    def record_success(self) -> None:
        self._state = "closed"
        self._consecutive_failures = 0
        self._is_trial_in_flight = False

    def record_failure(self) -> None:
        self._consecutive_failures += 1
        self._is_trial_in_flight = False
        if self._state == "half_open" or self._consecutive_failures >= self._failure_threshold:
            if self._state != "open":
                self.times_opened += 1
            self._state = "open"
            self._opened_at = self._clock()
