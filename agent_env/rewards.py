"""Rewards: score a model's final response against a sample's ground truth.

`build_reward(reward_cfg, answer_cfg)` returns a `RewardFn`: `reward(response, sample) -> RewardResult`.
Every built-in reward first finds the final answer with the task's answer pattern
(`extract_answer`), then judges it:

* `math_verify` — symbolic/numeric equality with HuggingFace math-verify (gold parsed as
  `\\boxed{gold}`, falling back to `$gold$`; integers such as AIME's 25 and "025" agree);
* `countdown` — the answer is an equation that uses each given number once and hits the target
  (agent_env/countdown.py, checked with `ast`, never `eval`);
* `gsm8k` — the number after `####` in the gold solution equals the extracted number (commas and
  `$` ignored). **If no answer matches the pattern, the last number in the whole response is used**
  (the usual GSM8K convention for models that do not box their answer);
* `exact_match` — stripped string equality;
* `custom` — `package.module:function(response, sample) -> float | RewardResult`.

Score: 1 for a correct answer, `format_score` for an extracted but wrong one, 0 when none was found.
A judge that raises on odd model output does not crash the caller: the result has score 0,
`extracted=None` and `error` set (callers count these as `reward/errors`).

Thread safety: rewards run in worker threads (`asyncio.to_thread`), where math-verify's
signal-based timeouts fail, so they are disabled (`parsing_timeout=None`, `timeout_seconds=None`).
Instead answers longer than `MAX_MATH_ANSWER_CHARS` are not parsed. A pathological short
expression can still keep sympy busy; run rewards in a process pool if that matters.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from agent_env.countdown import extract_equation, score_expression
from agent_env.samples import Sample
from agent_env.turns import find_answer
from configs.task_schema import AnswerConfig, RewardConfig

logger = logging.getLogger(__name__)

MAX_MATH_ANSWER_CHARS = 1000
"""Extracted answers longer than this are judged wrong without parsing (bounds sympy's work)."""

MAX_MATH_NESTING = 12
"""Answers with brackets nested deeper than this are judged wrong without parsing."""

_POWER_TOWER = re.compile(r"\d\^[\d.]+\^")
_HUGE_EXPONENT = re.compile(r"\^-?\d{6,}")
_HUGE_FACTORIAL = re.compile(r"\d{5,}[})]*!")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class RewardResult(BaseModel):
    """The score of one response and what it was based on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    score: float
    """The reward: 1 correct, `format_score` extracted but wrong, 0 no answer (custom: its value)."""
    is_correct: bool
    """Whether the answer is right (drives pass@k / maj@k)."""
    extracted: str | None = None
    """The answer found in the response (None = no answer, or the judge failed)."""
    error: str | None = None
    """Why judging failed (exception type and message); None when it did not."""


class RewardFn(Protocol):
    """Scores a final response for a sample. Never raises for odd model output."""

    def __call__(self, response: str, sample: Sample) -> RewardResult: ...


class RewardConfigError(ValueError):
    """A reward that cannot be built (e.g. a custom function that does not import)."""


# ---------------------------------------------------------------------------------------------
# Finding the answer


def extract_answer(text: str, answer_cfg: AnswerConfig) -> str | None:
    """The final answer in `text` (`agent_env.turns.find_answer`: last balanced `\\boxed{...}` or
    the pattern's last match), stripped; None if absent or empty."""
    found = find_answer(text, answer_cfg.pattern)
    if found is None or not found.strip():
        return None
    return found.strip()


# ---------------------------------------------------------------------------------------------
# Judges: (response, sample) -> (extracted answer or None, is_correct)

Judge = Callable[[str, Sample], tuple[str | None, bool]]


@dataclass(frozen=True)
class JudgedReward:
    """A reward from a judge: 1 if correct, `format_score` if an answer was found but is wrong,
    0 if none was found; a judge error gives 0 with `error` set."""

    judge: Judge
    format_score: float = 0.0

    def __call__(self, response: str, sample: Sample) -> RewardResult:
        try:
            extracted, is_correct = self.judge(response, sample)
        except Exception as exc:  # odd model output must not crash a rollout worker
            logger.debug("reward judge failed on sample %s", sample.sample_id, exc_info=True)
            return RewardResult(score=0.0, is_correct=False, extracted=None, error=_describe(exc))
        if is_correct:
            return RewardResult(score=1.0, is_correct=True, extracted=extracted)
        score = self.format_score if extracted is not None else 0.0
        return RewardResult(score=score, is_correct=False, extracted=extracted)


def math_answers_match(gold: str, predicted: str) -> bool:
    """Whether `predicted` equals `gold` per math-verify (gold first: the check is asymmetric)."""
    from math_verify import verify  # heavy (sympy); imported on first use

    if too_costly_to_verify(predicted):
        return False
    gold_parsed = _parse_math(gold)
    predicted_parsed = _parse_math(predicted)
    if not gold_parsed or not predicted_parsed:
        return False
    return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=None))


