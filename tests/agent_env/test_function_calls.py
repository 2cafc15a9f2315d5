"""Function calling in the agent loop: the Hermes/Qwen parser, reasoning never parsed, the template's
tool messages appended token-exactly (a real HF engine and a real tokenizer whose chat template renders
`tools=`, the real bubblewrap sandbox), and bad calls answered as errors the model sees."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from agent_env.function_calls import HermesParser, ParsedCall, resolve_parser, visible_text
from agent_env.loop import EpisodeSettings, prompt_tools, run_episode
from agent_env.prompts import render_prompt_ids
from agent_env.tool_messages import ToolMessageRenderer, ToolTemplateError, check_tools_template, tool_message
from rollout.engines.hf_engine import HFEngine
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.settings import HFEngineSettings
from rollout.tiny import build_byte_tokenizer
from rollout.types import GenerationRequest
from tests.agent_env.test_loop import Recorder, assert_trained_tokens_are_sampled
from tests.examples.memorise import memorise_episode
from tools.base import FunctionSpec, ToolResult
from tools.fakes import EchoTool
from tools.functions import Toolbox
from tools.registry import build_tool

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
FUNCTION_CALLING = EpisodeSettings(max_turns=3, max_total_tokens=1500, temperature=0.0,
                                   tool_format="function_call")


class Boxed42:
    def __call__(self, text: str) -> Any:
        from agent_env.turns import find_boxed

        return type("Score", (), {"score": float(find_boxed(text) == "42")})()


# ---------------------------------------------------------------------------------------------
# Parsing


def test_hermes_reads_every_call_of_a_turn() -> None:
    text = ('I will add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    calls = HermesParser().parse(text)
    assert [(c.name, dict(c.arguments), c.error) for c in calls] == [
        ("add", {"a": 1, "b": 2}, None), ("python", {"code": "print(1)"}, None)]


@pytest.mark.parametrize(("text", "error"), [
    ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>', "the call is not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'the call has no "name" string'),
    ('<tool_call>["add"]</tool_call>', 'the call has no "name" string'),
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     'the "arguments" of \'add\' are not a JSON'),
    ('<tool_call>{"name": "add", "arguments": {"a": 1}', "a <tool_call> was not closed by </tool_call>"),
])
def test_a_malformed_call_is_kept_with_what_is_wrong(text: str, error: str) -> None:
    (call,) = HermesParser().parse(text)
    assert call.error is not None and call.error.startswith(error)


def test_text_inside_a_reasoning_block_is_never_a_call() -> None:
    call = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    assert visible_text(f"<think>maybe {call}</think>answer") == "answer"
    assert visible_text(f"plan {call}</think>then") == "then"  # the template opened the block
    assert visible_text(f"a<think>b</think>c<think>unclosed {call}") == "ac"
    assert [c.name for c in HermesParser().parse(visible_text(f"<think>{call}</think>{call}"))] == ["add"]


def test_a_parser_is_found_by_name_or_import_path() -> None:
    assert isinstance(resolve_parser("hermes"), HermesParser)
    assert isinstance(resolve_parser("agent_env.function_calls:HermesParser"), HermesParser)
    with pytest.raises(ValueError, match="unknown tool parser 'qwen'; built-in: hermes"):
        resolve_parser("qwen")


# ---------------------------------------------------------------------------------------------
# The chat template's tool messages


def test_the_tiny_models_template_renders_tools_and_refuses_a_template_that_ignores_them() -> None:
    tokenizer = build_byte_tokenizer()
    tools = Toolbox([EchoTool()]).template_tools()
    check_tools_template(tokenizer, tools)
    renderer = ToolMessageRenderer(tokenizer, tools)
    assert renderer.suffix_text([tool_message("echo", "hi")]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nhi\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    eos = tokenizer.eos_token_id  # the model sampled its end of turn: it is not appended again
    assert tokenizer.decode(renderer.ids([tool_message("echo", "hi")], eos)).startswith("\n<|im_start|>user")
    plain = build_byte_tokenizer()
    plain.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                           "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(ToolTemplateError, match=r"ignores tools=.*prompt\.chat_template"):
        check_tools_template(plain, tools)


# ---------------------------------------------------------------------------------------------
# A real episode: the real engine, tokenizer, template and sandbox

SYSTEM, QUESTION = "Use the tools.", "What is 6*7?"
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
ANSWER = "The answer is \\boxed{42}."


@pytest.fixture(scope="module")
def python_tools() -> list[dict[str, Any]]:
    return Toolbox([_PythonShape()]).template_tools()


class _PythonShape:
    """Stands for the python tool when only its schema is needed (same name and code fence)."""

    name: ClassVar[str] = "python"


def _messages() -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def calling_model(tmp_path_factory: pytest.TempPathFactory, python_tools: list[dict[str, Any]]) -> Path:
    """A tiny model that memorised one function-calling episode, the template's tool message included."""
    tokenizer = build_byte_tokenizer()
    prompt = render_prompt_ids(tokenizer, _messages(), python_tools)
    between = ToolMessageRenderer(tokenizer, python_tools).suffix_text([tool_message("python", "42")])
    return memorise_episode(tmp_path_factory.mktemp("calling"), prompt, CALL + between + ANSWER)


