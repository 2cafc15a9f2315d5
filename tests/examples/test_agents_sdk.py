"""examples/agents_sdk: a Countdown agent written with the OpenAI Agents SDK, run unchanged as vcpo episodes.

The SDK is the real one (its Agent, Runner and function tool), the endpoint a real HTTP server on loopback.
The engine is scripted where the test needs the model to call the tool (a tiny random model does not), real
(the tiny HF model) in `vcpo train`. What is checked: the SDK sends the tools and the tool's result back,
the reply it gets is the text the model wrote, and what vcpo records is exactly what was sampled."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents", reason="the example needs the OpenAI Agents SDK (pip install openai-agents; "
                    "scripts/setup.sh installs it with the dev extras)")

from agent_env.programs.endpoint import EndpointSettings, ProgramEndpoint
from agent_env.samples import Sample
from examples.agents_sdk.agent import evaluate_arithmetic, solve
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.tiny import build_byte_tokenizer
from rollout.types import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "examples" / "mcp_tool" / "hermes_tools.jinja"


@pytest.mark.parametrize(("expression", "value"), [
    ("(3 + 5) * 2", "16"), ("7 / 2", "3.5"), ("-4 + 10", "6"), ("1 / 0", "error: division by zero"),
    ("__import__('os')", "error: only numbers, + - * / and parentheses are allowed"), ("2 +", None)])
def test_the_calculator_tool_evaluates_arithmetic_and_nothing_else(expression: str,
                                                                   value: str | None) -> None:
    result = evaluate_arithmetic(expression)
    assert result == value if value is not None else result.startswith("error: ")


async def test_the_sdk_agent_calls_its_tool_through_the_endpoint_and_answers() -> None:
    """Turn 1: the model calls calculate; the SDK runs it and sends the call and its result back; turn 2:
    the model answers. The second request's context is the first's plus what was sampled plus the tool's
    result (one segment: nothing trained twice)."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "(3 + 5) * 2"}}\n</tool_call>'
    # the model writes its call as the template writes one back (Qwen2.5's layout): the history the SDK
    # sends next renders to exactly the tokens sampled, so the conversation stays one segment
    replies = iter([f"Let me check.\n{call}", "It is 16, so \\boxed{(3 + 5) * 2}"])
    contexts: list[list[int]] = []

    def script(request: GenerationRequest) -> ScriptedReply:
        contexts.append(list(request.prompt_token_ids))
        text = next(replies)
        return ScriptedReply([*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id])

    engine = ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id)
    settings = EndpointSettings(max_total_tokens=8000, max_new_tokens_per_call=200)
    sample = Sample(sample_id="p0", fields={"numbers": [3, 5, 2], "target": 16}, answer={"target": 16})
    async with engine, ProgramEndpoint(engine, tokenizer, settings) as endpoint:
        answer = await solve(endpoint.open("ep"), sample)
        record = endpoint.close("ep")
    assert answer == "It is 16, so \\boxed{(3 + 5) * 2}"
    assert record.calls == 2
    first, second = (tokenizer.decode(c) for c in contexts)
    assert '"name": "calculate"' in first  # the SDK sent its tool
    assert "Numbers: 3, 5, 2. Target: 16." in first
    assert contexts[1][:len(contexts[0])] == contexts[0]
    assert "<tool_response>\n16\n</tool_response>" in second[len(first):]  # the tool's result came back
    trajectory = record.build("ep", "g", reward=1.0)
    assert trajectory is not None and len(trajectory.segment_starts) == 1
    sampled = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask, strict=True) if m]
    assert tokenizer.decode(sampled).count("<tool_call>") == 1 and tokenizer.decode(sampled).endswith(
        tokenizer.decode([tokenizer.eos_token_id]))


async def test_an_agent_out_of_turns_is_scored_not_dropped() -> None:
    """A model that only ever calls the tool runs the SDK out of turns (MaxTurnsExceeded): the episode ends
    with its last reply scored (None), as a built-in episode out of turns is, instead of failing."""
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 1"}}\n</tool_call>'
    ids = [*tokenizer.encode(call, add_special_tokens=False), tokenizer.eos_token_id]
    engine = ScriptedEngine(lambda request: ScriptedReply(ids), eos_token_id=tokenizer.eos_token_id)
    sample = Sample(sample_id="p0", fields={"numbers": [1, 1], "target": 2}, answer={"target": 2})
    settings = EndpointSettings(max_total_tokens=8000, max_new_tokens_per_call=200)
    async with engine, ProgramEndpoint(engine, tokenizer, settings) as ep:
        assert await solve(ep.open("ep"), sample) is None
        assert ep.close("ep").calls == 4  # the example's MAX_TURNS


@pytest.mark.skipif(importlib.util.find_spec("fastapi") is None, reason="the endpoint serves with fastapi")
def test_vcpo_train_runs_the_sdk_agent_as_its_episodes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The example's task in a real `vcpo train` (tiny random model, HF engine): every episode is one run of
    the SDK agent through the endpoint; the run trains and logs its episodes."""
    import yaml

    from tests.run.train.test_train_e2e import _vcpo, _write_configs

    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=1, tool=False)
    task_file = tmp_path / "task.yaml"
    task = yaml.safe_load(task_file.read_text())
    example = yaml.safe_load((ROOT / "examples" / "agents_sdk" / "task.yaml").read_text())
    task["loop"].update(program=example["loop"]["program"], program_timeout_s=120, max_total_tokens=1600,
                        max_new_tokens_per_turn=24)  # byte tokens: the tools' schemas alone are ~700
    task["prompt"]["chat_template"] = str(TEMPLATE)
    task_file.write_text(yaml.safe_dump(task))
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    episodes = [json.loads(line) for line in lines]
    assert episodes and all(e["turns"] >= 1 for e in episodes)
    assert _last_metrics(tmp_path).get("program/crashed", 0) == 0


def _last_metrics(tmp_path: Path) -> dict[str, Any]:
    from run.observability.metrics_log import read_metrics

    return read_metrics(tmp_path / "run")[-1]
