"""examples/openai_loop: the main job's agent written as a plain `openai`-SDK loop is, token for token, the
episode vcpo's built-in loop runs — same contexts, same sampled tokens, the same tool output in the same
place, one segment. The model is the memorised tiny agent (it writes print(6*7), the real bubblewrap sandbox
answers 42, the next turn boxes 42); the SDK, the endpoint's HTTP server and the engine are real."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the example is an openai-SDK program")

from agent_env.loop import EpisodeSettings, run_episode
from agent_env.programs.endpoint import EndpointSettings, ProgramEndpoint
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from configs.task_schema import TaskConfig
from examples.openai_loop import agent
from rollout.engines.hf_engine import HFEngine
from rollout.settings import HFEngineSettings
from rollout.tiny import build_byte_tokenizer
from tests.agent_env import memorised
from tools.registry import build_tool

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return memorised.make_memorised_model_dir(tmp_path_factory.mktemp("memorised"))


def _memorised_task() -> TaskConfig:
    """The example's Countdown task with the memorised model's question in place of Countdown's prompt."""
    prompt = agent.TASK.prompt.model_copy(update={"system": memorised.SYSTEM, "user": "{question}"})
    return agent.TASK.model_copy(update={"prompt": prompt})


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_the_sdk_loop_runs_the_built_in_loops_episode_token_for_token(
        memorised_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent, "TASK", _memorised_task())
    tokenizer = build_byte_tokenizer()
    sample = Sample(sample_id="q", fields={"question": memorised.QUESTION}, answer="42")
    settings = EpisodeSettings(max_turns=agent.MAX_TURNS, max_total_tokens=400, temperature=0.0)
    async with HFEngine(memorised_dir, HFEngineSettings()) as engine:
        async with ProgramEndpoint(engine, tokenizer, EndpointSettings.of_episode(settings)) as endpoint:
            returned = await agent.solve(endpoint.open("ep"), sample)
            record = endpoint.close("ep")
        async with build_tool({"type": "python", "timeout_s": 10, "warm_pool_size": 0}) as tool:
            prompt = render_prompt_ids(tokenizer, render_messages(memorised.SYSTEM, "{question}", sample))
            built_in = await run_episode(engine, tokenizer, prompt, settings, lambda text: _Unscored(),
                                         tool=tool, trajectory_id="b", group_id="g")
    assert returned == memorised.episode_text()  # its two turns and the sandbox's real output between
    trajectory = record.build("ep", "g", reward=1.0)
    assert trajectory is not None and len(trajectory.segment_starts) == 1 and record.calls == 2
    reference = built_in.trajectory
    assert list(trajectory.token_ids) == list(reference.token_ids)
    assert list(trajectory.loss_mask) == list(reference.loss_mask)  # the output is context, not trained


class _Unscored:
    score = 0.0


def test_the_example_task_runs_this_program_on_the_default_runs_budget() -> None:
    from configs.loader import load_config
    from configs.schema import RunConfig
    from run.train.wiring import load_task

    config = load_config(ROOT / "examples" / "openai_loop" / "run.yaml", RunConfig)
    task, _ = load_task(ROOT / config.task, config.task_overrides)
    assert task.loop.program == "examples.openai_loop.agent:solve"
    assert (task.loop.max_turns, task.loop.max_total_tokens) == (agent.MAX_TURNS, 640)
    assert config.warm_start.enabled and config.seed == 0 and config.trainer.total_steps == 10
