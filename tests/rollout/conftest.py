"""Fixtures for engine tests: the default model's reference forward and chat prompts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

QUESTIONS = (
    "What is 2+3?",
    "Name three colours of the rainbow and say which one you like best.",
    "Write one sentence about the sea.",
    "Count from one to five.",
)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def reference_model(default_model_dir: Path) -> PreTrainedModel:
    """The default model in fp32: the learner's view of the weights the engines start from."""
    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def chat_prompts(default_tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Chat-formatted prompts of different lengths, as token ids."""
    return [
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for q in QUESTIONS
    ]
