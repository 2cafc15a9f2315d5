"""Choosing and building engines from settings; the engine benchmark's JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError
from transformers import AutoModelForCausalLM

from rollout import factory
from rollout.bench import run_engine_bench
from rollout.errors import EngineUnavailable
from rollout.hf_engine import HFEngine
from rollout.openai_engine import OpenAIEngine
from rollout.settings import (
    AutoEngineSettings,
    EngineSettings,
    HFEngineSettings,
    SGLangEngineSettings,
    VLLMEngineSettings,
)
from rollout.sglang_engine import SGLangEngine


def test_settings_are_a_tagged_union_with_guided_errors() -> None:
    parse = TypeAdapter(EngineSettings).validate_python
    assert isinstance(parse({"backend": "hf", "max_batch_size": 4}), HFEngineSettings)
    assert isinstance(parse({"backend": "openai", "model": "m"}), factory.OpenAIEngineSettings)
    with pytest.raises(ValidationError, match="max_batch_sise"):
        parse({"backend": "hf", "max_batch_sise": 4})
    with pytest.raises(
        ValidationError, match="set use_prefix_caching=False or use_kv_recompute_on_update=True"
    ):
        VLLMEngineSettings(use_kv_recompute_on_update=False)
    with pytest.raises(ValidationError, match="weights_dir is not set"):
        SGLangEngineSettings(weight_sync="disk")


def test_auto_picks_vllm_when_it_runs_here_else_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    auto = AutoEngineSettings()
    expected = auto.vllm if factory.vllm_unavailable_reason() is None else auto.hf
    assert factory.choose_backend(auto) == expected
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "vllm is not installed" in factory.vllm_unavailable_reason()
    assert factory.choose_backend(auto) == auto.hf
    assert factory.choose_backend(HFEngineSettings(dtype="bfloat16")).dtype == "bfloat16"


def test_build_engine_returns_the_backend_asked_for(tmp_path: Path) -> None:
    assert isinstance(factory.build_engine(HFEngineSettings(), tmp_path), HFEngine)
    assert isinstance(factory.build_engine(SGLangEngineSettings(weight_sync="tensor")), SGLangEngine)
    assert isinstance(factory.build_engine(factory.OpenAIEngineSettings(model="m")), OpenAIEngine)
    with pytest.raises(ValueError, match="pass model_dir"):
        factory.build_engine(HFEngineSettings())


async def test_auto_falls_back_to_hf_when_vllm_fails_to_start(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class BrokenVLLM(HFEngine):
        name = "vllm"

        async def start(self) -> None:
            raise EngineUnavailable("vllm", "failed to start", "RuntimeError: no CPU attention kernel")

    monkeypatch.setattr(factory, "vllm_unavailable_reason", lambda: None)
    monkeypatch.setattr(
        factory,
        "build_engine",
        lambda settings, model_dir, tokenizer=None: (
            BrokenVLLM(model_dir)
            if isinstance(settings, AutoEngineSettings)
            else HFEngine(model_dir, settings)
        ),
    )
    engine = await factory.start_engine(AutoEngineSettings(), tiny_model_dir)
    try:
        assert type(engine) is HFEngine
    finally:
        await engine.close()


def test_bench_reports_tokens_per_s_against_hf_generate(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\['sglang'\] cannot be benchmarked in-process"):
        run_engine_bench(str(tiny_model_dir), tmp_path, backends=("hf", "sglang"))
    result = run_engine_bench(
        str(tiny_model_dir),
        tmp_path,
        concurrencies=(1, 2),
        max_new_tokens=4,
        backends=("hf",),
        min_requests=2,
    )
    json.dumps(result)  # JSON-able
    assert set(result["hf_generate"]["tokens_per_s"]) == {"1", "2"}
    hf = result["backends"]["hf"]
    assert set(hf["tokens_per_s"]) == {"1", "2"} and hf["weight_push_s"] >= 0
    ratio = hf["tokens_per_s"]["2"] / result["hf_generate"]["tokens_per_s"]["2"]
    # the reported speedup is rounded to 2 decimals: it may differ from the ratio by up to 0.005
    assert result["speedup_vs_hf_generate"]["hf"]["2"] == pytest.approx(ratio, abs=0.0051)
    assert result["unavailable"] == {}
    assert result["target"]["backend"] in ("hf", "vllm") and result["target"]["speedup"] == 2.5
    # the c=1 roofline counts the bytes a decode step reads: every weight once (the input embedding
    # table only when it is not also the output layer)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    read = {id(p): p.numel() for name, p in model.named_parameters()
            if model.config.tie_word_embeddings or "embed_tokens" not in name}
    bound = result["decode_bound"]
    assert bound["weight_bytes"] == 4 * sum(read.values())
    assert bound["memory_read_gbps"] > 0.5
    assert bound["tokens_per_s_c1"] == pytest.approx(bound["memory_read_gbps"] * 1e9 / bound["weight_bytes"],
                                                    rel=0.01)
    assert set(bound["fraction_of_bound_c1"]) == {"hf_generate", "hf"}


@pytest.mark.parametrize("use_eager", [True, False])
def test_bench_builds_vllm_in_the_requested_compile_mode(tiny_model_dir: Path, use_eager: bool) -> None:
    from rollout.bench import _build

    engine = _build("vllm", tiny_model_dir, "float32", 8, vllm_use_eager=use_eager)  # not started
    assert engine._settings.use_eager is use_eager and engine._settings.max_num_seqs == 32


def test_bench_runs_one_torch_thread_at_a_time(tiny_model_dir: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """An idle second torch thread halves a CPU engine's decode speed (libgomp stops spinning once the
    OpenMP teams outnumber the cores): while an engine is measured, no other engine's or the baseline's
    thread may be alive, and while the baseline runs, no engine thread."""
    import threading

    from rollout import bench

    def torch_threads() -> list[str]:
        return sorted(t.name.rsplit("_", 1)[0] for t in threading.enumerate()
                      if t.name.startswith("vcpo-") and ("-engine" in t.name or "bench-baseline" in t.name))

    seen: list[tuple[str, list[str]]] = []
    serve, measure = bench._serve, bench._HFGenerateBaseline.tokens_per_s

    async def spy_serve(*args: object) -> float:
        seen.append(("engine", torch_threads()))
        return await serve(*args)

    def spy_measure(self: object, *args: object) -> float:
        seen.append(("baseline", torch_threads()))
        return measure(self, *args)

    monkeypatch.setattr(bench, "_serve", spy_serve)
    monkeypatch.setattr(bench._HFGenerateBaseline, "tokens_per_s", spy_measure)
    run_engine_bench(str(tiny_model_dir), tmp_path, concurrencies=(1, 2), max_new_tokens=2, backends=("hf",),
                     min_requests=2)
    assert {kind for kind, _ in seen} == {"engine", "baseline"}
    for kind, threads in seen:
        alone = ["vcpo-hf-engine"] if kind == "engine" else ["vcpo-bench-baseline"]
        assert threads == alone, (kind, threads)
