"""Validated settings of the built-in tools and of the SandboxFusion-compatible server.

Imports only pydantic, so a config can be checked on any machine. Every model forbids unknown
fields; `tools/registry.py` turns validation errors into messages that name the field, the value
and the fix. These models check values only: whether bubblewrap or a package is installed is
checked when a tool starts.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class LocalSandboxSettings(_Settings):
    """The local Python sandbox: each execution under bubblewrap with rlimits (`type: python`)."""

    type: Literal["python"] = "python"
    """Registry key of this tool."""
    interpreter: str | None = None
    """Python executable run inside the sandbox; None uses the interpreter running vcpo (its venv and
    base prefix are bound read-only, so installed packages such as numpy are importable)."""
    extra_read_only_paths: tuple[str, ...] = ()
    """More host paths bound read-only at the same place (e.g. a data directory); default none."""
    timeout_s: float = Field(default=10.0, gt=0, le=3600)
    """Wall-clock limit per call in seconds; on expiry the whole process tree is killed."""
    cpu_time_limit_s: int | None = Field(default=None, gt=0)
    """CPU-seconds limit (RLIMIT_CPU) per call; None uses ceil(timeout_s) + 1."""
    memory_limit_mb: int = Field(default=1024, ge=64)
    """Address-space cap per process in MiB (RLIMIT_AS). BLAS/OpenMP threads are pinned to 1 so
    numpy fits; the sandbox as a whole can use up to max_processes times this."""
    max_processes: int = Field(default=32, ge=4, le=4096)
    """Processes plus threads per sandbox (RLIMIT_NPROC, per sandbox user); stops fork bombs."""
    max_open_files: int = Field(default=64, ge=16)
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    max_file_size_mb: int = Field(default=16, ge=1)
    """Largest file a process may write, in MiB (RLIMIT_FSIZE)."""
    work_dir_size_mb: int = Field(default=64, ge=1)
    """Size cap in MiB of the private tmpfs work directory (/tmp, also cwd and HOME) and of /dev/shm."""
    max_output_bytes: int = Field(default=65536, ge=256)
    """Bytes kept of stdout and of stderr each; the rest is read, counted and dropped."""
    max_fetch_file_bytes: int = Field(default=1 << 20, ge=1)
    """Bytes kept of each file returned through `ToolCall.fetch_files`."""
    preamble: str = ""
    """Python code run before every call (once per session), e.g. helper definitions; "" for none."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables inside the sandbox (the host environment is never passed)."""
    max_concurrency: int = Field(default=16, ge=1)
    """Executions running at once; further calls wait."""
    warm_pool_size: int = Field(default=2, ge=0)
    """Sandboxes pre-started and idle, waiting for code (hides bwrap and interpreter start-up from
    the latency); 0 starts every sandbox on demand."""
    max_concurrent_starts: int | None = Field(default=None, ge=1)
    """Sandboxes starting at once; None uses 4 per CPU (a start mostly waits on the kernel setting up
    namespaces and mounts, so a few per CPU overlap well; measured 27 -> 49 calls/s going 2 -> 8)."""
    startup_timeout_s: float = Field(default=20.0, gt=0)
    """Seconds a new sandbox may take to start before the tool reports it broken."""
    bwrap_path: str = "bwrap"
    """The bubblewrap program, a name looked up on PATH or an absolute path."""
    sandbox_uid_base: int = Field(default=2_000_000, ge=1000)
    """Only when vcpo runs as root: sandboxes run as distinct unprivileged uids taken from
    [sandbox_uid_base, sandbox_uid_base + sandbox_uid_count) so per-user limits apply to each."""
    sandbox_uid_count: int = Field(default=65536, ge=16)
    """Size of the uid range above (root only)."""
    use_unsafe_unisolated_execution: bool = False
    """DANGEROUS. Run without bubblewrap: no filesystem, network or process isolation, only
    rlimits (and no process limit when running as root). For machines where bubblewrap cannot
    work and the code is trusted; never for model-written code in training."""

    @property
    def effective_cpu_time_limit_s(self) -> int:
        return self.cpu_time_limit_s if self.cpu_time_limit_s is not None else math.ceil(self.timeout_s) + 1