@needs_bwrap
async def test_a_function_calling_episode_trains_exactly_the_sampled_tokens(calling_model: Path) -> None:
    tokenizer = build_byte_tokenizer()
    async with HFEngine(calling_model, HFEngineSettings()) as engine, \
            build_tool({"type": "python", "timeout_s": 10, "warm_pool_size": 0}) as python:
        toolbox = Toolbox([python])
        prompt = render_prompt_ids(tokenizer, _messages(), prompt_tools(toolbox, FUNCTION_CALLING))
        recorder = Recorder(engine)
        episode = await run_episode(engine, tokenizer, prompt, FUNCTION_CALLING, Boxed42(), tool=toolbox,
                                    trajectory_id="e0", group_id="g0")
    trajectory = episode.trajectory
    # the sandbox really ran the call, and the model answered from its result
    assert episode.response_text == CALL + ANSWER and trajectory.reward == 1.0
    (call,) = episode.turns[0].calls
    assert (call["name"], call["arguments"], call["status"], call["content"]) == (
        "python", {"code": "print(6*7)"}, "ok", "42")
    task = trajectory.task
    assert (task.turns, task.tool_calls, task.tool_errors, task.tool_parse_errors, task.tool_unknown) == (
        2, 1, 0, 0, 0)
    # the whole sequence is what the chat template renders for this conversation, token for token
    conversation = [*_messages(), {"role": "assistant", "content": CALL}, tool_message("python", "42"),
                    {"role": "assistant", "content": ANSWER}]
    rendered = tokenizer.apply_chat_template(conversation, tools=prompt_tools(toolbox, FUNCTION_CALLING),
                                             tokenize=False)
    assert tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) + "\n" == rendered
    # trained = sampled: every sampled token verbatim with mask 1, everything the template added mask 0
    (added,) = assert_trained_tokens_are_sampled(trajectory, prompt, recorder)
    assert tokenizer.decode(added, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


# ---------------------------------------------------------------------------------------------
# Bad calls and the limit: answered, counted, never raised (scripted engine: control logic)


def _scripted(texts: list[str], tokenizer: Any = None) -> tuple[Any, ScriptedEngine]:
    tokenizer = tokenizer or build_byte_tokenizer()
    replies = iter(texts)

    def script(request: GenerationRequest) -> ScriptedReply:
        return ScriptedReply([*tokenizer.encode(next(replies), add_special_tokens=False),
                              tokenizer.eos_token_id])

    return tokenizer, ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id)


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


