"""The OpenAI-compatible adapter against a local STAND-IN /v1/completions server (standin_servers.py —
not OpenAI, not vLLM) over our HF engine on the tiny model, and (slow) against vLLM's real server."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
import yaml
from fastapi import FastAPI
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rollout.engines.hf_engine import HFEngine
from rollout.engines.http_client import server_message
from rollout.engines.openai_engine import OpenAIEngine, ServedModel, served_model_ids, served_models
from rollout.engines.sglang_launcher import SGLangServer
from rollout.errors import (
    EngineUnavailable,
    HTTPFailure,
    InvalidRequest,
    MalformedResponse,
    UnsupportedOperation,
)
from rollout.settings import OpenAIEngineSettings, SGLangLaunchSettings
from tests.rollout import engine_spec as spec
from tests.rollout.standin_servers import REPO_ROOT, OpenAIStandin, free_port, serve

PROMPT = [256, 104, 105, 33, 10]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest_asyncio.fixture
async def standin(
    tiny_model_dir: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> AsyncIterator[tuple[str, OpenAIStandin]]:
    async with HFEngine(tiny_model_dir) as engine:
        server = OpenAIStandin(
            engine, tiny_tokenizer.decode, lambda text: tiny_tokenizer.encode(text, add_special_tokens=False)
        )
        server.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": "tiny"}]})
        async with serve(server.app) as url:
            yield f"{url}/v1", server


async def test_token_id_prompts_return_token_ids_and_real_logprobs(
    standin: tuple[str, OpenAIStandin], tiny_model_dir: Path
) -> None:
    url, server = standin
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    async with OpenAIEngine(OpenAIEngineSettings(base_url=url, model="tiny")) as engine:
        result = await spec.bounded(
            engine.generate(spec.request(PROMPT, max_new_tokens=10, seed=1, use_eos=False, temperature=0.9))
        )
        with pytest.raises(UnsupportedOperation, match="weights are fixed"):
            await engine.load_weights([], 1)
    (expected,) = spec.reference_logprobs(reference, [PROMPT], [result.token_ids], 0.9)
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)
    assert (result.finish_reason, len(result.token_ids), result.versions) == ("length", 10, (0,) * 10)
    body = server.calls[-1]
    assert (body["prompt"], body["return_token_ids"], body["logprobs"], body["ignore_eos"]) == (
        PROMPT,
        True,
        0,
        True,
    )


async def test_text_prompts_need_a_tokenizer_and_are_decoded(
    standin: tuple[str, OpenAIStandin], tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    url, server = standin
    with pytest.raises(ValueError, match="pass tokenizer="):
        OpenAIEngine(OpenAIEngineSettings(base_url=url, model="tiny", prompt_format="text"))
    settings = OpenAIEngineSettings(base_url=url, model="tiny", prompt_format="text")
    async with OpenAIEngine(settings, tiny_tokenizer) as engine:
        result = await spec.bounded(engine.generate(spec.request(PROMPT, max_new_tokens=4, use_eos=False)))
    assert (
        server.calls[-1]["prompt"] == tiny_tokenizer.decode(PROMPT)
        and "return_token_ids" not in server.calls[-1]
    )
    # random bytes re-tokenise into a different count (replacement characters): then the logprobs, which
    # belong to the server's 4 tokens, are dropped rather than misaligned
    assert result.has_logprobs == (len(result.token_ids) == 4)


async def test_abort_returns_at_once(standin: tuple[str, OpenAIStandin]) -> None:
    url, server = standin
    async with OpenAIEngine(OpenAIEngineSettings(base_url=url, model="tiny")) as engine:
        request = spec.request(PROMPT, max_new_tokens=3000, use_eos=False)
        task = asyncio.create_task(engine.generate(request))
        while not server.calls:  # the request reached the server
            await asyncio.sleep(0.01)
        await engine.abort(request.request_id)
        result = await spec.bounded(task, 5)
    assert result.finish_reason == "abort" and result.token_ids == ()


async def test_missing_logprobs_and_token_ids(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    bare = FastAPI()
    bare.get("/v1/models")(lambda: {"data": []})
    bare.post("/v1/completions")(lambda: {"choices": [{"text": "hi!", "finish_reason": "stop"}]})
    async with serve(bare) as url:
        async with OpenAIEngine(OpenAIEngineSettings(base_url=f"{url}/v1", model="m")) as engine:
            with pytest.raises(MalformedResponse, match="no token_ids; pass a tokenizer"):
                await engine.generate(spec.request(PROMPT))
        async with OpenAIEngine(
            OpenAIEngineSettings(base_url=f"{url}/v1", model="m"), tiny_tokenizer
        ) as engine:
            result = await engine.generate(spec.request(PROMPT))
    assert result.token_ids == tuple(tiny_tokenizer.encode("hi!", add_special_tokens=False))
    assert not result.has_logprobs and result.finish_reason == "stop"


async def test_server_down_is_a_typed_error_without_a_hang() -> None:
    started = time.perf_counter()
    with pytest.raises(EngineUnavailable, match="cannot reach the server"):
        await OpenAIEngine(
            OpenAIEngineSettings(
                base_url=f"http://127.0.0.1:{free_port()}/v1", model="m", connect_timeout_s=2
            )
        ).start()
    assert time.perf_counter() - started < 10


async def test_http_errors_carry_the_url_status_and_the_servers_own_message(
    tiny_model_dir: Path, tiny_tokenizer: PreTrainedTokenizerBase
) -> None:
    """A name the server does not serve: vLLM's 404 (stand-in, same body). The error's `http` is the one
    line a user sees; the verbatim body stays in engine_message."""
    async with HFEngine(tiny_model_dir) as hf:
        server = OpenAIStandin(hf, tiny_tokenizer.decode, tiny_tokenizer.encode, served=("smol",))
        async with serve(server.app) as url:
            assert await served_model_ids(f"{url}/v1/") == ["smol"]
            async with OpenAIEngine(OpenAIEngineSettings(base_url=f"{url}/v1", model="nope")) as engine:
                with pytest.raises(InvalidRequest) as caught:
                    await engine.generate(spec.request(PROMPT))
    assert caught.value.http == HTTPFailure(
        "POST", f"{url}/v1/completions", 404, "The model `nope` does not exist."
    )
    assert str(caught.value.http) == (
        f"POST {url}/v1/completions answered HTTP 404: The model `nope` does not exist."
    )
    assert '"type":"NotFoundError"' in caught.value.engine_message


def test_server_message_is_one_line() -> None:
    assert server_message('{"error": {"message": "no such\\nmodel", "code": 404}}') == "no such model"
    assert server_message('{"error": {"message": "raw\nnewline"}}') == "raw newline"
    assert server_message('{"object": "error", "message": "too long"}') == "too long"
    assert server_message('{"error": "bad"}') == "bad"
    assert server_message('{"detail": "Not Found"}') == "Not Found"
    assert server_message('{"detail": [{"msg": "x"}]}') == '[{"msg": "x"}]'
    assert server_message("<html>\n<b>502</b>\n</html>") == "<html> <b>502</b> </html>"
    assert server_message("") == ""
    assert server_message("x" * 600) == "x" * 499 + "…"


async def test_served_model_ids_needs_a_model_list() -> None:
    odd = FastAPI()
    odd.get("/v1/models")(lambda: {"models": ["m"]})
    async with serve(odd) as url:
        with pytest.raises(MalformedResponse, match="no data"):
            await served_model_ids(f"{url}/v1")


async def test_served_models_reads_each_models_context_length() -> None:
    """vLLM lists `max_model_len` per model; anything but a positive whole number is no length."""
    listing = FastAPI()
    listing.get("/v1/models")(lambda: {"object": "list", "data": [
        {"id": "a", "max_model_len": 512}, {"id": "b"}, {"id": "c", "max_model_len": True},
        {"id": "d", "max_model_len": "4096"}, {"id": "e", "max_model_len": 0}]})
    async with serve(listing) as url:
        served = await served_models(f"{url}/v1")
    assert served == [ServedModel("a", 512), ServedModel("b"), ServedModel("c"), ServedModel("d"),
                      ServedModel("e")]


@pytest.mark.slow
@pytest.mark.default_model
@pytest.mark.timeout(900)
async def test_real_vllm_openai_server(
    default_model_dir: Path,
    reference_model: PreTrainedModel,
    chat_prompts: list[list[int]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own OpenAI server (ready in ~30 s on CPU), started with the launcher's process handling.
    Then `vcpo eval` against it, as a user runs it: the server knows the model as 'smollm2', the
    tokenizer comes from the model's directory (a path the server does not know)."""
    pytest.importorskip("vllm")
    port = free_port()
    flags = (
        f"--model {default_model_dir} --served-model-name smollm2 --host 127.0.0.1 --port {port} "
        "--dtype float32 --enforce-eager --max-model-len 1024 --logprobs-mode processed_logprobs"
    )
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags.split()]
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    launch = SGLangLaunchSettings(model_path=str(default_model_dir), port=port, startup_timeout_s=300)
    settings = OpenAIEngineSettings(base_url=f"http://127.0.0.1:{port}/v1", model="smollm2")
    async with SGLangServer(launch, tmp_path / "vllm.log", command=command), OpenAIEngine(settings) as engine:
        requests = [spec.request(p, max_new_tokens=16, seed=i, temperature=0.7, use_eos=False)
                    for i, p in enumerate(chat_prompts)]  # fmt: skip
        results = await spec.bounded(asyncio.gather(*(engine.generate(r) for r in requests)))
        evals = await asyncio.to_thread(_vcpo_eval_runs, tmp_path, default_model_dir, settings.base_url)
    detected, named, unknown = evals
    for done, out in ((detected, "detected"), (named, "named")):
        assert done.returncode == 0, done.stderr[-3000:]
        meta, *samples = (json.loads(line) for line in (tmp_path / f"{out}.jsonl").read_text().splitlines())
        assert meta["meta"]["served_model"] == "smollm2" and len(samples) == 2
        assert all(sample["response_tokens"] > 0 for sample in samples)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr, unknown.stderr[-3000:]
    assert unknown.stderr.startswith(f"error: POST {settings.base_url}/completions answered HTTP 404: ")
    assert unknown.stderr.count("\n") == 1 and "nope" in unknown.stderr
    expected = spec.reference_logprobs(reference_model, chat_prompts, [r.token_ids for r in results], 0.7)
    for result, reference in zip(results, expected, strict=True):
        torch.testing.assert_close(torch.tensor(result.logprobs), reference, atol=5e-4, rtol=0)


