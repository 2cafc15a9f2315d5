"""Rewards: answer extraction, each built-in judge, custom functions, and failure containment."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agent_env.rewards import (
    RewardConfigError,
    RewardResult,
    build_reward,
    extract_answer,
    gsm8k_gold_number,
    last_number,
    math_answers_match,
    too_costly_to_verify,
)
from agent_env.samples import Sample
from configs.task_schema import AnswerConfig, RewardConfig

BOXED = AnswerConfig()
TAGS = AnswerConfig(pattern="<answer>(.*?)</answer>")


def _sample(answer: Any) -> Sample:
    return Sample(sample_id="s0", fields={}, answer=answer)


def _reward(kind: str, answer_cfg: AnswerConfig = BOXED, **extra: Any) -> Any:
    return build_reward(RewardConfig(type=kind, **extra), answer_cfg)


# ---------------------------------------------------------------------------------------------
# Extraction


@pytest.mark.parametrize(("text", "expected"), [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),                   # nested braces
    ("first \\boxed{1} then \\boxed{ 2 }", "2"),                     # the last one, stripped
    ("\\boxed{3} and a cut-off \\boxed{\\frac{1}{", "3"),           # unbalanced last one: an earlier one
    ("no answer at all", None),
    ("\\boxed{}", None),                                             # empty is no answer
])
def test_boxed_extraction(text: str, expected: str | None) -> None:
    assert extract_answer(text, BOXED) == expected


def test_regex_extraction_takes_the_last_match_across_lines() -> None:
    text = "<answer>1</answer> ... <answer>\n(1 + 2) * 3\n</answer>"
    assert extract_answer(text, TAGS) == "(1 + 2) * 3"
    assert extract_answer("<answer>unclosed", TAGS) is None


# ---------------------------------------------------------------------------------------------
# math_verify


@pytest.mark.parametrize(("gold", "response"), [
    ("0.5", "\\boxed{\\frac{1}{2}}"),
    ("\\frac{\\pi}{2}", "\\boxed{\\dfrac{\\pi}{2}}"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "\\boxed{(3, \\pi/2)}"),
    ("25", "\\boxed{025}"),              # AIME zero padding
    ("70", "The answer is $\\boxed{70}$."),
])
def test_math_verify_accepts_equivalent_answers(gold: str, response: str) -> None:
    result = _reward("math_verify")(response, _sample(gold))
    assert result.is_correct and result.score == 1.0


def test_math_verify_scores_wrong_and_missing_answers() -> None:
    reward = _reward("math_verify", format_score=0.1)
    wrong = reward("\\boxed{\\frac{1}{3}}", _sample("0.5"))
    assert (wrong.score, wrong.is_correct, wrong.extracted) == (0.1, False, "\\frac{1}{3}")
    missing = reward("I think it is one half", _sample("0.5"))
    assert (missing.score, missing.extracted) == (0.0, None)  # no answer: 0 even with a format score


def test_math_verify_gold_may_be_an_integer() -> None:
    assert _reward("math_verify")("\\boxed{70}", _sample(70)).is_correct


def test_math_verify_works_off_the_main_thread() -> None:
    # math-verify's default signal-based timeouts raise in worker threads; rollouts score in threads
    async def score() -> RewardResult:
        return await asyncio.to_thread(_reward("math_verify"), "\\boxed{\\sqrt{4}}", _sample("2"))

    result = asyncio.run(score())
    assert result.is_correct and result.error is None


@pytest.mark.parametrize("answer", ["9^{9^{9^{9}}}", "10^{10^{10}}", "2**100000", "99999!",
                                    "(" * 20 + "1" + ")" * 20])
def test_answers_that_would_hang_sympy_are_wrong_without_parsing(answer: str) -> None:
    assert too_costly_to_verify(answer)
    outcome: list[bool] = []
    worker = threading.Thread(target=lambda: outcome.append(math_answers_match("1", answer)), daemon=True)
    started = time.monotonic()
    worker.start()
    worker.join(timeout=10)
    assert outcome == [False] and time.monotonic() - started < 10


@pytest.mark.parametrize("answer", ["\\frac{1}{2004!}", "e^{-x^2}", "x^2+y^2", "2^{10}", "(1, 2)"])
def test_ordinary_answers_are_not_flagged_as_too_costly(answer: str) -> None:
    assert not too_costly_to_verify(answer)


# ---------------------------------------------------------------------------------------------
# gsm8k


SOLUTION = "She has 1000 + 234 = <<1000+234=1234>>1234 apples.\n#### 1,234"


def test_gsm8k_gold_is_the_number_after_the_marker() -> None:
    assert gsm8k_gold_number(SOLUTION) == 1234
    assert gsm8k_gold_number("#### -3.5") == -3.5
    assert gsm8k_gold_number("42") == 42  # an answer without #### is the number itself
    assert last_number("costs $1,234.50 in total") == 1234.5


@pytest.mark.parametrize("response", ["\\boxed{1234}", "\\boxed{1,234}", "\\boxed{\\$1234.00}",
                                      "so the total is 1234."])  # the last: fallback to the last number
def test_gsm8k_accepts_the_number_boxed_or_last(response: str) -> None:
    assert _reward("gsm8k")(response, _sample(SOLUTION)).is_correct


def test_gsm8k_fallback_uses_only_the_last_number() -> None:
    result = _reward("gsm8k")("1234 was a guess, the total is 1235", _sample(SOLUTION))
    assert (result.is_correct, result.extracted) == (False, "1235")
    assert _reward("gsm8k")("\\boxed{1235} (not 1234)", _sample(SOLUTION)).extracted == "1235"


def test_gsm8k_gold_without_a_number_is_reported_not_raised() -> None:
    result = _reward("gsm8k")("\\boxed{3}", _sample("#### none"))
    assert (result.score, result.extracted) == (0.0, None)
    assert result.error is not None and "no number after '####'" in result.error


# ---------------------------------------------------------------------------------------------
# countdown and exact_match


COUNTDOWN = {"target": 9, "numbers": [1, 2, 3]}


@pytest.mark.parametrize(("response", "score"), [
    ("\\boxed{(1 + 2) * 3}", 1.0),
    ("\\boxed{(1 + 2) \\times 3 = 9}", 1.0),
    ("\\boxed{3 * 3}", 0.1),          # extracted, but 1 and 2 are unused
    ("\\boxed{__import__('os')}", 0.1),
    ("(1 + 2) * 3 without a box", 0.0),
])
def test_countdown_reward(response: str, score: float) -> None:
    assert _reward("countdown", format_score=0.1)(response, _sample(COUNTDOWN)).score == score


def test_countdown_with_answer_tags() -> None:
    response = "<think>..</think><answer> (1+2)*3 </answer>"
    assert _reward("countdown", TAGS)(response, _sample(COUNTDOWN)).is_correct


def test_a_judge_that_raises_gives_zero_with_the_error() -> None:
    result = _reward("countdown")("\\boxed{1 + 2}", _sample({"goal": 3}))  # malformed ground truth
    assert (result.score, result.is_correct, result.extracted) == (0.0, False, None)
    assert result.error == "KeyError: 'target'"


def test_exact_match_compares_stripped_strings() -> None:
    reward = _reward("exact_match")
    assert reward("\\boxed{ Evelyn }", _sample("Evelyn ")).is_correct
    assert not reward("\\boxed{evelyn}", _sample("Evelyn")).is_correct


# ---------------------------------------------------------------------------------------------
# custom


CUSTOM_MODULE = '''
from agent_env.rewards import RewardResult

def length_bonus(response, sample):
    return min(len(response) / 10, 1.0)

def detailed(response, sample):
    return RewardResult(score=0.5, is_correct=True, extracted="x")

def broken(response, sample):
    raise RuntimeError("bug in user code")

def wrong_type(response, sample):
    return "1.0"

not_a_function = 3
'''


@pytest.fixture
def custom_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "my_rewards_for_test.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards_for_test"


def test_custom_float_and_result_returns(custom_module: str) -> None:
    ten_chars = _reward("custom", function=f"{custom_module}:length_bonus")("\\boxed{7}.", _sample(7))
    assert (ten_chars.score, ten_chars.is_correct, ten_chars.extracted) == (1.0, True, "7")  # 10/10 = 1.0
    short = _reward("custom", function=f"{custom_module}:length_bonus")("abcd", _sample(7))
    assert (short.score, short.is_correct) == (0.4, False)  # 4/10; a float is correct only when ≥ 1
    detailed = _reward("custom", function=f"{custom_module}:detailed")("", _sample(7))
    assert detailed == RewardResult(score=0.5, is_correct=True, extracted="x")


def test_custom_errors_are_contained(custom_module: str) -> None:
    broken = _reward("custom", function=f"{custom_module}:broken")("x", _sample(1))
    assert (broken.score, broken.error) == (0.0, "RuntimeError: bug in user code")
    wrong_type = _reward("custom", function=f"{custom_module}:wrong_type")("x", _sample(1))
    assert wrong_type.error is not None and "return a float or a RewardResult" in wrong_type.error


def test_custom_functions_that_do_not_import_say_how_to_fix(custom_module: str) -> None:
    with pytest.raises(RewardConfigError, match=r"cannot import module 'no_such_module_xyz'.*pip install"):
        _reward("custom", function="no_such_module_xyz:f")
    with pytest.raises(RewardConfigError, match=r"has no function 'not_a_function'; define it as"):
        _reward("custom", function=f"{custom_module}:not_a_function")
