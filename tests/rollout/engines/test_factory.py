"""Choosing and building engines from settings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pydantic import TypeAdapter, ValidationError

from rollout.engines import factory
from rollout.engines.hf_engine import HFEngine
from rollout.engines.openai_engine import OpenAIEngine
from rollout.engines.sglang_engine import SGLangEngine
from rollout.errors import EngineUnavailable
from rollout.settings import (
    AutoEngineSettings,
    EngineSettings,
    HFEngineSettings,
    SGLangEngineSettings,
    VLLMEngineSettings,
)


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
