"""Every key the trainer logs per training step, in one place (docs/algorithm.md "Metrics every
training step must log").

The staleness / importance-sampling / baseline / reward keys are computed in `vcpo.metrics` and
re-exported here unchanged; this module adds the learner-side keys (optimiser, timing, rollout
statistics, throughput). Times are seconds per training step, token counts are per step, `*_frac`
are fractions in [0, 1] and `*_mean` are means over the step's trajectories.

It only names things: computing, reducing across ranks and writing metrics happen elsewhere
(`vcpo.metrics`, the trainer, `run.observability.metrics_log`).
"""

from __future__ import annotations

from rollout.lag_control import (
    ROLLOUT_IDLE_FRACTION,
    ROLLOUT_LAG_JUDGED,
    ROLLOUT_LAG_JUDGED_ESS,
    ROLLOUT_LAG_LOWERS,
    ROLLOUT_LAG_MISMATCH_ESS,
    ROLLOUT_LAG_MOVE,
    ROLLOUT_LAG_RAISES,
    ROLLOUT_MAX_LAG,
)
from vcpo.corrections import (
    CORRECTION_REJECTED_BY_LAG,
    CORRECTION_REJECTED_TOKENS,
    CORRECTION_REJECTED_TRAJECTORIES,
    stage_metric,
)
from vcpo.metrics import (
    IS_BY_LAG_ESS_RATIO,
    IS_BY_LAG_KL_K3,
    IS_BY_LAG_LOG_W_MEAN,
    IS_ESS_RATIO,
    IS_ESS_RATIO_CLIPPED,
    IS_KL_K3,
    IS_LOG_W_MAX,
    IS_LOG_W_MEAN,
    IS_LOG_W_MIN,
    IS_MISMATCH_ESS_RATIO,
    IS_MISMATCH_KL_K3,
    IS_MISMATCH_LOG_W_MEAN,
    IS_STALENESS_LOG_W_EXCESS,
    IS_W_MAX,
    IS_W_P99,
    OPOB_BASELINE_MEAN,
    OPOB_GAP_TO_GROUP_MEAN,
    PG_CLIP_FRAC,
    PG_MASKED_FRAC,
    REWARD_MAX,
    REWARD_MEAN,
    REWARD_MIN,
    REWARD_STD,
    STALENESS_HIST,
    STALENESS_HIST_BINS,
    STALENESS_MAX,
    STALENESS_MEAN,
    TOKENS_TRAINED,
)

# --- Axes: every logged record carries all three. ----------------------------------------------
TRAINER_STEP = "trainer_step"
"""Optimiser steps completed (the x-axis of every plot and TensorBoard's global_step)."""
POLICY_VERSION = "policy_version"
"""Version of the policy after this step (what the rollout side receives at the next weight sync)."""
WALL_S = "wall_s"
"""Seconds since the run started, summed over resumed segments (time spent stopped is not counted)."""
AXES = (TRAINER_STEP, POLICY_VERSION, WALL_S)

# --- Optimiser. --------------------------------------------------------------------------------
LR_BASE = "lr/base"
"""Scheduled learning rate η_0 before any staleness or ESS scaling."""
LR_SCALE = "lr/scale"
"""Multiplier applied to lr/base this step (ESS-scaled step size; 1.0 when no rule is active)."""
GRAD_NORM = "grad/norm"
"""Global L2 norm of the gradient before clipping."""

# --- Tokens, time and throughput. --------------------------------------------------------------
TOKENS_GENERATED = "tokens/generated"
"""Response tokens sampled by the engine for this step's trajectories."""
TOKENS_LEARNER_INPUT = "tokens/learner_input"
"""Every token of the step's trajectories the learner reads: prompts, observations and sampled tokens of
every segment (a compacted episode's later segments each repeat a context)."""
TIME_GENERATE = "time/generate"
"""Seconds the rollout side spent generating this step's batch (overlaps training when async)."""
TIME_TRAIN = "time/train"
"""Seconds of the learner's forward/backward/optimiser work this step."""
TIME_LEARNER_PROXIMAL = "time/learner_proximal"
"""Seconds of the learner step's proximal pass (log π_old, in the weights' dtype, no grad)."""
TIME_LEARNER_GRADIENT = "time/learner_gradient"
"""Seconds of the learner step's gradient passes (forwards, backwards, per-trajectory norms)."""
TIME_LEARNER_OPTIMIZER = "time/learner_optimizer"
"""Seconds of the learner step's gradient clip and optimizer step."""
TIME_WEIGHT_SYNC = "time/weight_sync"
"""Seconds spent pushing the new weights to the inference engine."""
TIME_IDLE_LEARNER = "time/idle_learner"
"""Seconds the learner waited for a batch."""
TIME_IDLE_ROLLOUT = "time/idle_rollout"
"""Seconds the rollout side was blocked (staleness bound or full queue)."""
TIME_STEP = "time/step"
"""Wall seconds of the whole training step, from the end of the previous one."""
TIME_CPU = "time/cpu"
"""CPU seconds this process and its finished children (tool calls) used during the step; ÷ (time/step ×
cores) is the machine's utilisation (Ray mode: the driver's only)."""
PERF_TOKENS_PER_S = "perf/tokens_per_s"
"""Generated tokens per second of step wall time (tokens/generated / time/step)."""

