"""The multi-turn agent loop (docs/agent_loop.md): one episode, token-in/token-out.

`run_episode` renders nothing and decodes nothing back into the context: it starts from the
prompt's token ids, appends exactly the tokens the engine returned (loss_mask 1, with their
behaviour log-probs and versions) and the tokenised observation text (loss_mask 0), and sends that
growing id sequence back to the engine each turn. Decoding happens only to *read* a turn (find
the code block or the final answer) and to score the episode. Which fenced block is code is the
tool's choice (`tools.base.code_fence_of`: ```` ```python ```` unless it declares another language).

Two ways to call tools (`EpisodeSettings.tool_format`): `code_fence`, SimpleTIR's one fenced block per
turn run by the one tool, its output appended as text; and `function_call`, where the model writes
structured calls (read by `agent_env.function_calls`), up to `max_parallel_calls` of a turn run
concurrently through a `tools.functions.Toolbox`, and the results are appended as the chat template's
tool messages (`agent_env.tool_messages`). Either way only the engine's tokens are trained.

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
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from agent_env.context import ContextPolicy, ContextView
from agent_env.function_calls import ParsedCall, ToolCallParser, resolve_parser, visible_text
from agent_env.tool_messages import ToolMessageRenderer, tool_message
from agent_env.turns import (
    TRUNCATION_MARKER,
    CodeFence,
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
from tools.functions import Toolbox, ToolboxEpisode

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
    tool_format: Literal["code_fence", "function_call"] = "code_fence"
    """code_fence: one fenced block per turn, one tool; function_call: structured calls, several tools."""
    tool_parser: str = "hermes"
    """function_call: the parser of the model's calls (agent_env.function_calls.resolve_parser)."""
    max_parallel_calls: int = 4
    """function_call: calls of one turn that run; later ones are answered with an error."""
    context: ContextPolicy = field(default_factory=ContextPolicy)
    """What each turn reads (agent_env/context.py): appended (the default), earlier reasoning stripped,
    the history compacted; a context that stops extending the last starts a new segment."""


@dataclass(frozen=True)
class TurnRecord:
    """One model turn as text, for logs and evaluation files (the trajectory holds the tokens)."""

    text: str
    finish_reason: FinishReason
    code: str | None = None
    observation: str | None = None
    tool_status: str | None = None
    calls: tuple[dict[str, Any], ...] = ()
    """function_call: each call of the turn (name, arguments, status, what the model saw)."""
    is_summary: bool = False
    """A summary the policy wrote of its history (`loop.context.compaction: summarize`), not a tool turn."""


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


def as_toolbox(tool: Tool | Toolbox | None) -> Toolbox | None:
    """The functions a function-calling episode offers: a toolbox as given, one tool as a toolbox of one."""
    return tool if isinstance(tool, Toolbox) or tool is None else Toolbox([tool])


def prompt_tools(tool: Tool | Toolbox | None, settings: EpisodeSettings) -> list[dict[str, Any]] | None:
    """The chat template's `tools=` for an episode's prompt: the functions' schemas with function calling,
    None with a code fence or no tool (the prompt then renders exactly as without tools)."""
    toolbox = as_toolbox(tool) if settings.tool_format == "function_call" else None
    return toolbox.template_tools() if toolbox is not None else None


@dataclass
class _Counts:
    """What an episode did, for `TaskInfo`."""

    tool_calls: int = 0
    tool_errors: int = 0
    tool_parse_errors: int = 0
    tool_unknown: int = 0
    void_turns: int = 0


@dataclass
class _Turn:
    text: str
    """The turn decoded without special tokens: what is scored and logged."""
    finish: FinishReason
    is_truncated: bool
    token_ids: list[int]
    """Every token the turn sampled (its parts' tokens, in order)."""


