"""Start and stop an SGLang server (`python -m sglang.launch_server`) for the SGLang adapter.

`sglang_server_command` builds the command line from SGLangLaunchSettings; `SGLangServer` is an
async context manager that launches it in its own process group (output to a log file), waits
until `GET /health` answers, yields the base URL, and on exit terminates the group (SIGTERM, then
SIGKILL after a grace period). Start-up failures surface as EngineUnavailable with the log's tail;
a server that never becomes healthy as EngineTimeout. The environment drops
SGLANG_RETURN_ORIGINAL_LOGPROB so logprobs stay those of the tempered distribution (what the
learner recomputes).

Not here: installing SGLang (GPU machines only: pip install 'vcpo[sglang]'), multi-node launches.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import httpx

from rollout.errors import EngineTimeout, EngineUnavailable
from rollout.settings import SGLangLaunchSettings

_STOP_GRACE_S = 30.0
_POLL_S = 0.5


def sglang_server_command(settings: SGLangLaunchSettings, python: str = sys.executable) -> list[str]:
    """The launch command for `settings`; optional flags appear only when set."""
    command = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        settings.model_path,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        "--tp-size",
        str(settings.tp_size),
        "--dtype",
        settings.dtype,
    ]
    optional = (
        ("--mem-fraction-static", settings.mem_fraction_static),
        ("--context-length", settings.context_length),
        ("--random-seed", settings.random_seed),
    )
    for flag, value in optional:
        if value is not None:
            command += [flag, str(value)]
    return [*command, *settings.extra_args]


def sglang_server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without SGLANG_RETURN_ORIGINAL_LOGPROB (see the module docstring)."""
    return {key: value for key, value in environ.items() if key != "SGLANG_RETURN_ORIGINAL_LOGPROB"}


class SGLangServer:
    """`async with SGLangServer(settings, log_path) as base_url:` — a running, healthy server.

    `command` overrides the launch command (tests use a stand-in program)."""

    def __init__(
        self, settings: SGLangLaunchSettings, log_path: Path, command: Sequence[str] | None = None
    ) -> None:
        self._settings = settings
        self._log_path = Path(log_path)
        self._command = list(command) if command is not None else sglang_server_command(settings)
        self._process: asyncio.subprocess.Process | None = None
        self.base_url = f"http://{settings.host}:{settings.port}"

    async def __aenter__(self) -> str:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._log_path.open("wb") as log:
            self._process = await asyncio.create_subprocess_exec(
                *self._command,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=sglang_server_env(os.environ),
                start_new_session=True,
            )
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise
        return self.base_url

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._settings.startup_timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            while time.monotonic() < deadline:
                if self._process.returncode is not None:
                    raise EngineUnavailable(
                        "sglang",
                        f"the server exited with code {self._process.returncode} "
                        f"during start-up; see {self._log_path}",
                        self._log_tail(),
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{self.base_url}/health")).status_code == 200:
                        return
                await asyncio.sleep(_POLL_S)
        raise EngineTimeout(
            "sglang",
            f"the server did not become healthy within startup_timeout_s="
            f"{self._settings.startup_timeout_s}; see {self._log_path}",
            self._log_tail(),
        )

    async def stop(self) -> None:
        """Terminate the server's process group; SIGKILL after a grace period. Idempotent."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), _STOP_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await asyncio.wait_for(process.wait(), _STOP_GRACE_S)

    def _log_tail(self, max_chars: int = 3000) -> str:
        try:
            return self._log_path.read_text(errors="replace")[-max_chars:]
        except OSError:
            return ""
