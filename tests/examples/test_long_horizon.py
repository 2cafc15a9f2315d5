"""examples/long_horizon: the README's `vcpo train` of the keychain task, through the real command.

The command is read from the README and run as a user types it, with only test-speed settings
appended: a tiny byte-level model (budgets scaled to bytes: a byte tokenizer makes every text ~4x
longer), the HF engine, one step at temperature 0.3. Its warm start is the README's — the keychain
solver's episodes through the task's own loop and the real sandbox — run long enough on one chain for
the tiny model to memorise it, so that the RL step's episodes really follow the chain for six tool
turns, really outgrow the budget and are really compacted: the step trains segmented episodes that the
real sandbox scored.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from run.observability.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "long_horizon"
VCPO = Path(sys.executable).parent / "vcpo"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

BYTE_BUDGETS = ("loop.max_total_tokens=4000", "loop.context.compact_at_tokens=720",
                "loop.max_new_tokens_per_turn=96")
"""The task's token budgets for a byte tokenizer: compaction after about four hops of six."""


def readme_commands() -> list[list[str]]:
    text = (EXAMPLE / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(".venv/bin/vcpo ")]


def test_every_file_the_readme_names_exists() -> None:
    commands = readme_commands()
    assert [command[1] for command in commands] == ["train", "bench", "bench", "bench"]
    for command in commands:
        assert all((ROOT / arg).is_file() for arg in command if arg.endswith(".yaml")), command


@needs_bwrap
def test_the_readme_train_runs_compacted_six_turn_episodes_through_the_real_sandbox(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    (train,) = [command for command in readme_commands() if command[1] == "train"]
    run_dir = tmp_path / "run"
    overrides = [f"model.path={tiny_model_dir}", "engine.backend=hf", "learner.device=cpu",
                 f"run_dir={run_dir}", "trainer.total_steps=1", "trainer.eval_every=0",
                 "trainer.checkpoint_every=1", "algo.group_size=2", "rollout.groups_per_step=1",
                 "warm_start.examples=1", "warm_start.epochs=200", "warm_start.lr=3e-3",
                 "warm_start.autocast=none", "learner.autocast=none",
                 f"task_overrides=[dataset.num_samples=1,dataset.min_hops=6,dataset.max_hops=6,loop.temperature=0.3,"
                 f"{','.join(BYTE_BUDGETS)}]", "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "VCPO_CACHE_DIR": str(tmp_path / "cache")}
    result = subprocess.run([str(VCPO), *train[1:], *overrides], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    log = run_dir / "logs" / "libraries.log"
    assert result.returncode == 0, result.stderr[-3000:] + (log.read_text()[-3000:] if log.is_file() else "")
    (record,) = read_metrics(run_dir)
    assert record["rollout/segments_mean"] > 1 and record["rollout/compactions_mean"] >= 1
    assert record["rollout/tool_calls_mean"] >= 5 and record["staleness/segment_max"] == 0
    episodes = [json.loads(line) for line in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    compacted = [episode for episode in episodes if episode.get("segments")]
    assert compacted and all(len(episode["segments"]) >= 2 for episode in compacted)
    assert any(episode["reward"] == 1.0 for episode in compacted)  # the chain's key, from the real sandbox


CEILING = ROOT / "docs" / "results" / "long_horizon_ceiling.json"


@pytest.mark.skipif(not CEILING.is_file(), reason="docs/results/long_horizon_ceiling.json is written by "
                    "`python examples/long_horizon/ceiling.py --out docs/results/long_horizon_ceiling.json` "
                    "once the arms have run")
def test_the_committed_ceiling_is_what_the_evidence_gives() -> None:
    """Each arm's success by chain length is recomputed from its evaluation files (a prompt's hops from the
    generator: the sets are generator seeds 1 and 2 of 512 chains, a prompt's id its row); the ceiling's
    counts add up to the sets' sizes and no chain longer than the longest that fits is finished."""
    from agent_env.keychain import generate_keychain_rows
    from examples.long_horizon import ceiling

    committed = json.loads(CEILING.read_text())
    for entry in committed["sets"].values():
        by_hops = entry["by_hops"]
        assert sum(cell["prompts"] for cell in by_hops.values()) == entry["prompts"] == 128
        assert sum(cell["solver_finishes"] for cell in by_hops.values()) == entry["solver_finishes"]
        longest_fit = max(int(h) for h, cell in by_hops.items() if cell["solver_finishes"])
        assert all(cell["solver_finishes"] == 0 for h, cell in by_hops.items() if int(h) > longest_fit)
    hops_of = {name: {str(i): row["hops"] for i, row in enumerate(generate_keychain_rows(512, seed))}
               for name, seed in (("heldout", 1), ("test", 2))}
    arms = {arm: ceiling.arm_by_hops(ROOT / folder, hops_of)
            for arm, folder in ceiling.ARMS.items() if (ROOT / folder).is_dir()}
    assert arms == committed["arms"]
