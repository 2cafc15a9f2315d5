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

    def __post_init__(self) -> None:
        check_bench_lengths(self.tokens, self.prompt, self.sampled)