def too_costly_to_verify(answer: str) -> bool:
    """Answers that would make sympy compute astronomically large integers, which cannot be
    interrupted (not even by math-verify's own alarm: one big-int power is a single C call):
    power towers of numbers (`9^{9^{9}}`), exponents ≥ 100000, factorials of ≥ 10000; and
    brackets nested deeper than `MAX_MATH_NESTING` (parsing time grows with depth, ~0.1 s a level).
    A heuristic on the text with braces, parentheses and spaces removed; symbolic powers such as
    `e^{-x^2}` pass."""
    if len(answer) > MAX_MATH_ANSWER_CHARS or _nesting_depth(answer) > MAX_MATH_NESTING:
        return True
    flat = re.sub(r"\\left|\\right|[\s{}()]", "", answer).replace("**", "^")
    huge_factorial = _HUGE_FACTORIAL.search(re.sub(r"\s", "", answer))  # braces kept: {1}{2004!} is fine
    return bool(_POWER_TOWER.search(flat) or _HUGE_EXPONENT.search(flat) or huge_factorial)


def _nesting_depth(text: str) -> int:
    depth = deepest = 0
    for char in text:
        if char in "({[":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")}]":
            depth -= 1
    return deepest


def _parse_math(text: str) -> list[Any]:
    """math-verify's parse of an answer string: as `\\boxed{text}` (bare LaTeX such as
    `\\frac{\\pi}{2}` or `(3, \\frac{\\pi}{2})` only parses inside a math environment), then as
    `$text$`, then as is (for text that brings its own `$...$`). Timeouts off (see module doc)."""
    from math_verify import parse

    if len(text) > MAX_MATH_ANSWER_CHARS:
        return []
    for candidate in (f"\\boxed{{{text}}}", f"${text}$", text):
        parsed = parse(candidate, parsing_timeout=None)
        if parsed:
            return parsed
    return []


def make_math_verify_judge(answer_cfg: AnswerConfig) -> Judge:
    """Judge: math-verify equality of the extracted answer and `str(sample.answer)`."""
    import math_verify  # noqa: F401  fail at build time, not in the first rollout, if it is missing

    def judge(response: str, sample: Sample) -> tuple[str | None, bool]:
        extracted = extract_answer(response, answer_cfg)
        return extracted, extracted is not None and math_answers_match(str(sample.answer), extracted)

    return judge


def make_countdown_judge(answer_cfg: AnswerConfig) -> Judge:
    """Judge: the extracted equation (`= rhs` dropped) is valid for sample.answer
    {"target", "numbers"}."""

    def judge(response: str, sample: Sample) -> tuple[str | None, bool]:
        extracted = extract_answer(response, answer_cfg)
        if extracted is None:
            return None, False
        equation = extract_equation(extracted)
        target, numbers = sample.answer["target"], sample.answer["numbers"]
        return extracted, equation is not None and score_expression(equation, numbers, int(target))

    return judge


