"""Model resolution and loading: the default model, tiny models, and the errors users see."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout.models import (
    ModelLoadError,
    find_default_gguf,
    load_causal_lm,
    load_tokenizer,
    resolve_model,
)
from rollout.tiny import TinyModelSpec, make_tiny_model_dir


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_tiny_model_directory_loads_like_any_checkpoint(tmp_path: Path, arch: str, tied: bool) -> None:
    directory = make_tiny_model_dir(tmp_path / arch, TinyModelSpec(arch=arch, tie_word_embeddings=tied))
    model = load_causal_lm(str(directory), tmp_path)
    tokenizer = load_tokenizer(str(directory), tmp_path)
    assert model.config.tie_word_embeddings is tied
    assert model.config.model_type == arch
    text = "<|im_start|>user\nhé ```python\nprint(1)```<|im_end|>\n"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text  # byte-level: exact round trip, specials are single tokens
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == model.config.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tokenizer))


def test_tiny_models_are_seeded(tmp_path: Path) -> None:
    a = load_causal_lm(str(make_tiny_model_dir(tmp_path / "a", TinyModelSpec(seed=7))), tmp_path)
    b = load_causal_lm(str(make_tiny_model_dir(tmp_path / "b", TinyModelSpec(seed=7))), tmp_path)
    c = load_causal_lm(str(make_tiny_model_dir(tmp_path / "c", TinyModelSpec(seed=8))), tmp_path)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[weight], b.state_dict()[weight])
    assert not torch.equal(a.state_dict()[weight], c.state_dict()[weight])


def test_path_without_config_is_rejected_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no config\.json; point model\.path at a Hugging Face"):
        resolve_model(str(tmp_path), tmp_path)


def test_unknown_spec_is_rejected_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="neither a local directory nor a hub id"):
        resolve_model("./no/such/model", tmp_path)


def test_hub_id_is_left_to_transformers(tmp_path: Path) -> None:
    resolved = resolve_model("Qwen/Qwen2.5-0.5B-Instruct", tmp_path)
    assert (resolved.name_or_path, resolved.is_local) == ("Qwen/Qwen2.5-0.5B-Instruct", False)


@pytest.mark.default_model
def test_default_model_conversion_is_exact_and_done_once(
    default_model_dir: Path, model_cache_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    assert resolve_model("default", model_cache_dir).name_or_path == str(default_model_dir)
    before = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m-instruct", model_cache_dir).name_or_path == str(default_model_dir)
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == before  # not converted again

    converted = load_causal_lm("default", model_cache_dir)
    tokenizer = load_tokenizer("default", model_cache_dir)
    assert converted.config.tie_word_embeddings
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()
    gguf = find_default_gguf()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}],
                                        add_generation_prompt=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, reference(ids).logits, rtol=0, atol=0)