# --- Rollout statistics (means over the step's trajectories). ----------------------------------
ROLLOUT_TURNS_MEAN = "rollout/turns_mean"
"""Assistant turns per trajectory."""
ROLLOUT_TOOL_CALLS_MEAN = "rollout/tool_calls_mean"
"""Tool calls per trajectory."""
ROLLOUT_TOOL_ERRORS_MEAN = "rollout/tool_errors_mean"
"""Failed tool calls (error returned to the model) per trajectory."""
ROLLOUT_TRUNCATED_FRAC = "rollout/truncated_frac"
"""Fraction of trajectories cut by a token or turn limit."""
ROLLOUT_VOID_TURN_FRAC = "rollout/void_turn_frac"
"""Fraction of turns with neither a tool call nor a final answer."""
ROLLOUT_RESPONSE_TOKENS_MEAN = "rollout/response_tokens_mean"
"""Model-generated tokens per trajectory."""
ROLLOUT_FILTERED_FRAC = "rollout/filtered_frac"
"""Fraction of the step's trajectories left out of the loss (void-turn or truncation filters)."""
ROLLOUT_SEGMENTS_MEAN = "rollout/segments_mean"
"""Segments per trajectory: 1 unless `loop.context` stripped reasoning or compacted the history."""
ROLLOUT_COMPACTIONS_MEAN = "rollout/compactions_mean"
"""Times per trajectory the history was compacted (`loop.context.compaction`)."""
PROGRAM_CRASHED = "program/crashed"
"""`loop.program`: runs of the agent program that raised (running total; each dropped its group)."""
PROGRAM_TIMED_OUT = "program/timed_out"
"""`loop.program`: runs past `loop.program_timeout_s` (running total)."""
PROGRAM_NEVER_CALLED = "program/never_called"
"""`loop.program`: runs that never called the endpoint (running total)."""
STALENESS_SEGMENT_MEAN = "staleness/segment_mean"
"""Mean lag of the step's segments, each from its first sampled token's version (an episode's later
segments can be fresher than its first, whose lag is the episode's: staleness/mean)."""
STALENESS_SEGMENT_MAX = "staleness/segment_max"
"""Largest segment lag of the step."""
TOOL_PARSE_ERRORS = "tool/parse_errors"
"""Function calls of this step's trajectories that could not be read (bad JSON, no name, unclosed tag)."""
TOOL_UNKNOWN = "tool/unknown"
"""Function calls of this step's trajectories naming a tool the task does not offer."""
ROLLOUT_SKIPPED_SAMPLES = "rollout/skipped_samples"
"""Bad samples (tasks that could not be posed) counted and skipped so far: a running total."""
ROLLOUT_FAILED_GROUPS = "rollout/failed_groups"
"""Groups whose generation failed and was given up so far: a running total."""
ROLLOUT_REFILLS = "rollout/refills"
"""rollout.dynamic_sampling: this step's groups dropped (all episodes scored alike) and refilled."""
ROLLOUT_REFILLED_GROUPS = "rollout/refilled_groups"
"""rollout.dynamic_sampling: groups dropped and refilled so far: a running total."""
ROLLOUT_REFILL_TOKENS = "rollout/refill_tokens"
"""rollout.dynamic_sampling: tokens the dropped groups sampled (what refilling cost): a running total."""
ROLLOUT_DROPPED_EPISODES = "rollout/dropped_episodes"
"""rollout.dynamic_sampling: this step's episodes in the groups dropped and refilled."""
ROLLOUT_REWARD_MEAN_GENERATED = "rollout/reward_mean_generated"
"""rollout.dynamic_sampling: the mean reward over every episode generated for this step, the dropped ones
included — the policy's own level; `reward/mean` (the trained episodes) is tilted towards groups with a
spread."""
# ROLLOUT_MAX_LAG: the lag bound in force after the step (every run). With rollout.max_lag: auto
# (rollout/lag_control.py) also ROLLOUT_LAG_MOVE (−1, 0, +1 this step), ROLLOUT_LAG_RAISES and
# ROLLOUT_LAG_LOWERS (running totals), ROLLOUT_LAG_JUDGED (1 when the batch was judged: all its groups
# admitted under the bound in force) and ROLLOUT_IDLE_FRACTION (the learner's idle / (idle + train)).
ROLLOUT_REGENERATED_GROUPS = "rollout/regenerated_groups"
"""launcher=ray: groups regenerated (same prompt) because their rollout actor died: a running total."""

