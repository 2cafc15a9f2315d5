"""STAND-IN SERVERS FOR TESTS — NOT SGLang, NOT vLLM, NOT OpenAI.

SGLang cannot run on this CPU machine, and no OpenAI-compatible server is reachable, so the HTTP
adapters are tested against small local servers that implement exactly the request/response
shapes of SGLang's documented native API and the OpenAI /v1/completions API, on 127.0.0.1 only.
They are backed by our HF engine on a real (tiny) model, so token ids and logprobs are real.
What they prove: the adapters speak those shapes, map errors, and drive the control flow. What
they cannot prove: that real SGLang/vLLM answer the same way — the GPU/slow-marked tests do that.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import pickle
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from safetensors.torch import load_file

from rollout.engines.hf_engine import HFEngine
from rollout.types import GenerationRequest, SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def serve(app: FastAPI) -> AsyncIterator[str]:
    """Serve `app` on 127.0.0.1 in the running event loop; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


class SGLangStandin:
    """STAND-IN for SGLang's HTTP API (documented shapes), backed by an HFEngine; records every request."""

    def __init__(self, engine: HFEngine, decode: Callable[[list[int]], str]) -> None:
        self.engine = engine
        self.decode = decode
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._running: set[str] = set()
        self._receiver: asyncio.subprocess.Process | None = None
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI(title="SGLang STAND-IN (tests only)")
        app.get("/health")(lambda: PlainTextResponse(""))
        app.post("/generate")(self.generate)
        app.post("/pause_generation")(self.pause_generation)
        app.post("/continue_generation")(self.continue_generation)
        app.post("/abort_request")(self.abort_request)
        app.api_route("/flush_cache", methods=["GET", "POST"])(self.flush_cache)
        app.post("/update_weights_from_disk")(self.update_weights_from_disk)
        app.post("/update_weights_from_tensor")(self.update_weights_from_tensor)
        app.post("/init_weights_update_group")(self.init_weights_update_group)
        app.post("/update_weights_from_distributed")(self.update_weights_from_distributed)
        return app

    async def _body(self, request: Request) -> dict[str, Any]:
        body = await request.json() if await request.body() else {}
        self.calls.append((request.url.path, body))
        return body

    async def generate(self, request: Request) -> Any:
        body = await self._body(request)
        if body.get("stream"):
            return JSONResponse({"error": "the stand-in does not stream"}, status_code=400)
        params = body.get("sampling_params", {})
        rid = body.get("rid") or uuid.uuid4().hex
        sampling = SamplingParams(
            max_new_tokens=params.get("max_new_tokens", 128),
            temperature=params.get("temperature", 1.0),
            top_p=params.get("top_p", 1.0),
            top_k=max(params.get("top_k", -1), 0),
            stop=tuple(params.get("stop", ())),
            stop_token_ids=tuple(params.get("stop_token_ids", ())),
            use_eos=not params.get("ignore_eos", False),
            seed=params.get("sampling_seed"),
        )
        self._running.add(rid)
        try:
            result = await self.engine.generate(
                GenerationRequest(request_id=rid, prompt_token_ids=body["input_ids"], sampling=sampling)
            )
        finally:
            self._running.discard(rid)
        finish: dict[str, Any] = {"type": result.finish_reason}
        if result.finish_reason == "stop":
            finish["matched"] = result.stop_reason
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(body["input_ids"]),
            "completion_tokens": len(result.token_ids),
            "weight_version": str(result.version_end),
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(result.logprobs, result.token_ids, strict=True)
            ]
        return {
            "text": self.decode(list(result.token_ids)),
            "output_ids": list(result.token_ids),
            "meta_info": meta,
        }

    async def pause_generation(self, request: Request) -> Any:
        body = await self._body(request)
        await self.engine.pause()
        if body.get("mode", "abort") == "abort":
            for rid in list(self._running):
                await self.engine.abort(rid)
        return {"success": True}

    async def continue_generation(self, request: Request) -> Any:
        await self._body(request)
        await self.engine.resume()
        return {"success": True}

    async def abort_request(self, request: Request) -> Any:
        body = await self._body(request)
        for rid in list(self._running) if body.get("abort_all") else [body.get("rid", "")]:
            await self.engine.abort(rid)
        return {"success": True}

    async def flush_cache(self, request: Request) -> Any:
        await self._body(request)
        if self._running:
            return PlainTextResponse("Cache not flushed because there are pending requests.", status_code=400)
        return PlainTextResponse("Cache flushed.")

    async def _load(self, named_tensors: list[tuple[str, Any]], weight_version: str) -> Any:
        try:
            await self.engine.load_weights(named_tensors, int(weight_version))
        except Exception as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    async def update_weights_from_disk(self, request: Request) -> Any:
        body = await self._body(request)
        named = [
            item
            for path in sorted(Path(body["model_path"]).glob("*.safetensors"))
            for item in load_file(str(path)).items()
        ]
        return await self._load(named, body["weight_version"])

    async def update_weights_from_tensor(self, request: Request) -> Any:
        body = await self._body(request)
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))  # tp rank 0's copy
        return await self._load(named, body["weight_version"])

    async def init_weights_update_group(self, request: Request) -> Any:
        """Join the group as rank `rank_offset` in a separate process (torch registers one group name per
        process, and a real server is another process anyway)."""
        body = await self._body(request)
        self._receiver = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.rollout.weight_receiver",
            json.dumps(body),
            cwd=REPO_ROOT,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        line = await asyncio.wait_for(self._receiver.stdout.readline(), 60)
        return {"success": line.strip() == b"joined", "message": line.decode()}

    async def update_weights_from_distributed(self, request: Request) -> Any:
        body = await self._body(request)
        out = Path(f"/tmp/vcpo-standin-{uuid.uuid4().hex}.safetensors")
        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
        self._receiver.stdin.write((json.dumps({"specs": specs, "out": str(out)}) + "\n").encode())
        await self._receiver.stdin.drain()
        line = await asyncio.wait_for(self._receiver.stdout.readline(), 60)
        if line.strip() != b"done":
            return JSONResponse({"success": False, "message": line.decode()}, status_code=400)
        named = list(load_file(str(out)).items())
        out.unlink()
        return await self._load(named, body["weight_version"])

    async def close(self) -> None:
        if self._receiver is not None and self._receiver.returncode is None:
            self._receiver.stdin.close()
            await asyncio.wait_for(self._receiver.wait(), 30)


