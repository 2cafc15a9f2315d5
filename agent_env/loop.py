"""The multi-turn SimpleTIR agent loop (docs/agent_loop.md): one episode, token-in/token-out.

`run_episode` renders nothing and decodes nothing back into the context: it starts from the
prompt's token ids, appends exactly the tokens the engine returned (loss_mask 1, with their
behaviour log-probs and versions) and the tokenised observation text (loss_mask 0), and sends that
growing id sequence back to the engine each turn. Decoding happens only to *read* a turn (find
the code block or the final answer) and to score the episode. Which fenced block is code is the
tool's choice (`tools.base.code_fence_of`: ```` ```python ```` unless it declares another language).

Concurrency: an episode is one coroutine; many run at once on one engine (which batches them) and
one tool (which bounds its own concurrency). Rewards run on a worker thread (math-verify can take
a while). Cancelling the coroutine cancels the engine request in flight (the engine aborts it) and
closes the tool session. What it deliberately does not do: choose prompts, group episodes, or
apply the loss filters (`mask_void_turns`, `remove_truncated`) — that is the rollout manager's and
the learner's job; the flags it needs are in `Trajectory.task`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agent_env.turns import (
    PYTHON_FENCE,
    TurnDecision,
    code_fence,
    decide_turn,
    find_answer,
    format_observation,
    observation_body,
    turn_needs_more,
)
from rollout.base import InferenceEngine
from rollout.errors import GenerationAborted
from rollout.trajectory import TaskInfo, Trajectory, TrajectoryBuilder, TrajectoryTimings
from rollout.types import DEFAULT_TEMPERATURE, FinishReason, GenerationRequest, SamplingParams
from tools.base import Tool, ToolCall, ToolResult, ToolSession, ToolUnavailableError, code_fence_of

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

MAX_CONTINUATIONS_PER_TURN = 8
"""Generate calls one turn may take when a stop fence did not close a code block."""


@dataclass(frozen=True)
class EpisodeSettings:
    """How one episode runs (built from a task's `loop`/`answer`/`eval` config by the caller)."""

    max_turns: int = 5
    """Tool calls allowed; the turn after the last allowed observation is the last turn."""
    max_total_tokens: int = 2048
    """Budget for prompt + every turn + observations; exhausting it sets `is_truncated`."""
    max_new_tokens_per_turn: int = 1024
    """Most tokens one turn may generate."""
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    answer_pattern: str = "boxed"
    """'boxed' or a regex with one group (see agent_env.turns.find_answer)."""
    observation_format: Literal["markdown", "simpletir"] = "markdown"
    max_observation_chars: int = 512
    preamble: str = ""
    """Code run before every executed block (same namespace)."""
    use_session: bool = False
    """One stateful interpreter per episode instead of a fresh process per call."""
    seed: int | None = None
    """Sampler seed of the first request (later turns use seed + turn); None = the engine's generator."""


@dataclass(frozen=True)
class TurnRecord:
    """One model turn as text, for logs and evaluation files (the trajectory holds the tokens)."""

    text: str
    finish_reason: FinishReason
    code: str | None = None
    observation: str | None = None
    tool_status: str | None = None


@dataclass(frozen=True)
class Episode:
    """The result of `run_episode`: the trajectory (reward set) and a readable account."""

    trajectory: Trajectory
    turns: tuple[TurnRecord, ...]
    response_text: str
    """The model's own text of every turn, concatenated (observations excluded) — what is scored."""
    answer: str | None
    """The extracted final answer, if any."""
    reward_info: Any = None
    """The reward function's full result (score, correctness, extracted, error)."""
    extras: dict[str, Any] = field(default_factory=dict)


ScoreFn = Callable[[str], Any]
"""`score(response_text) -> result with a float .score` (agent_env.rewards.RewardResult)."""


@contextlib.asynccontextmanager
async def _executor(tool: Tool | None, use_session: bool) -> AsyncIterator[Tool | ToolSession | None]:
    if tool is None or not use_session:
        yield tool
        return
    async with tool.session() as session:
        yield session


async def _execute(runner: Tool | ToolSession, code: str) -> ToolResult:
    """Run one block; our own failures other than an unavailable backend become an error result."""
    try:
        return await runner.run(ToolCall(code=code))
    except ToolUnavailableError:
        raise  # the sandbox is down for everyone: a run must stop loudly, not train on errors
    except Exception as exc:  # a bug or a broken sandbox for this one call: data, counted as an error
        log.warning("tool call failed on our side (%s: %s); the model sees an error", type(exc).__name__, exc)
        return ToolResult(status="error", stderr=f"ToolError: {type(exc).__name__}", message=str(exc)[:200])


def _sampling(settings: EpisodeSettings, max_new_tokens: int, stops: tuple[str, ...], turn: int
              ) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        stop=stops,
        seed=None if settings.seed is None else settings.seed + turn,
    )


