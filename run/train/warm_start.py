"""Cold-start SFT before RL (`warm_start` in a run config): a few tool-using demonstrations so that a
small model produces the answer format at all, and RL has groups with reward variance to learn from.

Why: the 135M default model writes a `\\boxed{}` equation in ~1% of Countdown-with-tool episodes, so
nearly every group has zero reward variance and every policy gradient is exactly 0 (docs/results.md).
SimpleTIR / ReTool-style pipelines start RL from a short supervised cold start for the same reason.

Demonstrations (Countdown tasks, i.e. answers with `numbers` and `target`): for training instances the
exact solver solves, the episode the agent loop would produce for a model that checks its equation
with the tool — turn 1 writes a ```python block printing the equation, the observation is formatted
exactly as the loop formats the sandbox's output (loss-masked), turn 2 gives the boxed equation.
Prompts are rendered with the task's template and chat template, as in rollouts. The instances come
from the *end* of the training set (the RL run starts from the beginning), so RL does not begin on
prompts whose answers were shown.

Keychain tasks (agent_env/keychain.py; `warm_start.demonstrations: keychain`): a solver that follows
the chain — one hop per turn, then the boxed key — plays the policy through the task's own loop and
tool (agent_env/demonstrations.py), so each demonstration shows the contexts the loop will really give
the model, compacted history included; each of its segments is one supervised sequence.

The result is cached as an HF model directory keyed by the model, task and settings, written beside
and renamed into place; a resumed run reuses it (the checkpoint restores the learner anyway).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import io
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent_env import keychain
from agent_env.countdown import score_expression, solve
from agent_env.demonstrations import SolverPolicy, scripted_demonstrations
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from agent_env.turns import format_observation
from configs.schema import RunConfig, WarmStartConfig
from configs.task_schema import TaskConfig
from learner.forward.logprobs import autocast, autocast_dtype, packed_target_logprobs
from learner.forward.packing import TrajectoryTokens, pack_trajectories
from learner.forward.varlen_attention import register_varlen_sdpa

log = logging.getLogger(__name__)

TURN_1 = "Let me check the equation with Python.\n```python\nprint({expression})\n```\n"
TURN_2 = "The equation {expression} equals {target}, so the answer is \\boxed{{{expression}}}."
RETRY = ("That gives {value}, not {target}. Let me try another equation.\n"
         "```python\nprint({expression})\n```\n")
SEARCH = "Let me search for the equation with Python.\n```python\n{program}```\n"
SEARCH_PROGRAM = """from itertools import permutations


def search(nums, target):
    if len(nums) == 1:
        return nums[0] if abs(eval(nums[0]) - target) < 1e-9 else None
    for a, b, *rest in permutations(nums):
        for op in '+-*/':
            try:
                found = search([f'({{a}} {{op}} {{b}})', *rest], target)
            except ZeroDivisionError:
                continue
            if found:
                return found


print(search([str(n) for n in {numbers}], {target}))
"""
"""A search over every order and operator, as a solver-minded person would write it: the same text
for every puzzle but the last line, whose numbers and target are copied from the prompt."""


def is_search_program(code: str) -> bool:
    """Whether a tool call's code is (a copy, perhaps garbled, of) SEARCH_PROGRAM."""
    return "def search(" in code


def _python_print(expression: str) -> str:
    """What `print(expression)` shows for the solver's arithmetic (ints, + - * / and parentheses)."""
    tree = ast.parse(expression, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div,
               ast.USub)
    if not all(isinstance(node, allowed) for node in ast.walk(tree)):
        raise ValueError(f"not plain arithmetic: {expression!r}")
    value = eval(compile(tree, "<solver>", "eval"), {"__builtins__": {}})
    return f"{value}\n"


def _wrong_expression(numbers: list[int], target: int, rng: random.Random) -> str | None:
    """An equation of the same numbers, written as the solver writes its own ("(a + b) - c"), that misses
    `target`; None when 20 draws all hit it."""
    for _ in range(20):
        order = rng.sample(numbers, len(numbers))
        expression = f"{order[0]} {rng.choice('+-*')} {order[1]}"
        for number in order[2:]:
            expression = f"({expression}) {rng.choice('+-*')} {number}"
        if _python_print(expression) != f"{target}\n":
            return expression
    return None


