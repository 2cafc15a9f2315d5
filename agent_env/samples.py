"""One problem of a task, as the agent loop, rewards and evaluation see it.

A `Sample` is built from a dataset row by `agent_env.datasets.load_samples` (or by a generator)
and crosses the seam into rollouts and reward workers, so it is a frozen, typed, JSON-able model.
It holds no prompt text: the prompt is rendered from `fields` with the task's template.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Sample(BaseModel):
    """A problem: an id, the values of the prompt's placeholders and the ground truth."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sample_id: str
    """Stable id within the dataset (the row's id field, else its position)."""
    fields: dict[str, Any]
    """Template field name → value, e.g. {"question": "What is 2+2?"}."""
    answer: Any
    """JSON-able ground truth: a string or number for math tasks, the GSM8K solution text (the
    reward reads the number after `####`), or {"target": int, "numbers": [int, ...]} for Countdown."""