async def run_episode(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    settings: EpisodeSettings,
    score: ScoreFn,
    *,
    tool: Tool | None,
    trajectory_id: str,
    group_id: str,
    task_name: str = "",
    sample_id: str = "",
) -> Episode:
    """Run one episode from `prompt_ids` (chat template applied) to a final answer, EOS or a budget."""
    started = time.perf_counter()
    builder = TrajectoryBuilder(prompt_ids)
    records: list[TurnRecord] = []
    model_texts: list[str] = []
    tool_calls = tool_errors = void_turns = 0
    tool_s = 0.0
    is_truncated = False
    finish: FinishReason = "stop"
    use_tool = tool is not None
    # the tool says which fenced blocks it runs (```python unless it declares `code_fence`)
    fence = code_fence(code_fence_of(tool)) if tool is not None else PYTHON_FENCE
    stops = fence.stops if use_tool else ()
    async with _executor(tool, settings.use_session) as runner:
        for turn in range(settings.max_turns + 1):
            # --- generate one turn (a stop on a non-closing fence continues the same turn) ---
            text, finish, turn_tokens = "", "stop", 0
            for part in range(MAX_CONTINUATIONS_PER_TURN):
                room = settings.max_total_tokens - len(builder.token_ids)
                budget = min(settings.max_new_tokens_per_turn - turn_tokens, room)
                if budget <= 0:
                    is_truncated, finish = True, "length"
                    break
                result = await engine.generate(GenerationRequest(
                    request_id=f"{trajectory_id}-t{turn}-{part}",
                    prompt_token_ids=tuple(builder.token_ids),
                    sampling=_sampling(settings, budget, stops, turn * MAX_CONTINUATIONS_PER_TURN + part),
                ))
                if result.finish_reason == "abort":  # not ours: cancelling this coroutine raises instead
                    raise GenerationAborted(engine.name, f"request {result.request_id} of {trajectory_id} "
                                            "was aborted by the engine, not by this episode")
                builder.add_generation(result)
                turn_tokens += len(result.token_ids)
                text += tokenizer.decode(result.token_ids, skip_special_tokens=True)
                finish = result.finish_reason
                # only a stop *string* on a bare fence continues the turn: an EOS right after a fence
                # ends it (both finish as "stop"; the EOS's stop_reason is its token id)
                stopped_at_fence = finish == "stop" and isinstance(result.stop_reason, str)
                if not (use_tool and stopped_at_fence and turn_needs_more(text, fence)):
                    break
            if finish == "length":
                is_truncated = True
            model_texts.append(text)
            decision = decide_turn(text, settings.answer_pattern, fence) if use_tool else _no_tool_decision(
                text, settings.answer_pattern)
            if decision.kind == "void":
                void_turns += 1
            # --- stop: an answer, EOS/length without code, the budget, or no tool calls left ---
            if decision.kind != "tool_call" or is_truncated or turn >= settings.max_turns or runner is None:
                records.append(TurnRecord(text, finish, code=decision.code))
                break
            # --- execute and append the observation (loss_mask 0) ---
            exec_started = time.perf_counter()
            tool_result = await _execute(runner, settings.preamble + (decision.code or ""))
            tool_s += time.perf_counter() - exec_started
            tool_calls += 1
            tool_errors += not tool_result.is_ok
            observation = format_observation(
                observation_body(tool_result, settings.max_observation_chars), settings.observation_format)
            records.append(TurnRecord(text, finish, decision.code, observation, tool_result.status))
            observation_ids = tokenizer.encode(observation, add_special_tokens=False)
            if len(builder.token_ids) + len(observation_ids) >= settings.max_total_tokens:
                is_truncated = True  # no room left to answer after this observation
                break
            builder.add_context(observation_ids)
    response_text = "".join(model_texts)
    reward_info = await asyncio.to_thread(score, response_text)
    trajectory = builder.build(
        trajectory_id,
        group_id,
        reward=float(reward_info.score),
        task=TaskInfo(turns=len(records), tool_calls=tool_calls, tool_errors=tool_errors,
                      void_turns=void_turns, finish_reason=finish, is_truncated=is_truncated,
                      name=task_name, sample_id=sample_id),
        timings=TrajectoryTimings(generate_s=builder.generate_s, tool_s=tool_s,
                                  total_s=time.perf_counter() - started),
    )
    return Episode(trajectory, tuple(records), response_text,
                   find_answer(response_text, settings.answer_pattern), reward_info)


def _no_tool_decision(text: str, answer_pattern: str) -> TurnDecision:
    answer = find_answer(text, answer_pattern)
    return TurnDecision("answer", answer=answer) if answer is not None else TurnDecision("void")

