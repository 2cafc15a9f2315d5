"""`vcpo eval`: metrics by hand, and the whole command with the real HF engine and sandbox on the
memorised tiny agent (it answers 6*7 by running Python): JSONL per sample, resume, summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent_env.evaluation.metrics import majority_is_correct, pass_at_k, summarize
from tests.agent_env import memorised

ROOT = Path(__file__).resolve().parents[3]


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 − C(3,2)/C(4,2) = 1 − 3/6
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong samples: some draw always has a right one
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c/n


def test_majority_vote_takes_the_most_frequent_answer() -> None:
    assert majority_is_correct([(True, "5"), (False, "6"), (True, " 5")])
    assert not majority_is_correct([(False, "6"), (False, "6"), (True, "5")])
    assert majority_is_correct([(True, "5"), (False, "6")])  # tie: the first seen wins
    assert not majority_is_correct([(False, None), (False, None)])


def test_summary_over_problems() -> None:
    per_problem = {"a": [(True, "1"), (False, "2")], "b": [(False, "3"), (False, "3")]}
    summary = summarize(per_problem, k=2)
    assert summary["avg@2"] == pytest.approx(0.25)  # (1/2 + 0) / 2
    assert summary["pass@2"] == pytest.approx(0.5)
    assert summary["maj@2"] == pytest.approx(0.5)  # a: tie → "1" (right); b: "3" (wrong)


async def test_a_failed_sample_stops_the_samples_in_flight(tmp_path: Path) -> None:
    """When one sample fails (the server refused it), evaluate raises that error only after the
    other samples in flight are cancelled, not leaving them running against a closing file."""
    import asyncio

    from agent_env.evaluation.evaluate import evaluate
    from agent_env.loop import EpisodeSettings
    from agent_env.samples import Sample
    from rollout.errors import InvalidRequest
    from rollout.tiny import build_byte_tokenizer

    class OneRefusal:  # only what the agent loop uses
        version = 0

        def __init__(self) -> None:
            self.calls, self.cancelled = 0, 0

        async def generate(self, request: Any) -> Any:
            self.calls += 1
            if self.calls == 1:
                raise InvalidRequest("fake", "refused")
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise

    engine = OneRefusal()
    with pytest.raises(InvalidRequest, match="refused"):
        await evaluate(engine, build_byte_tokenizer(), None, system=None, user="{q}",  # type: ignore[arg-type]
                       samples=[Sample(sample_id="a", fields={"q": "1+1"}, answer="2")],
                       reward=lambda _text, _sample: 0.0, settings=EpisodeSettings(max_new_tokens_per_turn=4),
                       k=3, out_path=tmp_path / "out.jsonl", meta={})
    assert (engine.calls, engine.cancelled) == (3, 2)


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return memorised.make_memorised_model_dir(tmp_path_factory.mktemp("memorised-eval"))


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cli", "eval", *args, "--no-progress"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def _write_memorised_task(tmp_path: Path, eval_settings: dict, *, has_tool: bool = True) -> Path:
    """tmp_path/task.yaml: the memorised question ("6*7", answer 42) with the Python tool (or none)."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": memorised.QUESTION, "answer": "42"}) + "\n")
    task = {"name": "six-times-seven", "dataset": {"type": "file", "path": "data.jsonl"},
            "fields": {"answer": "answer", "template_fields": {"question": "question"}},
            "prompt": {"system": memorised.SYSTEM, "user": "{question}"},
            "tool": {"type": "python", "timeout_s": 10, "warm_pool_size": 0} if has_tool else None,
            "loop": {"max_total_tokens": 400}, "reward": {"type": "math_verify"}, "eval": eval_settings}
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(task))
    return path


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
def test_vcpo_eval_runs_the_tool_loop_writes_samples_and_resumes(tmp_path: Path, memorised_dir: Path) -> None:
    _write_memorised_task(tmp_path, {"k": 2, "temperature": 0.0})
    out = tmp_path / "samples.jsonl"
    args = [str(tmp_path / "task.yaml"), "--model", str(memorised_dir), "--backend", "hf", "--out", str(out)]
    first = _eval(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0]["kind"] == "meta" and len(lines) == 3
    for sample in lines[1:]:
        assert sample["is_correct"] and sample["extracted"] == "42" and sample["tool_calls"] == 1
        assert sample["turns"][0]["code"] == "print(6*7)" and "42" in sample["turns"][0]["observation"]
    summary = json.loads(out.with_suffix(".summary.json").read_text())
    assert summary["avg@2"] == 1.0 and summary["pass@2"] == 1.0 and summary["maj@2"] == 1.0
    assert "avg@2" in first.stdout and "100.0%" in first.stdout
    # a killed run leaves a torn line: the rerun drops it and runs only the missing sample
    out.write_text("\n".join(out.read_text().splitlines()[:2]) + '\n{"kind": "sam')
    second = _eval(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3 and sorted(line["index"] for line in lines[1:]) == [0, 1]
    # other settings, same file: refused, nothing overwritten
    third = _eval(*args, "--k", "3")
    assert third.returncode == 2 and "other settings" in third.stderr


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_vcpo_eval_through_an_openai_compatible_url(tmp_path: Path, memorised_dir: Path) -> None:
    """`--backend openai --url`: the same tool loop over HTTP (a loopback stand-in server backed by
    the real HF engine on the memorised model, speaking vLLM's /v1/completions dialect)."""
    import asyncio

    from transformers import AutoTokenizer

    from cli import main
    from rollout.engines.hf_engine import HFEngine
    from tests.rollout.standin_servers import OpenAIStandin, serve

    _write_memorised_task(tmp_path, {"temperature": 0.0})
    tokenizer = AutoTokenizer.from_pretrained(memorised_dir)
    out = tmp_path / "samples.jsonl"
    async with HFEngine(memorised_dir) as engine:
        server = OpenAIStandin(engine, tokenizer.decode,
                               lambda text: tokenizer.encode(text, add_special_tokens=False))
        server.app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": str(memorised_dir)}]})
        async with serve(server.app) as url:
            code = await asyncio.to_thread(main, [
                "eval", str(tmp_path / "task.yaml"), "--backend", "openai", "--url", f"{url}/v1",
                "--model", str(memorised_dir), "--out", str(out), "--no-progress"])
    assert code == 0
    sample = json.loads(out.read_text().splitlines()[1])
    assert sample["is_correct"] and sample["tool_calls"] == 1 and len(server.calls) == 2  # two turns


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")
async def test_vcpo_eval_sends_the_served_name_and_reads_the_tokenizer_from_model(
    tmp_path: Path, memorised_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server knows the model as 'smol' (and refuses any other name with vLLM's 404); the
    tokenizer is a local directory the server has never heard of. `--served-model smol` works, and
    so does leaving it out: the server's /v1/models lists one model, which is then used."""
    import asyncio

    from transformers import AutoTokenizer

    from cli import main
    from rollout.engines.hf_engine import HFEngine
    from tests.rollout.standin_servers import OpenAIStandin, serve

    task = _write_memorised_task(tmp_path, {"temperature": 0.0})
    tokenizer = AutoTokenizer.from_pretrained(memorised_dir)
    monkeypatch.chdir(tmp_path)  # the default --out is evals/<task>-<served name>.jsonl under the cwd
    async with HFEngine(memorised_dir) as engine:
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        server = OpenAIStandin(engine, tokenizer.decode, encode, served=("smol",))
        async with serve(server.app) as url:
            common = ["eval", str(task), "--backend", "openai", "--url", f"{url}/v1", "--model",
                      str(memorised_dir), "--no-progress"]
            named = await asyncio.to_thread(main, [*common, "--served-model", "smol", "--out", "named.jsonl"])
            detected = await asyncio.to_thread(main, common)
    assert (named, detected) == (0, 0), capsys.readouterr().err
    assert [call["model"] for call in server.calls] == ["smol"] * 4  # two turns per run
    for out in (tmp_path / "named.jsonl", tmp_path / "evals" / "six-times-seven-smol.jsonl"):
        meta, sample = (json.loads(line) for line in out.read_text().splitlines())
        assert meta["meta"]["served_model"] == "smol" and meta["meta"]["model"] == str(memorised_dir)
        assert sample["is_correct"] and sample["tool_calls"] == 1
    assert f"smol (tokenizer: {memorised_dir})" in capsys.readouterr().out


def test_choose_served_model() -> None:
    from cli.eval_command import EvalArgumentError, choose_served_model

    assert choose_served_model(["smol"], "default", "http://h/v1") == "smol"  # the only one, whatever --model
    assert choose_served_model(["a", "b"], "b", "http://h/v1") == "b"  # the one equal to --model
    with pytest.raises(EvalArgumentError, match=r"http://h/v1/models lists no model"):
        choose_served_model([], "b", "http://h/v1")


async def _eval_in_process(*args: str) -> int:
    import asyncio

    from cli import main

    return await asyncio.to_thread(main, ["eval", *args, "--no-progress"])


def _models_server(*models: dict[str, Any]) -> Any:
    """A FastAPI app whose /v1/models lists `models` (as vLLM's OpenAI server does); tests add routes."""
    from fastapi import FastAPI

    app = FastAPI()
    app.get("/v1/models")(lambda: {"object": "list", "data": list(models)})
    return app


async def test_eval_with_several_served_models_and_no_match_says_to_pass_served_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.rollout.standin_servers import serve

    task = _write_memorised_task(tmp_path, {}, has_tool=False)
    app = _models_server({"id": "smol"}, {"id": "big"})
    async with serve(app) as url:
        code = await _eval_in_process(str(task), "--backend", "openai", "--url", f"{url}/v1/",
                                      "--model", "default", "--out", str(tmp_path / "out.jsonl"))
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"error: {url}/v1/models lists 'smol', 'big', none of them is --model 'default'; pass the "
                   "name to send as --served-model NAME\n")
    assert not (tmp_path / "out.jsonl").exists()


async def test_a_served_name_given_as_model_says_where_it_belongs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a user tried first: `--model smol` with smol the served name. --model is the tokenizer."""
    from tests.rollout.standin_servers import serve

    task = _write_memorised_task(tmp_path, {}, has_tool=False)
    app = _models_server({"id": "smol"})
    async with serve(app) as url:
        code = await _eval_in_process(str(task), "--backend", "openai", "--url", f"{url}/v1",
                                      "--model", "smol")
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "model 'smol' is neither a local directory nor a hub id" in err
    assert "--model is where the tokenizer comes from" in err and "goes in --served-model" in err


async def test_eval_against_an_unreachable_server_is_one_line_naming_the_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.rollout.standin_servers import free_port

    task = _write_memorised_task(tmp_path, {}, has_tool=False)
    url = f"http://127.0.0.1:{free_port()}/v1"
    code = await _eval_in_process(str(task), "--backend", "openai", "--url", url)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert f"GET {url}/models" in err and "ConnectError" in err


async def test_an_episode_budget_beyond_the_served_context_stops_before_any_request(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM lists each model's max_model_len and refuses (HTTP 400) any turn whose max_tokens passes it;
    a task budget longer than that is refused up front, with both fixes; within it, requests go out."""
    from fastapi.responses import JSONResponse

    from tests.rollout.standin_servers import serve

    task = _write_memorised_task(tmp_path, {}, has_tool=False)  # loop.max_total_tokens: 400
    app, completions = _models_server({"id": "smol", "max_model_len": 256}), []

    def refuse(body: dict[str, Any]) -> JSONResponse:
        """Record the request (FastAPI reads a dict parameter from the JSON body) and answer as vLLM does
        an unknown name, so no sample finishes."""
        completions.append(body)
        return JSONResponse({"error": {"message": "no", "code": 404}}, status_code=404)

    app.post("/v1/completions")(refuse)
    async with serve(app) as url:
        common = ["--backend", "openai", "--url", f"{url}/v1", "--model", str(tiny_model_dir),
                  "--out", str(tmp_path / "out.jsonl")]
        detected = await _eval_in_process(str(task), *common)
        named = await _eval_in_process(str(task), *common, "--served-model", "smol")
        first_err = capsys.readouterr().err
        assert not completions
        within = await _eval_in_process(str(task), "eval.max_total_tokens=256", *common)
    message = (f"error: {url}/v1/models gives 'smol' a context of 256 tokens (max_model_len), less than "
               "this task's episode budget of 400 tokens; restart the server with --max-model-len 400 or "
               "lower the budget with the override eval.max_total_tokens=256\n")
    assert (detected, named) == (2, 2) and first_err == message * 2
    assert within == 2
    assert capsys.readouterr().err.startswith(f"error: POST {url}/v1/completions answered HTTP 404")
    # the first turn asks for exactly what the context has left after the prompt
    assert completions and completions[0]["max_tokens"] + len(completions[0]["prompt"]) == 256


async def test_a_url_without_the_api_root_says_where_models_live(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM serves /v1/models; `--url http://host:port` finds only a 404 "Not Found" there."""
    from tests.rollout.standin_servers import serve

    task = _write_memorised_task(tmp_path, {}, has_tool=False)
    app = _models_server({"id": "smol"})
    async with serve(app) as url:
        codes = [await _eval_in_process(str(task), "--backend", "openai", "--url", url, *served)
                 for served in ([], ["--served-model", "smol"])]
    err = capsys.readouterr().err
    assert codes == [2, 2]
    assert err == (f"error: GET {url}/models answered HTTP 404: Not Found; --url must be the server's API "
                   "root, e.g. http://127.0.0.1:8000/v1\n") * 2


def _refusing_server(status: int, body: dict | str) -> Any:
    """/v1/models lists 'smol'; every completion is answered with `status` and `body`."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    app = _models_server({"id": "smol"})
    answer = (JSONResponse(body, status_code=status) if isinstance(body, dict)
              else PlainTextResponse(body, status_code=status))
    app.post("/v1/completions")(lambda: answer)
    return app


async def test_a_server_404_during_eval_is_one_line_with_url_status_and_message(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Through the real command in a subprocess (so a traceback would show): the server refuses every
    completion as vLLM does for an unknown model name; three samples are in flight."""
    import asyncio

    from tests.rollout.standin_servers import serve

    task = _write_memorised_task(tmp_path, {"k": 3}, has_tool=False)
    vllm_404 = {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                          "param": "model", "code": 404}}
    async with serve(_refusing_server(404, vllm_404)) as url:
        done = await asyncio.to_thread(_eval, str(task), "--backend", "openai", "--url", f"{url}/v1",
                                       "--model", str(tiny_model_dir), "--served-model", "nope",
                                       "--out", str(tmp_path / "out.jsonl"))
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: POST {url}/v1/completions answered HTTP 404: The model `nope` does not "
                           "exist.\n")


@pytest.mark.parametrize(("status", "body", "message"), [
    (400, {"object": "error", "message": "This model's maximum context length is 1024 tokens.\nReduce it.",
           "type": "BadRequestError", "code": 400},
     "This model's maximum context length is 1024 tokens. Reduce it."),  # vLLM's older error shape
    (422, {"detail": [{"loc": ["body", "prompt"], "msg": "Field required"}]},
     '[{"loc": ["body", "prompt"], "msg": "Field required"}]'),  # FastAPI validation
    (500, "Internal Server Error\n  Traceback (most recent call last):\n  boom", "Internal Server Error "
     "Traceback (most recent call last): boom"),  # plain text, several lines
])
async def test_other_http_errors_during_eval_are_one_line_too(
    tmp_path: Path, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], status: int, body: Any,
    message: str
) -> None:
    from tests.rollout.standin_servers import serve

    task = _write_memorised_task(tmp_path, {}, has_tool=False)
    async with serve(_refusing_server(status, body)) as url:
        code = await _eval_in_process(str(task), "--backend", "openai", "--url", f"{url}/v1",
                                      "--model", str(tiny_model_dir), "--out", str(tmp_path / "out.jsonl"))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == f"error: POST {url}/v1/completions answered HTTP {status}: {message}\n"
