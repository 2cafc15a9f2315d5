"""`vcpo eval`: k samples per problem through the agent loop, one JSONL line per sample, resumable.

The output file starts with a `meta` line (task, model, k, sampling); every later line is one
finished sample (all turns with their code and observations, tool calls, reward, correctness,
extracted answer). A rerun with the same file skips finished samples (a torn last line from a
killed run is dropped) and refuses a file written with different settings. Samples run
concurrently (`concurrency` episodes in flight on one engine); the summary (avg@k, pass@k, maj@k,
tool statistics) is computed from the file, so a resumed run reports on everything.
"""

from __future__ import annotations

import asyncio
import json
import os
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent_env.evaluation.metrics import summarize
from agent_env.loop import EpisodeSettings, prompt_tools, run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.runtime import ProgramEpisodes
from agent_env.samples import Sample
from rollout.base import InferenceEngine
from tools.base import Tool
from tools.functions import Toolbox

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EvalFileError(ValueError):
    """The output file belongs to a different evaluation."""


def read_finished(path: Path, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Finished sample records of `path` (a torn last line is cut off the file); [] for a new file."""
    if not path.is_file() or path.stat().st_size == 0:
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    records, good_bytes = [], 0
    for line in lines:
        try:
            record = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            break  # a torn write: everything after it is dropped
        if record is not None:
            records.append(record)
        good_bytes += len((line + "\n").encode("utf-8"))
    good_bytes = min(good_bytes, len(text.encode("utf-8")))
    if good_bytes < len(text.encode("utf-8")):
        with open(path, "r+b") as handle:
            handle.truncate(good_bytes)
    if not records or records[0].get("kind") != "meta":
        raise EvalFileError(f"{path} is not a vcpo eval file (no meta line); choose another --out")
    if records[0]["meta"] != meta:
        old = records[0]["meta"]
        changed = {key: (old.get(key), value) for key, value in meta.items() if old.get(key) != value}
        raise EvalFileError(f"{path} was written with other settings {changed} (file, now); use another "
                            "--out or delete the file to start over")
    return [r for r in records[1:] if r.get("kind") == "sample"]


def _record(sample: Sample, index: int, episode: Any) -> dict[str, Any]:
    trajectory, info = episode.trajectory, episode.reward_info
    return {
        "kind": "sample", "sample_id": sample.sample_id, "index": index,
        "reward": trajectory.reward, "is_correct": bool(getattr(info, "is_correct", trajectory.reward > 0)),
        "extracted": getattr(info, "extracted", episode.answer), "gold": sample.answer,
        "reward_error": getattr(info, "error", None),
        "tool_calls": trajectory.task.tool_calls, "tool_errors": trajectory.task.tool_errors,
        "turns": [{"text": t.text, "code": t.code, "observation": t.observation, "tool_status": t.tool_status,
                   "finish_reason": t.finish_reason, **({"calls": list(t.calls)} if t.calls else {}),
                   **({"is_summary": True} if t.is_summary else {})}
                  for t in episode.turns],
        "tool_parse_errors": trajectory.task.tool_parse_errors, "tool_unknown": trajectory.task.tool_unknown,
        "is_truncated": trajectory.task.is_truncated, "void_turns": trajectory.task.void_turns,
        "response_tokens": trajectory.num_sampled_tokens, "seconds": trajectory.timings.total_s,
    }


def _failed_record(sample: Sample, index: int, error: Exception) -> dict[str, Any]:
    """An agent program's run that failed (raised, timed out, never called): scored 0, the reason kept."""
    return {"kind": "sample", "sample_id": sample.sample_id, "index": index, "reward": 0.0,
            "is_correct": False, "extracted": None, "gold": sample.answer, "reward_error": None,
            "program_error": str(error)[:300],
            "tool_calls": 0, "tool_errors": 0, "turns": [], "tool_parse_errors": 0, "tool_unknown": 0,
            "is_truncated": False, "void_turns": 0, "response_tokens": 0, "seconds": 0.0}


async def evaluate(
    engine: InferenceEngine,
    tokenizer: PreTrainedTokenizerBase,
    tool: Tool | Toolbox | None,
    *,
    system: str | None,
    user: str,
    samples: Sequence[Sample],
    reward: Callable[[str, Sample], Any],
    settings: EpisodeSettings,
    k: int,
    out_path: Path,
    meta: dict[str, Any],
    concurrency: int = 64,
    task_name: str = "",
    on_sample: Callable[[dict[str, Any]], None] = lambda _r: None,
    program: ProgramEpisodes | None = None,
) -> dict[str, Any]:
    """Run every (problem, j < k) not yet in `out_path`; return the summary of the whole file. With
    `program` (a task's `loop.program`), each episode is one run of the user's agent program."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    finished = read_finished(out_path, meta)
    done = {(r["sample_id"], r["index"]) for r in finished}
    if not out_path.is_file() or out_path.stat().st_size == 0:
        out_path.write_text(json.dumps({"kind": "meta", "meta": meta}) + "\n", encoding="utf-8")
    todo = [(s, j) for s in samples for j in range(k) if (s.sample_id, j) not in done]
    gate = asyncio.Semaphore(concurrency)
    tools = prompt_tools(tool, settings)
    with open(out_path, "a", encoding="utf-8") as handle:

        async def one(sample: Sample, index: int) -> None:
            async with gate:
                prompt = render_prompt_ids(tokenizer, render_messages(system, user, sample), tools)
                seed = None
                if settings.seed is not None:  # distinct, reproducible per (problem, sample)
                    seed = settings.seed + 7919 * index + zlib.crc32(sample.sample_id.encode())
                seeded = EpisodeSettings(**{**vars(settings), "seed": seed})
                episode: Any = None
                if program is not None:
                    try:
                        episode = await program.episode(sample, seeded, f"{sample.sample_id}#{index}",
                                                        sample.sample_id, task_name)
                    except Exception as exc:  # the user's program failed: a wrong sample, never the run
                        record = _failed_record(sample, index, exc)
                else:
                    episode = await run_episode(engine, tokenizer, prompt, seeded,
                                                lambda text: reward(text, sample),
                                                tool=tool, trajectory_id=f"{sample.sample_id}#{index}",
                                                group_id=sample.sample_id, task_name=task_name,
                                                sample_id=sample.sample_id)
            if episode is not None:
                record = _record(sample, index, episode)
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
            finished.append(record)
            on_sample(record)

        tasks = [asyncio.ensure_future(one(sample, index)) for sample, index in todo]
        try:
            await asyncio.gather(*tasks)
        except BaseException:  # one failed (e.g. the server refused): stop the rest before the file closes
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    return summary_of(finished, {s.sample_id for s in samples}, k)


def summary_of(records: Sequence[dict[str, Any]], sample_ids: set[str], k: int) -> dict[str, Any]:
    """Metrics of the finished records of the selected problems."""
    per_problem: dict[str, list[tuple[bool, str | None]]] = {}
    chosen = [r for r in records if r["sample_id"] in sample_ids and r["index"] < k]
    for record in chosen:
        per_problem.setdefault(record["sample_id"], []).append((record["is_correct"], record["extracted"]))
    summary: dict[str, Any] = summarize(per_problem, k)
    n = max(1, len(chosen))
    summary.update({
        "tool_calls_mean": sum(r["tool_calls"] for r in chosen) / n,
        "tool_errors_mean": sum(r["tool_errors"] for r in chosen) / n,
        "truncated_frac": sum(r["is_truncated"] for r in chosen) / n,
        "no_answer_frac": sum(r["extracted"] is None for r in chosen) / n,
        "response_tokens_mean": sum(r["response_tokens"] for r in chosen) / n,
    })
    return summary
