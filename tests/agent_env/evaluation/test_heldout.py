"""Held-out evaluation (agent_env/evaluation/heldout.py): the intervals by hand, the choice of prompts
that are not training prompts, and the evaluator on the scripted engine — one file per version, resumed,
discarded."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from agent_env.evaluation.heldout import (
    HeldoutEvaluator,
    HeldoutResult,
    falling_warning,
    mean_t_interval,
    paired_change,
    select_heldout,
    t_quantile_975,
    wilson_interval,
)
from agent_env.loop import EpisodeSettings
from agent_env.rewards import RewardResult
from agent_env.samples import Sample
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.tiny import build_byte_tokenizer

USER = "Make {target}."


def _sample(target: int, sample_id: str | None = None) -> Sample:
    return Sample(sample_id=sample_id or f"s{target}", fields={"target": target}, answer=target)


def test_wilson_interval_by_hand() -> None:
    # 5 of 10: centre stays 0.5; half = 1.96·sqrt(0.025 + 3.8415/400)/(1 + 0.38415) = 0.2634
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.5 - 0.26341, 0.5 + 0.26341), abs=1e-4)
    # 0 of 10: [0, z²/(n + z²)] = [0, 3.8415/13.8415]
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)


def test_mean_t_interval_by_hand() -> None:
    # [1, 2, 3, 4]: mean 2.5, sd sqrt(5/3), t(3) = 3.182 → half 3.182·1.2910/2 = 2.054
    mean, low, high = mean_t_interval([1.0, 2.0, 3.0, 4.0])
    assert (mean, low, high) == pytest.approx((2.5, 2.5 - 2.0540, 2.5 + 2.0540), abs=1e-3)
    assert mean_t_interval([0.25]) == (0.25, 0.25, 0.25)
    assert t_quantile_975(500) == pytest.approx(1.96, abs=1e-3) and t_quantile_975(11) == 2.228
    with pytest.raises(ValueError):
        mean_t_interval([])


def test_paired_change_over_the_common_prompts() -> None:
    def result(version: int, per_prompt: dict[str, float]) -> HeldoutResult:
        return HeldoutResult(version, sum(per_prompt.values()) / len(per_prompt), 0, 1, per_prompt, {}, 0.0)

    start = result(0, {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0})
    end = result(10, {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0})
    change = paired_change(start, end)
    # differences [1, 1, 0, 0]: mean 0.5, sd sqrt(1/3), t(3)·0.57735/2 = 0.9186
    expected = (0.5, 0.5 - 0.9186, 0.5 + 0.9186)
    assert (change.gain, change.low, change.high) == pytest.approx(expected, abs=1e-3)
    assert "+50.0 points" in change.line()
    with pytest.raises(ValueError, match="share no prompt"):
        paired_change(start, result(5, {"z": 1.0}))
    assert falling_warning(start, end) is None  # a rise
    many = {f"p{i}": 1.0 for i in range(20)}
    fallen = result(20, {key: 0.0 for key in many})
    warning = falling_warning(result(0, many), fallen)
    assert warning is not None and warning.startswith("warning: held-out success fell significantly")
    assert falling_warning(None, fallen) is None


def test_select_heldout_drops_training_prompts_and_refuses_too_few() -> None:
    training = [_sample(t) for t in (10, 11, 12)]
    # another id, the same prompt text: still a training prompt
    candidates = [_sample(target, f"h{i}") for i, target in enumerate((11, 20, 12, 20, 21))]
    chosen = select_heldout(candidates, training, "sys", USER, size=2, source="gen")
    assert [s.sample_id for s in chosen.samples] == ["h1", "h4"]  # h3 repeats h1's prompt
    assert chosen.overlapping == 2
    with pytest.raises(ValueError, match=r"fewer than trainer\.eval_samples=3"):
        select_heldout(candidates, training, "sys", USER, size=3, source="gen")


def _evaluator(tmp_path: Path, engine: ScriptedEngine, samples: list[Sample], k: int = 1) -> HeldoutEvaluator:
    tokenizer = build_byte_tokenizer()
    answer = {s.sample_id: s.answer for s in samples}

    def reward(text: str, sample: Sample) -> RewardResult:
        right = f"\\boxed{{{sample.answer}}}" in text
        return RewardResult(score=float(right), is_correct=right, extracted=text.split("{")[-1].rstrip("}"))

    def script(request: Any) -> ScriptedReply:
        prompt = tokenizer.decode(request.prompt_token_ids)
        target = next(value for value in answer.values() if f"Make {value}." in prompt)
        text = f"\\boxed{{{target}}}" if target % 2 == 0 else "\\boxed{0}"  # even targets are right
        return ScriptedReply([*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id])

    engine._script = script
    heldout = select_heldout(samples, [], None, USER, size=len(samples))
    settings = EpisodeSettings(max_turns=0, max_total_tokens=64, max_new_tokens_per_turn=32, temperature=1.0,
                               seed=3)
    return HeldoutEvaluator(heldout, engine=engine, tokenizer=tokenizer, tool=None, system=None, user=USER,
                            reward=reward, settings=settings, k=k, out_dir=tmp_path / "eval", concurrency=4,
                            task_name="t")


async def test_evaluator_scores_writes_resumes_and_discards(tmp_path: Path) -> None:
    samples = [_sample(t) for t in (10, 11, 12, 13, 14)]  # 3 of 5 even
    engine = ScriptedEngine(eos_token_id=build_byte_tokenizer().eos_token_id)
    async with engine:
        evaluator = _evaluator(tmp_path, engine, samples)
        result = await evaluator.run(0)
        assert result.success == pytest.approx(0.6) and result.per_prompt["s10"] == 1.0
        assert (result.low, result.high) == pytest.approx(wilson_interval(3, 5))
        assert result.summary["no_answer_frac"] == 0.0
        assert "held-out success at step 0: 60.0%" in result.line()
        lines = evaluator.path(0).read_text().splitlines()
        assert json.loads(lines[0])["meta"]["version"] == 0 and len(lines) == 6
        # a partial file of version 4 (two samples done) is resumed: only the other three run
        partial = evaluator.path(4)
        partial.write_text("\n".join(lines[:3]).replace('"version": 0', '"version": 4') + "\n")
        before = len(engine.requests)
        assert evaluator.stored(4) is None  # partial: not a finished evaluation
        resumed = await evaluator.run(4)
        assert len(engine.requests) - before == 3 and resumed.success == pytest.approx(0.6)
        assert evaluator.stored(4) is not None and evaluator.stored(4).per_prompt == result.per_prompt
        evaluator.discard_after(2)
        assert evaluator.path(0).is_file() and not evaluator.path(4).exists()


async def test_evaluator_with_k_samples_uses_a_t_interval_over_prompts(tmp_path: Path) -> None:
    samples = [_sample(t) for t in (10, 11, 12, 13)]
    engine = ScriptedEngine(eos_token_id=build_byte_tokenizer().eos_token_id)
    async with engine:
        result = await _evaluator(tmp_path, engine, samples, k=3).run(7)
    assert len(engine.requests) == 12
    mean, low, high = mean_t_interval([1.0, 0.0, 1.0, 0.0])
    assert (result.success, result.low, result.high) == pytest.approx((mean, max(0.0, low), min(1.0, high)))
    assert math.isclose(result.success, 0.5)


def test_an_evaluation_file_written_twice_says_what_it_holds() -> None:
    """Records of one version from two processes: the error counts the samples it holds and the repeats
    (it once read 'missing -44 samples')."""
    from agent_env.evaluation.heldout import result_from_records

    samples = [Sample(sample_id=f"p{i}", fields={}, answer=None) for i in range(3)]
    once = [{"sample_id": f"p{i}", "index": 0, "is_correct": i == 0, "extracted": "1", "is_truncated": False,
             "response_tokens": 5, "tool_calls": 0, "tool_errors": 0} for i in range(3)]
    assert result_from_records(12, once, samples, 1, 0.0).success == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match=r"version 12 holds 3 of its 3 samples \(3 prompts × k = 1\) and 2 "
                                         r"records of samples it already held \(two processes"):
        result_from_records(12, once + once[:2], samples, 1, 0.0)
    with pytest.raises(ValueError, match=r"version 12 holds 2 of its 3 samples.*delete its file"):
        result_from_records(12, once[:2], samples, 1, 0.0)


async def test_an_evaluation_made_with_other_settings_is_set_aside_and_made_again(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stored start evaluation copied in from a run with other eval settings (or a resumed run whose
    task changed): the trainer's evaluator does not die of it (it once raised EvalFileError at step 0) and
    does not mix it in — it renames the file aside, says what differed, and evaluates the version again."""
    samples = [_sample(t) for t in (10, 11, 12)]
    engine = ScriptedEngine(eos_token_id=build_byte_tokenizer().eos_token_id)
    async with engine:
        evaluator = _evaluator(tmp_path, engine, samples)
        first = await evaluator.run(0)
        other = evaluator.path(0).read_text().replace('"max_total_tokens": 64', '"max_total_tokens": 128')
        evaluator.path(0).write_text(other)
        assert evaluator.stored(0) is None  # not this evaluation's: nothing to reuse
        before = len(engine.requests)
        with caplog.at_level("WARNING", logger="agent_env.evaluation.heldout"):
            again = await evaluator.run(0)
    assert len(engine.requests) - before == 3 and again.success == first.success
    assert "evaluating version 0 again" in caplog.text and "max_total_tokens" in caplog.text
    aside = [p.name for p in (tmp_path / "eval").iterdir() if "other-settings" in p.name]
    assert len(aside) == 1 and evaluator.stored(0) is not None


def test_an_evaluation_files_meta_names_a_managed_context_and_only_then(tmp_path: Path) -> None:
    """A loop that edits the context (loop.context) evaluates another policy-in-context: its files say so
    (and are JSON), while an appending loop's meta stays what it was before contexts could be managed."""
    from agent_env.context import ContextPolicy

    engine = ScriptedEngine(eos_token_id=build_byte_tokenizer().eos_token_id)
    evaluator = _evaluator(tmp_path, engine, [_sample(10)])
    assert "context" not in evaluator.meta(0)["settings"]
    evaluator.settings = EpisodeSettings(**{**vars(evaluator.settings), "context": ContextPolicy(
        compaction="keep_last", compact_at_tokens=48)})
    meta = json.loads(json.dumps(evaluator.meta(0)))
    assert meta["settings"]["context"]["compaction"] == "keep_last"
