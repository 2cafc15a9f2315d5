"""The SGLang adapter against a local STAND-IN server (tests/rollout/standin_servers.py — not SGLang)
implementing SGLang's documented request/response shapes over our HF engine on the tiny model, plus a GPU test
against real SGLang (skipped without CUDA / the sglang package)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from rollout.engines.hf_engine import HFEngine
from rollout.engines.sglang_engine import SGLangEngine
from rollout.errors import EngineOOM, EngineUnavailable, MalformedResponse, WeightLoadError
from rollout.settings import SGLangEngineSettings
from tests.rollout import engine_spec as spec
from tests.rollout.standin_servers import SGLangStandin, free_port, serve

ATOL = 1e-4
PROMPT = [256, 104, 105, 33, 10]  # <|im_start|> "hi!\n" in the byte tokenizer


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest_asyncio.fixture
async def standin(tiny_model_dir: Path) -> AsyncIterator[tuple[str, SGLangStandin]]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with HFEngine(tiny_model_dir) as engine:
        server = SGLangStandin(engine, tokenizer.decode)
        async with serve(server.app) as url:
            yield url, server
        await server.close()


def _adapter(url: str, model_dir: Path, tmp_path: Path, **settings: object) -> SGLangEngine:
    return SGLangEngine(
        SGLangEngineSettings(base_url=url, weights_dir=str(tmp_path / "weights"), **settings), model_dir
    )


async def test_generate_sends_input_ids_and_returns_real_logprobs(
    standin: tuple[str, SGLangStandin], tiny_model_dir: Path, tiny_reference: PreTrainedModel, tmp_path: Path
) -> None:
    url, server = standin
    async with _adapter(url, tiny_model_dir, tmp_path) as engine:
        results = await spec.check_logprobs_match_forward(
            engine, tiny_reference, [PROMPT, PROMPT[:2]], atol=ATOL, max_new_tokens=12
        )
        stopped = await spec.bounded(
            engine.generate(
                spec.request(
                    PROMPT,
                    max_new_tokens=12,
                    seed=0,
                    use_eos=False,
                    stop_token_ids=(results[0].token_ids[4],),
                )
            )
        )
    _, body = next(call for call in server.calls if call[0] == "/generate")
    assert body["input_ids"] == PROMPT or body["input_ids"] == PROMPT[:2]
    assert (body["return_logprob"], body["logprob_start_len"], body["stream"]) == (True, -1, False)
    assert body["sampling_params"]["top_k"] == -1 and body["sampling_params"]["ignore_eos"] is True
    first = results[0].token_ids.index(results[0].token_ids[4])
    assert stopped.token_ids == results[0].token_ids[: first + 1] and stopped.finish_reason == "stop"


async def test_abort_pause_and_flush_use_the_documented_endpoints(
    standin: tuple[str, SGLangStandin], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, server = standin
    async with _adapter(url, tiny_model_dir, tmp_path) as engine:
        await spec.check_abort_and_cancel_leave_others_running(engine, PROMPT)
        await spec.check_pause_holds_progress_until_resume(engine, PROMPT)
        assert await engine.flush_cache() is True
        long_request = spec.request(PROMPT, max_new_tokens=3000, use_eos=False)
        running = asyncio.create_task(engine.generate(long_request))
        await asyncio.sleep(0.3)
        assert await engine.flush_cache() is False  # SGLang refuses (400) while requests run
        await engine.abort(long_request.request_id)
        await spec.bounded(running)
    paths = [path for path, _ in server.calls]
    assert {"/abort_request", "/pause_generation", "/continue_generation", "/flush_cache"} <= set(paths)
    assert {"mode": "in_place"} in [body for path, body in server.calls if path == "/pause_generation"]


@pytest.mark.parametrize("weight_sync", ["disk", "tensor"])
async def test_weight_update_interrupts_and_continues_with_exact_versions(
    standin: tuple[str, SGLangStandin],
    tiny_model_dir: Path,
    tiny_reference: PreTrainedModel,
    tmp_path: Path,
    weight_sync: str,
) -> None:
    url, server = standin
    async with _adapter(url, tiny_model_dir, tmp_path, weight_sync=weight_sync) as engine:
        await spec.check_weight_load_mid_generation(
            engine, tiny_reference, spec.perturbed_copy(tiny_reference, 1.5), PROMPT, atol=ATOL
        )
    update = next(body for path, body in server.calls if path.startswith("/update_weights_from_"))
    assert (update["weight_version"], update["flush_cache"]) == ("1", True)
    if weight_sync == "disk":
        assert update["model_path"] == str(tmp_path / "weights" / "v1")
    assert {"mode": "abort"} in [body for path, body in server.calls if path == "/pause_generation"]


async def test_distributed_weight_update_broadcasts_to_the_server(
    standin: tuple[str, SGLangStandin], tiny_model_dir: Path, tiny_reference: PreTrainedModel, tmp_path: Path
) -> None:
    url, server = standin
    new_model = spec.perturbed_copy(tiny_reference, 1.5)
    async with _adapter(url, tiny_model_dir, tmp_path, weight_sync="distributed") as engine:
        await spec.bounded(
            engine.init_weights_update_group("127.0.0.1", free_port(), world_size=2, backend="gloo"), 90
        )
        await spec.bounded(engine.load_weights(list(new_model.state_dict().items()), 1), 90)
        await spec.check_logprobs_match_forward(engine, new_model, [PROMPT], atol=ATOL, max_new_tokens=8)
    init = next(body for path, body in server.calls if path == "/init_weights_update_group")
    assert (init["rank_offset"], init["world_size"], init["backend"]) == (1, 2, "gloo")
    update = next(body for path, body in server.calls if path == "/update_weights_from_distributed")
    assert update["names"][0] in new_model.state_dict() and update["dtypes"][0] == "float32"


async def test_bad_weight_names_are_refused_before_any_request(
    standin: tuple[str, SGLangStandin], tiny_model_dir: Path, tmp_path: Path
) -> None:
    url, server = standin
    async with _adapter(url, tiny_model_dir, tmp_path) as engine:
        with pytest.raises(WeightLoadError, match="unknown names"):
            await engine.load_weights([("model.no_such.weight", torch.zeros(1))], 1)
    assert not [path for path, _ in server.calls if path.startswith("/update_weights")]


async def test_server_down_is_a_typed_error_without_a_hang(tmp_path: Path) -> None:
    started = time.perf_counter()
    with pytest.raises(EngineUnavailable, match="cannot reach the server"):
        await SGLangEngine(
            SGLangEngineSettings(
                base_url=f"http://127.0.0.1:{free_port()}", weight_sync="tensor", connect_timeout_s=2
            )
        ).start()
    assert time.perf_counter() - started < 10


async def test_malformed_and_failed_responses_are_typed_errors(tmp_path: Path) -> None:
    broken = FastAPI()
    broken.get("/health")(lambda: "")
    broken.post("/generate")(lambda: {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop"}}})
    broken.post("/flush_cache")(lambda: JSONResponse({"error": "CUDA out of memory"}, status_code=500))
    async with (
        serve(broken) as url,
        SGLangEngine(SGLangEngineSettings(base_url=url, weight_sync="tensor")) as engine,
    ):
        with pytest.raises(MalformedResponse, match="do not match output_ids"):
            await engine.generate(spec.request(PROMPT))
        with pytest.raises(EngineOOM, match="out of memory"):
            await engine.flush_cache()


@pytest.mark.gpu
async def test_real_sglang_server_generates_and_reloads(
    default_model_dir: Path, reference_model: PreTrainedModel, chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    pytest.importorskip("sglang", reason="the sglang package is not installed")
    from rollout.engines.sglang_launcher import SGLangServer
    from rollout.settings import SGLangLaunchSettings

    launch = SGLangLaunchSettings(model_path=str(default_model_dir), port=free_port(), dtype="float32")
    async with SGLangServer(launch, log_path=tmp_path / "sglang.log") as url:
        settings = SGLangEngineSettings(base_url=url, weights_dir=str(tmp_path / "weights"))
        async with SGLangEngine(settings, default_model_dir) as engine:
            await spec.check_logprobs_match_forward(engine, reference_model, chat_prompts, atol=2e-3)
            await spec.check_weight_load_mid_generation(
                engine, reference_model, spec.perturbed_copy(reference_model), chat_prompts[1], atol=2e-3
            )