class OpenAIStandin:
    """STAND-IN for an OpenAI-compatible /v1/completions server, backed by an HFEngine. Accepts token-id
    prompts like vLLM does; returns logprobs.token_logprobs and (vLLM's extension) token ids when asked.
    With `served` names it also answers GET /v1/models with them and, like vLLM, refuses a completion
    for any other model with HTTP 404 and vLLM's error body."""

    def __init__(
        self,
        engine: HFEngine,
        decode: Callable[[list[int]], str],
        encode: Callable[[str], list[int]],
        served: tuple[str, ...] | None = None,
    ) -> None:
        self.engine, self.decode, self.encode, self.served = engine, decode, encode, served
        self.calls: list[dict[str, Any]] = []
        self.app = FastAPI(title="OpenAI /v1/completions STAND-IN (tests only)")
        self.app.post("/v1/completions")(self.completions)
        if served is not None:
            listing = {"object": "list", "data": [{"id": name, "object": "model"} for name in served]}
            self.app.get("/v1/models")(lambda: listing)

    async def completions(self, request: Request) -> Any:
        body = await request.json()
        self.calls.append(body)
        if self.served is not None and body.get("model") not in self.served:
            message = f"The model `{body.get('model')}` does not exist."
            return JSONResponse({"error": {"message": message, "type": "NotFoundError", "param": "model",
                                           "code": 404}}, status_code=404)  # fmt: skip
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else self.encode(prompt)
        stop = body.get("stop") or ()
        sampling = SamplingParams(
            max_new_tokens=body.get("max_tokens", 16),
            temperature=body.get("temperature", 1.0),
            top_p=body.get("top_p", 1.0),
            stop=tuple([stop] if isinstance(stop, str) else stop),
            seed=body.get("seed"),
        )
        generation = GenerationRequest(request_id=uuid.uuid4().hex, prompt_token_ids=ids, sampling=sampling)
        task = asyncio.create_task(self.engine.generate(generation))
        while not task.done():  # like vLLM: a client that left gets its request aborted
            if await request.is_disconnected():
                await self.engine.abort(generation.request_id)
            await asyncio.wait({task}, timeout=0.05)
        result = task.result()
        tokens = list(result.token_ids)
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.decode(tokens),
            "finish_reason": result.finish_reason,
        }
        if body.get("logprobs") is not None:
            choice["logprobs"] = {
                "tokens": [self.decode([t]) for t in tokens],
                "token_logprobs": list(result.logprobs),
                "top_logprobs": None,
                "text_offset": None,
            }
        if body.get("return_token_ids"):
            choice["token_ids"] = tokens
        return {
            "id": "cmpl-standin",
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)},
        }
