"""Tiny real models that have memorised one tool-using episode of a task's own prompt (test support).

The trick of tests/agent_env/memorised.py for any task: a tiny byte-level Llama trained for a few
hundred Adam steps on (the task's rendered prompt → a fixed episode text + EOS) reproduces the
episode under greedy decoding, and mostly at temperature 1. The real engine, real tool and real loop
then run a genuine multi-turn episode whose every token is known in advance. The episode text must
contain the tool's real output where the loop will append it, or the model goes off script there.
"""

from __future__ import annotations

from pathlib import Path

from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from configs.task_schema import TaskConfig
from rollout.tiny import TinyModelSpec, build_byte_tokenizer, make_tiny_model_dir, teach_tiny_model


def task_prompt_ids(task: TaskConfig, sample: Sample) -> list[int]:
    """The token ids the agent loop starts `sample`'s episode from (byte tokenizer, ChatML)."""
    messages = render_messages(task.prompt.system, task.prompt.user, sample)
    return render_prompt_ids(build_byte_tokenizer(), messages)


def memorise_episode(out_dir: Path, prompt_ids: list[int], episode_text: str, steps: int = 400) -> Path:
    """Write to `out_dir` a tiny model trained to continue `prompt_ids` with `episode_text` + EOS."""
    make_tiny_model_dir(out_dir, TinyModelSpec(hidden_size=96, intermediate_size=192, seed=1))
    tokenizer = build_byte_tokenizer()
    completion = [*tokenizer.encode(episode_text, add_special_tokens=False), tokenizer.eos_token_id]
    teach_tiny_model(out_dir, [(prompt_ids, completion)], steps=steps, lr=3e-3, stop_loss=1e-3)
    return out_dir
