"""The verifiable synthetic tasks of `vcpo bench staleness`, and their pre-taught policies.

* `addition` (the `tiny` preset, benchmarks/configs/staleness_tiny.yaml): "a+b=" → the sum, 1–2 answer
  tokens. A sequence weight there is a token weight, and every trajectory's gradient norm is about
  the same, so OPOB's norm term has nothing to do: a CI smoke, not a test of VCPO.
* `alphabet` (the paper-like preset, benchmarks/configs/staleness.yaml, the default): "d-k" →
  "d > e > f > g > h > i > j > k" (the preset's `separator: " > "`; default ", "), every letter of the
  range. Answers are long and variable (1 + len(separator) tokens per letter), so a sequence's IS
  weight is a product of many per-token ratios that drift a little with
  every policy update — the regime of LLM RL, where ESS falls with the lag because small token drifts
  accumulate. Reward 1 for the exact sequence.
* `count`: "17-41" → "17 18 19 … 41", the same shape with two-digit numbers; harder to pre-teach
  (0.06–0.09 success after 1500–3000 steps on this machine, against 0.36 after 900 for `alphabet`).

Training and evaluation prompts are disjoint for `alphabet` and `count` (a seeded split of all
(start, length) pairs). The policy is a byte-level Llama (rollout/tiny.py) pre-taught by supervised
learning on right answers until its exact success probability on the evaluation prompts reaches
`pretrain_success`: it knows the format and leans towards the answer without being sure of it —
where RL starts in practice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.staleness.schema import StalenessBenchConfig

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
    if bench.task == "alphabet":
        return _split(bench, [(start, count) for count in range(bench.count_min, bench.count_max + 1)
                              for start in range(26 - count + 1)],
                      lambda start, count: _alphabet_problem(start, count, bench.separator))
    pairs = [(start, count) for count in range(bench.count_min, bench.count_max + 1)
             for start in range(COUNT_START, 100 - count + 1)]
    random.Random(bench.split_seed).shuffle(pairs)
    held_out = max(1, round(bench.eval_fraction * len(pairs)))
    as_problems = [Problem(f"{start}-{start + count - 1}", " ".join(map(str, range(start, start + count))))
                   for start, count in pairs]
    return as_problems[held_out:], as_problems[:held_out]


def _alphabet_problem(start: int, count: int, separator: str) -> Problem:
    letters = [chr(ord("a") + i) for i in range(start, start + count)]
    return Problem(f"{letters[0]}-{letters[-1]}", separator.join(letters))


def _split(bench: StalenessBenchConfig, pairs: list[tuple[int, int]],
           make: Any) -> tuple[list[Problem], list[Problem]]:
    random.Random(bench.split_seed).shuffle(pairs)
    held_out = max(1, round(bench.eval_fraction * len(pairs)))
    as_problems = [make(start, count) for start, count in pairs]
    return as_problems[held_out:], as_problems[:held_out]


def task_file(bench: StalenessBenchConfig, root: Path) -> Path:
    """Write the training dataset and the task YAML into `root`; returns the YAML's path."""
    import yaml

    train, _ = problems(bench)
    rows = [{"id": f"p{i}", "question": p.prompt, "answer": p.answer} for i, p in enumerate(train)]
    (root / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if bench.task == "addition":
        pattern, new_tokens = r"\A(\d+)\Z", 4
    elif bench.task == "alphabet":
        per_letter = 1 + len(bench.separator)
        pattern = rf"\A([a-z](?:{re.escape(bench.separator)}[a-z])*)\Z"
        new_tokens = per_letter * bench.count_max + 4
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


POLICY_RECIPE = 2
"""Bumped when the pre-teaching code changes what a fingerprint's policy is (2: compact chat template,
evaluations every CHECK_EVERY steps), so no stale cached policy is reused."""


def policy_fingerprint(bench: StalenessBenchConfig) -> str:
    """What the pre-taught policy depends on (its cache key)."""
    fields = ("task", "max_operand", "count_min", "count_max", "eval_fraction", "split_seed",
              "pretrain_success", "pretrain_steps", "pretrain_lr", "pretrain_batch", "hidden_size",
              "num_layers", "intermediate_size")
    recipe = 1 if bench.task == "addition" else POLICY_RECIPE  # the tiny preset's policy is unchanged
    fields += ("separator",) if bench.task == "alphabet" else ()
    text = json.dumps({"recipe": recipe, **{name: getattr(bench, name) for name in fields}}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


COMPACT_CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}=>"
"""The count/alphabet policies' chat template: the prompt and "=>" (7 tokens for "17-41") instead of
ChatML's ~24 — the RL dynamics do not need role markers, and prompt tokens are ~40% of the compute."""


def _tokenizer(bench: StalenessBenchConfig) -> Any:
    from rollout.tiny import build_byte_tokenizer

    tokenizer = build_byte_tokenizer()
    if bench.task != "addition":  # addition keeps ChatML, as the tiny preset always had it
        tokenizer.chat_template = COMPACT_CHAT_TEMPLATE
    return tokenizer


def _examples(bench: StalenessBenchConfig, items: list[Problem]) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, answer + end-of-turn ids) per problem."""
    from agent_env.prompts import render_prompt_ids

    tokenizer = _tokenizer(bench)
    return [(render_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]),
             [*tokenizer.encode(p.answer, add_special_tokens=False), tokenizer.eos_token_id]) for p in items]


def answer_batch(bench: StalenessBenchConfig, items: list[Problem]) -> tuple[Any, Any, Any]:
    """Every problem's (prompt + right answer + end-of-turn) as one padded batch, the answer as labels."""
    from rollout.tiny import padded_sft_batch

    return padded_sft_batch([(prompt + answer, [False] * len(prompt) + [True] * len(answer))
                             for prompt, answer in _examples(bench, items)])


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
    return success_of(model, answer_batch(bench, problems(bench)[1]))


