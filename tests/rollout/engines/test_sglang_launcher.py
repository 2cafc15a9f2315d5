"""The SGLang launcher: the exact command line, waiting for health, and start-up failures as typed errors.
The launched program here is a STAND-IN (a few lines of Python serving /health), not SGLang."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from rollout.engines.sglang_launcher import SGLangServer, sglang_server_command, sglang_server_env
from rollout.errors import EngineUnavailable
from rollout.settings import SGLangLaunchSettings
from tests.rollout.standin_servers import free_port

HEALTH_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_command_has_the_documented_flags_and_only_those_set() -> None:
    settings = SGLangLaunchSettings(
        model_path="/models/m",
        port=31000,
        tp_size=2,
        dtype="bfloat16",
        mem_fraction_static=0.6,
        extra_args=("--attention-backend", "fa3"),
    )
    assert sglang_server_command(settings, python="py") == [
        "py",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/models/m",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
        "--dtype",
        "bfloat16",
        "--mem-fraction-static",
        "0.6",
        "--random-seed",
        "0",
        "--attention-backend",
        "fa3",
    ]


def test_server_environment_keeps_logprobs_tempered() -> None:
    env = sglang_server_env({"PATH": "/bin", "SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})
    assert env == {"PATH": "/bin"}


async def test_waits_for_health_and_stops_the_process_group(tmp_path: Path) -> None:
    port = free_port()
    settings = SGLangLaunchSettings(model_path="unused", port=port, startup_timeout_s=60)
    server = SGLangServer(
        settings, tmp_path / "server.log", command=[sys.executable, "-c", HEALTH_SERVER, str(port)]
    )
    async with server as url, httpx.AsyncClient() as client:
        assert (await client.get(f"{url}/health")).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


async def test_a_server_that_dies_at_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    settings = SGLangLaunchSettings(model_path="unused", port=free_port(), startup_timeout_s=60)
    command = [sys.executable, "-c", "import sys; print('CUDA error: no kernel image'); sys.exit(3)"]
    with pytest.raises(EngineUnavailable, match="exited with code 3") as caught:
        async with SGLangServer(settings, tmp_path / "server.log", command=command):
            pass
    assert "no kernel image" in caught.value.engine_message
