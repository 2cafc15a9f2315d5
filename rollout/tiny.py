"""Tiny random-weight HF models for fast tests and benchmarks, fully offline.

A tiny model is a real HF checkpoint directory (config.json + safetensors + tokenizer), so every
loader, engine and learner treats it exactly like the default model — only smaller. Its tokenizer
is a byte-level BPE with no merges (256 byte tokens + ChatML special tokens) built in code, so no
file has to be downloaded or shipped; the chat template is ChatML like SmolLM2's, with Qwen2.5's way of
rendering `tools=` and tool messages (function calling).

Not for: anything where the model's outputs must mean something (weights are random).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    # with `tools=`: a system turn listing their schemas, as Qwen2.5's template does (a given system
    # message is its first paragraph)
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\n</tools>\nCall one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>'"
    " + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    # tool results: consecutive tool messages in one user turn, each in <tool_response> tags
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML like SmolLM2's; given `tools=` it lists their schemas in a system turn and renders tool
messages in `<tool_response>` tags, as Qwen2.5's template does (without them it is plain ChatML)."""


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model. Defaults give ~0.1M parameters plus the byte vocabulary."""

    arch: Literal["llama", "qwen2"] = "llama"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    seed: int = 0


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 259-token byte-level tokenizer (256 bytes + 3 ChatML specials) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(spec: TinyModelSpec, vocab_size: int) -> PreTrainedModel:
    """A random-weight causal LM of `spec`'s shape, fp32, eval mode, seeded."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = LlamaConfig(**common) if spec.arch == "llama" else Qwen2Config(**common)
    config.architectures = ["LlamaForCausalLM" if spec.arch == "llama" else "Qwen2ForCausalLM"]
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(generator_state)
    return model.eval()


def make_tiny_model_dir(out_dir: Path, spec: TinyModelSpec | None = None) -> Path:
    """Write a tiny model + byte tokenizer as an HF checkpoint directory; returns `out_dir`.

    Token ids: the tokenizer puts the 256 bytes at 0..255 and the specials at 256..258, and the
    model's config names those ids as bos/eos/pad so generation stops on `<|im_end|>`.
    """
    spec = spec or TinyModelSpec()
    tokenizer = build_byte_tokenizer()
    model = build_tiny_model(spec, vocab_size=len(tokenizer))
    special = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
               (("bos", "<|im_start|>"), ("eos", "<|im_end|>"), ("pad", "<|endoftext|>"))}
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id, config.pad_token_id = (
            special["bos"], special["eos"], special["pad"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def padded_sft_batch(
    examples: list[tuple[list[int], list[bool]]], pad_id: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """(input ids, attention mask, labels) of right-padded (token ids, loss mask) rows; labels are
    the ids where the mask is set and -100 elsewhere (prompt, tool output, padding)."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for row, (tokens, mask) in enumerate(examples):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        attention[row, : len(tokens)] = 1
        targets = [token if trained else -100 for token, trained in zip(tokens, mask, strict=True)]
        labels[row, : len(tokens)] = torch.tensor(targets)
    return ids, attention, labels


def teach_tiny_model(
    model_dir: Path,
    examples: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    lr: float = 3e-3,
    seed: int = 0,
    stop_loss: float | None = None,
    until: Callable[[PreTrainedModel], bool] | None = None,
    check_every: int = 10,
) -> float:
    """Supervised-train the model in `model_dir` in place: full-batch Adam on (prompt ids, completion
    ids) pairs, loss on completion tokens only; returns the last loss. Stops early when the loss
    drops below `stop_loss` or when `until(model)` (asked every `check_every` steps, in eval mode
    without gradients) says so. One CPU thread (a tiny model only spins more). Used to pre-teach
    tiny models whose outputs must mean something."""
    import torch
    from transformers import AutoModelForCausalLM

    rows = [(prompt + completion, [False] * len(prompt) + [True] * len(completion))
            for prompt, completion in examples]
    ids, attention, labels = padded_sft_batch(rows)
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss_value = float("nan")
    try:
        for step in range(steps):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_value = loss.item()
            if stop_loss is not None and loss_value < stop_loss:
                break
            if until is not None and (step + 1) % check_every == 0:
                with torch.no_grad():
                    done = until(model.eval())
                model.train()
                if done:
                    break
    finally:
        torch.set_num_threads(threads)
        torch.random.set_rng_state(generator_state)
    model.eval().save_pretrained(model_dir, safe_serialization=True)
    return loss_value