def policy_dir_name(bench: StalenessBenchConfig) -> str:
    """The pre-taught policy's directory name under a run root."""
    return f"policy0-{policy_fingerprint(bench)}"


def pretrained_policy(bench: StalenessBenchConfig, root: Path) -> Path:
    """The pre-taught policy's HF directory under `root` (built once per fingerprint, atomically)."""
    model_dir = root / policy_dir_name(bench)
    if (model_dir / "config.json").is_file():
        return model_dir
    from rollout.tiny import TinyModelSpec, make_tiny_model_dir, teach_tiny_model

    tmp = model_dir.with_name(model_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny_model_dir(tmp, TinyModelSpec(hidden_size=bench.hidden_size, num_layers=bench.num_layers,
                                           intermediate_size=bench.intermediate_size or 2 * bench.hidden_size,
                                           seed=0))
    _tokenizer(bench).save_pretrained(tmp)  # the template the engine and the learner will render with
    train, held_out = problems(bench)
    check = answer_batch(bench, held_out)
    if bench.task == "addition":  # full-batch Adam, as the tiny preset always did
        teach_tiny_model(tmp, _examples(bench, train), steps=bench.pretrain_steps, lr=3e-3, check_every=1,
                         until=lambda model: success_of(model, check) >= bench.pretrain_success)
    else:
        _teach_in_minibatches(tmp, bench, _examples(bench, train), check, root)
    shutil.rmtree(model_dir, ignore_errors=True)
    os.replace(tmp, model_dir)
    return model_dir


CHECK_EVERY = 50
"""Pre-teaching steps between two evaluations of the success probability (the stopping test)."""


def _teaching_key(bench: StalenessBenchConfig) -> str:
    """What the pre-teaching trajectory depends on — not where it stops (steps, success target)."""
    fields = ("task", "count_min", "count_max", "eval_fraction", "split_seed", "pretrain_lr",
              "pretrain_batch", "hidden_size", "num_layers", "intermediate_size")
    fields += ("separator",) if bench.task == "alphabet" else ()
    text = json.dumps({"recipe": POLICY_RECIPE, **{name: getattr(bench, name) for name in fields}},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _teach_in_minibatches(model_dir: Path, bench: StalenessBenchConfig,
                          examples: list[tuple[list[int], list[int]]], check: tuple[Any, Any, Any],
                          root: Path) -> None:
    """Adam on random minibatches of `pretrain_batch` right answers; stops at the first evaluation
    (every CHECK_EVERY steps) whose success probability reaches `pretrain_success`, or after
    `pretrain_steps`. The whole state (weights, Adam, sampler, step, evaluations) is saved atomically at
    every evaluation under `root/teaching-<key>.pt`, so an interrupted or longer pre-teaching continues
    where the last one stopped, exactly as one uninterrupted run would."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.tiny import padded_sft_batch

    rows = [(prompt + answer, [False] * len(prompt) + [True] * len(answer)) for prompt, answer in examples]
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=bench.pretrain_lr)
    state_path = root / f"teaching-{_teaching_key(bench)}.pt"
    step, history = 0, []
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        reached = [s for s, success in state["history"] if success >= bench.pretrain_success]
        on_path = (not reached or reached[0] == state["step"]) and state["step"] <= bench.pretrain_steps
        if on_path:  # this request would have passed through the saved state: continue from it
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["generator"])
            step, history = state["step"], state["history"]
    done = bool(history) and history[-1][1] >= bench.pretrain_success
    while not done and step < bench.pretrain_steps:
        chosen = torch.randint(len(rows), (bench.pretrain_batch,), generator=generator).tolist()
        ids, attention, labels = padded_sft_batch([rows[i] for i in chosen])
        model(input_ids=ids, attention_mask=attention, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % CHECK_EVERY == 0:
            with torch.no_grad():
                success = success_of(model.eval(), check)
            model.train()
            history.append((step, success))
            log.info("pre-teaching step %d: evaluation success probability %.3f", step, success)
            tmp = state_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "generator": generator.get_state(), "step": step, "history": history}, tmp)
            os.replace(tmp, state_path)
            done = success >= bench.pretrain_success
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
    tokenizer = _tokenizer(bench)
    per_item = 1 + len(bench.separator) if bench.task == "alphabet" else 3
    budget = 4 if bench.task == "addition" else per_item * bench.count_max + 4
    for problem, (prompt, _) in zip(chosen, _examples(bench, chosen), strict=True):
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
