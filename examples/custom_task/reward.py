"""The custom reward of the unit-conversion example: full credit for the right number, partial for a
close one. The task YAML names it: `reward: {type: custom, function:
examples.custom_task.reward:conversion_reward}`.

vcpo calls `conversion_reward(response, sample)` once per episode, on a worker thread:
* `response` is the model's own text of every turn, concatenated (tool outputs are not in it);
* `sample` is an `agent_env.samples.Sample`: `sample.answer` is the row's ground truth (the task's
  `fields.answer`), `sample.fields` its template fields, `sample.sample_id` its id.
It returns a float, or a `RewardResult` to also say whether the answer counts as correct (pass@k and
maj@k use it) and which answer was read (written to the eval samples file).

Model output is untrusted text: nothing here raises on it. An unboxed, unparsable or absurd answer
gets a low score, not an exception. (If a reward does raise, vcpo scores the episode 0 and counts it
in the `rollout/reward_errors` metric, but a crash hides the reason from you.)
"""

from __future__ import annotations

import math
import re

from agent_env.rewards import RewardResult
from agent_env.samples import Sample
from agent_env.turns import find_boxed

CORRECT_RELATIVE_ERROR = 0.01
"""Within 1% of the true value: correct (rounding to a few digits is fine)."""
CLOSE_RELATIVE_ERROR = 0.10
"""Within 10%: half credit (e.g. a rounded conversion factor)."""
FORMAT_SCORE = 0.1
"""Any other finite number in the box: a little credit for answering in the asked format."""

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?")
_TIMES_TEN = re.compile(r"\s*(?:\\times|\\cdot|×|\*|x)\s*10\s*\^\s*\{?\s*([-+]?\d+)\s*\}?")


def parse_number(text: str) -> float | None:
    """The first number in `text` as a float, or None. Reads `26.1`, `26.1 miles`, `1,234.5`,
    `9.46e12` and `9.46 \\times 10^{12}`; never raises."""
    match = _NUMBER.search(text)
    if match is None:
        return None
    mantissa = match.group().replace(",", "")
    power = _TIMES_TEN.match(text, match.end())
    literal = f"{mantissa}e{power.group(1)}" if power and "e" not in mantissa.lower() else mantissa
    value = float(literal)  # the regexes only admit valid float literals; huge ones become inf
    return value if math.isfinite(value) else None


def conversion_reward(response: str, sample: Sample) -> RewardResult:
    """1 within 1% of the answer, 0.5 within 10%, 0.1 for another number, 0 without a boxed number."""
    boxed = find_boxed(response)
    if boxed is None:
        return RewardResult(score=0.0, is_correct=False, extracted=None)
    value = parse_number(boxed)
    if value is None:
        return RewardResult(score=0.0, is_correct=False, extracted=boxed.strip())
    gold = float(sample.answer)
    relative_error = abs(value - gold) / max(abs(gold), 1e-12)
    if relative_error <= CORRECT_RELATIVE_ERROR:
        score = 1.0
    elif relative_error <= CLOSE_RELATIVE_ERROR:
        score = 0.5
    else:
        score = FORMAT_SCORE
    return RewardResult(score=score, is_correct=score == 1.0, extracted=boxed.strip())
