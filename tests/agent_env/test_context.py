"""Managed contexts in the agent loop (`loop.context`): earlier reasoning stripped, the history compacted —
each turn generated after exactly the context the trajectory trains it in, every sampled token stored once,
where it was sampled; an episode whose context is never edited stays one segment."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from agent_env.context import ContextPolicy
from agent_env.loop import Episode, EpisodeSettings, run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.samples import Sample
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.tiny import build_byte_tokenizer
from rollout.trajectory import Trajectory
from rollout.types import GenerationRequest, GenerationResult
from tests.agent_env.test_loop import Recorder, Score
from tools.fakes import EchoTool

CODE = "```python\nprint({n})\n```"


SUMMARY = "I printed 1 to 4; the answer might be 42."


def _turns(tokenizer, texts: list[str]) -> ScriptedEngine:
    """Replies `texts` in order; a summary request (the context ends with "Summary:") gets SUMMARY."""
    replies = iter(texts)

    def script(request: GenerationRequest) -> ScriptedReply:
        asks_summary = tokenizer.decode(list(request.prompt_token_ids)).endswith("Summary:")
        tokens = tokenizer.encode(SUMMARY if asks_summary else next(replies), add_special_tokens=False)
        return ScriptedReply([*tokens, tokenizer.eos_token_id])

    return ScriptedEngine(script, eos_token_id=tokenizer.eos_token_id)


def _prompt(tokenizer) -> list[int]:
    sample = Sample(sample_id="q", fields={"question": "Add the numbers."}, answer="42")
    return render_prompt_ids(tokenizer, render_messages("Use python.", "{question}", sample))


async def _run(tokenizer, texts: list[str], policy: ContextPolicy, max_total_tokens: int = 4000
               ) -> tuple[Episode, list[tuple[GenerationRequest, GenerationResult]]]:
    engine = _turns(tokenizer, texts)
    recorder = Recorder(engine)
    settings = EpisodeSettings(max_turns=len(texts), max_total_tokens=max_total_tokens,
                               max_new_tokens_per_turn=200, temperature=0.0, context=policy)
    async with engine:
        episode = await run_episode(engine, tokenizer, _prompt(tokenizer), settings,
                                    lambda text: Score(float("42" in text)), tool=EchoTool(),
                                    trajectory_id="e", group_id="g")
    return episode, recorder.calls


async def _episode(tokenizer, texts: list[str], policy: ContextPolicy, max_total_tokens: int = 4000
                   ) -> tuple[Trajectory, list[tuple[GenerationRequest, GenerationResult]]]:
    episode, calls = await _run(tokenizer, texts, policy, max_total_tokens)
    return episode.trajectory, calls


Calls = list[tuple[GenerationRequest, GenerationResult]]


def _check_token_exact(trajectory: Trajectory, calls: Calls) -> None:
    """Every turn was generated after the context its segment trains it in, and its sampled tokens sit right
    after that context, with their log-probs: what is trained is what was sampled, in what the model read."""
    tokens, mask = trajectory.token_ids, trajectory.loss_mask
    starts = set(trajectory.segment_starts)
    position, segment_start = 0, 0
    for request, result in calls:
        context = list(request.prompt_token_ids)
        while True:  # the segment holding this call: its tokens from its start are the call's context
            here = list(tokens[segment_start:segment_start + len(context)])
            if here == context and segment_start + len(context) >= position:
                break
            later = sorted(s for s in starts if s > segment_start)
            assert later, f"no segment holds the context of call {request.request_id}"
            segment_start = later[0]
        at = segment_start + len(context)
        sampled = list(result.token_ids)
        assert list(tokens[at:at + len(sampled)]) == sampled and all(mask[at:at + len(sampled)])
        assert list(trajectory.behavior_logprobs[at:at + len(sampled)]) == list(result.logprobs)
        position = at + len(sampled)
    assert sum(mask) == sum(len(result.token_ids) for _, result in calls)  # each sampled token once


async def test_an_unmanaged_context_stays_one_segment_token_for_token() -> None:
    tokenizer = build_byte_tokenizer()
    texts = ["<think>a</think>" + CODE.format(n=1), "\\boxed{42}"]
    plain, calls = await _episode(tokenizer, texts, ContextPolicy())
    assert plain.segment_starts == (0,)
    assert list(calls[1][0].prompt_token_ids) == list(plain.token_ids[:len(calls[1][0].prompt_token_ids)])
    _check_token_exact(plain, calls)


async def test_stripped_reasoning_starts_a_segment_the_next_turn_reads_without_it() -> None:
    tokenizer = build_byte_tokenizer()
    texts = ["<think>first plan</think>" + CODE.format(n=1), "<think>second</think>" + CODE.format(n=2),
             "no reasoning here " + CODE.format(n=3), "\\boxed{42}"]
    trajectory, calls = await _episode(tokenizer, texts, ContextPolicy(think="strip"))
    assert len(trajectory.segment_starts) == 3  # turns 1 and 2 reasoned: two new contexts; turn 3 did not
    for index in (1, 2, 3):
        prompt = tokenizer.decode(list(calls[index][0].prompt_token_ids))
        assert "<think>" not in prompt and "print(1)" in prompt
    assert "print(2)" in tokenizer.decode(list(calls[3][0].prompt_token_ids))
    _check_token_exact(trajectory, calls)
    sampled = zip(trajectory.token_ids, trajectory.loss_mask, strict=True)
    sampled_text = tokenizer.decode([token for token, mask in sampled if mask])
    assert sampled_text.count("<think>") == 2  # the reasoning trains where it was sampled


async def test_compaction_keeps_the_prompt_and_the_last_turns_once_the_context_grows_too_long() -> None:
    tokenizer = build_byte_tokenizer()
    texts = [CODE.format(n=n) for n in range(1, 7)] + ["\\boxed{42}"]
    prompt_length = len(_prompt(tokenizer))
    policy = ContextPolicy(compaction="keep_last", compact_at_tokens=prompt_length + 120, keep_last_turns=1)
    trajectory, calls = await _episode(tokenizer, texts, policy)
    assert trajectory.task.compactions >= 2
    assert len(trajectory.segment_starts) == trajectory.task.compactions + 1
    for request, _ in calls:
        assert len(request.prompt_token_ids) <= prompt_length + 120 + 60  # the context never ran away
    last = tokenizer.decode(list(calls[-1][0].prompt_token_ids))
    assert "print(6)" in last and "print(1)" not in last  # only the latest turn kept after the prompt
    _check_token_exact(trajectory, calls)


async def test_a_summary_the_policy_writes_is_trained_and_replaces_the_history() -> None:
    """summarize: at the budget the policy reads its context plus the request and writes a summary (sampled,
    in the segment it was written in); the next context is the prompt, the summary and the last turn. The
    summary is trained with the episode's reward but not scored: its "42" does not make the episode right."""
    tokenizer = build_byte_tokenizer()
    texts = [CODE.format(n=n) for n in range(1, 7)] + ["\\boxed{41}"]
    prompt_length = len(_prompt(tokenizer))
    policy = ContextPolicy(compaction="summarize", compact_at_tokens=prompt_length + 150, keep_last_turns=1)
    episode, calls = await _run(tokenizer, texts, policy)
    trajectory = episode.trajectory
    summaries = [record for record in episode.turns if record.is_summary]
    assert trajectory.task.compactions == len(summaries) >= 1 and trajectory.reward == 0.0
    assert trajectory.task.turns == len(texts)  # a summary is not a tool turn
    assert len(trajectory.segment_starts) == trajectory.task.compactions + 1
    asked = [tokenizer.decode(list(request.prompt_token_ids)) for request, _ in calls]
    assert sum(text.endswith("Summary:") for text in asked) == len(summaries)
    after = asked[asked.index(next(text for text in asked if text.endswith("Summary:"))) + 1]
    assert "Summary of your earlier work:\n" + SUMMARY in after and "print(1)" not in after
    sampled = zip(trajectory.token_ids, trajectory.loss_mask, strict=True)
    assert tokenizer.decode([token for token, mask in sampled if mask]).count(SUMMARY) == len(summaries)
    _check_token_exact(trajectory, calls)