# --- Behaviour corrections (algo.corrections; vcpo/corrections.py), when configured. ----------------
# CORRECTION_REJECTED_TOKENS: share of the sampled tokens the stages removed together;
# CORRECTION_REJECTED_TRAJECTORIES: share of the trajectories with sampled tokens that kept none;
# CORRECTION_REJECTED_BY_LAG: per staleness bin (those of staleness/hist), the removed share of the bin's
# sampled tokens (null for an empty bin). Each stage adds `stage_metric(label, what)` =
# correction/<label>/{rejected_tokens, rejected_tokens_by_lag, rejected_trajectories} (a rejection) or
# correction/<label>/{truncated_tokens, weight_mean} (a truncation).

# --- Loss. -------------------------------------------------------------------------------------
TRAIN_LOSS = "train/loss"
"""The policy loss that was back-propagated (after aggregation)."""
TRAIN_TRAJECTORIES = "train/trajectories"
"""Trajectories in the step's minibatch."""
TRAIN_ENTROPY = "train/entropy"
"""Mean token entropy of the policy on trained tokens (optional: costs a full-vocab pass)."""

# --- Held-out evaluation (trainer.eval_every): only in the records of evaluated versions. ----------
EVAL_SUCCESS = "eval/success"
"""Held-out success rate: mean correctness over every (prompt, sample) of the evaluation."""
EVAL_SUCCESS_LOW = "eval/success_low"
"""Lower end of its 95% interval (Wilson for k = 1, a t-interval over prompts for k > 1)."""
EVAL_SUCCESS_HIGH = "eval/success_high"
"""Upper end of its 95% interval."""
EVAL_PROMPTS = "eval/prompts"
"""Held-out prompts evaluated."""
EVAL_NO_ANSWER_FRAC = "eval/no_answer_frac"
"""Share of held-out episodes with no extracted answer."""
EVAL_TOOL_CALLS_MEAN = "eval/tool_calls_mean"
"""Tool calls per held-out episode."""
EVAL_TRUNCATED_FRAC = "eval/truncated_frac"
"""Share of held-out episodes cut by the token budget."""
EVAL_RESPONSE_TOKENS_MEAN = "eval/response_tokens_mean"
"""Sampled tokens per held-out episode."""
def eval_set_metric(eval_set: str, metric: str) -> str:
    """An eval set's version of an `eval/*` metric: `eval/<eval_set>/success`, ... (trainer.eval_sets)."""
    return f"eval/{eval_set}/{metric.removeprefix('eval/')}"


TIME_EVAL = "time/eval"
"""Seconds the held-out evaluation took (not part of time/step)."""

# --- The run's learning signal so far (the live line's; `vcpo trend` over the steps up to this one). ---
TREND_SUCCESS = "trend/success_per_100_steps"
"""Change of the training episodes' success rate (reward ≥ 1) per 100 steps, least squares, so far."""
TREND_SUCCESS_LOW = "trend/success_per_100_steps_low"
"""Lower end of its 95% step-bootstrap interval."""
TREND_SUCCESS_HIGH = "trend/success_per_100_steps_high"
"""Upper end of that interval (below 0: success is falling by more than noise explains)."""

REQUIRED_EVERY_STEP = (
    STALENESS_MEAN,
    STALENESS_MAX,
    STALENESS_HIST,
    IS_ESS_RATIO,
    IS_ESS_RATIO_CLIPPED,
    IS_W_MAX,
    IS_W_P99,
    IS_LOG_W_MEAN,
    IS_LOG_W_MIN,
    IS_LOG_W_MAX,
    IS_KL_K3,
    LR_BASE,
    LR_SCALE,
    OPOB_BASELINE_MEAN,
    OPOB_GAP_TO_GROUP_MEAN,
    GRAD_NORM,
    PG_CLIP_FRAC,
    PG_MASKED_FRAC,
    REWARD_MEAN,
    REWARD_MAX,
    REWARD_MIN,
    REWARD_STD,
    TOKENS_GENERATED,
    TOKENS_TRAINED,
    TIME_GENERATE,
    TIME_TRAIN,
    TIME_WEIGHT_SYNC,
    TIME_IDLE_LEARNER,
    TIME_IDLE_ROLLOUT,
)
"""The keys docs/algorithm.md requires in every training step's record."""

