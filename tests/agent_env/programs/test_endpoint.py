"""The agent-program endpoint with the real `openai` SDK as the program: a real tiny model on the HF engine,
a real byte tokenizer with a ChatML template, a real HTTP server on loopback. What is recorded is exactly
what was sampled, each token after the context the model read: a call that extends the conversation
continues the episode's segment, a call with an edited history starts a new one. Bad requests get errors
the SDK raises, and counts; no other episode's record changes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai", reason="these tests drive the endpoint with the openai SDK")

from agent_env.programs.endpoint import EndpointSettings, ProgramEndpoint  # noqa: E402
from agent_env.prompts import render_prompt_ids  # noqa: E402
from rollout.engines.hf_engine import HFEngine  # noqa: E402
from rollout.fakes import ScriptedEngine, ScriptedReply  # noqa: E402
from rollout.settings import HFEngineSettings  # noqa: E402
from rollout.tiny import TinyModelSpec, build_byte_tokenizer, make_tiny_model_dir, teach_tiny_model  # noqa: E402
from rollout.types import GenerationRequest, GenerationResult  # noqa: E402

SYSTEM, QUESTION, ANSWER = "Be brief.", "Say hello.", "Hello world."
TEMPLATE = Path(__file__).resolve().parents[3] / "examples" / "mcp_tool" / "hermes_tools.jinja"


def _tokenizer() -> Any:
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = TEMPLATE.read_text()
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model that answers the first question with ANSWER and the end of its turn."""
    out = tmp_path_factory.mktemp("hello-model")
    make_tiny_model_dir(out, TinyModelSpec(hidden_size=96, intermediate_size=192, seed=1))
    tokenizer = _tokenizer()
    prompt = render_prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": QUESTION}])
    completion = [*tokenizer.encode(ANSWER, add_special_tokens=False), tokenizer.eos_token_id]
    teach_tiny_model(out, [(prompt, completion)], steps=400, lr=3e-3, stop_loss=1e-3)
    return out


