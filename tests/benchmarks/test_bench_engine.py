"""`vcpo bench engine`: paired rounds against HF `generate`, each backend in a worker process of its own."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.engine import run_engine_bench
from rollout.errors import EngineTimeout


def test_bench_reports_paired_rounds_against_hf_generate(tiny_model_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds, the vcpo HF engine against HF generate, each in a worker process of its own: rates per
    round, speedups as the median of each round's ratio, a weight push, the c=1 roofline."""
    from benchmarks import engine as bench

    with pytest.raises(ValueError, match=r"\['sglang'\] cannot be benchmarked in-process"):
        run_engine_bench(str(tiny_model_dir), tmp_path, backends=("hf", "sglang"))
    answers: list[tuple[str, str, dict[str, object]]] = []
    ask = bench.BenchWorker.ask

    def spy(self: bench.BenchWorker, command: dict[str, object], timeout_s: float = 60.0
            ) -> dict[str, object]:
        answer = ask(self, command, timeout_s)
        answers.append((self.backend, str(command["op"]), answer))
        return answer

    monkeypatch.setattr(bench.BenchWorker, "ask", spy)
    result = run_engine_bench(str(tiny_model_dir), tmp_path, concurrencies=(1, 2), max_new_tokens=4,
                              backends=("hf",), min_requests=2, rounds=2)
    json.dumps(result)  # JSON-able
    base, hf = result["hf_generate"], result["backends"]["hf"]
    for numbers in (base, hf):
        assert set(numbers["tokens_per_s_per_round"]) == {"1", "2"}
        for c, rates in numbers["tokens_per_s_per_round"].items():
            assert len(rates) == 2 and all(rate > 0 for rate in rates)
            assert numbers["tokens_per_s"][c] == pytest.approx(sum(rates) / 2, abs=0.051)  # median, 1 dp
    assert hf["weight_push_s"] >= 0 and hf["start_s"] > 0
    assert hf["torch_threads"] == base["torch_threads"] == torch.get_num_threads()  # inherited, not cut
    for c in ("1", "2"):
        ratios = [e / b for e, b in zip(hf["tokens_per_s_per_round"][c], base["tokens_per_s_per_round"][c],
                                        strict=True)]
        # rounded to 2 decimals: each may differ from the exact ratio by up to 0.005
        assert result["speedup_per_round"]["hf"][c] == pytest.approx(ratios, abs=0.0051)
        assert result["speedup_vs_hf_generate"]["hf"][c] == pytest.approx(sum(ratios) / 2, abs=0.011)
    assert result["unavailable"] == {} and result["rounds"] == 2
    assert result["target"]["backend"] in ("hf", "vllm") and result["target"]["speedup"] == 2.5
    # turns: each round measures both at each concurrency, the order rotated from round to round
    serves = [(backend, answer) for backend, op, answer in answers if op == "serve"]
    assert [backend for backend, _ in serves] == ["hf_generate", "hf"] * 2 + ["hf", "hf_generate"] * 2
    # a process per backend, and no other engine thread beside the one measured
    pids = {backend: {answer["pid"] for b, answer in serves if b == backend}
            for backend in ("hf", "hf_generate")}
    assert all(len(p) == 1 for p in pids.values()) and pids["hf"] != pids["hf_generate"]
    assert os.getpid() not in pids["hf"] | pids["hf_generate"]
    for backend, answer in serves:
        assert answer["threads"] == (["vcpo-hf-engine"] if backend == "hf" else []), (backend, answer)
    # the c=1 roofline counts the bytes a decode step reads: every weight once (the input embedding
    # table only when it is not also the output layer); the bandwidth is probed once a round
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    read = {id(p): p.numel() for name, p in model.named_parameters()
            if model.config.tie_word_embeddings or "embed_tokens" not in name}
    bound = result["decode_bound"]
    assert bound["weight_bytes"] == 4 * sum(read.values())
    assert len(result["memory_read_gbps_per_round"]) == 2 and bound["memory_read_gbps"] > 0.5
    assert bound["tokens_per_s_c1"] == pytest.approx(bound["memory_read_gbps"] * 1e9 / bound["weight_bytes"],
                                                    rel=0.01)
    assert set(bound["fraction_of_bound_c1"]) == {"hf_generate", "hf"}


@pytest.mark.parametrize("use_eager", [True, False])
def test_bench_builds_vllm_in_the_requested_compile_mode(tiny_model_dir: Path, use_eager: bool) -> None:
    from benchmarks.engine_worker import build_engine

    engine = build_engine("vllm", tiny_model_dir, "float32", 8, vllm_use_eager=use_eager)  # not started
    assert engine._settings.use_eager is use_eager and engine._settings.max_num_seqs == 32


def test_a_bench_worker_that_dies_is_reported_not_waited_for(tiny_model_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine's worker killed mid-run: that backend is reported unavailable with the exit code, the
    run goes on with the baseline; a worker that never answers times out instead of hanging."""
    from benchmarks import engine as bench

    ask = bench.BenchWorker.ask

    def kill_the_engine(self: bench.BenchWorker, command: dict[str, object],
                        timeout_s: float = 60.0) -> dict[str, object]:
        if self.backend == "hf" and command["op"] == "serve":
            os.kill(self.pid, signal.SIGKILL)
        return ask(self, command, timeout_s)

    monkeypatch.setattr(bench.BenchWorker, "ask", kill_the_engine)
    result = run_engine_bench(str(tiny_model_dir), tmp_path, concurrencies=(1,), max_new_tokens=2,
                              backends=("hf",), min_requests=1, rounds=1)
    assert result["backends"] == {} and result["target"]["is_met"] == {}
    assert "the bench worker exited (code -9)" in result["unavailable"]["hf"]
    assert result["hf_generate"]["tokens_per_s_per_round"]["1"][0] > 0

    worker, _ = bench.BenchWorker.start({"backend": "hf_generate", "model_dir": str(tiny_model_dir),
                                         "dtype": "float32", "prompts": [[1, 2, 3]], "max_concurrency": 1})
    try:
        os.kill(worker.pid, signal.SIGSTOP)  # alive but silent
        with pytest.raises(EngineTimeout, match="did not answer within 1 s"):
            worker.ask({"op": "bandwidth"}, timeout_s=1.0)
    finally:
        worker.close()
