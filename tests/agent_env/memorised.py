"""A tiny real model that has memorised a tool-using answer: a deterministic agent for loop tests.

Random tiny models never write a ```python block. Training a tiny byte-level Llama for a few hundred
Adam steps on one full episode (prompt → code block → the sandbox's real output → boxed answer)
makes greedy decoding reproduce it, so the real engine, real sandbox and real loop run a genuine
multi-turn episode whose every token is known in advance. Test support only.
"""

from __future__ import annotations

from pathlib import Path

from agent_env.prompts import render_prompt_ids
from rollout.tiny import TinyModelSpec, build_byte_tokenizer, make_tiny_model_dir, teach_tiny_model

SYSTEM = "Use python."
QUESTION = "What is 6*7?"
TURN_1 = "Let me compute.\n```python\nprint(6*7)\n```\n"
OBSERVATION = "\n```output\n42\n```\n"
TURN_2 = "So the answer is \\boxed{42}."


def episode_text() -> str:
    return TURN_1 + OBSERVATION + TURN_2


def make_memorised_model_dir(out_dir: Path, steps: int = 400) -> Path:
    """Write the tiny model trained to continue the chat prompt with `episode_text()` + EOS."""
    make_tiny_model_dir(out_dir, TinyModelSpec(hidden_size=96, intermediate_size=192, seed=1))
    tokenizer = build_byte_tokenizer()
    prompt = render_prompt_ids(tokenizer, [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": QUESTION}])
    completion = [*tokenizer.encode(episode_text(), add_special_tokens=False), tokenizer.eos_token_id]
    teach_tiny_model(out_dir, [(prompt, completion)], steps=steps, lr=3e-3, stop_loss=1e-3)
    return out_dir