OPTIONAL = (
    TIME_STEP,
    TIME_CPU,
    TIME_LEARNER_PROXIMAL,
    TIME_LEARNER_GRADIENT,
    TIME_LEARNER_OPTIMIZER,
    PERF_TOKENS_PER_S,
    TOKENS_LEARNER_INPUT,
    ROLLOUT_TURNS_MEAN,
    ROLLOUT_TOOL_CALLS_MEAN,
    ROLLOUT_TOOL_ERRORS_MEAN,
    ROLLOUT_TRUNCATED_FRAC,
    ROLLOUT_VOID_TURN_FRAC,
    ROLLOUT_RESPONSE_TOKENS_MEAN,
    ROLLOUT_FILTERED_FRAC,
    ROLLOUT_SEGMENTS_MEAN,
    ROLLOUT_COMPACTIONS_MEAN,
    PROGRAM_CRASHED,
    PROGRAM_TIMED_OUT,
    PROGRAM_NEVER_CALLED,
    STALENESS_SEGMENT_MEAN,
    STALENESS_SEGMENT_MAX,
    TOOL_PARSE_ERRORS,
    TOOL_UNKNOWN,
    ROLLOUT_SKIPPED_SAMPLES,
    ROLLOUT_FAILED_GROUPS,
    ROLLOUT_REGENERATED_GROUPS,
    ROLLOUT_REFILLS,
    ROLLOUT_REFILLED_GROUPS,
    ROLLOUT_REFILL_TOKENS,
    ROLLOUT_MAX_LAG,
    ROLLOUT_LAG_MOVE,
    ROLLOUT_LAG_RAISES,
    ROLLOUT_LAG_LOWERS,
    ROLLOUT_LAG_JUDGED,
    ROLLOUT_IDLE_FRACTION,
    ROLLOUT_LAG_JUDGED_ESS,
    ROLLOUT_LAG_MISMATCH_ESS,
    TRAIN_LOSS,
    TRAIN_ENTROPY,
    CORRECTION_REJECTED_TOKENS,
    CORRECTION_REJECTED_TRAJECTORIES,
    CORRECTION_REJECTED_BY_LAG,
    EVAL_SUCCESS,
    EVAL_SUCCESS_LOW,
    EVAL_SUCCESS_HIGH,
    EVAL_PROMPTS,
    EVAL_NO_ANSWER_FRAC,
    EVAL_TOOL_CALLS_MEAN,
    EVAL_TRUNCATED_FRAC,
    EVAL_RESPONSE_TOKENS_MEAN,
    TIME_EVAL,
    TREND_SUCCESS,
    TREND_SUCCESS_LOW,
    TREND_SUCCESS_HIGH,
    TRAIN_TRAJECTORIES,
    IS_BY_LAG_ESS_RATIO,
    IS_BY_LAG_KL_K3,
    IS_BY_LAG_LOG_W_MEAN,
    IS_MISMATCH_ESS_RATIO,
    IS_MISMATCH_KL_K3,
    IS_MISMATCH_LOG_W_MEAN,
    IS_STALENESS_LOG_W_EXCESS,
)
"""Further keys the trainer logs when it has them."""

ALL_METRICS = REQUIRED_EVERY_STEP + OPTIONAL


def staleness_bin_bounds(index: int, num_bins: int = STALENESS_HIST_BINS) -> tuple[int, int | None]:
    """Lags counted in bin `index` of `staleness/hist`, as (low, high) inclusive; high is None for
    the open last bin. Bins: [0], [1], [2,3], [4,7], ..., [2^{b-1}, 2^b - 1], ..., [2^{n-2}, ∞)."""
    if not 0 <= index < num_bins:
        raise ValueError(f"staleness bin index {index} is outside 0..{num_bins - 1}")
    low = 0 if index == 0 else 2 ** (index - 1)
    high = None if index == num_bins - 1 else (0 if index == 0 else 2**index - 1)
    return low, high


def staleness_bin_label(index: int, num_bins: int = STALENESS_HIST_BINS, width: int = 0) -> str:
    """'0', '1', '2-3', '4-7', ..., '128+'; numbers zero-padded to `width` digits (so that labels
    sort in bin order as text, as TensorBoard sorts tags)."""
    low, high = staleness_bin_bounds(index, num_bins)
    if high is None:
        return f"{low:0{width}d}+"
    return f"{low:0{width}d}" if high == low else f"{low:0{width}d}-{high:0{width}d}"