def test_strip_removes_complete_reasoning_blocks_only() -> None:
    policy = ContextPolicy(think="strip")
    assert policy.without_reasoning("<think>a\nb</think>\n\nanswer") == "answer"
    assert policy.without_reasoning("x <think>a</think> y <think>b</think>z") == "x y z"
    assert policy.without_reasoning("no reasoning") is None
    assert policy.without_reasoning("<think>unfinished") is None


# A thinking model's template: earlier assistant turns are rendered without their reasoning.
QWEN_LIKE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1].lstrip() }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


async def test_with_the_default_models_tokenizer_every_segment_is_token_exact(
        default_model_dir: Path) -> None:
    """A real tokenizer (SmolLM2's), with a chat template that renders earlier turns without their
    reasoning: the stripped contexts the engine read are what the trajectory trains in, token for token."""
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = QWEN_LIKE_TEMPLATE
    texts = ["<think>I will add them.</think>" + CODE.format(n=40), "<think>So 42.</think>\\boxed{42}"]
    trajectory, calls = await _episode(tokenizer, texts, ContextPolicy(think="strip"))
    assert len(trajectory.segment_starts) == 2 and trajectory.reward == 1.0
    second = tokenizer.decode(list(calls[1][0].prompt_token_ids))
    assert "I will add them" not in second and "print(40)" in second and "<|im_start|>assistant" in second
    _check_token_exact(trajectory, calls)


@pytest.mark.parametrize("bad", [{"compaction": "keep_last"}, {"compaction": "summarize"},
                                 {"compaction": "keep_last", "compact_at_tokens": 5000}])
def test_a_compaction_without_a_usable_trigger_is_refused(bad: dict) -> None:
    from pydantic import ValidationError

    from configs.task_schema import LoopConfig

    with pytest.raises(ValidationError, match="compact_at_tokens"):
        LoopConfig.model_validate({"max_total_tokens": 2048, "context": bad})
