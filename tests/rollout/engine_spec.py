"""The behaviour every real engine must show, as reusable checks (HF, vLLM, SGLang via its stand-in).

Each `check_*` drives an engine through the public protocol only and asserts the contract:
logprobs equal a forward pass of the same weights at the same temperature; stop strings and stop
tokens end the generation at their first occurrence (included); abort and cancellation return
the tokens so far while other requests carry on; pause holds progress; a weight load takes effect
at a step boundary with the new version, after which tokens are sampled from the new weights.
Every await is bounded, so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Iterator, Sequence
from typing import TypeVar

import torch
from transformers import PreTrainedModel

from rollout.base import InferenceEngine
from rollout.types import GenerationRequest, GenerationResult, SamplingParams

WAIT_S = 120.0
_T = TypeVar("_T")
_ids = itertools.count()


async def bounded(awaitable: Awaitable[_T], timeout_s: float = WAIT_S) -> _T:
    return await asyncio.wait_for(awaitable, timeout_s)


def request(prompt: Sequence[int], **sampling: object) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"spec-{next(_ids)}", prompt_token_ids=tuple(prompt), sampling=SamplingParams(**sampling)
    )


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Reference forwards on one thread: on a shared 2-core machine a busy second core turns OpenMP's
    spinning barriers into seconds per forward; one thread costs ~1.7x on an idle machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
@_one_torch_thread()
def reference_logprobs(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    generations: Sequence[Sequence[int]],
    temperature: float,
) -> list[torch.Tensor]:
    """log softmax(logits / T)[token] of each generated token, from one right-padded forward pass (the
    learner's computation; padding after a causal sequence does not change it)."""
    sequences = [[*prompt, *tokens] for prompt, tokens in zip(prompts, generations, strict=True)]
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    scale = temperature if temperature > 0 else 1.0
    out = []
    for row, (prompt, tokens) in enumerate(zip(prompts, generations, strict=True)):
        step_logits = logits[row, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        out.append(
            torch.log_softmax(step_logits / scale, dim=-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        )
    return out


async def check_logprobs_match_forward(
    engine: InferenceEngine,
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    atol: float,
    temperature: float = 0.7,
    max_new_tokens: int = 24,
) -> list[GenerationResult]:
    """Concurrent requests of different lengths: each result's logprobs match its own forward pass."""
    requests = [
        request(p, temperature=temperature, max_new_tokens=max_new_tokens, seed=i, use_eos=False)
        for i, p in enumerate(prompts)
    ]
    results = await bounded(asyncio.gather(*(engine.generate(r) for r in requests)))
    expected = reference_logprobs(model, prompts, [r.token_ids for r in results], temperature)
    for req, result, reference in zip(requests, results, expected, strict=True):
        assert result.request_id == req.request_id
        assert result.finish_reason == "length" and len(result.token_ids) == max_new_tokens  # no padding
        assert result.versions == (engine.version,) * max_new_tokens
        torch.testing.assert_close(torch.tensor(result.logprobs), reference, atol=atol, rtol=0)
    return results


async def check_stop_string_ends_at_first_occurrence(
    engine: InferenceEngine, prompt: Sequence[int], decode: object
) -> None:
    """Pick a 2-token text span from an unconstrained run; the same seed with that stop string must end
    on the token that completes its first occurrence."""
    free = await bounded(engine.generate(request(prompt, max_new_tokens=24, seed=3, use_eos=False)))
    texts = [decode(free.token_ids[: i + 1]) for i in range(len(free.token_ids))]  # type: ignore[operator]
    stop = texts[12][len(texts[10]) :]  # the text of tokens 11 and 12
    assert stop.strip(), f"pick a visible span; got {stop!r}"
    first_end = next(i for i, text in enumerate(texts) if stop in text)
    stopped = await bounded(
        engine.generate(request(prompt, max_new_tokens=24, seed=3, use_eos=False, stop=(stop,)))
    )
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.token_ids == free.token_ids[: first_end + 1]


async def check_stop_token_ends_generation(engine: InferenceEngine, prompt: Sequence[int]) -> None:
    free = await bounded(engine.generate(request(prompt, max_new_tokens=12, seed=5, use_eos=False)))
    stop_id = free.token_ids[6]
    first = free.token_ids.index(stop_id)
    stopped = await bounded(
        engine.generate(request(prompt, max_new_tokens=12, seed=5, use_eos=False, stop_token_ids=(stop_id,)))
    )
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_id)
    assert stopped.token_ids == free.token_ids[: first + 1]


async def check_abort_and_cancel_leave_others_running(engine: InferenceEngine, prompt: Sequence[int]) -> None:
    long_request = request(prompt, max_new_tokens=4000, use_eos=False)
    cancelled_request = request(prompt, max_new_tokens=4000, use_eos=False)
    short_request = request(prompt, max_new_tokens=8, use_eos=False)
    long_task = asyncio.create_task(engine.generate(long_request))
    cancelled_task = asyncio.create_task(engine.generate(cancelled_request))
    await asyncio.sleep(1.0)
    short = await bounded(engine.generate(short_request))  # runs while the long ones are in flight
    await engine.abort(long_request.request_id)
    aborted = await bounded(long_task, 30)
    cancelled_task.cancel()
    await asyncio.gather(cancelled_task, return_exceptions=True)
    assert len(short.token_ids) == 8 and short.finish_reason == "length"
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 4000
    assert len(aborted.logprobs) == len(aborted.versions) == len(aborted.token_ids)
    await engine.abort("no-such-request")  # unknown ids are ignored
    after = await bounded(engine.generate(request(prompt, max_new_tokens=4, use_eos=False)), 60)
    assert len(after.token_ids) == 4


async def check_pause_holds_progress_until_resume(engine: InferenceEngine, prompt: Sequence[int]) -> None:
    await bounded(engine.pause(), 60)
    task = asyncio.create_task(engine.generate(request(prompt, max_new_tokens=4, use_eos=False)))
    done, _ = await asyncio.wait({task}, timeout=1.5)
    assert not done, "a paused engine must not generate"
    await engine.resume()
    result = await bounded(task, 60)
    assert len(result.token_ids) == 4


async def check_weight_load_mid_generation(
    engine: InferenceEngine,
    old_model: PreTrainedModel,
    new_model: PreTrainedModel,
    prompt: Sequence[int],
    atol: float,
    temperature: float = 0.8,
) -> None:
    """Push `new_model`'s weights while a request is in flight: its tokens split into the old and the new
    version, each matching the forward pass of the weights that produced it; later requests use the new
    weights only."""
    old_version = engine.version
    new_version = old_version + 1
    in_flight = request(prompt, max_new_tokens=4000, temperature=temperature, seed=11, use_eos=False)
    task = asyncio.create_task(engine.generate(in_flight))
    await asyncio.sleep(0.5)
    await bounded(engine.load_weights(list(new_model.state_dict().items()), new_version), 120)
    assert engine.version == new_version
    await asyncio.sleep(0.5)
    await engine.abort(in_flight.request_id)
    spanning = await bounded(task)
    split = spanning.versions.index(new_version)
    assert 0 < split < len(spanning.token_ids), "the load must land while the request is in flight"
    assert set(spanning.versions[:split]) == {old_version} and set(spanning.versions[split:]) == {new_version}
    assert (spanning.version_start, spanning.version_end) == (old_version, new_version)
    (old_expected,) = reference_logprobs(old_model, [prompt], [spanning.token_ids], temperature)
    (new_expected,) = reference_logprobs(new_model, [prompt], [spanning.token_ids], temperature)
    got = torch.tensor(spanning.logprobs)
    torch.testing.assert_close(got[:split], old_expected[:split], atol=atol, rtol=0)
    torch.testing.assert_close(got[split:], new_expected[split:], atol=atol, rtol=0)
    await check_logprobs_match_forward(engine, new_model, [prompt], atol=atol, max_new_tokens=8)


def perturbed_copy(model: PreTrainedModel, scale: float = 1.05) -> PreTrainedModel:
    """A copy of `model` with the embedding (tied to lm_head) and the first layer scaled: a weight update
    whose effect on logprobs is large (and that exercises the tied-lm_head path)."""
    import copy

    new = copy.deepcopy(model)
    with torch.no_grad():
        for name, parameter in new.named_parameters():
            if "embed_tokens" in name or ".layers.0." in name:
                parameter.mul_(scale)
    return new