__all__ = [
    "ALL_METRICS",
    "AXES",
    "CORRECTION_REJECTED_BY_LAG",
    "CORRECTION_REJECTED_TOKENS",
    "CORRECTION_REJECTED_TRAJECTORIES",
    "EVAL_NO_ANSWER_FRAC",
    "EVAL_PROMPTS",
    "EVAL_RESPONSE_TOKENS_MEAN",
    "EVAL_SUCCESS",
    "EVAL_SUCCESS_HIGH",
    "EVAL_SUCCESS_LOW",
    "EVAL_TOOL_CALLS_MEAN",
    "EVAL_TRUNCATED_FRAC",
    "GRAD_NORM",
    "IS_BY_LAG_ESS_RATIO",
    "IS_BY_LAG_KL_K3",
    "IS_BY_LAG_LOG_W_MEAN",
    "IS_ESS_RATIO",
    "IS_ESS_RATIO_CLIPPED",
    "IS_KL_K3",
    "IS_LOG_W_MAX",
    "IS_LOG_W_MEAN",
    "IS_LOG_W_MIN",
    "IS_MISMATCH_ESS_RATIO",
    "IS_MISMATCH_KL_K3",
    "IS_MISMATCH_LOG_W_MEAN",
    "IS_STALENESS_LOG_W_EXCESS",
    "IS_W_MAX",
    "IS_W_P99",
    "LR_BASE",
    "LR_SCALE",
    "OPOB_BASELINE_MEAN",
    "OPOB_GAP_TO_GROUP_MEAN",
    "OPTIONAL",
    "PERF_TOKENS_PER_S",
    "PG_CLIP_FRAC",
    "PG_MASKED_FRAC",
    "POLICY_VERSION",
    "PROGRAM_CRASHED",
    "PROGRAM_NEVER_CALLED",
    "PROGRAM_TIMED_OUT",
    "REQUIRED_EVERY_STEP",
    "REWARD_MAX",
    "REWARD_MEAN",
    "REWARD_MIN",
    "REWARD_STD",
    "ROLLOUT_FAILED_GROUPS",
    "ROLLOUT_FILTERED_FRAC",
    "ROLLOUT_IDLE_FRACTION",
    "ROLLOUT_LAG_JUDGED",
    "ROLLOUT_LAG_JUDGED_ESS",
    "ROLLOUT_LAG_LOWERS",
    "ROLLOUT_LAG_MISMATCH_ESS",
    "ROLLOUT_LAG_MOVE",
    "ROLLOUT_LAG_RAISES",
    "ROLLOUT_MAX_LAG",
    "ROLLOUT_REFILLED_GROUPS",
    "ROLLOUT_REFILLS",
    "ROLLOUT_REFILL_TOKENS",
    "ROLLOUT_REGENERATED_GROUPS",
    "ROLLOUT_RESPONSE_TOKENS_MEAN",
    "ROLLOUT_SKIPPED_SAMPLES",
    "ROLLOUT_TOOL_CALLS_MEAN",
    "ROLLOUT_TOOL_ERRORS_MEAN",
    "ROLLOUT_TRUNCATED_FRAC",
    "ROLLOUT_TURNS_MEAN",
    "ROLLOUT_VOID_TURN_FRAC",
    "STALENESS_HIST",
    "STALENESS_HIST_BINS",
    "STALENESS_MAX",
    "STALENESS_MEAN",
    "TIME_CPU",
    "TIME_EVAL",
    "TIME_GENERATE",
    "TIME_IDLE_LEARNER",
    "TIME_IDLE_ROLLOUT",
    "TIME_LEARNER_GRADIENT",
    "TIME_LEARNER_OPTIMIZER",
    "TIME_LEARNER_PROXIMAL",
    "TIME_STEP",
    "TIME_TRAIN",
    "TIME_WEIGHT_SYNC",
    "TOKENS_GENERATED",
    "TOKENS_LEARNER_INPUT",
    "TOKENS_TRAINED",
    "TOOL_PARSE_ERRORS",
    "TOOL_UNKNOWN",
    "TRAINER_STEP",
    "TRAIN_ENTROPY",
    "TRAIN_LOSS",
    "TRAIN_TRAJECTORIES",
    "TREND_SUCCESS",
    "TREND_SUCCESS_HIGH",
    "TREND_SUCCESS_LOW",
    "WALL_S",
    "eval_set_metric",
    "stage_metric",
    "staleness_bin_bounds",
    "staleness_bin_label",
]