def _vcpo_eval_runs(tmp_path: Path, tokenizer_dir: Path, url: str) -> list[subprocess.CompletedProcess]:
    """`vcpo eval` of a tool-less two-sample task against the server at `url` (serving 'smollm2'), with
    `--model` the tokenizer's directory: without --served-model (read from /models), with it, and with
    a name the server does not serve."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": "What is 2+3?", "answer": "5"}) + "\n")
    task = {"name": "add", "dataset": {"type": "file", "path": "data.jsonl"},
            "fields": {"answer": "answer", "template_fields": {"question": "question"}},
            "prompt": {"user": "{question} Put the final answer in \\boxed{{}}."},
            "loop": {"max_total_tokens": 256, "max_new_tokens_per_turn": 32},
            "reward": {"type": "math_verify"}, "eval": {"k": 2, "max_turns": 0, "temperature": 0.7}}
    (tmp_path / "task.yaml").write_text(yaml.safe_dump(task))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    common = [sys.executable, "-m", "cli", "eval", str(tmp_path / "task.yaml"), "--backend", "openai",
              "--url", url, "--model", str(tokenizer_dir), "--no-progress"]
    runs = [[*common, "--out", str(tmp_path / "detected.jsonl")],
            [*common, "--served-model", "smollm2", "--out", str(tmp_path / "named.jsonl")],
            [*common, "--served-model", "nope", "--out", str(tmp_path / "unknown.jsonl")]]
    return [subprocess.run(run, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
            for run in runs]
