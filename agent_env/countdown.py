"""Countdown: make, solve and check "use these numbers once each to reach the target" puzzles.

* `generate_countdown_rows` / `generate_countdown`: seeded instances in the style of the
  Countdown-Tasks-3to4 data: target uniform in [min_target, max_target], 3–4
  numbers uniform in 1..max_number, numbers redrawn until the instance is solvable.
* `solve`: exhaustive search with exact rational arithmetic (`Fraction`), each number used once,
  + − × ÷ and parentheses; returns one solution as an expression string.
* `score_expression`: checks a model's equation without `eval`: the text is parsed with `ast` and
  only integer literals, + − × ÷ and parentheses are accepted (no names, calls, `**`, unary minus).
  Each given number must be used exactly once (as a multiset), and the value must equal the target
  exactly (true division, rational arithmetic; division by zero fails).

Deliberately stricter than TinyZero's scorer (which `eval`s with a 1e-5 tolerance and also lets
`**` and `//` through): an answer scores here only if it is a correct Countdown equation.
Not here: finding the equation in the model's text (`extract_equation` only cleans up what the
task's answer pattern captured) or the reward's score values (agent_env/rewards.py).
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from agent_env.samples import Sample

MAX_EXPRESSION_CHARS = 256
"""Longer answers are rejected before parsing (a Countdown equation of 4–6 numbers is ~30 chars)."""

_MAX_REDRAWS_PER_TARGET = 100
"""Redraws of the numbers for one target before a new target is drawn."""

_Step = tuple[str, int, Fraction, int, Fraction] | None
"""How a value was made: (operator, left mask, left value, right mask, right value); None = a given number."""

_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}

_ALIASES = (
    ("\\left", ""), ("\\right", ""), ("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"),
    ("×", "*"), ("·", "*"), ("÷", "/"), ("−", "-"), ("–", "-"), ("$", ""), ("\\,", " "), ("\\ ", " "),
)
"""Unicode and LaTeX spellings of the operators a model may write, mapped to Python's."""


# ---------------------------------------------------------------------------------------------
# Solving


def solve(numbers: Sequence[int], target: int) -> str | None:
    """One expression that uses every number exactly once and equals `target`, else None.

    Dynamic programming over subsets of the numbers (by position, so repeated numbers count
    separately): `values[mask]` maps every value the numbers in `mask` can make to how it was made.
    For the full set only the last operation is needed, so instead of enumerating it we look up
    the partner value each operation would need (target − a, target / a, ...). Intermediate values
    may be negative or fractional; all arithmetic is exact.
    """
    count = len(numbers)
    if count == 0:
        return None
    goal = Fraction(target)
    values: dict[int, dict[Fraction, _Step]] = {1 << i: {Fraction(n): None} for i, n in enumerate(numbers)}
    full = (1 << count) - 1
    if count == 1:
        return str(numbers[0]) if Fraction(numbers[0]) == goal else None
    for mask in sorted(range(1, full), key=int.bit_count):
        if mask.bit_count() > 1:
            values[mask] = _combine_all(mask, values)
    for left_mask, right_mask in _splits(full):
        found = _last_step(goal, left_mask, values[left_mask], right_mask, values[right_mask])
        if found is not None:
            return _render(full, goal, {**values, full: {goal: found}})
    return None


def _splits(mask: int) -> list[tuple[int, int]]:
    """Each unordered split of `mask` into two non-empty parts, once."""
    found = []
    part = (mask - 1) & mask
    while part:
        if part < mask ^ part:
            found.append((part, mask ^ part))
        part = (part - 1) & mask
    return found


def _combine_all(mask: int, values: dict[int, dict[Fraction, _Step]]) -> dict[Fraction, _Step]:
    """Every value the numbers in `mask` can make, each with one way to make it."""
    made: dict[Fraction, _Step] = {}
    for a_mask, b_mask in _splits(mask):
        for a in values[a_mask]:
            for b in values[b_mask]:
                made.setdefault(a + b, ("+", a_mask, a, b_mask, b))
                made.setdefault(a * b, ("*", a_mask, a, b_mask, b))
                made.setdefault(a - b, ("-", a_mask, a, b_mask, b))
                made.setdefault(b - a, ("-", b_mask, b, a_mask, a))
                if b:
                    made.setdefault(a / b, ("/", a_mask, a, b_mask, b))
                if a:
                    made.setdefault(b / a, ("/", b_mask, b, a_mask, a))
    return made


def _last_step(goal: Fraction, a_mask: int, a_values: dict[Fraction, _Step], b_mask: int,
               b_values: dict[Fraction, _Step]) -> _Step:
    """An operation `a op b = goal` (either order) with a, b from the two sets, else None."""
    for a in a_values:
        if not a and not goal:  # 0 * b = 0 for any b
            return ("*", a_mask, a, b_mask, next(iter(b_values)))
        needs = [("+", goal - a, False), ("-", a - goal, False), ("-", a + goal, True)]
        if a:
            needs += [("*", goal / a, False), ("/", a * goal, True)]
            if goal:
                needs.append(("/", a / goal, False))
        for operator, b, b_first in needs:
            if b in b_values:  # every denominator here is a or a / goal, both non-zero
                return (operator, b_mask, b, a_mask, a) if b_first else (operator, a_mask, a, b_mask, b)
    return None


