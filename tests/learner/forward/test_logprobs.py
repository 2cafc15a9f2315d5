"""Packed forward log-probabilities equal per-sequence ones: no attention across trajectories; with a
group's prompt shared, the same log-probs, statistics and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from learner.forward.logprobs import (
    check_packing_aware,
    packed_target_logprobs,
    packed_target_stats,
    token_logprobs,
    trajectory_logliks,
)
from learner.forward.packing import TrajectoryTokens, build_microbatch, pack_trajectories, share_prefixes
from learner.forward.varlen_attention import attention_segments, register_varlen_sdpa
from tests.learner.conftest import shared_prompt_trajectories, tiny_model


def test_token_logprobs_by_hand() -> None:
    # softmax([0, ln 3]) = [1/4, 3/4]
    logits = torch.tensor([[0.0, math.log(3.0)], [0.0, math.log(3.0)]])
    got = token_logprobs(logits, torch.tensor([1, 0]))
    assert torch.allclose(got, torch.tensor([math.log(0.75), math.log(0.25)]))


def test_trajectory_logliks_weight_and_split_by_trajectory() -> None:
    a = TrajectoryTokens([5, 6, 7, 8], [False, False, True, True], group_id=1)
    b = TrajectoryTokens([9, 10, 11], [False, True, False], group_id=2)
    batch = build_microbatch([a, b], [0, 1])  # targets at positions 1, 2 (c = 1/2) and 4 (c = 1)
    # ℓ_a = ½(−1) + ½(−2) = −1.5; ℓ_b = 1·(−3) = −3
    got = trajectory_logliks(torch.tensor([-1.0, -2.0, -3.0]), batch)
    assert got.tolist() == [-1.5, -3.0]


@pytest.mark.parametrize(
    ("kind", "attention"),
    [("llama_tied", "sdpa"), ("llama_tied", "eager"), ("qwen2", "sdpa"), ("qwen2", "varlen")],
)
def test_packed_logprobs_equal_unpacked(
    kind: str, attention: str, trajectories: list[TrajectoryTokens]
) -> None:
    model = tiny_model(kind, register_varlen_sdpa() if attention == "varlen" else attention)
    with torch.no_grad():
        for batch in pack_trajectories(trajectories, max_tokens=120):
            packed = packed_target_logprobs(model, batch)
            offset = 0
            for j in range(batch.num_trajectories):
                count = batch.target_counts[j]
                single = packed_target_logprobs(model, batch.select(j))
                torch.testing.assert_close(packed[offset : offset + count], single, rtol=1e-5, atol=1e-5)
                offset += count


def test_token_logprobs_gradient_matches_finite_differences() -> None:
    logits = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, torch.tensor([1, 4, 0])), (logits,))


def test_unknown_attention_implementation_is_rejected() -> None:
    model = tiny_model("llama_tied")
    model.config._attn_implementation = "some_custom_kernel"
    with pytest.raises(ValueError, match="isolate packed trajectories"):
        check_packing_aware(model)


def test_autocast_auto_is_bf16_only_where_the_hardware_does_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from configs.schema import RunConfig
    from learner.forward.logprobs import autocast_dtype
    from run.train.learner_setup import learner_autocast

    cpu = torch.device("cpu")
    assert autocast_dtype("none", cpu) is None and autocast_dtype("bfloat16", cpu) is torch.bfloat16
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": True, "avx2": True})
    assert autocast_dtype("auto", cpu) is torch.bfloat16
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx512_bf16": False, "avx2": True})
    assert autocast_dtype("auto", cpu) is None  # emulated bf16 would be slower than fp32
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    config = RunConfig.model_validate({"learner": {"autocast": "auto"}})
    assert learner_autocast(config, cpu) is torch.bfloat16
    # where autocast cannot apply, 'auto' means off (no error, unlike an explicit 'bfloat16')
    megatron = {"learner": {"backend": "megatron", "autocast": "auto"}}
    for fields in ({"model": {"dtype": "bfloat16"}}, megatron):
        fields.setdefault("learner", {"autocast": "auto"})
        assert learner_autocast(RunConfig.model_validate(fields), cpu) is None


def test_attention_segments_find_roots_and_branches() -> None:
    positions = torch.tensor([[0, 1, 2, 3, 4, 2, 3, 0, 1, 0, 1, 2, 1, 2, 3]])
    assert [(s.start, s.end, s.root, s.prefix) for s in attention_segments(positions)] == [
        (0, 5, 0, 0), (5, 7, 0, 2), (7, 9, 7, 0), (9, 12, 9, 0), (12, 15, 9, 1)]
    with pytest.raises(ValueError, match="has only 2 tokens"):
        attention_segments(torch.tensor([[0, 1, 5, 6]]))  # a branch from position 5 of a 2-token root
    with pytest.raises(ValueError, match="start at 0"):
        attention_segments(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_shared_prompts_give_the_unshared_logprobs_stats_and_gradient(kind: str) -> None:
    trajectories = shared_prompt_trajectories(num_groups=3, per_group=4, seed=1)
    model = tiny_model(kind, register_varlen_sdpa())
    batch = build_microbatch(trajectories, list(range(len(trajectories))))
    layout = share_prefixes(batch)
    assert layout is not None and layout.num_tokens < 0.6 * batch.num_tokens
    with torch.no_grad():
        full_stats = packed_target_stats(model, batch)
        shared_stats = packed_target_stats(model, batch, layout=layout)
    for full, shared in zip(full_stats, shared_stats, strict=True):
        torch.testing.assert_close(shared, full, rtol=1e-5, atol=1e-5)
    # differentiable like the unshared forward: the same gradient of a loss over every target
    weights = torch.randn(int(batch.target_mask.sum()), generator=torch.Generator().manual_seed(0))
    grads = []
    for shared_layout in (None, layout):
        model.zero_grad()
        (packed_target_logprobs(model, batch, layout=shared_layout) * weights).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, full in grads[0].items():
        torch.testing.assert_close(grads[1][name], full, rtol=1e-4, atol=1e-5, msg=name)


def test_a_shared_prompt_layout_is_refused_where_the_attention_cannot_branch() -> None:
    trajectories = shared_prompt_trajectories(num_groups=2, per_group=3, seed=2)
    model = tiny_model("llama_tied", "sdpa")  # HF's sdpa would let a branch see only itself
    batch = build_microbatch(trajectories, list(range(len(trajectories))))
    with pytest.raises(ValueError, match="read another's prompt"):
        packed_target_logprobs(model, batch, layout=share_prefixes(batch))
