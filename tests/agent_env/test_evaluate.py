"""`vcpo eval`: metrics by hand, and the whole command with the real HF engine and sandbox on the
memorised tiny agent (it answers 6*7 by running Python): JSONL per sample, resume, summary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent_env.eval_metrics import majority_is_correct, pass_at_k, summarize
from tests.agent_env import memorised

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.fixture(scope="module")
def memorised_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return memorised.make_memorised_model_dir(tmp_path_factory.mktemp("memorised-eval"))


def _eval(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "learner.cli", "eval", *args, "--no-progress"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def _write_memorised_task(tmp_path: Path, eval_settings: dict) -> Path:
    """tmp_path/task.yaml: the memorised question ("6*7", answer 42) with the Python tool."""
    (tmp_path / "data.jsonl").write_text(json.dumps({"question": memorised.QUESTION, "answer": "42"}) + "\n")
    task = {"name": "six-times-seven", "dataset": {"type": "file", "path": "data.jsonl"},
            "fields": {"answer": "answer", "template_fields": {"question": "question"}},
            "prompt": {"system": memorised.SYSTEM, "user": "{question}"},
            "tool": {"type": "python", "timeout_s": 10, "warm_pool_size": 0},
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

    from learner.cli import main
    from rollout.hf_engine import HFEngine
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
