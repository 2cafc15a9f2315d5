"""The task YAML schema: which data, which prompt, which tools, which budgets, which reward.

A task file (`configs/tasks/*.yaml`) is everything the agent loop, the trainer and `vcpo eval` need
to know about one problem set. Rows of the dataset become `agent_env.samples.Sample`s through
`fields` (dotted paths into each row); the prompt is a `str.format` template over those fields.

Checked here, at load time: placeholders exist, regexes compile with one group, a custom reward
names its function, dataset paths use only the `{data_dir}` placeholder, `tool` and `tools` are not
both set and several tools use function calling. Not checked here (this module imports only pydantic):
the tool specs (`run.train.wiring.load_task` validates them with
`tools.registry.validate_tool_settings`), whether files exist, whether a custom reward imports.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from configs.base import StrictModel
from configs.loader import load_config

DATA_DIR_PLACEHOLDER = "{data_dir}"
"""The one placeholder a file dataset path may contain; replaced by the data folder at load time."""

# ---------------------------------------------------------------------------------------------
# Where rows come from


class FieldMap(StrictModel):
    """How a dataset row becomes a sample: dotted paths into the row (`a.b.0.c`: keys and list
    indices). Keys that contain a dot cannot be addressed."""

    id: str | None = None
    """Path to a row id (any scalar, turned into a string); None = the row's position (0, 1, ...)."""
    answer: str | dict[str, str]
    """Path to the ground truth (e.g. `reward_model.ground_truth`), or a mapping name → path that
    builds a dict answer (e.g. `{target: target, numbers: nums}` for Countdown)."""
    template_fields: dict[str, str] = Field(default_factory=dict)
    """Prompt placeholder name → path into the row, e.g. `{question: prompt.0.content}`."""


class _DatasetBase(StrictModel):
    limit: int | None = Field(None, gt=0)
    """Use only the first N valid samples; None = all of them."""
    fields: FieldMap | None = None
    """Row → sample mapping for this dataset only (e.g. an eval set with other column names);
    None = the task's `fields`."""


class FileDataset(_DatasetBase):
    """A local file: one row per JSON line / array element / parquet or CSV row."""

    type: Literal["file"] = "file"
    """Dataset source kind."""
    path: str
    """File path. `{data_dir}` is replaced by the data folder (argument `data_dir`, else env
    VCPO_DATA_DIR, else `../shared/data` beside the repo); relative paths are from the task file's folder."""
    format: Literal["auto", "jsonl", "json", "parquet", "csv"] = "auto"
    """File format; auto = from the suffix (.jsonl, .json, .parquet, .csv)."""

    @field_validator("path")
    @classmethod
    def _only_known_placeholder(cls, path: str) -> str:
        others = [m for m in re.findall(r"\{[^{}]*\}", path) if m != DATA_DIR_PLACEHOLDER]
        if others:
            raise ValueError(f"unknown placeholder(s) {', '.join(others)}; the only one allowed is "
                             f"{DATA_DIR_PLACEHOLDER} (the shared data folder)")
        return path


class HubDataset(_DatasetBase):
    """A Hugging Face hub dataset (needs network or a warm HF cache)."""

    type: Literal["hub"] = "hub"
    """Dataset source kind."""
    id: str
    """Hub id, e.g. `openai/gsm8k`."""
    split: str = "train"
    """Split name."""
    subset: str | None = None
    """Config/subset name (e.g. `main` for gsm8k); None = the dataset's default."""


class GeneratorDataset(_DatasetBase):
    """Instances generated in-process from a seed (no files). Countdown rows have columns
    `id`, `target` and `nums`, the same as the TinyZero parquet, so both share one field map; keychain
    rows (agent_env/keychain.py) have `start`, `hops` and `answer`."""

    type: Literal["generator"] = "generator"
    """Dataset source kind."""
    name: Literal["countdown", "keychain"]
    """Which generator: countdown (the fields below up to max_target) or keychain (min_hops, max_hops)."""
    num_samples: int = Field(gt=0)
    """How many instances to generate."""
    seed: int = 0
    """Seed of the generator: the same seed gives the same instances."""
    min_numbers: int = Field(3, ge=2)
    """Fewest numbers per instance."""
    max_numbers: int = Field(4, ge=2, le=5)
    """Most numbers per instance (the solvability search grows fast beyond 5, so 5 is the cap)."""
    max_number: int = Field(99, ge=1)
    """Numbers are drawn uniformly from 1..max_number."""
    min_target: int = Field(10, ge=1)
    """Smallest target."""
    max_target: int = Field(100, ge=1)
    """Largest target (targets are uniform in [min_target, max_target])."""
    min_hops: int = Field(6, ge=1)
    """keychain: fewest hops (tool calls) an instance needs."""
    max_hops: int = Field(9, ge=1)
    """keychain: most hops (uniform in [min_hops, max_hops])."""

    @model_validator(mode="after")
    def _check_ranges(self) -> GeneratorDataset:
        if self.min_numbers > self.max_numbers:
            raise ValueError(f"dataset.min_numbers={self.min_numbers} > dataset.max_numbers="
                             f"{self.max_numbers}; lower min_numbers or raise max_numbers")
        if self.min_target > self.max_target:
            raise ValueError(f"dataset.min_target={self.min_target} > dataset.max_target="
                             f"{self.max_target}; lower min_target or raise max_target")
        if self.min_hops > self.max_hops:
            raise ValueError(f"dataset.min_hops={self.min_hops} > dataset.max_hops={self.max_hops}; lower "
                             "min_hops or raise max_hops")
        countdown_only = {"min_numbers", "max_numbers", "max_number", "min_target", "max_target"}
        other = {"countdown": {"min_hops", "max_hops"}, "keychain": countdown_only}[self.name]
        # a field left at its default changes nothing, and a run's own task.yaml dump holds every field
        defaults = {name: type(self).model_fields[name].default for name in other}
        if stray := sorted(name for name in other & self.model_fields_set
                           if getattr(self, name) != defaults[name]):
            raise ValueError(f"dataset: {', '.join(stray)} do not apply to the {self.name} generator; remove "
                             "them")
        return self


DatasetConfig = Annotated[FileDataset | HubDataset | GeneratorDataset, Field(discriminator="type")]
"""A dataset source, tagged on `type`: file, hub or generator."""

# ---------------------------------------------------------------------------------------------
# Prompt, loop, answer, filters, reward, evaluation


class PromptConfig(StrictModel):
    """The chat prompt. Templates use `str.format`: `{name}` is a template field, and literal
    braces are doubled (`\\boxed{{}}` renders as `\\boxed{}`)."""

    system: str | None = None
    """System message template; None = no system message."""
    user: str
    """User message template, e.g. `{question}\\n\\nPut the final answer in \\boxed{{}}.`"""
    chat_template: str | None = None
    """A Jinja chat template file (relative paths from the task file's folder) used instead of the
    model's own, e.g. one that renders `tools=` for a model whose template ignores them; None = the
    model's template."""


DEFAULT_SUMMARY_REQUEST = ("\n\nYour context is full. Write a short summary of what you have tried and "
                           "learned so far; it replaces the history above.\nSummary:")
DEFAULT_SUMMARY_PREFIX = "Summary of your earlier work:"


class ContextConfig(StrictModel):
    """What each turn reads (agent_env/context.py): by default every turn's context is the last one plus the
    turn and its observation. A context that stops extending the last one starts a new segment of the
    trajectory, trained as one episode (docs/agent_loop.md)."""

    think: Literal["keep", "strip"] = "keep"
    """strip: earlier turns' reasoning (`think_open` … `think_close`) is removed before the next turn, as a
    thinking model's chat template drops it from the history (Qwen3 with observations as user turns);
    the reasoning still trains where it was sampled."""
    think_open: str = "<think>"
    """Where a turn's reasoning begins."""
    think_close: str = "</think>"
    """Where it ends."""
    compaction: Literal["none", "keep_last", "summarize"] = "none"
    """Once the next turn's context would pass `compact_at_tokens`: keep_last keeps only the prompt and the
    last `keep_last_turns` turns (with their observations); summarize first asks the policy for a summary
    of its work (`summary_request`), sampled and trained with the episode's reward, and keeps the prompt,
    the summary and the last `keep_last_turns` turns."""
    compact_at_tokens: int | None = Field(None, gt=0)
    """The context length that triggers compaction (required with one; below loop.max_total_tokens)."""
    keep_last_turns: int = Field(2, ge=0)
    """Turns kept after the prompt (and the summary)."""
    summary_request: str = Field(DEFAULT_SUMMARY_REQUEST, min_length=1)
    """summarize: the text appended to the context to ask for the summary."""
    summary_prefix: str = DEFAULT_SUMMARY_PREFIX
    """summarize: the text the summary follows in the next context."""
    summary_max_tokens: int = Field(256, gt=0)
    """summarize: most tokens of one summary (also capped by what is left of loop.max_total_tokens)."""

    @model_validator(mode="after")
    def _check(self) -> ContextConfig:
        if self.compaction != "none" and self.compact_at_tokens is None:
            raise ValueError(f"loop.context.compaction: {self.compaction} needs compact_at_tokens (the "
                             "context length that triggers it), e.g. compact_at_tokens: 1536")
        return self


class LoopConfig(StrictModel):
    """Budgets and sampling of the multi-turn tool loop during training (docs/agent_loop.md)."""

    max_turns: int = Field(5, ge=0)
    """Most tool calls per episode; 0 = the model answers without running code."""
    max_total_tokens: int = Field(2048, gt=0)
    """Token budget of what the model reads at a turn: prompt + every generated turn + every observation
    (of the current segment, when `context` manages it: the whole episode otherwise)."""
    max_new_tokens_per_turn: int = Field(1024, gt=0)
    """Most tokens generated in one turn (also capped by what is left of max_total_tokens)."""
    observation_format: Literal["markdown", "simpletir"] = "markdown"
    """markdown: "\\n```output\\n{stdout}\\n```\\n"; simpletir: "\\nCode execution result: {stdout}\\n"."""
    max_observation_chars: int = Field(512, gt=0)
    """Tool output longer than this is cut, with a marker, before the model sees it."""
    preamble: str = ""
    """Python code prepended to every executed block (e.g. helper imports); "" = none."""
    use_session: bool = False
    """Keep one interpreter per episode (variables survive between turns); False = fresh process per call."""
    # rollout.types.DEFAULT_TEMPERATURE spelled out (configs imports nothing); tests/configs keeps them equal
    temperature: float = Field(1.0, ge=0)
    """Sampling temperature of rollouts; 0 = greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 = off."""
    tool_format: Literal["code_fence", "function_call"] = "code_fence"
    """How the model calls tools. code_fence: one fenced code block per turn runs in the one tool
    (SimpleTIR); function_call: the tools' JSON schemas go to the chat template's `tools=` and the
    model writes structured calls that `tool_parser` reads, results return as the template's tool
    messages (docs/agent_loop.md)."""
    tool_parser: str = "hermes"
    """function_call only: which parser reads calls from a turn: `hermes` (`<tool_call>{"name": ...,
    "arguments": ...}</tool_call>`: Qwen2.5/3, Hermes, SmolLM3) or `package.module:Class`."""
    max_parallel_calls: int = Field(4, ge=1)
    """function_call only: calls of one turn that run (concurrently); further calls in that turn are
    not run and the model sees an error for each."""
    context: ContextConfig = Field(default_factory=ContextConfig)
    """What each turn reads: appended (the default), reasoning stripped, history compacted."""
    program: str | None = Field(None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """An agent written as a program instead of the built-in loop: `package.module:function`, an async
    function `(base_url, sample)` that calls the OpenAI-compatible endpoint at `base_url` and returns a
    reward (a number), its final answer (a string, scored by the task's reward) or None (the last reply is
    scored). Its calls are the episode's trained tokens (docs/agent_loop.md); the turn budgets above bound
    each call, `max_total_tokens` each call's context and answer."""
    program_timeout_s: float = Field(600.0, gt=0)
    """Seconds one run of `program` may take; past it the episode is dropped and counted (its group is
    replaced by a fresh prompt, as for any failed group)."""

    @model_validator(mode="after")
    def _check_context(self) -> LoopConfig:
        at = self.context.compact_at_tokens
        if at is not None and at >= self.max_total_tokens:
            raise ValueError(f"loop.context.compact_at_tokens={at} must be below loop.max_total_tokens="
                             f"{self.max_total_tokens}: compaction must happen before the budget ends the "
                             "episode")
        return self


class AnswerConfig(StrictModel):
    """How the final answer is found in the model's text."""

    pattern: str = "boxed"
    """"boxed" = the last `\\boxed{...}` (nested braces allowed); otherwise a regex with exactly one
    group, searched with DOTALL, last match wins (e.g. `<answer>(.*?)</answer>`)."""

    @field_validator("pattern")
    @classmethod
    def _one_group_regex(cls, pattern: str) -> str:
        if pattern == "boxed":
            return pattern
        try:
            groups = re.compile(pattern).groups
        except re.error as exc:
            raise ValueError(f"not a valid regex ({exc}); use 'boxed' or a regex with one group, "
                             "e.g. '<answer>(.*?)</answer>'") from None
        if groups != 1:
            raise ValueError(f"the regex has {groups} groups, needs exactly 1 (the answer); use "
                             "(?:...) for the other groups")
        return pattern


class FilterConfig(StrictModel):
    """SimpleTIR's stabilisers: which trajectories leave the loss (both are counted as metrics)."""

    mask_void_turns: bool = False
    """Zero the loss mask of trajectories with a turn that has neither code nor a final answer."""
    remove_truncated: bool = False
    """Zero the loss mask of trajectories that ran out of token budget."""


class RewardConfig(StrictModel):
    """Which reward scores the final answer (agent_env/rewards.py)."""

    type: Literal["math_verify", "countdown", "gsm8k", "exact_match", "custom"]
    """math_verify: symbolic equality (math-verify); countdown: the equation uses each number once and
    hits the target; gsm8k: the number after `####`; exact_match: stripped strings; custom: `function`."""
    function: str | None = None
    """`package.module:function`, called as f(response, sample) -> float | RewardResult; only for
    type=custom."""
    format_score: float = 0.0
    """Score when an answer was extracted but is wrong (e.g. 0.1 as in TinyZero); 0 = binary reward.
    Not used by custom rewards (the function returns its own score)."""

    @model_validator(mode="after")
    def _function_iff_custom(self) -> RewardConfig:
        if self.type == "custom" and not self.function:
            raise ValueError("reward.type='custom' needs reward.function ('package.module:function'); "
                             "set it or pick a built-in reward.type")
        if self.type != "custom" and self.function is not None:
            raise ValueError(f"reward.function={self.function!r} is only used with reward.type='custom' "
                             f"(got reward.type={self.type!r}); remove reward.function or set type: custom")
        if self.function is not None and not re.fullmatch(r"[\w.]+:\w+", self.function):
            raise ValueError(f"reward.function={self.function!r} must look like 'package.module:function'")
        return self


class EvalConfig(StrictModel):
    """Settings of `vcpo eval` on this task."""

    k: int = Field(1, ge=1)
    """Samples per problem."""
    max_turns: int = Field(10, ge=0)
    """Most tool calls per episode during evaluation."""
    temperature: float = Field(0.6, ge=0)
    """Sampling temperature; 0 = greedy (then k > 1 repeats the same answer)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass; 1 = off."""
    max_total_tokens: int | None = Field(None, gt=0)
    """Token budget per episode; None = loop.max_total_tokens."""
    limit: int | None = Field(None, gt=0)
    """Evaluate only the first N problems; None = all."""
    metrics: tuple[Literal["avg@k", "pass@k", "maj@k"], ...] = ("avg@k", "pass@k", "maj@k")
    """Reported metrics: mean correctness, any-of-k correct, majority-vote answer correct."""

    @field_validator("metrics")
    @classmethod
    def _not_empty(cls, metrics: tuple[str, ...]) -> tuple[str, ...]:
        if not metrics:
            raise ValueError("no metric to report; list at least one of avg@k, pass@k, maj@k")
        return metrics


# ---------------------------------------------------------------------------------------------
# The task


class TaskConfig(StrictModel):
    """One task: data, prompt, tool, budgets, reward and evaluation settings."""

    name: str
    """Short task name used in run names and metrics."""
    dataset: DatasetConfig
    """Training (and default evaluation) data."""
    eval_dataset: DatasetConfig | None = None
    """Data for `vcpo eval`; None = `dataset`."""
    heldout_dataset: DatasetConfig | None = None
    """Prompts the trainer evaluates the live policy on while it trains (`trainer.eval_every`): any whose
    prompt equals a training prompt is dropped, then the first `trainer.eval_samples` are used. None =
    no held-out evaluation for this task."""
    fields: FieldMap
    """Row → sample mapping (a dataset's own `fields` replaces it for that dataset)."""
    prompt: PromptConfig
    """System and user message templates."""
    tool: dict[str, Any] | None = None
    """Tool spec as in configs/tools/*.yaml (e.g. `{type: python, timeout_s: 10}`); None = no tool."""
    tools: list[dict[str, Any]] | None = None
    """Several tool specs (each as `tool`), for `loop.tool_format: function_call`; None = `tool` alone.
    Set `tool` or `tools`, not both."""
    loop: LoopConfig = Field(default_factory=LoopConfig)
    """Turn and token budgets, observation format, sampling for training rollouts."""
    answer: AnswerConfig = Field(default_factory=AnswerConfig)
    """How the final answer is found."""
    filters: FilterConfig = Field(default_factory=FilterConfig)
    """Which trajectories leave the loss."""
    reward: RewardConfig
    """How the final answer is scored."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Evaluation settings."""

    @model_validator(mode="after")
    def _placeholders_have_fields(self) -> TaskConfig:
        problems: list[str] = []
        maps = {"fields": self.fields}
        for section, dataset in (("dataset", self.dataset), ("eval_dataset", self.eval_dataset),
                                 ("heldout_dataset", self.heldout_dataset)):
            if dataset is not None and dataset.fields is not None:
                maps[f"{section}.fields"] = dataset.fields
        templates = (("prompt.system", self.prompt.system), ("prompt.user", self.prompt.user))
        for prompt_field, template in templates:
            if template is None:
                continue
            try:
                names = template_placeholders(template)
            except ValueError as exc:
                problems.append(f"{prompt_field}: {exc}")
                continue
            for map_name, field_map in maps.items():
                for name in sorted(names - set(field_map.template_fields)):
                    problems.append(
                        f"{prompt_field} uses {{{name}}} but {map_name}.template_fields has no '{name}'; "
                        f"add {map_name}.template_fields.{name}: <path in the row>, or remove the "
                        "placeholder")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _tools_fit_the_format(self) -> TaskConfig:
        if self.tool is not None and self.tools is not None:
            raise ValueError("both tool and tools are set; put every tool in the tools list and remove tool")
        specs = self.tool_specs()
        for index, spec in enumerate(specs):
            if not isinstance(spec.get("type"), str):
                where = "tool" if self.tool is not None else f"tools.{index}"
                raise ValueError(f"{where} has no string `type`; give each tool a type such as "
                                 "{type: python} or {type: mcp, command: ...}")
        if len(specs) > 1 and self.loop.tool_format != "function_call":
            raise ValueError(f"tools lists {len(specs)} tools but loop.tool_format is "
                             f"{self.loop.tool_format!r}, where a turn's one code block goes to one tool; "
                             "set loop.tool_format: function_call, or keep one tool")
        return self

    def tool_specs(self) -> list[dict[str, Any]]:
        """The task's tool specs: `tools`, or `[tool]`, or none."""
        if self.tools is not None:
            return list(self.tools)
        return [self.tool] if self.tool is not None else []


def template_placeholders(template: str) -> set[str]:
    """The `{name}` placeholders of a str.format template. Raises ValueError (with the fix) for
    malformed braces, positional `{}` and attribute/index forms (`{a.b}`, `{a[0]}`)."""
    names: set[str] = set()
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"malformed template ({exc}); write literal braces as '{{{{' and '}}}}', "
                         "e.g. \\boxed{{}}") from None
    for _, name, _, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"placeholder {{{name}}} is not a plain name; use {{question}}-style names "
                             "and write literal braces as '{{' and '}}' (e.g. \\boxed{{}})")
        names.add(name)
    return names


def load_task_config(path: str | Path, overrides: Sequence[str] = ()) -> TaskConfig:
    """Read a task YAML (following `extends:`), apply `a.b=value` overrides and validate.
    Raises `configs.loader.ConfigError` naming the file, every bad field and the fix."""
    return load_config(path, TaskConfig, overrides)