async def test_bad_calls_and_calls_over_the_limit_become_error_messages_and_counts() -> None:
    thought = _call("echo", '{"code": "thought"}')
    turn = (f"<think>{thought}</think>"
            + _call("echo", '{"code": "print(1)"}') + _call("echo", '{"code": 5}') + _call("search", "{}")
            + '<tool_call>{"name": "echo", "arguments": </tool_call>' + _call("echo", '{"code": "late"}'))
    tokenizer, engine = _scripted([turn, "so \\boxed{42}"])
    recorder = Recorder(engine)
    settings = EpisodeSettings(tool_format="function_call", max_parallel_calls=4)
    async with engine, EchoTool() as echo:
        episode = await run_episode(engine, tokenizer, [1, 2], settings, Boxed42(), tool=Toolbox([echo]),
                                    trajectory_id="e", group_id="g")
    task = episode.trajectory.task
    assert (task.tool_calls, task.tool_errors, task.tool_parse_errors, task.tool_unknown) == (1, 2, 1, 1)
    assert episode.trajectory.reward == 1.0 and task.turns == 2
    statuses = [(c["name"], c["status"]) for c in episode.turns[0].calls]
    assert statuses == [("echo", "ok"), ("echo", "invalid_arguments"), ("search", "unknown"),
                        ("", "parse_error"), ("echo", "refused")]
    # what the model read before its second turn: one tool message per call, in its order
    added = tokenizer.decode(recorder.calls[1][0].prompt_token_ids, skip_special_tokens=False)
    responses = added.split("<tool_response>\n")[1:]
    assert [r.split("\n</tool_response>")[0] for r in responses] == [
        "print(1)",
        "Error: arguments of 'echo' do not match its schema: code: 5 is not of type 'string'",
        "Error: unknown tool 'search'; the tools are: echo",
        "Error: the call is not valid JSON (Expecting value at character 29); write "
        '{"name": "<tool>", "arguments": {...}}',
        "Error: not run; at most 4 tool calls run per turn"]
    assert "thought" not in added.split("<|im_start|>assistant\n")[-2].split("<tool_response>")[1]


class _Slow:
    """Three functions that each take 0.2 s and record how many run at once (control logic only)."""

    name: ClassVar[str] = "slow"

    def __init__(self) -> None:
        self.running = self.most = 0

    def functions(self) -> tuple[FunctionSpec, ...]:
        return tuple(FunctionSpec(name=name) for name in ("a", "b", "c"))

    async def call_function(self, name: str, arguments: Mapping[str, Any]) -> ToolResult:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(0.2)
        self.running -= 1
        return ToolResult(status="ok", stdout=name)

    def session(self) -> Any:
        raise AssertionError("no sessions here")


async def test_the_calls_of_a_turn_run_concurrently_up_to_the_limit() -> None:
    tokenizer, engine = _scripted([_call("a", "{}") + _call("b", "{}") + _call("c", "{}"), "\\boxed{42}"])
    slow = _Slow()
    settings = EpisodeSettings(tool_format="function_call", max_parallel_calls=2)
    async with engine:
        episode = await run_episode(engine, tokenizer, [1, 2], settings, Boxed42(), tool=Toolbox([slow]),
                                    trajectory_id="e", group_id="g")
    assert slow.most == 2
    assert [c["status"] for c in episode.turns[0].calls] == ["ok", "ok", "refused"]


async def test_a_turn_without_calls_ends_the_episode_like_a_code_fence_turn() -> None:
    tokenizer, engine = _scripted(["<think>I could call a tool</think>The answer is \\boxed{42}."])
    async with engine, EchoTool() as echo:
        episode = await run_episode(engine, tokenizer, [1, 2], FUNCTION_CALLING, Boxed42(), tool=echo,
                                    trajectory_id="e", group_id="g")
    assert episode.trajectory.task.tool_calls == 0 and episode.trajectory.reward == 1.0
    assert ParsedCall("x").error is None


async def test_calls_are_read_when_the_tokenizer_marks_the_call_tags_special() -> None:
    tokenizer = build_byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tokenizer, engine = _scripted([_call("echo", '{"code": "hi"}'), "\\boxed{42}"], tokenizer)
    async with engine, EchoTool() as echo:
        episode = await run_episode(engine, tokenizer, [1, 2], FUNCTION_CALLING, Boxed42(), tool=echo,
                                    trajectory_id="e", group_id="g")
    assert "<tool_call>" not in episode.turns[0].text  # the text shown and scored drops special tokens
    assert [(c["name"], c["content"]) for c in episode.turns[0].calls] == [("echo", "hi")]