class Recording:
    """Wraps an engine: every result it returned, in order."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.results, self.contexts = engine, [], []

    @property
    def version(self) -> int:
        return self.engine.version

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await self.engine.generate(request)
        self.contexts.append(list(request.prompt_token_ids))
        self.results.append(result)
        return result


SETTINGS = EndpointSettings(max_total_tokens=4000, max_new_tokens_per_call=16, temperature=0.0)


async def test_a_conversation_is_one_segment_and_an_edited_history_starts_another(model_dir: Path) -> None:
    tokenizer = _tokenizer()
    async with HFEngine(model_dir, HFEngineSettings()) as hf:
        engine = Recording(hf)
        async with ProgramEndpoint(engine, tokenizer, SETTINGS) as endpoint:
            client = openai.AsyncOpenAI(base_url=endpoint.open("ep0"), api_key="unused")
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
            first = await client.chat.completions.create(model="policy", messages=messages, temperature=1.7)
            assert first.choices[0].message.content == ANSWER  # greedy, whatever the request asks
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "Again."}]
            await client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            edited = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Something else."}]
            await client.chat.completions.create(model="policy", messages=edited)
            record = endpoint.close("ep0")
            # a stop string ends the sample and is left out of the reply (as OpenAI's does), not the record
            client = openai.AsyncOpenAI(base_url=endpoint.open("ep1"), api_key="unused")
            stopped = await client.chat.completions.create(model="policy", messages=messages[:2],
                                                           stop=["wor"])
            assert stopped.choices[0].message.content == "Hello "
            assert tokenizer.decode(list(engine.results[-1].token_ids)) == "Hello wor"
            endpoint.close("ep1")
    trajectory = record.build("ep0", "g0", reward=1.0)
    assert trajectory is not None and len(trajectory.segment_starts) == 2 and record.calls == 3
    (c1, c2, c3, _), (r1, r2, r3, _) = engine.contexts, engine.results
    assert len(r2.token_ids) <= 4  # the request's max_tokens lowers the budget
    assert c2[:len(c1) + len(r1.token_ids)] == c1 + list(r1.token_ids)  # the conversation extends
    ids, mask = list(trajectory.token_ids), list(trajectory.loss_mask)
    start = trajectory.segment_starts[1]
    assert ids[:start] == c2 + list(r2.token_ids) and ids[start:] == c3 + list(r3.token_ids)
    sampled = [t for t, m in zip(ids, mask, strict=True) if m]
    assert sampled == [t for r in (r1, r2, r3) for t in r.token_ids]  # exactly what was sampled, once
    logprobs = [lp for lp, m in zip(trajectory.behavior_logprobs, mask, strict=True) if m]
    assert logprobs == [lp for r in (r1, r2, r3) for lp in r.logprobs]


async def test_a_program_continues_its_own_assistant_turn_in_one_segment(model_dir: Path) -> None:
    """vLLM's extensions a tool-in-the-turn loop needs: `include_stop_str_in_output` returns the stop string
    with the text, and `continue_final_message` (with `add_generation_prompt: false`) continues the last
    assistant message instead of opening a turn — so a program that sends back exactly what it got continues
    the segment: the second context is the first plus the tokens sampled, nothing trained twice."""
    tokenizer = _tokenizer()
    async with HFEngine(model_dir, HFEngineSettings()) as hf:
        engine = Recording(hf)
        async with ProgramEndpoint(engine, tokenizer, SETTINGS) as endpoint:
            client = openai.AsyncOpenAI(base_url=endpoint.open("ep"), api_key="unused", max_retries=0)
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": QUESTION}]
            first = await client.chat.completions.create(
                model="policy", messages=messages, stop=["wor"],
                extra_body={"include_stop_str_in_output": True})
            assert first.choices[0].message.content == "Hello wor"
            messages.append({"role": "assistant", "content": "Hello wor"})
            second = await client.chat.completions.create(
                model="policy", messages=messages,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
            assert second.choices[0].message.content == "ld."
            for extra, why in (({"continue_final_message": True}, "add_generation_prompt: false"),
                               ({"add_generation_prompt": False}, "set continue_final_message"),
                               ({"include_stop_str_in_output": "yes"}, "must be a boolean")):
                with pytest.raises(openai.BadRequestError, match=why):
                    await client.chat.completions.create(model="policy", messages=messages, extra_body=extra)
            with pytest.raises(openai.BadRequestError, match="must be the assistant's, not 'user'"):
                await client.chat.completions.create(
                    model="policy", messages=messages[:2],
                    extra_body={"continue_final_message": True, "add_generation_prompt": False})
            record = endpoint.close("ep")
    assert record.calls == 2 and endpoint.counts.malformed == 4
    (c1, c2), (r1, r2) = engine.contexts, engine.results
    assert c2 == c1 + list(r1.token_ids)  # the open turn continued: no end of turn, no new one
    trajectory = record.build("ep", "g", reward=1.0)
    assert trajectory is not None and len(trajectory.segment_starts) == 1
    assert list(trajectory.token_ids) == c2 + list(r2.token_ids)


def _scripted(text: str) -> ScriptedEngine:
    tokenizer = build_byte_tokenizer()
    ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    return ScriptedEngine(lambda request: ScriptedReply(ids), eos_token_id=tokenizer.eos_token_id)


async def test_tool_calls_come_back_in_the_openai_format() -> None:
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": schema}}]
    settings = EndpointSettings(max_total_tokens=4000, max_new_tokens_per_call=200)
    engine = _scripted("Adding. " + call)
    async with engine, ProgramEndpoint(engine, _tokenizer(), settings) as endpoint:
        client = openai.AsyncOpenAI(base_url=endpoint.open("ep"), api_key="unused")
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "2+3?"}], tools=tools)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
        (made,) = choice.message.tool_calls
        assert (made.function.name, made.function.arguments) == ("add", '{"a": 2, "b": 3}')
        # the program sends the call back with its result: the arguments string is read for the template
        follow = [{"role": "user", "content": "2+3?"}, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": made.id, "content": "5"}]
        follow[1]["content"] = choice.message.content
        await client.chat.completions.create(model="policy", messages=follow, tools=tools)
        assert endpoint.close("ep").calls == 2


async def test_bad_requests_get_errors_and_counts_and_touch_no_other_episode() -> None:
    settings = EndpointSettings(max_total_tokens=150, max_new_tokens_per_call=8)
    async with _scripted("ok") as engine, ProgramEndpoint(engine, _tokenizer(), settings) as endpoint:
        good = openai.AsyncOpenAI(base_url=endpoint.open("good"), api_key="unused", max_retries=0)
        assert [model.id async for model in good.models.list()] == ["vcpo-policy"]
        await good.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        stranger = openai.AsyncOpenAI(base_url=f"{endpoint.url}/sessions/nobody/v1", api_key="x",
                                      max_retries=0)
        with pytest.raises(openai.NotFoundError, match="no session 'nobody'"):
            await stranger.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="messages"):
            await good.chat.completions.create(model="p", messages=[])
        with pytest.raises(openai.BadRequestError, match="budget is 150"):
            await good.chat.completions.create(model="p", messages=[{"role": "user", "content": "x" * 200}])
        late = openai.AsyncOpenAI(base_url=endpoint.open("late"), api_key="unused", max_retries=0)
        endpoint.close("late")
        with pytest.raises(openai.ConflictError, match="has ended"):
            await late.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
        record = endpoint.close("good")
    assert record.calls == 1  # the refused requests recorded nothing
    assert endpoint.counts.as_dict() == {"unknown_session": 1, "ended_session": 1, "malformed": 1,
                                         "over_budget": 1, "engine_errors": 0}


def _program_run(tmp_path: Path, tiny_model_dir: Path, steps: int) -> Path:
    import yaml

    from tests.run.train.test_train_e2e import _write_configs

    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=steps, tool=False)
    task_file = tmp_path / "task.yaml"
    task = yaml.safe_load(task_file.read_text())
    task["loop"].update(program="tests.agent_env.programs.sdk_agent:two_calls", program_timeout_s=120,
                        max_total_tokens=400)
    task_file.write_text(yaml.safe_dump(task))
    return config


def test_vcpo_train_runs_episodes_of_an_sdk_program(tmp_path: Path, tiny_model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`loop.program` in a real `vcpo train`: every episode is one run of the program (two calls through
    the endpoint); one run crashes — its group is dropped, counted and replaced, and the run goes on."""
    import json

    from run.observability.metrics_log import read_metrics
    from tests.agent_env.programs.sdk_agent import CRASH_MARKER
    from tests.run.train.test_train_e2e import _vcpo

    monkeypatch.setenv(CRASH_MARKER, str(tmp_path / "crashed-once"))
    config = _program_run(tmp_path, tiny_model_dir, steps=2)
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2]
    assert records[-1]["program/crashed"] == 1 and records[-1]["rollout/failed_groups"] == 1
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    episodes = [json.loads(line) for line in lines]
    assert len(episodes) == 2 * 2 * 4 and all(e["turns"] == 2 for e in episodes)  # two calls each


