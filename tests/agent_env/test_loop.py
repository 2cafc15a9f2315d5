"""The SimpleTIR loop with the real HF engine and the real bubblewrap sandbox: token-in/token-out,
masks, budgets and flags; control-flow corner cases with the scripted engine."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent_env.loop import EpisodeSettings, run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from agent_env.turns import decide_turn, find_boxed, format_observation, observation_body, turn_needs_more
from rollout.engines.hf_engine import HFEngine
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.settings import HFEngineSettings
from rollout.tiny import build_byte_tokenizer
from rollout.types import GenerationRequest, GenerationResult
from tests.agent_env import memorised
from tools.base import ToolResult
from tools.fakes import EchoTool
from tools.registry import build_tool

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


@dataclass(frozen=True)
class Score:
    score: float


def _boxed_42(text: str) -> Score:
    return Score(float(find_boxed(text) == "42"))


class Recorder:
    """Wraps an engine's generate to keep every (request, result) pair."""

    def __init__(self, engine) -> None:
        self.calls: list[tuple[GenerationRequest, GenerationResult]] = []
        self._generate = engine.generate
        engine.generate = self.generate

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self._generate(request)
        self.calls.append((request, result))
        return result


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return memorised.make_memorised_model_dir(tmp_path_factory.mktemp("memorised"))


def _prompt_ids(tokenizer) -> list[int]:
    sample = Sample(sample_id="q", fields={"question": memorised.QUESTION}, answer="42")
    return render_prompt_ids(tokenizer, render_messages(memorised.SYSTEM, "{question}", sample))


@needs_bwrap
async def test_real_engine_and_sandbox_episode_is_token_exact(memorised_dir: Path) -> None:
    tokenizer = build_byte_tokenizer()
    prompt = _prompt_ids(tokenizer)
    settings = EpisodeSettings(max_turns=3, max_total_tokens=400, temperature=0.0)
    async with HFEngine(memorised_dir, HFEngineSettings()) as engine, \
            build_tool({"type": "python", "timeout_s": 10, "warm_pool_size": 0}) as tool:
        recorder = Recorder(engine)
        episode = await run_episode(engine, tokenizer, prompt, settings, _boxed_42, tool=tool,
                                    trajectory_id="e0", group_id="g0")
    trajectory = episode.trajectory
    # the episode the model memorised, with the sandbox's real output in the middle
    assert episode.response_text == memorised.TURN_1 + memorised.TURN_2
    assert tokenizer.decode(trajectory.token_ids[len(prompt):], skip_special_tokens=True) == (
        memorised.episode_text())
    assert (trajectory.task.tool_calls, trajectory.task.tool_errors, trajectory.task.turns) == (1, 0, 2)
    assert trajectory.reward == 1.0 and episode.answer == "42"
    assert not trajectory.task.is_truncated and trajectory.task.void_turns == 0
    # between turns only the observation
    (observation,) = assert_trained_tokens_are_sampled(trajectory, prompt, recorder)
    assert observation == tokenizer.encode(memorised.OBSERVATION, add_special_tokens=False)


def assert_trained_tokens_are_sampled(trajectory: Any, prompt: list[int], recorder: Recorder
                                      ) -> list[list[int]]:
    """Token by token: each request's prompt is exactly the trajectory so far; each result's tokens follow
    it verbatim with loss_mask 1 and their logprobs; everything else (the prompt, what the loop appended
    between turns) has loss_mask 0. Returns what was appended between turns, one list per gap."""
    ids, mask = list(trajectory.token_ids), list(trajectory.loss_mask)
    position, appended = len(prompt), []
    assert ids[:position] == prompt and not any(mask[:position])
    for index, (request, result) in enumerate(recorder.calls):
        assert list(request.prompt_token_ids) == ids[:position]
        end = position + len(result.token_ids)
        assert ids[position:end] == list(result.token_ids) and all(mask[position:end])
        assert list(trajectory.behavior_logprobs[position:end]) == list(result.logprobs)
        position = end
        if index + 1 < len(recorder.calls):
            next_start = len(recorder.calls[index + 1][0].prompt_token_ids)
            appended.append(ids[position:next_start])
            assert not any(mask[position:next_start])
            position = next_start
    assert position == len(ids)
    return appended


@needs_bwrap
async def test_a_tight_token_budget_truncates_and_flags_the_episode(memorised_dir: Path) -> None:
    tokenizer = build_byte_tokenizer()
    prompt = _prompt_ids(tokenizer)
    settings = EpisodeSettings(max_turns=3, max_total_tokens=len(prompt) + 20, temperature=0.0)
    async with HFEngine(memorised_dir, HFEngineSettings()) as engine, \
            build_tool({"type": "python", "timeout_s": 10, "warm_pool_size": 0}) as tool:
        episode = await run_episode(engine, tokenizer, prompt, settings, _boxed_42, tool=tool,
                                    trajectory_id="e1", group_id="g0")
    assert episode.trajectory.task.is_truncated
    assert len(episode.trajectory.token_ids) == len(prompt) + 20
    assert episode.trajectory.task.tool_calls == 0 and episode.trajectory.reward == 0.0


def _scripted(texts: list[str]):
    tokenizer = build_byte_tokenizer()
    replies = iter(texts)

    def script(request: GenerationRequest) -> ScriptedReply:
        ids = tokenizer.encode(next(replies), add_special_tokens=False)
        return ScriptedReply([*ids, tokenizer.eos_token_id])

    return tokenizer, ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id)


