"""A tiny real model that has memorised a tool-using answer: a deterministic agent for loop tests.

Random tiny models never write a ```python block. Training a tiny byte-level Llama for a few hundred
Adam steps on one full episode (prompt → code block → the sandbox's real output → boxed answer)
makes greedy decoding reproduce it, so the real engine, real sandbox and real loop run a genuine
multi-turn episode whose every token is known in advance. Test support only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.tiny import TinyModelSpec, build_byte_tokenizer, make_tiny_model_dir

SYSTEM = "Use python."
QUESTION = "What is 6*7?"
TURN_1 = "Let me compute.\n```python\nprint(6*7)\n```\n"
OBSERVATION = "\n```output\n42\n```\n"
TURN_2 = "So the answer is \\boxed{42}."


def episode_text() -> str:
    return TURN_1 + OBSERVATION + TURN_2


def make_memorised_model_dir(out_dir: Path, steps: int = 400) -> Path:
    """Write the tiny model trained to continue the chat prompt with `episode_text()` + EOS."""
    from transformers import AutoModelForCausalLM

    make_tiny_model_dir(out_dir, TinyModelSpec(hidden_size=96, intermediate_size=192, seed=1))
    tokenizer = build_byte_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    completion = [*tokenizer.encode(episode_text(), add_special_tokens=False), tokenizer.eos_token_id]
    ids = torch.tensor([prompt + completion])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    model = AutoModelForCausalLM.from_pretrained(out_dir).train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: extra threads only spin (and fight a busy neighbour)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if loss.item() < 1e-3:
                break
    finally:
        torch.set_num_threads(threads)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    return out_dir
