"""Countdown: the solver, the safe equation checker and the seeded generator."""

from __future__ import annotations

import builtins
from collections import Counter

import pytest

from agent_env.countdown import (
    MAX_EXPRESSION_CHARS,
    extract_equation,
    generate_countdown,
    generate_countdown_rows,
    score_expression,
    solve,
)


@pytest.mark.parametrize(("numbers", "target"), [
    ([2, 3, 4], 14),      # 2 * (3 + 4)
    ([79, 17, 60], 36),   # 79 + 17 - 60
    ([3, 3, 8, 8], 24),   # 8 / (3 - 8 / 3): needs a fractional intermediate value
    ([5, 5, 7], 0),       # (5 - 5) * 7
    ([6, 6, 6], 6),       # repeated numbers each count once: 6 + 6 - 6
    ([9], 9),
])
def test_solve_finds_an_equation_that_scores(numbers: list[int], target: int) -> None:
    equation = solve(numbers, target)
    assert equation is not None
    assert score_expression(equation, numbers, target)


@pytest.mark.parametrize(("numbers", "target"), [([1, 1, 1], 100), ([2, 2], 5), ([9], 8), ([], 3)])
def test_solve_returns_none_when_there_is_no_equation(numbers: list[int], target: int) -> None:
    # 1,1,1 make at most (1+1)*... = 3; 2,2 make 0, 1, 4 only; a lone 9 is not 8
    assert solve(numbers, target) is None


@pytest.mark.parametrize("expression", [
    "(1 + 2) * 3", "3 * (2 + 1)", "(3 * 2) + 1 + 2", "6 / 2 * 3 * 1 * 2 / 2",
])
def test_valid_equations_score(expression: str) -> None:
    tokens = expression.replace("(", " ").replace(")", " ").split()
    numbers = [int(token) for token in tokens if token.isdigit()]
    assert score_expression(expression, numbers, 9)


@pytest.mark.parametrize(("expression", "why"), [
    ("(1 + 2) * 4", "evaluates to 12"),
    ("(1 + 2) * 3 * 1", "uses 1 twice"),
    ("3 * 3", "does not use 1 and 2"),
    ("(1 + 2) * 3 + 2 - 2", "uses 2 three times"),
    ("1 + 2 + 3 * 2", "equals 9 but uses 2 twice"),
    ("-1 + 2 * 3 + 4", "unary minus"),
    ("3 ** 2 + 1 - 1", "power is not an allowed operation"),
    ("(1 + 2) // 1 * 3", "floor division"),
    ("3 % 4 * 3", "modulo"),
    ("1.0 * 2 * 3 + 3", "float literal"),
    ("x * 3", "a name"),
    ("__import__('os').system('echo hi')", "a call"),
    ("(lambda: 9)()", "a lambda"),
    ("True + 2 * 3 + 2", "bools are not numbers"),
    ("'9'", "a string"),
    ("1 + 2 +", "syntax error"),
    ("1 / (2 - 2) + 3", "division by zero"),
    ("", "empty"),
    ("1 + 2 + 3\x00", "null byte"),
])
def test_invalid_equations_do_not_score(expression: str, why: str) -> None:
    assert not score_expression(expression, [1, 2, 3], 9), why


def test_input_longer_than_the_cap_is_rejected_without_parsing() -> None:
    assert not score_expression("1+" * 5000 + "1", [1] * 5001, 5001)
    assert not score_expression("(" * 300 + "9" + ")" * 300, [9], 9)  # beyond the parser's nesting limit


def test_deep_but_short_input_is_judged_normally() -> None:
    nested = "(" * 100 + "1" + ")" * 100 + " + 2 + 3 + 3"
    assert len(nested) <= MAX_EXPRESSION_CHARS
    assert score_expression(nested, [1, 2, 3, 3], 9)
    chain = "+".join(["1"] * 120)  # a 119-level deep tree of additions
    assert score_expression(chain, [1] * 120, 120)


def test_scoring_never_calls_eval(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec must not be used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert score_expression("(1 + 2) * 3", [1, 2, 3], 9)
    assert not score_expression("__import__('os')", [1, 2, 3], 9)


def test_fractions_are_exact() -> None:
    # 1/3 * 3 is exactly 1 in rational arithmetic (floats would give 0.999... for some orders)
    assert score_expression("1 / 3 * 3 + 8", [1, 3, 3, 8], 9)
    assert not score_expression("7 / 2 + 5", [7, 2, 5], 9)  # 8.5, not 9


@pytest.mark.parametrize(("answer", "expected"), [
    ("(1 + 2) * 3 = 9", "(1 + 2) * 3"),
    ("9 = (1 + 2) * 3", "(1 + 2) * 3"),
    ("(1 + 2) \\times 3", "(1 + 2) * 3"),
    ("\\left(1 + 2\\right) \\cdot 3", "(1 + 2) * 3"),
    ("(1 + 2) × 3 − 0 ÷ 1", "(1 + 2) * 3 - 0 / 1"),
    ("$12 / 4$", "12 / 4"),
    ("9", "9"),
    ("  =  ", None),
])
def test_extract_equation_normalises_what_the_pattern_captured(answer: str, expected: str | None) -> None:
    assert extract_equation(answer) == expected


def test_the_generator_is_seeded_and_deterministic() -> None:
    assert generate_countdown_rows(30, seed=7) == generate_countdown_rows(30, seed=7)
    assert generate_countdown_rows(30, seed=7) != generate_countdown_rows(30, seed=8)
    assert generate_countdown_rows(10, seed=7) == generate_countdown_rows(30, seed=7)[:10]


def test_generated_instances_are_in_range_and_solvable() -> None:
    rows = generate_countdown_rows(200, seed=0)
    assert len(rows) == 200
    assert all(10 <= row["target"] <= 100 for row in rows)
    assert all(3 <= len(row["nums"]) <= 4 and all(1 <= n <= 99 for n in row["nums"]) for row in rows)
    assert all(solve(row["nums"], row["target"]) is not None for row in rows)
    counts = Counter(len(row["nums"]) for row in rows)
    assert counts[3] > 50 and counts[4] > 50  # both sizes drawn (uniformly: ~100 each)


def test_generator_ranges_are_respected() -> None:
    rows = generate_countdown_rows(50, seed=1, min_numbers=2, max_numbers=2, max_number=10,
                                   min_target=5, max_target=6)
    assert all(len(r["nums"]) == 2 and max(r["nums"]) <= 10 and r["target"] in (5, 6) for r in rows)


def test_impossible_ranges_fail_with_a_hint() -> None:
    # numbers are all 1, so 3-4 of them reach at most (1+1)*(1+1) = 4 < 50
    with pytest.raises(ValueError, match="widen the ranges"):
        generate_countdown_rows(1, seed=0, max_number=1, min_target=50, max_target=60)


def test_generated_samples_carry_fields_and_answer() -> None:
    sample = generate_countdown(1, seed=0)[0]
    row = generate_countdown_rows(1, seed=0)[0]
    assert sample.sample_id == "0"
    assert sample.fields == {"numbers": row["nums"], "target": row["target"]}
    assert sample.answer == {"target": row["target"], "numbers": row["nums"]}