async def test_turn_limit_stops_without_running_more_code() -> None:
    code = "```python\nprint(1)\n```\n"
    tokenizer, engine = _scripted([code, code, code])
    async with engine, EchoTool() as tool:
        episode = await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(max_turns=2), _boxed_42,
                                    tool=tool, trajectory_id="e", group_id="g")
    assert episode.trajectory.task.tool_calls == 2  # the third block is not executed
    assert episode.trajectory.task.turns == 3


async def test_a_turn_without_code_or_answer_is_void_and_ends_the_episode() -> None:
    tokenizer, engine = _scripted(["I am not sure."])
    async with engine, EchoTool() as tool:
        episode = await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(), _boxed_42, tool=tool,
                                    trajectory_id="e", group_id="g")
    assert episode.trajectory.task.void_turns == 1 and episode.trajectory.reward == 0.0


async def test_without_a_tool_code_blocks_are_just_text() -> None:
    tokenizer, engine = _scripted(["```python\nprint(1)\n```\nthen \\boxed{42}"])
    async with engine:
        episode = await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(), _boxed_42, tool=None,
                                    trajectory_id="e", group_id="g")
    assert episode.trajectory.task.tool_calls == 0 and episode.trajectory.reward == 1.0


def test_turn_decisions() -> None:
    assert decide_turn("x\n```python\nprint(2)\n```\n", "boxed").code == "print(2)"
    assert decide_turn("so \\boxed{\\frac{1}{2}}", "boxed").answer == "\\frac{1}{2}"
    assert decide_turn("<answer>7</answer>", r"<answer>(.*?)</answer>").answer == "7"
    assert decide_turn("nothing here", "boxed").kind == "void"
    assert turn_needs_more("look:\n```\n") and not turn_needs_more("```python\na=1\n```\n")


def test_observations_show_stdout_the_exception_line_or_the_limit() -> None:
    ok = ToolResult(status="ok", stdout="4\n")
    error = ToolResult(status="error",
                       stderr="Traceback ...\n  File x\nZeroDivisionError: division by zero\n")
    timeout = ToolResult(status="timeout", message="Timed out after 2 s")
    assert format_observation(observation_body(ok, 512), "markdown") == "\n```output\n4\n```\n"
    assert observation_body(error, 512) == "ZeroDivisionError: division by zero"
    assert observation_body(timeout, 512) == "Timed out after 2 s"
    assert observation_body(ToolResult(status="ok", stdout="a" * 600), 512).endswith("…[truncated]")
    assert format_observation("4", "simpletir") == "\nCode execution result: 4\n"
    fresh = ToolResult(status="ok", stdout="y", is_session_reset=True, message="The session was restarted.")
    assert observation_body(fresh, 512) == "The session was restarted.\ny"  # answered, on a new session


async def test_only_a_stop_string_at_a_bare_fence_continues_the_turn() -> None:
    """A bare ``` line stops generation (the stop string fired) and the turn goes on until a block
    closes; a model that ends its turn with EOS right after such a line is done (seen with vLLM: the
    turn ran on past EOS into an invented next chat turn)."""
    bare = "look:\n```\n"
    for stop_string_fired, expected_calls in ((True, 3), (False, 1)):
        tokenizer, engine = _scripted([bare, "```python\nprint(1)\n```\n", "\\boxed{42}"])
        generate = engine.generate

        async def as_a_stop_string(request: GenerationRequest, fired: bool = stop_string_fired,
                                   generate: Any = generate, tokenizer: Any = tokenizer) -> GenerationResult:
            result = await generate(request)
            if fired and tokenizer.decode(result.token_ids, skip_special_tokens=True) == bare:
                return result.model_copy(update={"token_ids": result.token_ids[:-1],  # no EOS: the stop
                                                 "logprobs": result.logprobs[:-1],      # string fired
                                                 "versions": result.versions[:-1], "stop_reason": "```\n"})
            return result

        engine.generate = as_a_stop_string  # type: ignore[method-assign]
        recorder = Recorder(engine)
        async with engine, EchoTool() as tool:
            episode = await run_episode(engine, tokenizer, [1, 2], EpisodeSettings(), _boxed_42, tool=tool,
                                        trajectory_id="e", group_id="g")
        task = episode.trajectory.task
        assert len(recorder.calls) == expected_calls
        if stop_string_fired:  # one turn of two parts ran the block; the next answered
            assert (task.turns, task.tool_calls, episode.trajectory.reward) == (2, 1, 1.0)
        else:  # the EOS ended a turn with neither a block nor an answer
            assert (task.turns, task.tool_calls, task.void_turns) == (1, 0, 1)


async def test_an_episode_that_never_generates_lags_from_the_version_it_ran_under() -> None:
    """A prompt that fills the token budget: no generate call, so versions.start is the engine's version when
    the episode began, not 0 (which would count it as lagging by every version the learner has made)."""
    tokenizer, engine = _scripted(["never asked"])
    prompt = _prompt_ids(tokenizer)
    await engine.load_weights([], version=7)
    settings = EpisodeSettings(max_turns=3, max_total_tokens=len(prompt), temperature=0.0)
    episode = await run_episode(engine, tokenizer, prompt, settings, _boxed_42, tool=None,
                                trajectory_id="e1", group_id="g0")
    versions = episode.trajectory.versions
    assert (versions.start, versions.end) == (7, 7) and not any(episode.trajectory.loss_mask)
    assert episode.trajectory.task.is_truncated
