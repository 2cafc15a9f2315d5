"""Run by tests/examples/test_tool_plugin.py in a subprocess whose PYTHONPATH holds the installed
plug-in (and the repo): everything that needs `vcpo_sqlite_tool` importable happens here, so the
test process itself never sees the plug-in.

`python -m tests.examples.sqlite_plugin_check REQUEST.json REPORT.json`. The request names the
model, the task file, the database, the tool types to try and the extra queries; the report holds
what `tools.registry.known_tools()` lists and, per tool type, the agent-loop episode of the task's
first problem (real HF engine, greedy as `vcpo eval`) and each query's `ToolResult`. It asserts
nothing: the test does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
from pathlib import Path
from typing import Any

from agent_env.datasets import load_samples
from agent_env.loop import run_episode
from agent_env.prompts import render_messages, render_prompt_ids
from agent_env.rewards import build_reward
from agent_env.runtime import episode_settings
from rollout.engines.hf_engine import HFEngine
from run.train.wiring import load_task
from tools.base import ToolCall
from tools.registry import build_tool, known_tools


async def check_tool(request: dict[str, Any], tool_type: str, engine: HFEngine, tokenizer: Any
                     ) -> dict[str, Any]:
    """One tool type: the first problem's episode, then the extra queries on the same tool."""
    task, task_path = load_task(request["task"])  # resolves and checks `tool: {type: sqlite}` as vcpo eval
    sample = load_samples(task, which="eval", task_dir=task_path.parent).samples[0]
    reward = build_reward(task.reward, task.answer)
    prompt = render_prompt_ids(tokenizer, render_messages(task.prompt.system, task.prompt.user, sample))
    # the task's tool settings with this entry point and the test's database
    spec = {**(task.tool or {}), "type": tool_type, "database": request["database"]}
    if tool_type == "sqlite_sandboxed":
        spec["warm_pool_size"] = 0  # no idle sandboxes: the test's CPU is scarce
    async with build_tool(spec) as tool:
        episode = await run_episode(engine, tokenizer, prompt, episode_settings(task, seed=0, for_eval=True),
                                    lambda text: reward(text, sample), tool=tool,
                                    trajectory_id=f"{tool_type}-0", group_id="0", sample_id=sample.sample_id)
        queries = {}
        for name, query in request["queries"].items():
            result = await tool.run(ToolCall(code=query["sql"], timeout_s=query.get("timeout_s")))
            queries[name] = result.model_dump(mode="json")
    return {
        "tool_class": f"{type(tool).__module__}:{type(tool).__qualname__}",
        "tool_file": inspect.getfile(type(tool)),
        "sample_id": sample.sample_id,
        "episode": {
            "turns": [{"text": turn.text, "code": turn.code, "observation": turn.observation,
                       "tool_status": turn.tool_status} for turn in episode.turns],
            "reward": episode.trajectory.reward, "answer": episode.answer,
            "tool_calls": episode.trajectory.task.tool_calls,
        },
        "queries": queries,
    }


async def check(request: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(request["model"])
    report: dict[str, Any] = {"known_tools": known_tools(), "tools": {}}
    async with HFEngine(request["model"]) as engine:
        for tool_type in request["tool_types"]:
            report["tools"][tool_type] = await check_tool(request, tool_type, engine, tokenizer)
    return report


def main(argv: list[str]) -> int:
    request_path, report_path = (Path(arg) for arg in argv)
    report = asyncio.run(check(json.loads(request_path.read_text())))
    report_path.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
