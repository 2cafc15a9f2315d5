"""docs/extending.md's worked examples: an objective and a correction stage of the user's own
(examples/custom_algorithm/plugins.py), named by import path, checked by `vcpo config check` and trained by
a real `vcpo train`; and what a user gets for a wrong path, class or parameter."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from configs.schema import AlgoConfig
from examples.custom_algorithm.plugins import ClippedRLOO, MaxRatioRejection
from learner.backends.algorithm_from_config import (
    PluginError,
    build_corrections,
    build_objective,
    check_algorithm,
)
from run.observability.metrics_log import read_metrics
from tests.run.train.test_train_e2e import _write_configs
from vcpo.corrections import CorrectionView, apply_corrections
from vcpo.objectives.base import PolicyLossInputs
from vcpo.objectives.weighted import RLOO

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "custom_algorithm"
PLUGINS = "examples.custom_algorithm.plugins"


def _vcpo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_example_config_builds_both_plugins_with_its_parameters() -> None:
    algo = AlgoConfig.model_validate(yaml.safe_load((EXAMPLE / "run.yaml").read_text())["algo"])
    check_algorithm(algo)
    objective = build_objective(algo)
    assert isinstance(objective, ClippedRLOO) and objective.max_advantage == 0.5
    assert build_corrections(algo) == (MaxRatioRejection(upper=4.0),)
    checked = _vcpo("config", "check", str(EXAMPLE / "run.yaml"))
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert f"import_path: {PLUGINS}:ClippedRLOO" in checked.stdout


def test_the_objective_is_rloo_with_its_advantages_clipped() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0])  # one success in a group of four: RLOO gives it +1
    batch = dict(logprobs=torch.zeros(4, 3, requires_grad=True), old_logprobs=torch.zeros(4, 3),
                 behavior_logprobs=torch.zeros(4, 3), loss_mask=torch.ones(4, 3, dtype=torch.bool),
                 rewards=rewards, group_ids=torch.zeros(4, dtype=torch.long))
    inputs = PolicyLossInputs(**batch)
    plain = RLOO().batch_context(inputs).rows["advantages"]
    clipped = ClippedRLOO(max_advantage=0.5).batch_context(inputs).rows["advantages"]
    assert plain.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    assert clipped.tolist() == pytest.approx([0.5, -1 / 3, -1 / 3, -1 / 3])


def test_the_stage_rejects_a_trajectory_with_one_token_past_its_ratio() -> None:
    stage = MaxRatioRejection(upper=4.0)
    ell = torch.tensor([[0.0, math.log(5.0), 0.0], [0.1, -3.0, math.log(3.0)]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    view = CorrectionView(ell, ell, mask, torch.zeros(2, dtype=torch.bool), 20.0)
    assert stage.keep(view).tolist() == [False, True]
    done = apply_corrections([stage], old_logprobs=ell, behavior_logprobs=torch.zeros(2, 3), loss_mask=mask,
                             rewards=torch.tensor([1.0, 0.0]), group_ids=torch.zeros(2, dtype=torch.long))
    assert done.rejected.tolist() == [True, False]
    assert float(done.metrics["correction/max_ratio_reject/rejected_trajectories"]) == 0.5


def test_a_run_trains_with_both_plugins(tmp_path: Path, tiny_model_dir: Path) -> None:
    objective = {"type": "custom", "import_path": f"{PLUGINS}:ClippedRLOO", "params": {"max_advantage": 0.5}}
    stage = {"type": "custom", "import_path": f"{PLUGINS}:MaxRatioRejection"}
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=2, tool=False,
                            extra={"algo": {"objective": objective, "corrections": [stage], "group_size": 4}})
    result = _vcpo("train", str(config), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2]
    assert all("correction/max_ratio_reject/rejected_trajectories" in r and math.isfinite(r["grad/norm"])
               for r in records)


@pytest.mark.parametrize(("override", "says"), [
    (f"algo.objective.import_path={PLUGINS}:Nope", f"module '{PLUGINS}' has no dataclass 'Nope'"),
    ("algo.objective.import_path=no_such_package.mod:X", "cannot import module 'no_such_package.mod'"),
    (f"algo.objective.import_path={PLUGINS}:MaxRatioRejection", "MaxRatioRejection is no objective"),
    ("algo.objective.params={max_adv: 1}", "ClippedRLOO has no parameter(s) ['max_adv']; it takes:"),
    (f"algo.corrections=[{{type: custom, import_path: '{PLUGINS}:MaxRatioRejection', "
     "params: {upper: 0.5}}]", "upper=0.5 must be > 1"),
])
def test_a_bad_plugin_is_refused_naming_the_file_the_field_and_the_fix(override: str, says: str) -> None:
    result = _vcpo("config", "check", str(EXAMPLE / "run.yaml"), override)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "examples/custom_algorithm/run.yaml" in result.stderr and says in result.stderr, result.stderr


def test_a_truncation_under_an_objective_that_corrects_itself_is_refused() -> None:
    algo = AlgoConfig.model_validate({"objective": {"type": "vcpo"}, "corrections": [
        {"type": "custom", "import_path": "vcpo.corrections:TokenTruncation", "params": {"cap": 2.0}}]})
    with pytest.raises(PluginError, match="does not take token weights"):
        check_algorithm(algo)