def test_the_held_out_set_of_a_program_task_is_evaluated_as_runs_of_the_program(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    import json

    from tests.run.train.test_train_e2e import _vcpo

    config = _program_run(tmp_path, tiny_model_dir, steps=2)
    task_file = tmp_path / "task.yaml"
    task_file.write_text(task_file.read_text() + "heldout_dataset: {type: generator, name: countdown, "
                         "num_samples: 16, seed: 1}\n")
    result = _vcpo("train", str(config), "--no-progress", "trainer.eval_every=2", "trainer.eval_samples=2")
    assert result.returncode == 0, result.stderr[-3000:]
    for version in (0, 2):  # two calls of the program each, at the held-out sampling; resumable files
        path = tmp_path / "run" / "eval" / f"version_{version:06d}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()][1:]
        assert len(rows) == 2
        assert all(row["response_tokens"] > 0 and "program_error" not in row for row in rows)


def test_a_program_that_does_not_import_is_refused_when_the_task_loads(tmp_path: Path) -> None:
    from configs.loader import ConfigError
    from run.train.wiring import load_task

    with pytest.raises(ConfigError) as info:
        load_task("configs/tasks/countdown.yaml", ["loop.program=tests.agent_env.programs.sdk_agent:nope"])
    assert "loop.program='tests.agent_env.programs.sdk_agent:nope'" in str(info.value)
    assert "has no async function 'nope'" in str(info.value)


async def test_a_failed_run_of_the_program_is_a_wrong_sample_of_the_evaluation(tmp_path: Path) -> None:
    """An evaluation never dies of the user's program: its failed run is scored 0 with the reason kept."""
    import json

    from agent_env.evaluation.evaluate import evaluate
    from agent_env.loop import EpisodeSettings
    from agent_env.samples import Sample

    class Crashing:
        async def episode(self, *args: Any) -> Any:
            raise RuntimeError("the program fell over")

    out = tmp_path / "eval.jsonl"
    sample = Sample(sample_id="a", fields={"q": "?"}, answer="1")
    summary = await evaluate(None, _tokenizer(), None, system=None, user="{q}",  # type: ignore[arg-type]
                             samples=[sample], reward=lambda text, sample: None, settings=EpisodeSettings(),
                             k=1, out_path=out, meta={"t": 1}, program=Crashing())
    (row,) = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert (row["reward"], row["is_correct"], row["program_error"]) == (0.0, False, "the program fell over")
    assert summary["no_answer_frac"] == 1.0
