"""Sampling with exact behaviour logprobs, truncation, and stop strings across token boundaries."""

from __future__ import annotations

import math

import torch

from rollout.engines.sampling import StopStringMatcher, sample_next_tokens, truncate_logits
from rollout.tiny import build_byte_tokenizer
from rollout.types import SamplingParams

NEG_INF = float("-inf")


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert truncate_logits(logits, top_k=2, top_p=1.0).tolist() == [NEG_INF, 3.0, 2.0, NEG_INF]


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    # probabilities 0.5, 0.25, 0.125, 0.125 (logits = log p). A token goes once the more likely ones
    # already hold ≥ top_p: top_p=0.7 and 0.75 → 0.5 + 0.25 = 0.75 suffices, tokens 2 and 3 go;
    # top_p=0.76 → one 0.125 token is needed too (0.875), the other goes.
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    for top_p in (0.7, 0.75):
        kept = truncate_logits(probs.log(), top_k=0, top_p=top_p)
        assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = torch.isfinite(truncate_logits(probs.log(), top_k=0, top_p=0.76)).tolist()
    assert kept[:2] == [True, True] and sum(kept) == 3


def test_logprob_is_of_the_temperature_scaled_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    params = [SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=2.0, seed=2)]
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    sampled = sample_next_tokens(logits, params, generators)
    for row, token in enumerate(sampled.token_ids.tolist()):
        expected = torch.log_softmax(logits[row] / params[row].temperature, dim=-1)[token]
        assert math.isclose(sampled.logprobs[row].item(), expected.item(), abs_tol=1e-6)


def test_truncated_logprob_is_renormalised_over_the_kept_tokens() -> None:
    # top_k=2 of logits [2, 1, 0]: p = softmax([2, 1]) → log p(token 0) = 2 − log(e² + e) = −0.3133
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=2)]
    for seed in range(20):
        sampled = sample_next_tokens(logits, params, [torch.Generator().manual_seed(seed)])
        token = int(sampled.token_ids[0])
        assert token in (0, 1)
        expected = [2.0, 1.0][token] - math.log(math.exp(2.0) + math.exp(1.0))
        assert math.isclose(sampled.logprobs[0].item(), expected, abs_tol=1e-6)


def test_greedy_takes_the_argmax_and_reports_the_untempered_logprob() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    sampled = sample_next_tokens(logits, [SamplingParams(temperature=0.0)], [torch.Generator()])
    assert sampled.token_ids.tolist() == [1]
    assert math.isclose(sampled.logprobs[0].item(), torch.log_softmax(logits[0], -1)[1].item(), abs_tol=1e-6)


def test_same_seed_same_tokens() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(seed=7)]
    draws = [
        sample_next_tokens(logits, params, [torch.Generator().manual_seed(7)]).token_ids.item()
        for _ in range(3)
    ]
    assert len(set(draws)) == 1


def test_stop_string_spanning_tokens_is_found_on_the_completing_token() -> None:
    tokenizer = build_byte_tokenizer()  # one token per byte: "```" is three tokens
    matcher = StopStringMatcher(["```\n"], tokenizer)
    ids = tokenizer("print(1)\n```\nmore")["input_ids"]
    completing = next(i for i in range(1, len(ids) + 1) if matcher.match(ids[:i]) is not None)
    assert tokenizer.decode(ids[:completing]) == "print(1)\n```\n"
    assert all(matcher.match(ids[:i]) is None for i in range(1, completing))


def test_multibyte_stop_string_matches_when_its_last_byte_arrives() -> None:
    tokenizer = build_byte_tokenizer()
    matcher = StopStringMatcher(["é!"], tokenizer)  # 'é' is two byte tokens
    ids = tokenizer("caf" + "é!")["input_ids"]
    assert [matcher.match(ids[:i]) for i in range(1, len(ids) + 1)] == [None] * (len(ids) - 1) + ["é!"]
    assert not StopStringMatcher([], tokenizer)
