"""The engine seam's data: validation with guided errors, and the truncation warning."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from rollout.request_record import GenerationProgress
from rollout.types import GenerationRequest, GenerationResult, SamplingParams, TruncationWarning


def _result(**overrides: object) -> GenerationResult:
    fields: dict[str, object] = dict(
        request_id="r",
        token_ids=(5, 6),
        logprobs=(-0.5, -1.0),
        versions=(0, 1),
        finish_reason="length",
        version_start=0,
        version_end=1,
    )
    return GenerationResult(**(fields | overrides))


def test_result_needs_one_logprob_and_version_per_token() -> None:
    with pytest.raises(ValidationError, match="one entry per sampled token"):
        _result(logprobs=(-0.5,))
    assert not _result(logprobs=()).has_logprobs  # evaluation servers may send none
    with pytest.raises(ValidationError, match="one entry per sampled token"):
        _result(versions=(0,))


def test_result_versions_never_decrease() -> None:
    with pytest.raises(ValidationError, match="must not decrease"):
        _result(versions=(1, 0))
    with pytest.raises(ValidationError, match="must not decrease"):
        _result(version_start=2, versions=(2, 2), version_end=1)


def test_result_rejects_nan_and_positive_logprobs() -> None:
    with pytest.raises(ValidationError, match="log-probabilities"):
        _result(logprobs=(float("nan"), -1.0))
    with pytest.raises(ValidationError, match="log-probabilities"):
        _result(logprobs=(0.5, -1.0))


def test_requests_are_frozen_and_strict() -> None:
    request = GenerationRequest(request_id="a", prompt_token_ids=[1, 2])
    assert request.prompt_token_ids == (1, 2)
    with pytest.raises(ValidationError):
        request.request_id = "b"  # type: ignore[misc]
    with pytest.raises(ValidationError, match="temprature"):
        SamplingParams(temprature=0.5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="at least 1 item"):
        GenerationRequest(request_id="a", prompt_token_ids=[])


@pytest.mark.parametrize(
    ("top_p", "top_k", "temperature", "truncated"),
    [(1.0, 0, 1.0, False), (0.9, 0, 1.0, True), (1.0, 5, 0.7, True), (0.9, 5, 0.0, False)],
)
def test_truncation_is_top_p_or_top_k_while_sampling(
    top_p: float, top_k: int, temperature: float, truncated: bool
) -> None:
    params = SamplingParams(top_p=top_p, top_k=top_k, temperature=temperature)
    assert params.is_truncated is truncated


def test_truncation_warning_is_logged_once_per_engine(caplog: pytest.LogCaptureFixture) -> None:
    warning = TruncationWarning("hf", logging.getLogger("test"))
    with caplog.at_level(logging.WARNING):
        warning.check(SamplingParams())
        warning.check(SamplingParams(top_p=0.5))
        warning.check(SamplingParams(top_k=3))
    assert [r.message.count("truncate the sampling distribution") for r in caplog.records] == [1]


def test_progress_freezes_into_a_result_with_per_token_versions() -> None:
    progress = GenerationProgress(
        request=GenerationRequest(request_id="r", prompt_token_ids=[1]), version_start=3
    )
    progress.extend([7, 8], [-0.1, -0.2], version=3)
    progress.extend([9], [-0.3], version=4)
    progress.finish("stop")  # no reason given: EOS, reported as the last token id
    result = progress.result(version_end=4)
    assert (result.token_ids, result.versions, result.stop_reason) == ((7, 8, 9), (3, 3, 4), 9)
    assert result.timings.total_s >= result.timings.first_token_s >= 0
    aborted = progress.result(version_end=4, finish_reason="abort")
    assert (aborted.finish_reason, aborted.stop_reason) == ("abort", None)