async def _generate_turn(engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                         builder: TrajectoryBuilder, settings: EpisodeSettings, fence: CodeFence | None,
                         turn: int, trajectory_id: str) -> _Turn:
    """One model turn, appended to `builder`. With a code `fence`, a stop on a fence that does not close
    a code block continues the same turn (up to MAX_CONTINUATIONS_PER_TURN generate calls)."""
    text, finish, is_truncated, token_ids = "", "stop", False, []
    stops = fence.stops if fence is not None else ()
    for part in range(MAX_CONTINUATIONS_PER_TURN):
        room = settings.max_total_tokens - len(builder.context_ids())
        budget = min(settings.max_new_tokens_per_turn - len(token_ids), room)
        if budget <= 0:
            is_truncated, finish = True, "length"
            break
        result = await engine.generate(GenerationRequest(
            request_id=f"{trajectory_id}-t{turn}-{part}",
            prompt_token_ids=tuple(builder.context_ids()),
            sampling=_sampling(settings, budget, stops, turn * MAX_CONTINUATIONS_PER_TURN + part),
        ))
        if result.finish_reason == "abort":  # not ours: cancelling this coroutine raises instead
            raise GenerationAborted(engine.name, f"request {result.request_id} of {trajectory_id} "
                                    "was aborted by the engine, not by this episode")
        builder.add_generation(result)
        token_ids.extend(result.token_ids)
        text += tokenizer.decode(result.token_ids, skip_special_tokens=True)
        finish = result.finish_reason
        # only a stop *string* on a bare fence continues the turn: an EOS right after a fence
        # ends it (both finish as "stop"; the EOS's stop_reason is its token id)
        stopped_at_fence = finish == "stop" and isinstance(result.stop_reason, str)
        if not (fence is not None and stopped_at_fence and turn_needs_more(text, fence)):
            break
    return _Turn(text, finish, is_truncated or finish == "length", token_ids)


async def run_episode(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Sequence[int],
    settings: EpisodeSettings,
    score: ScoreFn,
    *,
    tool: Tool | Toolbox | None,
    trajectory_id: str,
    group_id: str,
    task_name: str = "",
    sample_id: str = "",
) -> Episode:
    """Run one episode from `prompt_ids` (chat template applied, with `prompt_tools`'s `tools=` for
    function calling) to a final answer, EOS or a budget."""
    started = time.perf_counter()
    builder = TrajectoryBuilder(prompt_ids, version_at_start=engine.version)
    view = ContextView(settings.context, tokenizer, prompt_ids) if settings.context.manages else None
    records: list[TurnRecord] = []
    model_texts: list[str] = []
    counts = _Counts()
    tool_s = 0.0
    is_truncated = False
    finish: FinishReason = "stop"
    runner_scope, fence, renderer, parser = _tool_plumbing(tool, settings, tokenizer)
    async with runner_scope as runner:
        for turn in range(settings.max_turns + 1):
            generated = await _generate_turn(engine, tokenizer, builder, settings, fence, turn, trajectory_id)
            if view is not None:
                view.add_turn(generated.token_ids)
            text, finish = generated.text, generated.finish
            is_truncated = is_truncated or generated.is_truncated
            model_texts.append(text)
            calls = [] if parser is None else parser.parse(visible_text(
                # special tokens kept: some tokenizers mark <tool_call> or <think> as special
                tokenizer.decode(generated.token_ids, skip_special_tokens=False)))
            if fence is not None:
                decision = decide_turn(text, settings.answer_pattern, fence)
            elif calls:
                decision = TurnDecision("tool_call")
            else:
                decision = _no_tool_decision(text, settings.answer_pattern)
            if decision.kind == "void":
                counts.void_turns += 1
            # --- stop: an answer, EOS/length without a call, the budget, or no tool calls left ---
            if decision.kind != "tool_call" or is_truncated or turn >= settings.max_turns or runner is None:
                records.append(TurnRecord(text, finish, code=decision.code))
                break
            # --- execute and append the observation (loss_mask 0) ---
            exec_started = time.perf_counter()
            if renderer is not None:
                last_token = generated.token_ids[-1] if generated.token_ids else None
                record, observation_ids = await _call_functions(
                    runner, calls, settings, counts, renderer, text, finish, last_token)
            else:
                record, observation_ids = await _run_code(runner, decision, settings, counts, tokenizer, text,
                                                          finish)
            tool_s += time.perf_counter() - exec_started
            records.append(record)
            if view is None:
                context = [*builder.context_ids(), *observation_ids]
            else:
                view.add_observation(observation_ids)
                if settings.context.compaction == "summarize" and view.needs_compaction():
                    records.append(await _write_summary(engine, tokenizer, builder, view, settings, turn,
                                                        trajectory_id))
                context = view.next_context()
            if len(context) >= settings.max_total_tokens:
                is_truncated = True  # no room left to answer after this observation
                break
            builder.start_segment(context)  # appended where it extends what the model read so far
    response_text = "".join(model_texts)
    reward_info = await asyncio.to_thread(score, response_text)
    trajectory = builder.build(
        trajectory_id,
        group_id,
        reward=float(reward_info.score),
        task=TaskInfo(turns=sum(not r.is_summary for r in records), tool_calls=counts.tool_calls,
                      tool_errors=counts.tool_errors,
                      tool_parse_errors=counts.tool_parse_errors, tool_unknown=counts.tool_unknown,
                      void_turns=counts.void_turns, finish_reason=finish, is_truncated=is_truncated,
                      compactions=view.compactions if view is not None else 0,
                      name=task_name, sample_id=sample_id),
        timings=TrajectoryTimings(generate_s=builder.generate_s, tool_s=tool_s,
                                  total_s=time.perf_counter() - started),
    )
    return Episode(trajectory, tuple(records), response_text,
                   find_answer(response_text, settings.answer_pattern), reward_info)


