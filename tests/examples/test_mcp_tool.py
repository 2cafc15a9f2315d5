"""examples/mcp_tool: an MCP server's tools through function calling, for real: the example's own server
(the official SDK's) on stdio and on loopback HTTP, the real `vcpo train` and `vcpo eval` commands as the
README types them, and `vcpo eval --backend openai`.

The model is a tiny one that memorised a function-calling episode of the task's first question (its
prompt rendered with the example's chat template and the server's real tool schemas): two `stock`
calls in one turn, the server's answers as the template's tool messages, then the boxed sum. So the
scores are real: the reward is 1 only when the server answered 12 and 3 and the model read them.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_env.datasets import load_samples
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.tool_messages import ToolMessageRenderer, tool_message
from configs.task_schema import load_task_config
from rollout.tiny import build_byte_tokenizer
from run.observability.metrics_log import read_metrics
from tests.examples.memorise import memorise_episode
from tests.rollout.standin_servers import OpenAIStandin, serve
from tools.functions import Toolbox
from tools.registry import build_tool

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mcp_tool"
VCPO = Path(sys.executable).parent / "vcpo"
pytestmark = pytest.mark.timeout(900)

TURN_1 = ('<tool_call>\n{"name": "stock", "arguments": {"item": "pen"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "stock", "arguments": {"item": "lamp"}}\n</tool_call>')
SERVER_SAYS = [tool_message("stock", "12"), tool_message("stock", "3")]
TURN_2 = "12 pens and 3 lamps: \\boxed{15}."


def readme_commands() -> list[list[str]]:
    """Every `vcpo ...` line of the README's ```bash blocks, split as a shell would."""
    blocks = re.findall(r"```bash\n(.*?)```", (EXAMPLE / "README.md").read_text(), re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith("vcpo ")]


def readme_command(subcommand: str, task: str = "task.yaml") -> list[str]:
    (command,) = [c for c in readme_commands() if c[1] == subcommand and
                  (subcommand == "train" or f"examples/mcp_tool/{task}" in c)]
    return command


def _run(command: list[str], timeout_s: float = 800) -> subprocess.CompletedProcess[str]:
    """`command` as typed in the repo root after the README's `export PYTHONPATH=$PWD`."""
    assert command[0] == "vcpo" and VCPO.is_file(), f"no vcpo script beside {sys.executable}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(VCPO), *command[1:]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def _failure(result: subprocess.CompletedProcess[str], run_dir: Path | None = None) -> str:
    log = run_dir / "logs" / "libraries.log" if run_dir else None
    return result.stderr[-3000:] + (log.read_text()[-3000:] if log and log.is_file() else "")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def http_server() -> Iterator[str]:
    """The example's server on loopback streamable HTTP, as the README starts it."""
    port = _free_port()
    process = _start_example_server(port)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


@pytest.fixture(scope="module")
def template_tools() -> list[dict[str, Any]]:
    """The `tools=` list of the example's task: the real server's schemas of `stock` and `price`."""
    task = load_task_config(EXAMPLE / "task.yaml")
    spec = {**task.tool_specs()[0], "cwd": str(ROOT)}  # its server path is from the repository root

    async def listed() -> list[dict[str, Any]]:
        async with build_tool(spec) as tool:
            return Toolbox([tool]).template_tools()

    return asyncio.run(listed())


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory, template_tools: list[dict[str, Any]]) -> Path:
    task = load_task_config(EXAMPLE / "task.yaml")
    (sample, *_) = load_samples(task, task_dir=EXAMPLE).samples
    assert sample.sample_id == "pens-and-lamps"
    tokenizer = build_byte_tokenizer()
    tokenizer.chat_template = (EXAMPLE / "hermes_tools.jinja").read_text()
    prompt = render_prompt_ids(tokenizer, render_messages(task.prompt.system, task.prompt.user, sample),
                               template_tools)
    between = ToolMessageRenderer(tokenizer, template_tools).suffix_text(SERVER_SAYS)
    return memorise_episode(tmp_path_factory.mktemp("memorised-shop"), prompt, TURN_1 + between + TURN_2)


