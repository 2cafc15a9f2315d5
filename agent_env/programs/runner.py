"""One episode as one run of the user's agent program (`loop.program`).

The program gets the episode's base URL on the endpoint and its sample; what it calls through the URL is
the episode (`EpisodeRecorder`). It returns a reward (a number), its final answer (a string the task's
reward scores) or None (the last reply is scored). A program that raises, runs past its timeout or never
calls the endpoint fails the episode (`ProgramFailed`, counted): the rollout manager drops its group and
fills the slot with a fresh prompt, as for any failed group, and the run goes on.
"""

from __future__ import annotations

import asyncio
import importlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agent_env.loop import Episode, EpisodeSettings
from agent_env.programs.endpoint import EndpointSettings, ProgramEndpoint
from agent_env.rewards import RewardResult
from agent_env.samples import Sample

Program = Callable[[str, Sample], Awaitable[Any]]


class ProgramFailed(RuntimeError):
    """The program raised, ran past its timeout or never called the endpoint."""


class ProgramConfigError(ValueError):
    """`loop.program` does not name an async function."""


def import_program(spec: str) -> Program:
    """The async function `package.module:function` names (ProgramConfigError with the fix)."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ProgramConfigError(f"loop.program={spec!r}: cannot import module {module_name!r} ({exc}); "
                                 "check the spelling and that its package is installed or on PYTHONPATH"
                                 ) from None
    function = getattr(module, attribute, None)
    if not asyncio.iscoroutinefunction(function):
        raise ProgramConfigError(f"loop.program={spec!r}: module {module_name!r} has no async function "
                                 f"{attribute!r}; define async def {attribute}(base_url, sample)")
    return function  # type: ignore[return-value]


@dataclass
class ProgramCounts:
    crashed: int = 0
    timed_out: int = 0
    never_called: int = 0


@dataclass
class ProgramRunner:
    endpoint: ProgramEndpoint
    program: Program
    reward: Callable[[str, Sample], Any]
    timeout_s: float
    counts: ProgramCounts = field(default_factory=ProgramCounts)

    def counters(self) -> dict[str, float]:
        """Running totals for the step's metrics: failed runs by why, and the endpoint's refusals."""
        refused = {f"program/refused_{name}": float(n) for name, n in self.endpoint.counts.as_dict().items()}
        return {"program/crashed": float(self.counts.crashed),
                "program/timed_out": float(self.counts.timed_out),
                "program/never_called": float(self.counts.never_called), **refused}

    async def episode(self, sample: Sample, settings: EpisodeSettings, trajectory_id: str, group_id: str,
                      task_name: str) -> Episode:
        """One run of the program, sampled as `settings` says (the training rollouts', or an evaluation's)."""
        base_url = self.endpoint.open(trajectory_id, EndpointSettings.of_episode(settings))
        started = time.perf_counter()
        try:
            returned = await asyncio.wait_for(self.program(base_url, sample), self.timeout_s)
        except TimeoutError:
            self.counts.timed_out += 1
            raise ProgramFailed(f"episode {trajectory_id}: the program ran past loop.program_timeout_s="
                                f"{self.timeout_s:g}") from None
        except Exception as exc:
            self.counts.crashed += 1
            raise ProgramFailed(f"episode {trajectory_id}: the program raised {type(exc).__name__}: {exc}"
                                ) from exc
        finally:
            record = self.endpoint.close(trajectory_id)
        last = record.texts[-1] if record.texts else ""
        if isinstance(returned, bool) or not isinstance(returned, int | float | str | type(None)):
            self.counts.crashed += 1
            raise ProgramFailed(f"episode {trajectory_id}: the program returned a {type(returned).__name__}; "
                                "return a reward (a number), the final answer (a string) or None")
        if isinstance(returned, int | float):
            reward = RewardResult(score=float(returned), is_correct=float(returned) > 0, extracted=None)
        else:
            reward = await asyncio.to_thread(self.reward, last if returned is None else returned, sample)
        trajectory = record.build(trajectory_id, group_id, float(reward.score), name=task_name,
                                  sample_id=sample.sample_id, total_s=time.perf_counter() - started)
        if trajectory is None:
            self.counts.never_called += 1
            raise ProgramFailed(f"episode {trajectory_id}: the program never called the endpoint")
        text = "".join(record.texts)
        return Episode(trajectory, (), text, reward.extracted, reward)
