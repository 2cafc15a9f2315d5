"""Tiny random-weight HF causal LMs and packed variable-length trajectories for learner tests."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from learner.forward.packing import TrajectoryTokens
from learner.traj_grads.opob_grad import BaselineFn

VOCAB = 160
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
}


def tiny_model(
    kind: str, attn_implementation: str = "sdpa", seed: int = 0, layers: int = 2
) -> torch.nn.Module:
    """kind: 'llama_tied' (SmolLM2-like), 'llama_untied', or 'qwen2' (q/k/v biases, untied)."""
    torch.manual_seed(seed)
    common = {**_COMMON, "num_hidden_layers": layers}
    if kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=False, attn_implementation=attn_implementation)
        model = Qwen2ForCausalLM(config)
    else:
        config = LlamaConfig(
            **common, tie_word_embeddings=kind == "llama_tied", attn_implementation=attn_implementation
        )
        model = LlamaForCausalLM(config)
    with torch.no_grad():  # random RMSNorm scales, so a wrong x̂ or δ cannot hide behind ones
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.float().eval()


def random_trajectories(num_groups: int, per_group: int, seed: int = 0) -> list[TrajectoryTokens]:
    """Lengths 3..40; a 1–5 token prompt masked out, and in longer ones a 3-token tool span too.

    Token 0 (the pad id) appears in some trajectories so the embedding's padding_idx is exercised.
    """
    rng = random.Random(seed)
    trajectories = []
    for group in range(num_groups):
        for _ in range(per_group):
            length = rng.randint(3, 40)
            prompt = rng.randint(1, min(5, length - 1))
            ids = [rng.randrange(VOCAB) for _ in range(length)]
            if rng.random() < 0.3:
                ids[rng.randrange(length)] = 0
            loss_mask = [False] * prompt + [True] * (length - prompt)
            if length - prompt > 8:
                tool_start = rng.randint(prompt + 1, length - 4)
                loss_mask[tool_start : tool_start + 3] = [False] * 3
            trajectories.append(TrajectoryTokens(ids, loss_mask, group_id=100 + group))
    return trajectories


def shared_prompt_trajectories(num_groups: int, per_group: int, seed: int = 0, prompt: int = 20
                               ) -> list[TrajectoryTokens]:
    """Groups whose members share a `prompt`-token prompt (as an RL group does), responses of 3..20
    tokens, some with a tool span; the second member of every group starts its response like the first
    (the common prefix runs past the prompt) and the last member of group 0 is not trained."""
    rng = random.Random(seed)
    trajectories: list[TrajectoryTokens] = []
    for group in range(num_groups):
        shared = [rng.randrange(1, VOCAB) for _ in range(prompt + group)]
        first_response: list[int] = []
        for member in range(per_group):
            response = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 20))]
            if member == 0:
                first_response = response
            if member == 1:
                response = first_response[:2] + response
            loss_mask = [False] * len(shared) + [True] * len(response)
            if len(response) > 10:
                loss_mask[len(shared) + 5 : len(shared) + 8] = [False] * 3
            if group == 0 and member == per_group - 1:
                loss_mask = [False] * len(loss_mask)
            trajectories.append(TrajectoryTokens(shared + response, loss_mask, group_id=100 + group))
    return trajectories


def vcpo_coefficients(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """VCPO-shaped per-trajectory coefficients: a_i = w_i R_i / B and s_i = w_i / B (σ = 1), random w, R."""
    generator = torch.Generator().manual_seed(seed)
    weights = torch.rand(count, generator=generator) * 2.0
    rewards = torch.randint(0, 2, (count,), generator=generator).float()
    return weights * rewards / count, weights / count


def optimal_baseline(a: torch.Tensor, s: torch.Tensor) -> BaselineFn:
    """The per-group b* = Σ s²‖g‖² (a/s) / Σ s²‖g‖² of those coefficients (a/s is each reward)."""

    def baseline(group: int, members: torch.Tensor, sq_norms: torch.Tensor) -> float:
        importance = s[members] ** 2 * sq_norms
        return float((importance * (a / s)[members]).sum() / importance.sum())

    return baseline


def capture_grads(learner: object) -> dict[str, torch.Tensor]:
    """Make `learner`'s next step record every parameter's gradient here (and skip its optimizer step):
    the dict fills when the step reaches `_finish`."""
    captured: dict[str, torch.Tensor] = {}

    def finish(lr_scale: float) -> float:
        for name, p in learner.model.named_parameters():  # type: ignore[attr-defined]
            captured[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        learner.model.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        return 0.0

    learner._finish = finish  # type: ignore[attr-defined]
    return captured


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a busy
    neighbour makes OpenMP's spinning threads ~100× slower; run each learner test on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def trajectories() -> list[TrajectoryTokens]:
    """3 groups × 3 trajectories (about 200 tokens)."""
    return random_trajectories(num_groups=3, per_group=3)
