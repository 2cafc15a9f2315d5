"""Typed engine failures. Each carries the engine's name and the engine's own message, and its
text says what to do.

A request that ends early because someone asked (abort, cancel) is *data*, not an error: its
`GenerationResult` has `finish_reason="abort"` and the tokens sampled so far. Errors are for
failures: the engine is down or broken, out of memory, answered something unreadable, did not
answer in time, was handed an impossible request, or cannot do what was asked.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HTTPFailure:
    """A server's HTTP error answer: `str()` is one line for a user (method, URL, status, and the
    server's own message — the JSON body's error message when there is one)."""

    method: str
    url: str
    status: int
    message: str

    def __str__(self) -> str:
        return f"{self.method} {self.url} answered HTTP {self.status}: {self.message or '(empty body)'}"


class EngineError(RuntimeError):
    """Base of every engine failure. `engine` names the backend; `engine_message` is what the
    engine itself said (exception text, HTTP body), kept verbatim for logs. `http` is set when a
    server answered with an HTTP error status."""

    def __init__(
        self, engine: str, message: str, engine_message: str = "", *, http: HTTPFailure | None = None
    ) -> None:
        self.engine = engine
        self.engine_message = engine_message
        self.http = http
        detail = f" (engine said: {engine_message})" if engine_message else ""
        super().__init__(f"[{engine}] {message}{detail}")


class EngineUnavailable(EngineError):
    """The engine cannot serve: not started, closed, failed to start, crashed, or its server is
    unreachable. Restart it (or the server) and retry."""


class EngineOOM(EngineError):
    """The engine ran out of (GPU or host) memory. Lower the batch size / KV cache space / max
    model length, or use a smaller model."""


class EngineTimeout(EngineError):
    """The engine did not answer within the configured timeout."""


class MalformedResponse(EngineError):
    """The engine answered, but not in the documented shape (bad JSON, missing fields,
    lengths that do not match)."""


class InvalidRequest(EngineError):
    """The request cannot be served as given (empty or too-long prompt, duplicate request id,
    token ids outside the vocabulary); the message names the field and the fix."""


class GenerationAborted(EngineError):
    """A request ended with finish_reason 'abort' that its caller did not ask for (the server or
    another party aborted it): a failure of that request, retried like any other, never a silent
    cancellation."""


class UnsupportedOperation(EngineError):
    """The backend cannot do this at all (e.g. `load_weights` on an OpenAI-compatible server)."""


class WeightLoadError(EngineError):
    """`load_weights` was given names or shapes the model does not have; nothing was loaded."""
