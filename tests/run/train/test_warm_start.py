"""The cold-start SFT: solver-written tool episodes (prompt and observation loss-masked, the boxed
equation correct), the SFT lowers the loss on them and is cached, and `vcpo train` with
`warm_start.enabled` starts RL from the warm-started model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from agent_env.countdown import score_expression
from agent_env.datasets import load_samples
from agent_env.turns import find_boxed
from configs.schema import RunConfig
from rollout.tiny import build_byte_tokenizer
from run.observability.metrics_log import read_metrics
from run.train.checkpointing import latest_checkpoint, load_checkpoint
from run.train.warm_start import demonstrations, run_warm_start, warm_start_dir
from run.train.wiring import load_task
from tests.run.train.test_train_e2e import _vcpo, _write_configs, needs_bwrap

ROOT = Path(__file__).resolve().parents[3]


def _task():
    return load_task(ROOT / "configs" / "tasks" / "countdown.yaml", ["dataset.num_samples=40"])


def test_demonstrations_are_correct_tool_episodes_with_masked_prompt_and_observation() -> None:
    task, path = _task()
    samples = load_samples(task, which="train", task_dir=path.parent).samples
    tokenizer = build_byte_tokenizer()
    demos = demonstrations(task, samples, tokenizer, count=5, seed=0)
    assert len(demos) == 5
    for (ids, mask), sample in zip(demos, reversed(samples), strict=False):  # from the end of the set
        text = tokenizer.decode(ids)
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        untrained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        assert "```output\n" in untrained and "```output" not in trained  # the observation is masked
        assert "Using the numbers" in untrained and "Using the numbers" not in trained
        assert "```python\nprint(" in trained and trained.endswith("<|im_end|>")
        equation = find_boxed(text)
        assert equation is not None
        assert score_expression(equation, sample.answer["numbers"], sample.answer["target"])


def test_retry_demonstrations_check_a_wrong_equation_read_its_output_and_then_check_the_right_one() -> None:
    task, path = load_task(ROOT / "configs" / "tasks" / "countdown.yaml",
                           ["dataset.num_samples=40", "loop.max_turns=3"])
    samples = load_samples(task, which="train", task_dir=path.parent).samples
    tokenizer = build_byte_tokenizer()
    demos = demonstrations(task, samples, tokenizer, count=6, seed=0, retry_fraction=1.0)
    assert len(demos) == 6
    for ids, mask in demos:
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        untrained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        first, second = re.findall(r"```python\nprint\((.*)\)\n```", trained)
        shown = re.findall(r"```output\n(.*)\n```", untrained)
        equation = find_boxed(tokenizer.decode(ids))
        target = int(re.search(r"not (-?\d+)\. Let me try another", trained).group(1))
        assert equation == second != first and float(shown[1]) == target != float(shown[0])
        assert f"That gives {shown[0]}, not {target}." in trained  # the model reads the tool's output
    plain = demonstrations(task, samples, tokenizer, count=6, seed=0)
    assert plain == demonstrations(task, samples, tokenizer, count=6, seed=0, retry_fraction=0.0)
    two_turns, _ = load_task(ROOT / "configs" / "tasks" / "countdown.yaml",
                             ["dataset.num_samples=40", "loop.max_turns=2"])
    with pytest.raises(ValueError, match=r"loop\.max_turns is 2.*raise it to 3"):
        demonstrations(two_turns, samples, tokenizer, count=2, seed=0, retry_fraction=0.5)


def test_search_demonstrations_run_one_program_whose_printed_equation_is_the_answer() -> None:
    task, path = _task()
    samples = load_samples(task, which="train", task_dir=path.parent).samples
    tokenizer = build_byte_tokenizer()
    demos = demonstrations(task, samples, tokenizer, count=8, seed=0, search_fraction=1.0)
    assert len(demos) == 8
    programs = []
    for ids, mask in demos:
        trained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        untrained = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if not m])
        numbers, target = map(json.loads, re.search(r"Using the numbers (\[[^]]*\]), create an equation "
                                                    r"that equals (\d+)", untrained).groups())
        program = re.search(r"```python\n(.*?)```", trained, re.S).group(1)
        assert program.endswith(f"for n in {numbers}], {target}))\n")  # copied from the prompt
        shown = re.search(r"```output\n(.*)\n```", untrained).group(1)  # the program's output, masked
        assert find_boxed(tokenizer.decode(ids)) == shown and score_expression(shown, numbers, target)
        programs.append((program, shown))
    # every program is the same text but its last line: one strategy, not one per puzzle
    assert len({program.rsplit("\n", 2)[0] for program, _ in programs}) == 1
    mixed = demonstrations(task, samples, tokenizer, count=40, seed=0, search_fraction=0.5)
    searches = sum("def search" in tokenizer.decode(ids) for ids, _ in mixed)
    assert 0 < searches < len(mixed)
    assert demonstrations(task, samples, tokenizer, count=6, seed=0) == demonstrations(
        task, samples, tokenizer, count=6, seed=0, search_fraction=0.0)


@needs_bwrap
async def test_the_sandbox_prints_what_the_search_demonstration_shows() -> None:
    from tools.base import ToolCall
    from tools.registry import build_tool

    task, path = _task()
    samples = load_samples(task, which="train", task_dir=path.parent).samples
    tokenizer = build_byte_tokenizer()
    demos = demonstrations(task, samples, tokenizer, count=3, seed=0, search_fraction=1.0)
    async with build_tool({"type": "python", "timeout_s": 10, "warm_pool_size": 0}) as tool:
        for ids, _ in demos:
            text = tokenizer.decode(ids)
            program = re.search(r"```python\n(.*?)```", text, re.S).group(1)
            result = await tool.run(ToolCall(code=program))
            assert result.status == "ok", result
            assert f"```output\n{result.stdout}```" in text


def test_warm_start_lowers_the_loss_and_is_cached(tmp_path: Path, tiny_model_dir: Path) -> None:
    task, path = _task()
    config = RunConfig.model_validate({"model": {"path": str(tiny_model_dir)}, "task": str(path),
                                       "warm_start": {"enabled": True, "examples": 8, "epochs": 3,
                                                      "lr": 3e-3, "batch_size": 4}})
    out = run_warm_start(config, task, path, tmp_path)
    assert out == warm_start_dir(config, task, tmp_path) and (out / "model.safetensors").is_file()
    report = json.loads((out / "warm_start.json").read_text())
    assert report["examples"] == 8 and report["last_loss"] < report["first_loss"]
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert run_warm_start(config, task, path, tmp_path) == out  # cached: not trained again
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_warm_start_under_bf16_autocast_lowers_the_loss_and_has_its_own_cache(tmp_path: Path,
                                                                              tiny_model_dir: Path) -> None:
    task, path = _task()
    fields = {"model": {"path": str(tiny_model_dir)}, "task": str(path),
              "warm_start": {"enabled": True, "examples": 8, "epochs": 3, "lr": 3e-3, "batch_size": 4}}
    config = RunConfig.model_validate({**fields, "warm_start": {**fields["warm_start"],
                                                                 "autocast": "bfloat16"}})
    out = run_warm_start(config, task, path, tmp_path)
    assert out != warm_start_dir(RunConfig.model_validate(fields), task, tmp_path)  # fp32 SFT: another model
    report = json.loads((out / "warm_start.json").read_text())
    assert report["last_loss"] < report["first_loss"]


@needs_bwrap
def test_train_with_warm_start_runs_rl_from_the_warm_model(tmp_path: Path, tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VCPO_CACHE_DIR", str(tmp_path / "cache"))
    warm_start = {"enabled": True, "examples": 4, "epochs": 1, "batch_size": 4}
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=2, extra={"warm_start": warm_start})
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    warm = list((tmp_path / "cache" / "models" / "warm_start").glob("*/warm_start.json"))
    assert len(warm) == 1
    _, meta = load_checkpoint(latest_checkpoint(tmp_path / "run"), map_location="cpu")
    assert meta["config"]["model"]["path"] == str(warm[0].parent)  # RL ran from the warm-started model
    assert len(read_metrics(tmp_path / "run")) == 2


def test_the_packed_sft_step_is_the_padded_hf_labels_loss_and_gradient() -> None:
    """The warm start's packed step (no padding, logits only at trained tokens) computes what an HF
    forward of the right-padded batch with labels= does: the same token-mean loss and gradient."""
    from learner.forward.varlen_attention import register_varlen_sdpa
    from rollout.tiny import padded_sft_batch
    from run.train.warm_start import _sft_step
    from tests.learner.conftest import random_trajectories, tiny_model

    trajectories = random_trajectories(num_groups=2, per_group=3, seed=7)
    batch = [(list(t.token_ids), list(t.loss_mask)) for t in trajectories]
    padded_model = tiny_model("llama_tied", seed=3)
    ids, attention, labels = padded_sft_batch(batch)
    padded_loss = padded_model(input_ids=ids, attention_mask=attention, labels=labels).loss
    padded_loss.backward()
    packed_model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa(), seed=3)
    packed_loss = _sft_step(packed_model, batch, budget=40, compute_dtype=None)  # several micro-batches
    assert packed_loss == pytest.approx(float(padded_loss), rel=1e-5)
    for (name, want), got in zip(padded_model.named_parameters(), packed_model.parameters(), strict=True):
        scale = float(want.grad.abs().max())
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6 * scale, msg=name)


@needs_bwrap
def test_a_keychain_warm_start_trains_on_every_segment_of_the_solvers_episodes(tmp_path: Path,
                                                                              tiny_model_dir: Path) -> None:
    """The keychain solver's episodes, run through the task's own loop and sandbox, compacted past the
    budget: each segment is a supervised sequence, the SFT lowers its loss, and the model is cached apart
    from a Countdown warm start's."""
    task, path = load_task(ROOT / "configs" / "tasks" / "keychain.yaml",  # a byte tokenizer: longer texts
                           ["dataset.num_samples=8", "loop.max_total_tokens=4000",
                            "loop.context.compact_at_tokens=700", "loop.max_new_tokens_per_turn=200"])
    warm_start = {"enabled": True, "demonstrations": "keychain", "examples": 3, "epochs": 3, "lr": 3e-3,
                  "batch_size": 4}
    config = RunConfig.model_validate({"model": {"path": str(tiny_model_dir)}, "task": str(path),
                                       "warm_start": warm_start})
    out = run_warm_start(config, task, path, tmp_path)
    report = json.loads((out / "warm_start.json").read_text())
    assert report["examples"] > 3  # three episodes, more segments
    assert report["last_loss"] < report["first_loss"]
    countdown = RunConfig.model_validate({"model": {"path": str(tiny_model_dir)}, "task": str(path),
                                          "warm_start": {**warm_start, "demonstrations": "countdown"}})
    assert warm_start_dir(countdown, task, tmp_path) != out


def test_countdown_only_warm_start_settings_are_refused_for_the_keychain_solver() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="retry_fraction and search_fraction are Countdown's"):
        RunConfig.model_validate({"warm_start": {"demonstrations": "keychain", "search_fraction": 0.25}})