def _tool_plumbing(tool: Tool | Toolbox | None, settings: EpisodeSettings, tokenizer: PreTrainedTokenizerBase
                   ) -> tuple[contextlib.AbstractAsyncContextManager[Any], CodeFence | None,
                              ToolMessageRenderer | None, ToolCallParser | None]:
    """How the episode reaches its tool: the runner's scope (a session or the shared tool), and either the
    code fence it runs (code_fence) or the renderer of tool messages and the call parser (function_call)."""
    if settings.tool_format == "function_call":
        toolbox = as_toolbox(tool)
        if toolbox is None:
            return _function_scope(toolbox, settings), None, None, None
        renderer = ToolMessageRenderer(tokenizer, toolbox.template_tools())
        return _function_scope(toolbox, settings), None, renderer, resolve_parser(settings.tool_parser)
    if isinstance(tool, Toolbox):
        raise TypeError("a Toolbox offers functions: run it with tool_format='function_call'")
    # the tool says which fenced blocks it runs (```python unless it declares `code_fence`)
    fence = code_fence(code_fence_of(tool)) if tool is not None else None
    return _executor(tool, settings.use_session), fence, None, None


async def _write_summary(engine: InferenceEngine, tokenizer: PreTrainedTokenizerBase,
                         builder: TrajectoryBuilder, view: ContextView, settings: EpisodeSettings, turn: int,
                         trajectory_id: str) -> TurnRecord:
    """The policy writes a summary of the context it has read, after the summary request: sampled and
    trained where it is written (the episode's reward is its reward), then the history is compacted to it.
    With no room left to write one, the history is cut to its last turns alone."""
    builder.start_segment([*view.render(), *view.summary_request_ids()])
    policy = settings.context
    budget = min(policy.summary_max_tokens, settings.max_total_tokens - len(builder.context_ids()))
    if budget <= 0:
        view.compact()
        return TurnRecord("", "length", is_summary=True)
    result = await engine.generate(GenerationRequest(
        request_id=f"{trajectory_id}-t{turn}-summary",
        prompt_token_ids=tuple(builder.context_ids()),
        # a seed offset past every tool turn's, so a summary never repeats a turn's random stream
        sampling=_sampling(settings, budget, (),
                           (settings.max_turns + 1 + turn) * MAX_CONTINUATIONS_PER_TURN),
    ))
    if result.finish_reason == "abort":
        raise GenerationAborted(engine.name, f"request {result.request_id} of {trajectory_id} "
                                "was aborted by the engine, not by this episode")
    builder.add_generation(result)
    text = tokenizer.decode(result.token_ids, skip_special_tokens=True)
    view.compact(text)
    return TurnRecord(text, result.finish_reason, is_summary=True)


