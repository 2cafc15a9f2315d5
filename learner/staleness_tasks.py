"""The verifiable synthetic tasks of `vcpo bench staleness`, and their pre-taught policies.

* `addition` (the `tiny` preset, configs/bench/staleness_tiny.yaml): "a+b=" → the sum, 1–2 answer
  tokens. A sequence weight there is a token weight, and every trajectory's gradient norm is about
  the same, so OPOB's norm term has nothing to do: a CI smoke, not a test of VCPO.
* `count` (the `paper` preset, configs/bench/staleness.yaml, the default): "17-41" → "17 18 19 … 41",
  every integer from the first to the second. Answers are long and variable (3 tokens per number, 4
  to 22 numbers: 12–66 tokens), so a sequence's IS weight is a product of many per-token ratios that
  drift a little with every policy update — the regime of LLM RL, where ESS falls with the lag because
  small token drifts accumulate. Reward 1 for the exact sequence. Training and evaluation prompts are
  disjoint (a seeded split of all (start, count) pairs).

The policy is a byte-level Llama (rollout/tiny.py) pre-taught by supervised learning on right answers
until its exact success probability on the evaluation prompts reaches `pretrain_success`: it knows the
format and leans towards the answer without being sure of it — where RL starts in practice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from configs.schema import StalenessBenchConfig

log = logging.getLogger(__name__)

COUNT_START = 10
"""Counting starts at a two-digit number (3 tokens per number, the space included)."""


@dataclass(frozen=True)
class Problem:
    """One prompt and its only right answer (the reward is exact match)."""

    prompt: str
    answer: str


def problems(bench: StalenessBenchConfig) -> tuple[list[Problem], list[Problem]]:
    """(training problems, evaluation problems). `addition` trains and evaluates on all of them (as the
    tiny preset always did); `count` holds `eval_fraction` of the (start, count) pairs out."""
    if bench.task == "addition":
        every = [Problem(f"{a}+{b}=", str(a + b))
                 for a in range(bench.max_operand + 1) for b in range(bench.max_operand + 1)]
        return every, every
    pairs = [(start, count) for count in range(bench.count_min, bench.count_max + 1)
             for start in range(COUNT_START, 100 - count + 1)]
    random.Random(bench.split_seed).shuffle(pairs)
    held_out = max(1, round(bench.eval_fraction * len(pairs)))
    as_problems = [Problem(f"{start}-{start + count - 1}", " ".join(map(str, range(start, start + count))))
                   for start, count in pairs]
    return as_problems[held_out:], as_problems[:held_out]


def task_file(bench: StalenessBenchConfig, root: Path) -> Path:
    """Write the training dataset and the task YAML into `root`; returns the YAML's path."""
    import yaml

    train, _ = problems(bench)
    rows = [{"id": f"p{i}", "question": p.prompt, "answer": p.answer} for i, p in enumerate(train)]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if bench.task == "addition":
        pattern, new_tokens = r"\A(\d+)\Z", 4
    else:
        pattern, new_tokens = r"\A(\d+(?: \d+)*)\Z", 3 * bench.count_max + 4
    task = {
        "name": bench.task,
        "dataset": {"type": "file", "path": "train.jsonl"},
        "fields": {"id": "id", "answer": "answer", "template_fields": {"question": "question"}},
        "prompt": {"user": "{question}"},
        "loop": {"max_turns": 0, "max_total_tokens": 64 + new_tokens,
                 "max_new_tokens_per_turn": new_tokens, "temperature": 1.0},
        "answer": {"pattern": pattern},
        "reward": {"type": "exact_match"},
    }
    path = root / "task.yaml"
    path.write_text(yaml.safe_dump(task, sort_keys=False))
    return path


def policy_fingerprint(bench: StalenessBenchConfig) -> str:
    """What the pre-taught policy depends on (its cache key)."""
    fields = ("task", "max_operand", "count_min", "count_max", "eval_fraction", "split_seed",
              "pretrain_success", "pretrain_steps", "pretrain_lr", "pretrain_batch", "hidden_size",
              "num_layers", "intermediate_size")
    text = json.dumps({name: getattr(bench, name) for name in fields}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _examples(items: list[Problem]) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, answer + end-of-turn ids) per problem."""
    from agent_env.prompts import render_prompt_ids
    from rollout.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    return [(render_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]),
             [*tokenizer.encode(p.answer, add_special_tokens=False), tokenizer.eos_token_id]) for p in items]


def answer_batch(items: list[Problem]) -> tuple[Any, Any, Any]:
    """Every problem's (prompt + right answer + end-of-turn) as one padded batch, the answer as labels."""
    from rollout.tiny import padded_sft_batch

    return padded_sft_batch([(prompt + answer, [False] * len(prompt) + [True] * len(answer))
                             for prompt, answer in _examples(items)])


