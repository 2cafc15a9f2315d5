"""HTTP plumbing shared by the server adapters (SGLang, OpenAI-compatible): one pooled async client
and the mapping of transport failures to typed engine errors.

Every request has a connect timeout and a total timeout, so nothing waits forever. Failures map
as: cannot connect → EngineUnavailable; timed out → EngineTimeout; HTTP 4xx → InvalidRequest;
HTTP 5xx → EngineOOM when the body says out-of-memory, else EngineUnavailable; a body that is not
JSON → MalformedResponse. The server's own message is kept in `engine_message`; an HTTP error
status also sets the error's `http` (an `HTTPFailure`: URL, status and the server's message on one
line, for a user).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import httpx

from rollout.errors import (
    EngineOOM,
    EngineTimeout,
    EngineUnavailable,
    HTTPFailure,
    InvalidRequest,
    MalformedResponse,
)

PROBE_TIMEOUT_S = 30.0  # a server's health check / model list answers fast even under load
_MESSAGE_CHARS = 500  # the longest server message shown to a user


class ServerSettings(Protocol):
    """The connection fields every server adapter's settings have."""

    base_url: str
    connect_timeout_s: float
    request_timeout_s: float
    max_connections: int


class JSONClient:
    """A pooled httpx.AsyncClient for one server; `post`/`get` return decoded JSON or raise typed errors."""

    def __init__(
        self,
        engine: str,
        base_url: str,
        connect_timeout_s: float,
        request_timeout_s: float,
        max_connections: int,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.engine = engine
        self.base_url = base_url.rstrip("/")
        self._request_timeout_s = request_timeout_s
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    @classmethod
    async def connect(
        cls, engine: str, server: ServerSettings, probe_path: str, headers: dict[str, str] | None = None
    ) -> JSONClient:
        """A client whose server answered `GET probe_path`; a typed error (nothing left open) if not."""
        client = cls(engine, server.base_url, server.connect_timeout_s, server.request_timeout_s,
                     server.max_connections, headers)  # fmt: skip
        try:
            await client.get(
                probe_path, timeout_s=max(server.connect_timeout_s, PROBE_TIMEOUT_S), is_json=False
            )
        except BaseException:
            await client.close()
            raise
        return client

    async def close(self) -> None:
        await self._client.aclose()

    async def get(self, path: str, timeout_s: float | None = None, is_json: bool = True) -> Any:
        return await self._send("GET", path, None, timeout_s, is_json)

    async def post(
        self,
        path: str,
        payload: dict[str, Any] | None = None,
        timeout_s: float | None = None,
        is_json: bool = True,
    ) -> Any:
        """POST `payload` as JSON; the decoded JSON answer (its text when `is_json` is False)."""
        return await self._send("POST", path, payload, timeout_s, is_json)

    async def _send(
        self, method: str, path: str, payload: dict[str, Any] | None, timeout_s: float | None, is_json: bool
    ) -> Any:
        where = f"{method} {self.base_url}{path}"
        timeout = httpx.Timeout(timeout_s or self._request_timeout_s, connect=self._client.timeout.connect)
        try:
            response = await self._client.request(method, path, json=payload, timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
            raise EngineUnavailable(
                self.engine,
                f"cannot reach the server ({where}); start it or fix base_url",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        except httpx.TimeoutException as exc:
            raise EngineTimeout(
                self.engine,
                f"{where} did not answer in time; raise the timeout or lower the load",
                f"{type(exc).__name__}: {exc}",
            ) from exc
        body = response.text
        if response.status_code >= 400:
            http = HTTPFailure(method, f"{self.base_url}{path}", response.status_code, server_message(body))
            if response.status_code >= 500:
                error = EngineOOM if "out of memory" in body.lower() else EngineUnavailable
                raise error(self.engine, f"{where} failed with HTTP {response.status_code}", body[:2000],
                            http=http)  # fmt: skip
            raise InvalidRequest(
                self.engine, f"{where} rejected the request (HTTP {response.status_code})", body[:2000],
                http=http,
            )
        if not is_json:
            return body
        try:
            return response.json() if body else None
        except ValueError as exc:
            raise MalformedResponse(
                self.engine, f"{where} answered with something that is not JSON", body[:2000]
            ) from exc


def server_message(body: str) -> str:
    """What an HTTP error body says, on one line: the JSON error message when there is one
    (OpenAI/vLLM `{"error": {"message": …}}`, `{"message": …}`, `{"error": "…"}`, FastAPI's
    `{"detail": …}`), else the body's text with its whitespace collapsed; cut to 500 characters."""
    try:
        data = json.loads(body, strict=False)  # control characters in strings too
    except ValueError:
        data = None
    text = body
    if isinstance(data, dict):
        error = data.get("error")
        for candidate in (error.get("message") if isinstance(error, dict) else error,
                          data.get("message"), data.get("detail")):  # fmt: skip
            if candidate:
                text = candidate if isinstance(candidate, str) else json.dumps(candidate)
                break
    text = " ".join(text.split())
    return text if len(text) <= _MESSAGE_CHARS else text[: _MESSAGE_CHARS - 1] + "…"


def field(data: Any, *path: str | int, engine: str, kind: type | tuple[type, ...] = object) -> Any:
    """`data[path[0]][path[1]]...`, checked to be of `kind`; MalformedResponse naming the path otherwise."""
    value = data
    for key in path:
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            raise MalformedResponse(
                engine, f"the response has no {'.'.join(map(str, path))}", str(data)[:2000]
            ) from None
    if not isinstance(value, kind):
        raise MalformedResponse(
            engine,
            f"{'.'.join(map(str, path))} should be {kind}, got {type(value).__name__}",
            str(data)[:2000],
        )
    return value