async def _run_code(runner: Tool | ToolSession, decision: TurnDecision, settings: EpisodeSettings,
                    counts: _Counts, tokenizer: PreTrainedTokenizerBase, text: str, finish: FinishReason
                    ) -> tuple[TurnRecord, list[int]]:
    """A code-fence turn's block, run; its observation as text tokens."""
    tool_result = await _execute(runner, settings.preamble + (decision.code or ""))
    counts.tool_calls += 1
    counts.tool_errors += not tool_result.is_ok
    observation = format_observation(
        observation_body(tool_result, settings.max_observation_chars), settings.observation_format)
    record = TurnRecord(text, finish, decision.code, observation, tool_result.status)
    return record, tokenizer.encode(observation, add_special_tokens=False)


@contextlib.asynccontextmanager
async def _function_scope(toolbox: Toolbox | None, settings: EpisodeSettings
                          ) -> AsyncIterator[ToolboxEpisode | None]:
    if toolbox is None:
        yield None
        return
    async with toolbox.episode(use_session=settings.use_session, preamble=settings.preamble) as episode:
        yield episode


def _cut(text: str, max_chars: int) -> str:
    return text if len(text) <= max_chars else text[:max_chars] + TRUNCATION_MARKER


async def _call_functions(runner: ToolboxEpisode, calls: list[ParsedCall], settings: EpisodeSettings,
                          counts: _Counts, renderer: ToolMessageRenderer, text: str, finish: FinishReason,
                          last_token: int | None) -> tuple[TurnRecord, list[int]]:
    """A function-calling turn's calls: the well-formed, known, schema-valid ones among the first
    `max_parallel_calls` run concurrently; every other one is answered with an error the model sees
    (counted: parse errors, unknown names, the rest as tool errors). Returns the turn's record and the
    ids of the template's tool messages, one per call in the model's order."""
    replies: list[tuple[str, str] | None] = []  # (status, content) now, or None: to run
    to_run: list[tuple[str, dict[str, Any]]] = []
    for index, call in enumerate(calls):
        if index >= settings.max_parallel_calls:
            counts.tool_errors += 1
            replies.append(("refused", f"Error: not run; at most {settings.max_parallel_calls} tool calls "
                                       "run per turn"))
        elif call.error is not None:
            counts.tool_parse_errors += 1
            replies.append(("parse_error", f"Error: {call.error}"))
        elif (problem := runner.toolbox.problem(call.name, call.arguments)) is not None:
            kind, message = problem
            if kind == "unknown":
                counts.tool_unknown += 1
            else:
                counts.tool_errors += 1
            replies.append((kind, f"Error: {message}"))
        else:
            replies.append(None)
            to_run.append((call.name, dict(call.arguments)))
    results = iter(await runner.run(to_run))
    details: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for call, reply in zip(calls, replies, strict=True):
        if reply is None:
            result = next(results)
            counts.tool_calls += 1
            counts.tool_errors += not result.is_ok
            # the template frames the content: a trailing newline of the output would only add a blank line
            status = result.status
            content = observation_body(result, settings.max_observation_chars).rstrip("\n")
        else:
            status, content = reply[0], _cut(reply[1], settings.max_observation_chars)
        details.append({"name": call.name, "arguments": dict(call.arguments), "status": status,
                        "content": content, **({"raw": call.raw} if call.error else {})})
        messages.append(tool_message(call.name or "invalid", content))
    worst = next((d["status"] for d in details if d["status"] not in ("ok", "output_truncated")), "ok")
    record = TurnRecord(text, finish, code=json.dumps([{"name": d["name"], "arguments": d["arguments"]}
                                                       for d in details]),
                        observation="\n".join(d["content"] for d in details), tool_status=worst,
                        calls=tuple(details))
    return record, renderer.ids(messages, last_token)


def _no_tool_decision(text: str, answer_pattern: str) -> TurnDecision:
    answer = find_answer(text, answer_pattern)
    return TurnDecision("answer", answer=answer) if answer is not None else TurnDecision("void")