def _search_output(program: str) -> str:
    """What the sandbox prints for a SEARCH_PROGRAM (our own text, so it runs here, on no input)."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(program, "<search>", "exec"), {"__name__": "__main__"})
    return printed.getvalue()


def demonstrations(task: TaskConfig, samples: list[Sample], tokenizer: Any, count: int, seed: int,
                   retry_fraction: float = 0.0,
                   search_fraction: float = 0.0) -> list[tuple[list[int], list[bool]]]:
    """(token ids, loss mask) of up to `count` solver-written tool episodes, from the end of `samples`; a
    `search_fraction` share of them runs a search program instead of checking one equation, and a
    `retry_fraction` share of the others checks a wrong equation first (three turns instead of two)."""
    if retry_fraction > 0 and task.loop.max_turns < 3:
        raise ValueError(f"warm_start.retry_fraction={retry_fraction} writes three-turn demonstrations, but "
                         f"the task's loop.max_turns is {task.loop.max_turns}; raise it to 3 or set "
                         "warm_start.retry_fraction=0")
    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    def observe(printed: str) -> list[int]:
        return encode(format_observation(printed, task.loop.observation_format))

    out: list[tuple[list[int], list[bool]]] = []
    rng = random.Random(seed)
    for sample in reversed(samples):
        if len(out) >= count:
            break
        answer = sample.answer
        if not isinstance(answer, dict) or not {"numbers", "target"} <= set(answer):
            raise ValueError(f"warm_start demonstrations need Countdown samples (answer with numbers and "
                             f"target); sample {sample.sample_id!r} has answer {answer!r}")
        numbers = list(answer["numbers"])
        rng.shuffle(numbers)
        expression = solve(numbers, int(answer["target"]))
        if expression is None:
            continue
        prompt = render_prompt_ids(tokenizer, render_messages(task.prompt.system, task.prompt.user, sample))
        wrong = searched = None
        if search_fraction > 0 and rng.random() < search_fraction:  # no draw at 0: demonstrations as before
            program = SEARCH_PROGRAM.format(numbers=list(answer["numbers"]), target=int(answer["target"]))
            found = _search_output(program).strip()
            if score_expression(found, answer["numbers"], int(answer["target"])):
                searched, expression = program, found
        elif retry_fraction > 0 and rng.random() < retry_fraction:
            wrong = _wrong_expression(numbers, int(answer["target"]), rng)
        if searched is not None:
            checks = [(SEARCH.format(program=searched), f"{expression}\n")]
        elif wrong is None:
            checks = [(TURN_1.format(expression=expression), _python_print(expression))]
        else:
            checks = [(TURN_1.format(expression=wrong), _python_print(wrong)),
                      (RETRY.format(value=_python_print(wrong).strip(), target=answer["target"],
                                    expression=expression), _python_print(expression))]
        ids, mask = list(prompt), [False] * len(prompt)
        for text, printed in checks:  # the model's turn (trained), then the tool's output (masked)
            turn, shown = encode(text), observe(printed)
            ids += turn + shown
            mask += [True] * len(turn) + [False] * len(shown)
        final = [*encode(TURN_2.format(expression=expression, target=answer["target"])),
                 tokenizer.eos_token_id]
        out.append((ids + final, mask + [True] * len(final)))
    return out


def _keychain_fields(sample: Sample) -> tuple[int, int]:
    try:
        return int(sample.fields["start"]), int(sample.fields["hops"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"warm_start.demonstrations: keychain needs samples with fields start and hops; "
                         f"sample {sample.sample_id!r} has {sorted(sample.fields)}") from None


KEYCHAIN_SOLVER = SolverPolicy(
    turns=lambda sample: keychain.solver_turns(*_keychain_fields(sample)),
    summary=lambda sample, done: keychain.solver_summary(*_keychain_fields(sample), done))
"""Follows the chain: one hop per turn, the key boxed after the last; its summary says where it is."""


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _autocast(config: RunConfig) -> torch.dtype | None:
    """The SFT trains fp32 weights (whatever model.dtype), under `warm_start.autocast`."""
    return autocast_dtype(config.warm_start.autocast, _device())


def _sft_step(model: torch.nn.Module, batch: list[tuple[list[int], list[bool]]], budget: int,
              compute_dtype: torch.dtype | None) -> float:
    """Accumulate the gradient of the batch's token-mean NLL of its trained (model-turn) tokens; return it.

    The learner's packed forward: examples packed end to end into `budget`-token micro-batches, no
    padding, attention kept inside each example, logits only where a token is trained (~70 of ~300
    per Countdown demonstration) — the whole-sequence × vocabulary logits of a padded HF forward were
    most of the SFT's time and memory. The loss is the padded `labels=` loss's: the mean over every
    trained token of the batch."""
    tokens = [TrajectoryTokens(ids, mask, group_id=index) for index, (ids, mask) in enumerate(batch)]
    device = next(model.parameters()).device
    microbatches = [mb.to(device) for mb in pack_trajectories(tokens, max_tokens=budget)]
    trained = sum(int(mb.target_positions.numel()) for mb in microbatches)
    total = 0.0
    for mb in microbatches:
        with autocast(device, compute_dtype):
            logprobs = packed_target_logprobs(model, mb)
        loss = -logprobs.sum() / trained
        loss.backward()
        total += float(loss.detach())
    return total


WARM_START_RECIPE = 2
"""Bumped when the SFT's code changes what a cached model is (2: packed forward, logits at trained
tokens only), so no model of the older recipe is taken for this one's."""


