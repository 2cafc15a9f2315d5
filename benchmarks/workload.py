"""The model shape and the minibatch `vcpo bench learner` times (`BenchShape`, `BenchBatch`), apart from the
bench so that the kernel floor (`kernel_floor.py`) can describe the same step without importing it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from benchmarks.schema import check_bench_lengths


@dataclass(frozen=True)
class BenchShape:
    """A random model's architecture (HF config fields)."""

    kind: Literal["llama", "qwen2"] = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    """Defaults: SmolLM2-135M's shape."""

    def body_linears(self) -> list[tuple[int, int]]:
        """(in, out) of one decoder layer's linear layers, as HF Llama/Qwen2 lay them out: q, k, v, o, gate,
        up, down (biases ignored)."""
        head_dim = self.hidden_size // self.num_attention_heads
        q, kv = self.num_attention_heads * head_dim, self.num_key_value_heads * head_dim
        hidden, inner = self.hidden_size, self.intermediate_size
        return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inner), (hidden, inner),
                (inner, hidden)]


@dataclass(frozen=True)
class BenchBatch:
    """The timed minibatch: groups × group_size trajectories of `tokens` tokens; the first `prompt` are
    the same for a group's members, the last `sampled` are trained. The defaults are the default run's
    step, as `vcpo bench learner`'s config (`benchmarks/configs/learner.yaml`) has them."""

    groups: int = 2
    group_size: int = 8
    tokens: int = 240
    sampled: int = 70
    prompt: int = 150
    turns: int = 1
    """Sampled segments per trajectory. 1: the untrained tokens after the prompt, then the `sampled` ones
    (the default run's shape). n > 1, a multi-turn episode: after the prompt, n sampled segments with the
    untrained tokens (tool outputs) spread over the n − 1 gaps between them."""

    def __post_init__(self) -> None:
        check_bench_lengths(self.tokens, self.prompt, self.sampled)
        if self.turns < 1 or self.turns > self.sampled:
            raise ValueError(f"turns={self.turns} must be between 1 and sampled={self.sampled}")

    def loss_mask(self) -> tuple[bool, ...]:
        """Which of a trajectory's tokens are trained (module docstring's layouts)."""
        untrained = self.tokens - self.prompt - self.sampled
        if self.turns == 1:
            return (False,) * (self.tokens - self.sampled) + (True,) * self.sampled
        mask = [False] * self.prompt
        for turn in range(self.turns):
            mask += [True] * (self.sampled * (turn + 1) // self.turns - self.sampled * turn // self.turns)
            if turn < self.turns - 1:
                gap = untrained * (turn + 1) // (self.turns - 1) - untrained * turn // (self.turns - 1)
                mask += [False] * gap
        return tuple(mask)