def success_of(model: Any, batch: tuple[Any, Any, Any]) -> float:
    """Mean over rows of P(labelled tokens | the rest): the exact expected reward of one temperature-1
    sample per prompt (teacher forcing, no sampling noise)."""
    import torch

    ids, attention, labels = batch
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = labels[:, 1:]
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (targets != -100)
    return float(picked.sum(dim=1).exp().mean())


def success_probability(model_dir: Path, bench: StalenessBenchConfig) -> float:
    """The policy in `model_dir`'s exact success probability on the evaluation problems."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return success_of(model, answer_batch(problems(bench)[1]))


def pretrained_policy(bench: StalenessBenchConfig, root: Path) -> Path:
    """The pre-taught policy's HF directory under `root` (built once per fingerprint, atomically)."""
    model_dir = root / f"policy0-{policy_fingerprint(bench)}"
    if (model_dir / "config.json").is_file():
        return model_dir
    from rollout.tiny import TinyModelSpec, make_tiny_model_dir, teach_tiny_model

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_model_dir(tmp, TinyModelSpec(hidden_size=bench.hidden_size, num_layers=bench.num_layers,
                                           intermediate_size=bench.intermediate_size or 2 * bench.hidden_size,
                                           seed=0))
    train, held_out = problems(bench)
    check = answer_batch(held_out)
    if bench.task == "addition":  # full-batch Adam, as the tiny preset always did
        teach_tiny_model(tmp, _examples(train), steps=bench.pretrain_steps, lr=3e-3, check_every=1,
                         until=lambda model: success_of(model, check) >= bench.pretrain_success)
    else:
        _teach_in_minibatches(tmp, bench, _examples(train), check)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    return model_dir


def _teach_in_minibatches(model_dir: Path, bench: StalenessBenchConfig,
                          examples: list[tuple[list[int], list[int]]], check: tuple[Any, Any, Any]) -> None:
    """Adam on random minibatches of `pretrain_batch` right answers; stops once the evaluation success
    probability (checked every 10 steps) reaches `pretrain_success`, or after `pretrain_steps`."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.tiny import padded_sft_batch

    rows = [(prompt + answer, [False] * len(prompt) + [True] * len(answer)) for prompt, answer in examples]
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=bench.pretrain_lr)
    for step in range(bench.pretrain_steps):
        chosen = torch.randint(len(rows), (bench.pretrain_batch,), generator=generator).tolist()
        ids, attention, labels = padded_sft_batch([rows[i] for i in chosen])
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if (step + 1) % 10 == 0:
            with torch.no_grad():
                success = success_of(model.eval(), check)
            model.train()
            if (step + 1) % 100 == 0:
                log.info("pre-teaching step %d: evaluation success probability %.3f", step + 1, success)
            if success >= bench.pretrain_success:
                break
    model.eval().save_pretrained(model_dir, safe_serialization=True)


def sampled_lengths(model_dir: Path, bench: StalenessBenchConfig, prompts: int = 64,
                    samples: int = 8, seed: int = 0) -> dict[str, float]:
    """Response lengths (tokens, end-of-turn included) of `samples` temperature-1 samples for each of
    `prompts` training prompts under the policy in `model_dir`, and their success rate."""
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    train, _ = problems(bench)
    chosen = random.Random(seed).sample(train, min(prompts, len(train)))
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.config.eos_token_id
    lengths, correct = [], 0
    torch.manual_seed(seed)
    from rollout.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    budget = 3 * bench.count_max + 4 if bench.task == "count" else 4
    for problem, (prompt, _) in zip(chosen, _examples(chosen), strict=True):
        ids = torch.tensor([prompt] * samples)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=budget,
                                 eos_token_id=eos, pad_token_id=eos)
        for row in out[:, len(prompt):].tolist():
            length = row.index(eos) + 1 if eos in row else len(row)
            lengths.append(length)
            text = tokenizer.decode(row[: length - 1] if eos in row else row)
            correct += int(eos in row and text == problem.answer)
    lengths.sort()

    def quantile(q: float) -> float:
        return float(lengths[min(len(lengths) - 1, int(q * len(lengths)))])

    return {"samples": len(lengths), "median": float(statistics.median(lengths)), "p10": quantile(0.1),
            "p90": quantile(0.9), "success_rate": correct / len(lengths)}
