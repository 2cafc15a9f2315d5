"""run_dir/trajectories.jsonl (`trainer.save_trajectories`): every trajectory the learner trained on,
as text with its step, group, reward, lag and turn counts (`TrajectoryLog`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.manager import GroupTicket
from rollout.trajectory import Trajectory

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TrajectoryLog:
    """run_dir/trajectories.jsonl: one line per trajectory the learner consumed, written (and fsynced)
    at each step; on resume from step S the lines of later steps and a torn last line are dropped."""

    def __init__(self, path: Path, tokenizer: PreTrainedTokenizerBase, resume_from_step: int) -> None:
        self.path, self.tokenizer = path, tokenizer
        kept = []
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    break
                if record["step"] <= resume_from_step:
                    kept.append(line)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, path)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())

    def write(self, step: int, groups: Sequence[tuple[GroupTicket, list[Trajectory]]], version: int) -> None:
        for ticket, members in groups:
            for trajectory in members:
                segments = trajectory.segments
                first_segment = self._segment(trajectory, *segments[0])
                record = {
                    "step": step, "group": ticket.group_index, "prompt_position": ticket.prompt_position,
                    "sample_id": trajectory.task.sample_id, "reward": trajectory.reward,
                    "lag": ticket.lag_of(trajectory, version),
                    "versions": [trajectory.versions.start, trajectory.versions.end],
                    "turns": trajectory.task.turns, "tool_calls": trajectory.task.tool_calls,
                    "tool_errors": trajectory.task.tool_errors, "truncated": trajectory.task.is_truncated,
                    "tool_parse_errors": trajectory.task.tool_parse_errors,
                    "tool_unknown": trajectory.task.tool_unknown,
                    "text": first_segment["text"],  # from the first sampled token (no prompt)
                }
                if len(segments) > 1:  # each segment from its first sampled token: no context twice
                    record["segments"] = [first_segment, *(self._segment(trajectory, *span)
                                                           for span in segments[1:])]
                self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def _segment(self, trajectory: Trajectory, start: int, stop: int) -> dict[str, object]:
        """One segment: its context's length and the text from its first sampled token on."""
        mask = trajectory.loss_mask[start:stop]
        first = start + (mask.index(True) if any(mask) else len(mask))
        return {"context_tokens": first - start, "sampled_tokens": sum(mask),
                "text": self.tokenizer.decode(trajectory.token_ids[first:stop], skip_special_tokens=False)}

    def close(self) -> None:
        self._file.close()