def warm_start_dir(config: RunConfig, task: TaskConfig, cache_dir: Path) -> Path:
    """Cache folder of the warm-started model for these settings (any change → a new folder)."""
    settings = {"model": config.model.path, "dtype": config.model.dtype, "task": task.model_dump(mode="json"),
                # autocast enters as the dtype used (below); the fractions only when not 0, so that models
                # cached before they existed stay valid
                "warm_start": config.warm_start.model_dump(mode="json", exclude={"autocast"} | {
                    name for name in ("retry_fraction", "search_fraction")
                    if not getattr(config.warm_start, name)} | (
                    {"demonstrations"} if config.warm_start.demonstrations == "countdown" else set())),
                "seed": config.seed, "recipe": WARM_START_RECIPE}
    if _autocast(config) is not None:  # absent otherwise: fp32 caches from before it stay valid
        settings["autocast"] = "bfloat16"
    if config.warm_start.search_fraction:  # a reworded program is another model
        settings["search_program"] = SEARCH + SEARCH_PROGRAM
    if config.warm_start.demonstrations == "keychain":  # so are reworded keychain turns
        settings["solver"] = [keychain.HOP_TURN, keychain.FINAL_TURN, keychain.SUMMARY]
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / "warm_start" / key


class WarmStartStopped(RuntimeError):
    """The warm start was asked to stop (`should_stop`); nothing was cached."""


REPORT_EVERY_S = 20.0
"""Most seconds between two progress lines of the warm start (a slow host still shows it moving)."""


def run_warm_start(config: RunConfig, task: TaskConfig, task_path: Path, cache_dir: Path,
                   report: Callable[[str], None] = log.info,
                   should_stop: Callable[[], bool] = lambda: False) -> Path:
    """The warm-started model directory (trained now, or the cached one — then the training set is
    not even loaded); `report` gets a line as each phase starts and one at least every `REPORT_EVERY_S`
    seconds of SFT. `should_stop` is polled between demonstrations and SFT steps: when it says so,
    `WarmStartStopped` is raised within one step and nothing is cached."""
    from agent_env.datasets import load_samples
    from rollout.models import load_causal_lm, load_tokenizer

    out_dir = warm_start_dir(config, task, cache_dir)
    if (out_dir / "config.json").is_file():
        log.info("warm start: reusing %s", out_dir)
        return out_dir
    settings: WarmStartConfig = config.warm_start
    report(f"[warm start] writing {settings.examples} solver demonstrations (once; cached in {out_dir})")
    tokenizer = load_tokenizer(config.model.path, cache_dir)
    samples = load_samples(task, which="train", task_dir=task_path.parent).samples
    if settings.demonstrations == "keychain":
        examples = scripted_demonstrations(task, list(reversed(samples)), tokenizer, KEYCHAIN_SOLVER,
                                           settings.examples)
    else:
        examples = demonstrations(task, samples, tokenizer, settings.examples, config.seed,
                                  settings.retry_fraction, settings.search_fraction)
    if should_stop():
        raise WarmStartStopped("stopped before training")
    if not examples:
        raise ValueError("warm_start: the solver found no demonstration among the training samples")
    model = load_causal_lm(config.model.path, cache_dir, torch.float32, _device().type).train()
    model.set_attn_implementation(register_varlen_sdpa())  # packed rows, no padding (restored below)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    compute_dtype = _autocast(config)
    generator = random.Random(config.seed)
    started = time.perf_counter()
    losses: list[float] = []
    batches = -(-len(examples) // settings.batch_size)  # per epoch
    budget = config.learner.micro_batch_tokens
    report(f"[warm start] supervised training: {settings.epochs} epochs × {batches} steps "
           f"({'bf16 autocast' if compute_dtype is not None else 'fp32'})")
    last_report = time.perf_counter()
    for epoch in range(settings.epochs):
        order = list(range(len(examples)))
        generator.shuffle(order)
        for first in range(0, len(order), settings.batch_size):
            batch = [examples[i] for i in order[first: first + settings.batch_size]]
            losses.append(_sft_step(model, batch, budget, compute_dtype))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if should_stop():
                raise WarmStartStopped(f"stopped at step {len(losses)}/{settings.epochs * batches}")
            if len(losses) == 1 or time.perf_counter() - last_report >= REPORT_EVERY_S:
                report(f"[warm start] step {len(losses)}/{settings.epochs * batches}, loss {losses[-1]:.3f}, "
                       f"{time.perf_counter() - started:.0f} s")
                last_report = time.perf_counter()
        mean = sum(losses[-batches:]) / batches
        report(f"[warm start] epoch {epoch + 1}/{settings.epochs}: mean loss {mean:.3f}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.set_attn_implementation("sdpa")  # the saved model is for engines, which generate
    model.eval().save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "warm_start.json").write_text(json.dumps({
        "examples": len(examples), "epochs": settings.epochs, "lr": settings.lr,
        "first_loss": losses[0], "last_loss": losses[-1],
        "seconds": round(time.perf_counter() - started, 1)}))
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir
