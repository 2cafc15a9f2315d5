"""Tasks from YAML, datasets, rewards, the multi-turn agent loop (SimpleTIR's code fence, or function
calling with several tools), running a task's episodes and groups for the rollout manager (`runtime`)
and evaluation (`evaluation`).

May import: `vcpo`, `rollout`, `tools`, `configs` (the task schema: a task component takes its own
validated section).
"""

from agent_env.datasets import DatasetError, DatasetLoad, load_samples
from agent_env.evaluation.evaluate import EvalFileError, evaluate
from agent_env.evaluation.metrics import majority_is_correct, pass_at_k, summarize
from agent_env.loop import Episode, EpisodeSettings, TurnRecord, run_episode
from agent_env.prompts import PromptError, render_messages, render_prompt_ids
from agent_env.rewards import RewardFn, RewardResult, build_reward, extract_answer
from agent_env.runtime import LiveCounts, RolloutRuntime, TaskRuntime, data_index, episode_settings
from agent_env.samples import Sample

__all__ = [
    "DatasetError",
    "DatasetLoad",
    "Episode",
    "EpisodeSettings",
    "EvalFileError",
    "LiveCounts",
    "PromptError",
    "RewardFn",
    "RewardResult",
    "RolloutRuntime",
    "Sample",
    "TaskRuntime",
    "TurnRecord",
    "build_reward",
    "data_index",
    "episode_settings",
    "evaluate",
    "extract_answer",
    "load_samples",
    "majority_is_correct",
    "pass_at_k",
    "render_messages",
    "render_prompt_ids",
    "run_episode",
    "summarize",
]