def make_gsm8k_judge(answer_cfg: AnswerConfig) -> Judge:
    """Judge: the number after `####` in the gold equals the extracted number; with no match of
    the answer pattern, the last number in the response is the answer (explicit fallback)."""

    def judge(response: str, sample: Sample) -> tuple[str | None, bool]:
        gold = gsm8k_gold_number(str(sample.answer))
        if gold is None:
            raise ValueError(f"sample {sample.sample_id}: no number after '####' in its answer")
        extracted = extract_answer(response, answer_cfg)
        if extracted is None:
            numbers = _NUMBER.findall(_clean_number_text(response))
            extracted = numbers[-1] if numbers else None
        predicted = last_number(extracted) if extracted is not None else None
        return extracted, predicted is not None and predicted == gold

    return judge


def gsm8k_gold_number(solution: str) -> Fraction | None:
    """The final answer of a GSM8K solution (`... #### 1,234` → 1234); a solution without `####`
    is read as the number itself."""
    _, marker, after = solution.rpartition("####")
    return last_number(after if marker else solution)


def last_number(text: str) -> Fraction | None:
    """The last number in `text` as an exact Fraction (`1,234.50` → 2469/2), ignoring `$` and
    thousands commas; None if there is none."""
    numbers = _NUMBER.findall(_clean_number_text(text))
    return Fraction(numbers[-1]) if numbers else None


def _clean_number_text(text: str) -> str:
    return _THOUSANDS_COMMA.sub("", text.replace("\\$", "").replace("$", ""))


def make_exact_match_judge(answer_cfg: AnswerConfig) -> Judge:
    """Judge: the extracted answer equals `str(sample.answer)`, both stripped."""

    def judge(response: str, sample: Sample) -> tuple[str | None, bool]:
        extracted = extract_answer(response, answer_cfg)
        return extracted, extracted is not None and extracted == str(sample.answer).strip()

    return judge


_JUDGES: dict[str, Callable[[AnswerConfig], Judge]] = {
    "math_verify": make_math_verify_judge,
    "countdown": make_countdown_judge,
    "gsm8k": make_gsm8k_judge,
    "exact_match": make_exact_match_judge,
}


# ---------------------------------------------------------------------------------------------
# Custom rewards and the builder


@dataclass(frozen=True)
class CustomReward:
    """A user function `f(response, sample) -> float | RewardResult`. A float counts as correct
    when it is ≥ 1; `extracted` is filled in from the task's answer pattern."""

    function: Callable[[str, Sample], Any]
    answer_cfg: AnswerConfig
    name: str

    def __call__(self, response: str, sample: Sample) -> RewardResult:
        try:
            value = self.function(response, sample)
            if isinstance(value, RewardResult):
                return value
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{self.name} returned {type(value).__name__}; "
                                "return a float or a RewardResult")
            score = float(value)
            return RewardResult(score=score, is_correct=score >= 1.0,
                                extracted=extract_answer(response, self.answer_cfg))
        except Exception as exc:  # user code on model output: report, do not crash the worker
            logger.debug("custom reward %s failed on sample %s", self.name, sample.sample_id, exc_info=True)
            return RewardResult(score=0.0, is_correct=False, extracted=None, error=_describe(exc))


def import_reward_function(spec: str) -> Callable[[str, Sample], Any]:
    """The function `package.module:function` names. Raises RewardConfigError with the fix."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise RewardConfigError(f"reward.function={spec!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardConfigError(
            f"reward.function={spec!r}: cannot import module {module_name!r} ({exc}); check the spelling "
            "and that its package is installed (pip install -e .) or on PYTHONPATH") from exc
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardConfigError(f"reward.function={spec!r}: module {module_name!r} has no function "
                                f"{attribute!r}; define it as def {attribute}(response, sample) -> float")
    return function


def build_reward(reward: RewardConfig, answer: AnswerConfig) -> RewardFn:
    """The reward a task's `reward` and `answer` sections describe (imports done now, so a missing
    package or custom function fails at startup)."""
    if reward.type == "custom":
        assert reward.function is not None  # RewardConfig's validator guarantees it
        return CustomReward(import_reward_function(reward.function), answer, reward.function)
    return JudgedReward(_JUDGES[reward.type](answer), reward.format_score)


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."
