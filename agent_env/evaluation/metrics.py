"""Evaluation metrics over k samples per problem: avg@k, pass@k (unbiased), maj@k.

Pure functions on per-problem lists of (is_correct, extracted answer). No I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from math import comb


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k estimator (Chen et al. 2021): 1 − C(n−c, k) / C(n, k), for n ≥ k samples."""
    if k > num_samples:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got {num_samples}")
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - comb(num_samples - num_correct, k) / comb(num_samples, k)


def majority_is_correct(samples: Sequence[tuple[bool, str | None]]) -> bool:
    """maj@k: the most frequent extracted answer (ties → first seen) is correct. No answer never wins."""
    answers = [answer.strip() for _, answer in samples if answer is not None and answer.strip()]
    if not answers:
        return False
    counts = Counter(answers)
    best = max(counts.values())
    winner = next(answer for answer in answers if counts[answer] == best)
    return any(is_correct for is_correct, answer in samples
               if answer is not None and answer.strip() == winner)


def summarize(per_problem: Mapping[str, Sequence[tuple[bool, str | None]]], k: int) -> dict[str, float]:
    """avg@k, pass@1, pass@k and maj@k (as fractions) over problems with at least k samples."""
    complete = {key: samples for key, samples in per_problem.items() if len(samples) >= k}
    n = len(complete)
    if n == 0:
        return {"problems": 0}
    def mean(values: Sequence[float]) -> float:
        return sum(values) / n
    correct = {key: sum(ok for ok, _ in samples) for key, samples in complete.items()}
    counts = {key: len(samples) for key, samples in complete.items()}
    return {
        "problems": n,
        "samples": sum(counts.values()),
        f"avg@{k}": mean([correct[key] / counts[key] for key in complete]),
        "pass@1": mean([pass_at_k(counts[key], correct[key], 1) for key in complete]),
        f"pass@{k}": mean([pass_at_k(counts[key], correct[key], k) for key in complete]),
        f"maj@{k}": mean([float(majority_is_correct(samples)) for samples in complete.values()]),
    }
