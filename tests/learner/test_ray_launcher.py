"""launcher=ray on a local Ray cluster (this machine, 2 CPUs) with a tiny random model: the real HF
engine in rollout actors, the real bubblewrap sandbox in a sandbox actor, the real torch learner in a
learner actor. Same metrics and lag guarantee as local mode, clean shutdown, and a killed rollout
actor is restarted while its in-flight group is regenerated."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml

from configs.loader import load_config
from configs.schema import RayConfig, RunConfig
from learner.checkpointing import latest_checkpoint
from learner.metric_names import REQUIRED_EVERY_STEP
from learner.metrics_log import read_metrics
from learner.ray_weights import pack_weights, plan_buckets, unpack_weights, weight_specs
from tests.learner.test_train_e2e import _vcpo, _write_configs

ray = pytest.importorskip("ray", reason="launcher=ray needs Ray: pip install 'vcpo[ray]' (setup.sh does)")
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")

MARKER_ENV = "VCPO_TEST_GROUP_MARKER"


def slow_digit_fraction(response: str, sample: object) -> float:
    """The e2e reward, after announcing (a marker file) that a group is in flight and lingering 1.5 s,
    so a test can kill the rollout actor while it holds a group."""
    marker = os.environ.get(MARKER_ENV)
    if marker:
        Path(marker).write_text(str(os.getpid()))
        time.sleep(1.5)
    return sum(c.isdigit() for c in response) / max(1, len(response))


def test_weights_round_trip_through_packing_and_buckets() -> None:
    named = [("a", torch.randn(3, 4)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.arange(6.0))]
    back = dict(unpack_weights(pack_weights(named)))
    for name, tensor in named:
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
    buckets = plan_buckets(weight_specs(named), bucket_mb=1)
    assert [b.dtype for b in buckets] == ["float32", "bfloat16", "float32"]  # a new bucket per dtype change
    big = [(f"w{i}", torch.zeros(512, 512)) for i in range(3)]  # 1 MB each
    assert [len(b.members) for b in plan_buckets(weight_specs(big), bucket_mb=2)] == [2, 1]


def test_layout_errors_name_the_field_and_the_fix(tmp_path: Path) -> None:
    from learner.ray_launcher import RayLaunchError, check_layout

    config = RunConfig(launcher="ray", ray=RayConfig(learner_ranks=2))
    with pytest.raises(RayLaunchError, match=r"ray\.learner_ranks=1"):
        check_layout(config)
    config = RunConfig(launcher="ray", ray=RayConfig(placement="colocated", rollout_workers=2))
    with pytest.raises(RayLaunchError, match=r"ray\.rollout_workers equal to ray\.learner_ranks"):
        check_layout(config)


def _ray_overrides(**ray_settings: object) -> list[str]:
    return ["launcher=ray", *(f"ray.{key}={value}" for key, value in ray_settings.items())]


@needs_bwrap
@pytest.mark.timeout(400)
def test_ray_train_matches_local_metrics_and_lag_bound(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two rollout actors + a sandbox actor + a learner actor, object-store weights, k = 1."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3)
    overrides = _ray_overrides(num_cpus=2, rollout_workers=2, rollout_cpus=0.5, learner_cpus=0.5,
                               sandbox_workers=1, sandbox_cpus=0.5)
    result = _vcpo("train", str(config), "--no-progress", *overrides, timeout=380)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3]
    for record in records:
        missing = [key for key in REQUIRED_EVERY_STEP if key not in record]
        assert not missing, missing
        assert record["staleness/max"] <= 1
        assert record["rollout/tool_calls_mean"] >= 0 and record["rollout/regenerated_groups"] == 0
    assert records[-1]["policy_version"] == 3
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step_000003"
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
    # clean shutdown: the run started its own cluster and stopped it (no raylet/actor left behind)
    assert "Traceback" not in result.stderr


@needs_bwrap
@pytest.mark.timeout(400)
def test_killed_rollout_actor_is_restarted_and_its_group_regenerated(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """One rollout actor, broadcast weights (the torch.distributed path: gloo here, NCCL on GPUs); the
    actor is killed after the first broadcast while a group is in flight; Ray restarts it, the group is
    regenerated (the restarted actor first loads the current weights from the object store), the
    broadcast group is re-formed for the next push, and every step still honours the lag bound."""
    from learner.compose import engine_settings, load_task
    from learner.ray_launcher import run_training_ray

    config_path = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3,
                                 reward="slow_digit_fraction", tool=False)
    task_file = tmp_path / "task.yaml"
    task_data = yaml.safe_load(task_file.read_text())
    task_data["reward"]["function"] = "tests.learner.test_ray_launcher:slow_digit_fraction"
    task_file.write_text(yaml.safe_dump(task_data))
    marker = tmp_path / "group-in-flight"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    config = load_config(config_path, RunConfig, _ray_overrides(
        num_cpus=2, rollout_workers=1, rollout_cpus=1, learner_cpus=1, weight_transport="broadcast"))
    task, task_path = load_task(config.task, config.task_overrides)
    settings = engine_settings(config.engine, str(config_path))

    async def kill_once_a_group_is_in_flight() -> None:
        metrics = tmp_path / "run" / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().strip()):  # after step 1 and its broadcast …
            await asyncio.sleep(0.05)
        marker.unlink(missing_ok=True)
        while not marker.exists():  # … while a group is generating
            await asyncio.sleep(0.05)
        name = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].endswith("-rollout-0"))
        ray.kill(ray.get_actor(name, namespace="vcpo"), no_restart=False)

    async def main() -> None:
        killer = asyncio.create_task(kill_once_a_group_is_in_flight())
        await run_training_ray(config, task, task_path, settings, tmp_path / "cache", tmp_path / "run",
                               progress=False)
        assert killer.done()
        killer.result()  # the kill happened (and raised nothing)

    with caplog.at_level(logging.INFO, logger="learner.ray_launcher"):
        asyncio.run(main())
    assert "vcpo-weights-2" in caplog.text  # the broadcast group was re-formed with the new actor
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3]
    assert records[-1]["rollout/regenerated_groups"] >= 1
    assert all(r["staleness/max"] <= 1 for r in records)
    assert not ray.is_initialized()  # the run's own cluster is shut down