class SandboxFusionClientSettings(_Settings):
    """A SandboxFusion service (`POST /run_code`) as a tool (`type: sandbox_fusion`)."""

    type: Literal["sandbox_fusion"] = "sandbox_fusion"
    """Registry key of this tool."""
    endpoint: str = Field(pattern=r"^https?://")
    """Base URL of the service, e.g. http://127.0.0.1:8080 (no trailing /run_code)."""
    run_timeout_s: float = Field(default=10.0, gt=0)
    """`run_timeout` sent with each call in seconds (a call's own timeout_s may lower it)."""
    memory_limit_mb: int | None = Field(default=None, gt=0)
    """`memory_limit_MB` sent with each call; None sends -1 (the service's default)."""
    connect_timeout_s: float = Field(default=5.0, gt=0)
    """Seconds to open a connection before it counts as a transient failure."""
    response_slack_s: float = Field(default=10.0, ge=0)
    """Seconds on top of the run timeout to wait for a response before it counts as transient."""
    max_retries: int = Field(default=3, ge=0, le=10)
    """Retries after the first attempt, only on connection errors, timeouts and HTTP 5xx."""
    retry_backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubles on each further retry."""
    max_backoff_s: float = Field(default=8.0, ge=0)
    """Upper bound of one backoff wait."""
    max_concurrency: int = Field(default=32, ge=1)
    """Requests in flight at once (also the HTTP connection-pool size)."""
    breaker_failure_threshold: int = Field(default=5, ge=1)
    """Consecutive failed attempts that open the circuit breaker (calls then fail fast)."""
    breaker_cooldown_s: float = Field(default=30.0, gt=0)
    """Seconds the breaker stays open before one trial request is let through (half-open)."""
    max_output_bytes: int = Field(default=65536, ge=256)
    """Bytes kept of stdout and of stderr each, as the local sandbox does."""


class E2BSettings(_Settings):
    """E2B cloud sandboxes through `e2b-code-interpreter` (`type: e2b`, extra `vcpo[e2b]`)."""

    type: Literal["e2b"] = "e2b"
    """Registry key of this tool."""
    api_key: SecretStr | None = None
    """E2B API key; None lets the e2b package read E2B_API_KEY from the environment."""
    template: str | None = None
    """Sandbox template name or id; None uses E2B's code-interpreter template."""
    timeout_s: float = Field(default=10.0, gt=0)
    """Execution timeout per call in seconds."""
    sandbox_lifetime_s: int = Field(default=3600, gt=0)
    """How long E2B keeps the sandbox alive, in seconds."""
    request_timeout_s: float = Field(default=30.0, gt=0)
    """Timeout of E2B's API requests (creating contexts etc.) in seconds."""
    max_concurrency: int = Field(default=8, ge=1)
    """Executions in flight at once in the one sandbox."""
    max_output_bytes: int = Field(default=65536, ge=256)
    """Bytes kept of stdout and of stderr each, as the local sandbox does."""


class SandboxServerSettings(_Settings):
    """`vcpo sandbox serve`: a SandboxFusion-compatible HTTP service backed by the local sandbox."""

    sandbox: LocalSandboxSettings = Field(default_factory=LocalSandboxSettings)
    """The local sandbox that runs each request; its limits cap the per-request ones."""
    use_non_loopback_host: bool = False
    """Must be true to bind an address outside 127.0.0.0/8 and ::1. The service has no
    authentication: anyone who reaches the port can run code in the sandboxes."""
    max_request_bytes: int = Field(default=16 << 20, ge=1024)
    """Largest accepted request body (code plus base64 files); larger ones get HTTP 413."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """uvicorn's log level."""


class MCPSettings(_Settings):
    """An MCP server's tools as functions (`type: mcp`), through the official `mcp` SDK, over stdio (a
    server the tool starts) or streamable HTTP (a server already running)."""

    type: Literal["mcp"] = "mcp"
    """Registry key of this tool."""
    command: str | None = None
    """stdio: the program that starts the server (`python` is the interpreter running vcpo); set this
    or `url`."""
    args: tuple[str, ...] = ()
    """stdio: the program's arguments, e.g. [examples/mcp_tool/server.py]."""
    env: dict[str, str] = Field(default_factory=dict)
    """stdio: extra environment variables of the server (over the SDK's minimal default environment)."""
    cwd: str | None = None
    """stdio: the server's working directory; None = vcpo's."""
    url: str | None = Field(default=None, pattern=r"^https?://")
    """streamable HTTP: the server's MCP endpoint, e.g. http://127.0.0.1:8000/mcp; set this or `command`."""
    headers: dict[str, str] = Field(default_factory=dict)
    """streamable HTTP: headers sent with every request (e.g. Authorization)."""
    tools: tuple[str, ...] | None = None
    """The server's tools to offer the model; one the server does not list refuses the tool when it
    starts, naming those it lists. None = every tool the server lists."""
    prefix: str = Field(default="", pattern=r"^[A-Za-z0-9_.-]*$")
    """Put before each tool's name as the model sees it (two servers with a tool of the same name)."""
    connect_timeout_s: float = Field(default=20.0, gt=0)
    """Seconds to start or reach the server and finish the MCP handshake."""
    call_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds one tool call may take; then it is cancelled on the server (that call alone: the connection
    and the other calls in flight stay) and fails, or is retried if repeating it is safe."""
    max_retries: int = Field(default=2, ge=0, le=10)
    """Retries of a failed call: one that never reached the server (no connection) always; one that timed
    out or whose connection broke only when repeating it is safe (the server marks the tool read-only or
    idempotent, or `idempotent` names it). Then the call fails with an error the model sees."""
    idempotent: tuple[str, ...] = ()
    """Tools (the server's names) safe to call twice, beyond those the server's annotations mark
    read-only or idempotent: a call of one that timed out or lost its connection is retried."""
    retry_backoff_s: float = Field(default=0.5, ge=0)
    """Wait before the first retry; doubles on each further one."""
    max_concurrency: int = Field(default=16, ge=1)
    """Calls in flight at once on this server."""

    @model_validator(mode="after")
    def _one_transport(self) -> MCPSettings:
        if (self.command is None) == (self.url is None):
            raise ValueError("set exactly one of `command` (stdio: vcpo starts the server) and `url` "
                             "(streamable HTTP: a running server's endpoint)")
        return self

    @property
    def where(self) -> str:
        """The server as a user would recognise it in a message."""
        return self.url or " ".join((self.command or "", *self.args))
