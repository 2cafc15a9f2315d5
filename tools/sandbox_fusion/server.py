"""`vcpo sandbox serve`: a SandboxFusion-compatible HTTP service backed by the local sandbox, so
rollout workers on many machines can share sandbox hosts through `type: sandbox_fusion`.

Endpoints: `POST /run_code` (the service's schema, see `sandbox_fusion_schema.py`; languages
python and bash, others answer SandboxError), `GET /v1/ping` ("pong"), `GET /metrics`.
Per-request `run_timeout` and `memory_limit_MB` can only tighten the server's sandbox limits.

Security: the service has no authentication. It binds loopback only unless
`SandboxServerSettings.use_non_loopback_host` is true; then put it on a private network.

Concurrency: uvicorn serves requests on one event loop; the local sandbox bounds executions to
its `max_concurrency`. fastapi and uvicorn are imported when the app is built (extra `vcpo[server]`).
"""

from __future__ import annotations

import base64
import binascii
import importlib
import ipaddress
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tools.base import ToolCall, ToolConfigError, ToolResult, ToolUnavailableError
from tools.sandbox.local_sandbox import LocalPythonSandbox
from tools.sandbox_fusion.schema import CommandRunResult, RunCodeRequest, RunCodeResponse
from tools.settings import SandboxServerSettings

SUPPORTED_LANGUAGES = ("python", "bash")


def _require(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ToolUnavailableError(
            f"the sandbox server needs {module}: pip install 'vcpo[server]' (fastapi and uvicorn)"
        ) from error


def to_tool_call(request: RunCodeRequest) -> ToolCall:
    """The local call for a request. Raises ValueError (the client's fault) for bad input."""
    if request.language not in SUPPORTED_LANGUAGES:
        raise ValueError(
            f"language {request.language!r} is not supported by this server (vcpo local sandbox); "
            f"supported: {', '.join(SUPPORTED_LANGUAGES)}"
        )
    files: dict[str, bytes] = {}
    for path, content in request.files.items():
        if content is None:
            continue
        try:
            files[path] = base64.b64decode(content, validate=True)
        except binascii.Error as error:
            raise ValueError(f"files[{path!r}] is not valid base64: {error}") from None
    return ToolCall(
        code=request.code,
        language="bash" if request.language == "bash" else "python",
        stdin=request.stdin,
        timeout_s=request.run_timeout if request.run_timeout > 0 else None,
        memory_limit_mb=request.memory_limit_MB if request.memory_limit_MB > 0 else None,
        files=files,
        fetch_files=tuple(request.fetch_files),
    )


def to_response(result: ToolResult) -> RunCodeResponse:
    """The service's response for a local result, by the service's status rule."""
    files = {path: base64.b64encode(content).decode() for path, content in result.files.items()}
    if result.status == "timeout":
        run_status, status = "TimeLimitExceeded", "Failed"
        return_code = None
    elif result.exit_code is None:
        run_status, status, return_code = "Error", "SandboxError", None
    else:
        run_status, return_code = "Finished", result.exit_code
        status = "Success" if result.exit_code == 0 else "Failed"
    run_result = CommandRunResult(
        status=run_status,
        execution_time=result.wall_time_s,
        return_code=return_code,
        stdout=result.stdout,
        stderr=result.stderr,
    )
    return RunCodeResponse(status=status, message=result.message, run_result=run_result, files=files)


def create_app(settings: SandboxServerSettings | None = None) -> Any:
    """The ASGI app (FastAPI). Its lifespan starts the local sandbox and closes it on shutdown."""
    settings = settings or SandboxServerSettings()
    fastapi = _require("fastapi")
    responses = importlib.import_module("fastapi.responses")

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        async with LocalPythonSandbox(settings.sandbox) as tool:
            app.state.tool = tool
            yield

    app = fastapi.FastAPI(title="vcpo sandbox (SandboxFusion-compatible)", lifespan=lifespan)

    @app.middleware("http")
    async def limit_body_size(request: Any, call_next: Any) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_request_bytes:
            return responses.JSONResponse(
                {
                    "detail": f"request body of {length} bytes exceeds "
                    f"max_request_bytes={settings.max_request_bytes}"
                },
                status_code=413,
            )
        return await call_next(request)

    @app.post("/run_code", response_model=RunCodeResponse)
    async def run_code(request: RunCodeRequest) -> RunCodeResponse:
        try:
            call = to_tool_call(request)
        except ValueError as error:
            return RunCodeResponse(status="SandboxError", message=str(error))
        return to_response(await app.state.tool.run(call))

    @app.get("/v1/ping", response_class=responses.PlainTextResponse)
    async def ping() -> str:
        return "pong"

    @app.get("/metrics")
    async def metrics() -> dict[str, float]:
        return app.state.tool.metrics()

    return app


def check_bind_host(host: str, settings: SandboxServerSettings) -> None:
    """Refuse a non-loopback address unless the settings allow it explicitly."""
    if host == "localhost":
        return
    try:
        is_loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        is_loopback = False
    if not is_loopback and not settings.use_non_loopback_host:
        raise ToolConfigError(
            f"refusing to bind the sandbox server to {host!r}: it has no authentication, "
            "so anyone who can reach the port could run code here. Bind 127.0.0.1, or set "
            "use_non_loopback_host: true in the server settings and keep the port on a private network"
        )


def serve(host: str, port: int, settings: SandboxServerSettings | None = None) -> None:
    """Run the service until interrupted (blocking). SIGINT/SIGTERM shut it down cleanly."""
    settings = settings or SandboxServerSettings()
    check_bind_host(host, settings)
    uvicorn = _require("uvicorn")
    uvicorn.run(create_app(settings), host=host, port=port, log_level=settings.log_level)