def _render(mask: int, value: Fraction, values: dict[int, dict[Fraction, _Step]]) -> str:
    step = values[mask][value]
    if step is None:
        return str(value.numerator)
    operator, a_mask, a, b_mask, b = step
    left, right = _render(a_mask, a, values), _render(b_mask, b, values)
    return f"{_wrap(left)} {operator} {_wrap(right)}"


def _wrap(text: str) -> str:
    return text if text.isdigit() else f"({text})"


def _may_be_solvable(numbers: Sequence[int], target: int) -> bool:
    """A fast float version of `solve`'s search (about 4x faster) used by the generator to reject
    draws early. It can only err towards False (a value near a rounding boundary), which merely
    costs a redraw; every instance the generator keeps is confirmed by the exact `solve`."""
    count = len(numbers)
    full = (1 << count) - 1
    values: dict[int, set[float]] = {1 << i: {float(n)} for i, n in enumerate(numbers)}
    for mask in sorted(range(1, full), key=int.bit_count):
        if mask.bit_count() > 1:
            made: set[float] = set()
            for a_mask, b_mask in _splits(mask):
                for a in values[a_mask]:
                    for b in values[b_mask]:
                        made.update((a + b, a * b, a - b, b - a))
                        if b:
                            made.add(a / b)
                        if a:
                            made.add(b / a)
            values[mask] = made
    goal = float(target)
    for a_mask, b_mask in _splits(full):
        keys = {round(value, 6) for value in values[b_mask]}
        for a in values[a_mask]:
            needs = [goal - a, a - goal, a + goal]
            if a:
                needs += [goal / a, a * goal] + ([a / goal] if goal else [])
            if any(round(need, 6) in keys for need in needs) or (not a and not goal):
                return True
    return count == 1 and float(numbers[0]) == goal


# ---------------------------------------------------------------------------------------------
# Checking a model's equation


def extract_equation(answer: str) -> str | None:
    """The left-hand expression of what the answer pattern captured, in Python operator spelling.

    `(1 + 2) * 3 = 9` → `(1 + 2) * 3`; `9 = (1 + 2) * 3` → `(1 + 2) * 3` (the first side with an
    operator wins); `×`, `÷`, `−`, `\\times`, `\\div`, `\\cdot`, `\\left(`/`\\right)` and `$` are
    normalised. None when nothing is left.
    """
    text = answer
    for alias, replacement in _ALIASES:
        text = text.replace(alias, replacement)
    sides = [side.strip() for side in text.split("=") if side.strip()]
    if not sides:
        return None
    with_operator = [side for side in sides if any(op in side for op in "+-*/")]
    return (with_operator or sides)[0]


def score_expression(expression: str, numbers: Sequence[int], target: int) -> bool:
    """True iff `expression` is a valid Countdown equation for (numbers, target). Never raises."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return False
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    used: list[int] = []
    value = _evaluate(tree.body, used)
    return value is not None and value == target and Counter(used) == Counter(int(n) for n in numbers)


def _evaluate(node: ast.AST, used: list[int]) -> Fraction | None:
    """Exact value of an allowed expression tree, collecting its literals in `used`; None if the
    tree contains anything else or divides by zero."""
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:  # bool, float, str, ... are not Countdown numbers
            return None
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left = _evaluate(node.left, used)
        right = _evaluate(node.right, used)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Add):
            return left + right
        if isinstance(node.op, ast.Sub):
            return left - right
        if isinstance(node.op, ast.Mult):
            return left * right
        return left / right if right != 0 else None
    return None  # names, calls, attributes, unary minus, **, //, %, comparisons, ...


# ---------------------------------------------------------------------------------------------
# Generating


def generate_countdown_rows(
    num_samples: int,
    seed: int,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    min_target: int = 10,
    max_target: int = 100,
) -> list[dict[str, Any]]:
    """`num_samples` solvable instances as rows `{"target": int, "nums": [int, ...]}` (the
    TinyZero parquet's column names). The same arguments always give the same rows."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    targets_drawn = 0
    while len(rows) < num_samples:
        targets_drawn += 1
        if targets_drawn > 20 * num_samples + 100:  # ranges with (almost) no solvable instance
            raise ValueError(
                f"could not find solvable Countdown instances (numbers 1..{max_number}, targets "
                f"{min_target}..{max_target}, {min_numbers}-{max_numbers} numbers); widen the ranges")
        target = rng.randint(min_target, max_target)
        count = rng.randint(min_numbers, max_numbers)
        for _ in range(_MAX_REDRAWS_PER_TARGET):
            numbers = [rng.randint(1, max_number) for _ in range(count)]
            if _may_be_solvable(numbers, target) and solve(numbers, target) is not None:
                rows.append({"target": target, "nums": numbers})
                break
    return rows


def generate_countdown(
    num_samples: int,
    seed: int,
    *,
    min_numbers: int = 3,
    max_numbers: int = 4,
    max_number: int = 99,
    min_target: int = 10,
    max_target: int = 100,
) -> list[Sample]:
    """The rows of `generate_countdown_rows` as samples: fields {numbers, target}, answer
    {"target", "numbers"}, id = position."""
    rows = generate_countdown_rows(num_samples, seed, min_numbers=min_numbers, max_numbers=max_numbers,
                                   max_number=max_number, min_target=min_target, max_target=max_target)
    return [
        Sample(sample_id=str(index), fields={"numbers": row["nums"], "target": row["target"]},
               answer={"target": row["target"], "numbers": row["nums"]})
        for index, row in enumerate(rows)
    ]
