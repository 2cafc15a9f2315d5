"""The wire format of SandboxFusion's `POST /run_code`, shared by our client and our server.

Field names and defaults follow the service (including `memory_limit_MB`, which the official
0.3.7 client does not send). Unknown request fields are ignored rather than rejected, as by the
service itself: clients of other versions send more or fewer fields and must keep working.

Status rule of the service: a command that could not run (`Error`) makes the response a
`SandboxError`; a timeout or a non-zero exit makes it `Failed`; otherwise `Success`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CommandRunStatus = Literal["Finished", "Error", "TimeLimitExceeded"]
RunStatus = Literal["Success", "Failed", "SandboxError"]


class RunCodeRequest(BaseModel):
    """Body of `POST /run_code`."""

    model_config = ConfigDict(extra="ignore", use_attribute_docstrings=True)

    code: str
    """Source code to run."""
    language: str
    """python, bash, cpp, ... (our server runs python and bash)."""
    compile_timeout: float = 10
    """Seconds for compilation (compiled languages only; unused by our server)."""
    run_timeout: float = 10
    """Seconds the program may run."""
    memory_limit_MB: int = -1
    """Memory limit in MiB; -1 leaves the server's default."""
    stdin: str | None = None
    """Text on standard input."""
    files: dict[str, str | None] = Field(default_factory=dict)
    """Files written before the run: path -> base64 content (None entries are skipped)."""
    fetch_files: list[str] = Field(default_factory=list)
    """Paths read back after the run into the response's `files`."""


class CommandRunResult(BaseModel):
    """How one command (compile or run) went."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    status: CommandRunStatus
    """Finished (ran to an exit), Error (could not run) or TimeLimitExceeded."""
    execution_time: float | None = None
    """Seconds it ran."""
    return_code: int | None = None
    """Exit status; None after a timeout."""
    stdout: str | None = None
    """Standard output."""
    stderr: str | None = None
    """Standard error."""


class RunCodeResponse(BaseModel):
    """Response of `POST /run_code`."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    status: RunStatus
    """Success, Failed or SandboxError (see the module docstring)."""
    message: str = ""
    """Why, when status is not Success."""
    compile_result: CommandRunResult | None = None
    """Compilation step; None for interpreted languages."""
    run_result: CommandRunResult | None = None
    """The run; None when it never started."""
    executor_pod_name: str | None = None
    """Which executor ran it (informational)."""
    files: dict[str, str] = Field(default_factory=dict)
    """Fetched files: path -> base64 content."""