def test_the_readme_names_real_files_and_the_task_checks() -> None:
    commands = readme_commands()
    assert [c[1] for c in commands] == ["config", "train", "eval", "eval"]
    for command in commands:
        assert all((ROOT / arg).is_file() for arg in command if arg.endswith((".yaml", ".jsonl"))), command
    result = _run(readme_command("config"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tool_format: function_call" in result.stdout


def _check_trained(result: subprocess.CompletedProcess[str], run_dir: Path, steps: int) -> None:
    assert result.returncode == 0, _failure(result, run_dir)
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == list(range(1, steps + 1))
    assert all(r["tool/parse_errors"] >= 0 and r["tool/unknown"] >= 0 for r in records)
    episodes = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == steps * 2 * 4  # steps × groups per step × group size (run.yaml)
    # the server's real answers reached the model as the template's tool messages, and it used them
    solved = [e for e in episodes if e["reward"] == 1.0]
    assert solved and all(e["tool_calls"] == 2 for e in solved)
    assert all("<tool_response>\n12\n</tool_response>\n<tool_response>\n3\n</tool_response>" in e["text"]
               for e in solved)


def test_the_readme_trains_with_the_server_on_stdio(memorised_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = _run([*readme_command("train"), f"model.path={memorised_dir}", "engine.backend=hf",
                   f"run_dir={run_dir}", "trainer.total_steps=2", "learner.device=cpu",
                   "task_overrides=[dataset.limit=1]", "--no-progress"])
    _check_trained(result, run_dir, 2)
    assert (run_dir / "export" / "config.json").is_file()


def _start_example_server(port: int) -> subprocess.Popen[bytes]:
    """The example's server on loopback streamable HTTP, as the README starts it."""
    process = subprocess.Popen([sys.executable, str(EXAMPLE / "server.py"), "--http", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "the example server did not start"
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        time.sleep(0.2)


def _http_task(tmp_path: Path, url: str) -> Path:
    """task_http.yaml with the server at `url` (a port free here), written where the test can use it."""
    spec = yaml.safe_load((EXAMPLE / "task_http.yaml").read_text())
    assert spec["tools"][0]["url"].startswith("http://127.0.0.1:")
    spec["extends"] = str(EXAMPLE / "task_http.yaml")
    spec["tools"][0]["url"] = url
    # relative paths are from the task file's folder: this one is elsewhere
    spec["prompt"] = {"chat_template": str(EXAMPLE / "hermes_tools.jinja")}
    spec["dataset"] = {"type": "file", "path": str(EXAMPLE / "questions.jsonl")}
    task = tmp_path / "task.yaml"
    task.write_text(yaml.safe_dump(spec))
    return task


def test_a_training_step_against_the_server_on_loopback_http(memorised_dir: Path, http_server: str,
                                                             tmp_path: Path) -> None:
    task = _http_task(tmp_path, http_server)
    run_dir = tmp_path / "run"
    result = _run([*readme_command("train"), f"task={task}", f"model.path={memorised_dir}",
                   "engine.backend=hf", f"run_dir={run_dir}", "trainer.total_steps=1", "learner.device=cpu",
                   "task_overrides=[dataset.limit=1]", "--no-progress"])
    _check_trained(result, run_dir, 1)


def test_a_server_that_dies_mid_run_fails_those_calls_and_the_run_goes_on_once_it_is_back(
        memorised_dir: Path, tmp_path: Path) -> None:
    """`vcpo train` against the HTTP server, killed after the first step and started again two steps
    later: the calls in between fail visibly (errors the model reads, counted), the run reconnects,
    solves the task again and finishes every step with every episode logged."""
    port = _free_port()
    server = _start_example_server(port)
    run_dir, steps = tmp_path / "run", 8
    command = [*readme_command("train"), f"task={_http_task(tmp_path, f'http://127.0.0.1:{port}/mcp')}",
               f"model.path={memorised_dir}", "engine.backend=hf", f"run_dir={run_dir}",
               f"trainer.total_steps={steps}", "learner.device=cpu", "task_overrides=[dataset.limit=1]",
               "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    train = subprocess.Popen([str(VCPO), *command[1:]], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)

    def steps_logged() -> int:
        path = run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def wait_for(count: int) -> int:
        deadline = time.monotonic() + 600
        while (done := steps_logged()) < count:
            assert train.poll() is None and time.monotonic() < deadline, "the run ended or stalled"
            time.sleep(0.05)
        return done

    try:
        killed_after = wait_for(1)
        server.kill()
        server.wait()
        restarted_after = wait_for(killed_after + 2)
        server = _start_example_server(port)
        stdout, stderr = train.communicate(timeout=600)
    finally:
        train.kill()
        server.kill()
        server.wait()
    result = subprocess.CompletedProcess(train.args, train.returncode, stdout, stderr)
    assert restarted_after < steps - 2, "the run outpaced the test: restart the server sooner"
    assert result.returncode == 0, _failure(result, run_dir)
    records = read_metrics(run_dir)
    assert [r["trainer_step"] for r in records] == list(range(1, steps + 1))
    episodes = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(episodes) == steps * 2 * 4
    failed = [e for e in episodes if "the tool server did not answer" in e["text"]]
    assert failed, "no episode met the dead server"
    assert sum(r["rollout/tool_errors_mean"] for r in records) > 0
    assert records[-1]["reward/mean"] > 0, "the run did not solve the task again once the server was back"


def _check_samples(out: Path) -> None:
    meta, *samples = (json.loads(line) for line in out.read_text().splitlines())
    assert meta["kind"] == "meta" and len(samples) == 2
    for sample in samples:  # greedy: the memorised episode with the server's real answers
        first = sample["turns"][0]
        assert [(c["name"], c["arguments"], c["status"], c["content"]) for c in first["calls"]] == [
            ("stock", {"item": "pen"}, "ok", "12"), ("stock", {"item": "lamp"}, "ok", "3")]
        assert (sample["extracted"], sample["reward"], sample["tool_calls"]) == ("15", 1.0, 2)
        assert (sample["tool_parse_errors"], sample["tool_unknown"]) == (0, 0)


def test_the_readme_evaluates_with_vcpo_eval(memorised_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "shop.jsonl"
    result = _run([*readme_command("eval"), "--model", str(memorised_dir), "--backend", "hf", "--out",
                   str(out), "--limit", "1", "--k", "2", "eval.temperature=0", "--no-progress"])
    assert result.returncode == 0, result.stderr[-3000:]
    _check_samples(out)


async def test_vcpo_eval_with_the_openai_backend_runs_the_same_calls(memorised_dir: Path,
                                                                     tmp_path: Path) -> None:
    """`--backend openai`: prompts go to the server as token ids rendered here with the tools, and the
    calls run here; the server is the tests' /v1/completions stand-in on the HF engine."""
    from cli import main
    from rollout.engines.hf_engine import HFEngine
    from rollout.settings import HFEngineSettings

    tokenizer = build_byte_tokenizer()
    out = tmp_path / "served.jsonl"
    async with HFEngine(memorised_dir, HFEngineSettings()) as engine:
        standin = OpenAIStandin(engine, lambda ids: tokenizer.decode(ids), tokenizer.encode, served=("shop",))
        async with serve(standin.app) as url:
            command = ["eval", str(EXAMPLE / "task.yaml"), "--backend", "openai", "--url", f"{url}/v1",
                       "--model", str(memorised_dir), "--out", str(out), "--limit", "1", "--k", "2",
                       "eval.temperature=0", "--no-progress"]
            code = await asyncio.to_thread(main, command)
    assert code == 0
    _check_samples(out)
    assert standin.calls and all(isinstance(call["prompt"], list) for call in standin.calls)


def test_a_tool_the_server_does_not_list_stops_eval_naming_the_task_and_the_servers_tools(
        memorised_dir: Path, tmp_path: Path) -> None:
    wrong = ("tools=[{type: mcp, command: python, args: [examples/mcp_tool/server.py], "
             "tools: [stock, search]}]")
    result = _run([*readme_command("eval"), wrong, "--model", str(memorised_dir), "--backend", "hf",
                   "--out", str(tmp_path / "out.jsonl"), "--no-progress"])
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr[result.stderr.index("error:"):]
    assert "examples/mcp_tool/task.yaml" in error
    assert ("tools.0: MCP server python examples/mcp_tool/server.py does not list tool(s) 'search'; it "
            "lists: stock, price") in error
