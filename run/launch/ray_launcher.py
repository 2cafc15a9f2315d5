"""`launcher: ray` — the same training loop with rollout workers, learner ranks and sandboxes as Ray actors.

Layout (docs/architecture.md's processes, spread over a cluster):

* The driver (the `vcpo train` process) runs `run.train.trainer.train` unchanged: the rollout manager
  (lag bound, admission, retries, checkpoint state) and the step loop stay here, so every guarantee
  of local mode holds by construction.
* `RolloutWorker` actors (run/launch/ray_actors.py) each own one engine and the agent loops of local
  mode (a `TaskRuntime` built by `run.train.wiring.task_runtime`); the manager's `run_group`
  dispatches a group to the least-loaded worker, and its trajectories come back through the object
  store (msgpack).
* `LearnerRank` actors each own a learner built by `run.train.learner_setup.build_learner`; the driver's
  `RayLearnerGroup` calls every rank and keeps rank 0's metrics.
* `SandboxActor`s (optional) run the task's tool for every worker (`RemoteTool`).

Why not a trajectory queue actor: admission control needs to know which slot each group fills and
to regenerate exactly the groups a dead worker held; a per-group call returns its result (or the
actor's death) to the one waiter that owns the ticket, with one object-store hop and no second
bookkeeping of in-flight work.

Weights: after each step the learner's weights are put once in the object store and every worker
loads them (`weight_transport: object_store`), or learner rank 0 broadcasts them to the workers over
a torch.distributed group (`broadcast`: NCCL on GPUs, gloo on CPU), bucketed. Every call has a
timeout. A dead rollout worker is restarted by Ray (`max_actor_restarts`); its in-flight groups are
regenerated on a live worker with the same prompts, and it serves again once it holds the current
weights (object store: at once; broadcast: from the next sync, when the group is re-formed).
Placement: `separate` puts rollout and learner actors in disjoint placement groups; `colocated` puts
learner rank i and rollout worker i in one bundle. A request the cluster cannot place (e.g. GPUs on
a CPU-only cluster) fails at once naming the resource, instead of waiting forever.

Requires `pip install "vcpo[ray]"`. Assumes `run_dir` and the model path are on storage every node
sees (checkpoints and the exported model are written by the learner's rank 0 and the driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from configs.schema import RayConfig, RunConfig
from configs.task_schema import TaskConfig
from learner.backends.torch_learner import StepInput
from learner.distributed.weight_transport import WeightSpec, pack_weights, unpack_weights
from rollout.errors import EngineUnavailable
from rollout.manager import GroupTicket, RunGroup
from rollout.trajectory import Trajectory
from rollout.types import GenerationRequest, GenerationResult
from run.launch.ray_actors import (
    GroupResult,
    LearnerRank,
    LearnerSpec,
    RayLaunchError,
    RemoteTool,
    RolloutWorker,
    SandboxActor,
    StaleWeights,
    WeightsHandle,
    WorkerSpec,
    free_port,
    node_ip,
    ray_module,
)
from run.observability.live_activity import heartbeat
from tools.base import code_fence_of
from tools.registry import resolve_tool_class

log = logging.getLogger(__name__)

NAMESPACE = "vcpo"


# --- the driver's side ---------------------------------------------------------------------------


class RemoteWeights:
    """What `RayLearnerGroup.named_weights()` returns: the learner's current weights, left where they
    are until the rollout pool picks a transport. Iterating fetches them (any other consumer)."""

    def __init__(self, learners: RayLearnerGroup) -> None:
        self.learners = learners

    def object_refs(self) -> tuple[Any, ...]:
        return self.learners.call_all("weights_refs")[0]

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(unpack_weights(ray_module().get(self.object_refs()[0])))


@dataclass
class _WorkerState:
    handle: Any
    incarnation: str = ""
    in_flight: int = 0
    reward_errors: dict[str, int] = field(default_factory=dict)
    """Running total per incarnation (a restarted actor counts from 0 again)."""
    down: bool = False
    """Died and being restarted by Ray (a probe clears it)."""
    dead: bool = False
    """Out of restarts: never used again."""
    stale: bool = False
    """Restarted (or missed a push) and maybe not holding the current weights: the next group sent to it
    carries an object-store copy (broadcast transport; the object-store transport always sends one)."""


class RayRolloutPool:
    """The rollout side of `train` for launcher=ray: the weight target and `run_group` over workers."""

    def __init__(self, workers: list[Any], ray_config: RayConfig, task: TaskConfig, tokenizer: Any,
                 learners: RayLearnerGroup, skipped_samples: int) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.config = ray_config
        self.learners = learners
        self.workers = [_WorkerState(handle) for handle in workers]
        self.skipped_samples = skipped_samples
        self.regenerated_groups = 0
        self._weights: WeightsHandle | None = None
        self._version = 0
        self._changed = asyncio.Condition()
        self._group_generation = 0
        self._specs: list[WeightSpec] | None = None
        self._group_incarnations: list[str] | None = None
        self._probes: set[asyncio.Task[None]] = set()

    # RolloutRuntime
    @property
    def engine(self) -> RayRolloutPool:
        return self

    def group_runner(self, group_size: int, seed: int) -> RunGroup:
        return self.run_group

    def counters(self) -> dict[str, float]:
        errors = sum(sum(w.reward_errors.values()) for w in self.workers)
        return {"rollout/skipped_samples": self.skipped_samples, "rollout/reward_errors": errors,
                "rollout/regenerated_groups": self.regenerated_groups}

    def live_counts(self) -> None:
        """The episodes run in the rollout actors' processes: the live line shows only the phase."""
        return None

    # WeightTarget: each worker pauses itself around its own reload
    async def pause(self) -> None:
        return None

    async def resume(self) -> None:
        return None

    @property
    def version(self) -> int:
        return self._version

    async def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        if self.config.weight_transport == "broadcast" and isinstance(named_tensors, RemoteWeights):
            await self._broadcast(version)
        else:
            if isinstance(named_tensors, RemoteWeights):  # the learner packs and puts them itself
                refs = await asyncio.to_thread(named_tensors.object_refs)
            else:
                refs = (ray_module().put(pack_weights(named_tensors)),)
            self._weights = WeightsHandle(version, refs)
            pushes = [self._call(w, "load_handle", self._weights) for w in self.workers]
            results = await asyncio.gather(*pushes, return_exceptions=True)
            self._log_dead(results)
        async with self._changed:
            self._version = version
            self._changed.notify_all()

    async def _broadcast(self, version: int) -> None:
        """Learner rank 0 → every worker over one group; re-formed when a worker was restarted."""
        if self._specs is None:
            self._specs = await asyncio.to_thread(lambda: self.learners.call_all("specs")[0])
        async with self._changed:  # a restarting worker must be back to take part (dead ones never)
            await asyncio.wait_for(self._changed.wait_for(lambda: not any(w.down for w in self.workers)),
                                   self.config.start_timeout_s)
        members = [w for w in self.workers if not w.dead]
        incarnations = await asyncio.gather(*(self._call(w, "incarnation") for w in members),
                                            return_exceptions=True)
        if any(isinstance(i, BaseException) for i in incarnations):
            raise RayLaunchError(f"a rollout worker went down during a weight broadcast: {incarnations}")
        if incarnations != self._group_incarnations:  # first sync, or a member was restarted
            await self._form_group(members)
            self._group_incarnations = list(incarnations)
        config = self.config
        device = "cuda" if config.rollout_gpus > 0 else "cpu"
        sends = [_await_ref(rank.broadcast.remote(config.bucket_mb)) for rank in self.learners.ranks]
        received = [self._call(w, "receive", self._specs, version, config.bucket_mb, device) for w in members]
        await asyncio.wait_for(asyncio.gather(*sends, *received), config.call_timeout_s)
        for worker in members:
            worker.stale = False

    async def _form_group(self, members: list[_WorkerState]) -> None:
        self._group_generation += 1
        name = f"vcpo-weights-{self._group_generation}"
        rank0 = self.learners.ranks[0]
        address, port = await _await_ref(rank0.free_port.remote())
        backend = "nccl" if self.config.rollout_gpus > 0 and self.config.learner_gpus > 0 else "gloo"
        world = len(members) + 1
        timeout = self.config.start_timeout_s
        log.info("ray: forming weight group %s (%s, %d ranks at %s:%d)", name, backend, world, address, port)
        joins = [_await_ref(rank0.join_group.remote(address, port, world, name, backend, timeout))]
        joins += [self._call(w, "join_group", address, port, world, i + 1, name, backend, timeout)
                  for i, w in enumerate(members)]
        await asyncio.wait_for(asyncio.gather(*joins), timeout + 30)

    async def _call(self, worker: _WorkerState, method: str, *args: Any) -> Any:
        ref = getattr(worker.handle, method).remote(*args)
        try:
            return await asyncio.wait_for(_await_ref(ref), self.config.call_timeout_s)
        except asyncio.CancelledError:
            ray_module().cancel(ref)
            raise
        except TimeoutError:
            ray_module().cancel(ref)
            raise RayLaunchError(f"rollout worker call {method} took over call_timeout_s="
                                 f"{self.config.call_timeout_s:.0f} s") from None

    def _log_dead(self, results: list[Any]) -> None:
        for worker, result in zip(self.workers, results, strict=True):
            if isinstance(result, BaseException):
                worker.stale = True
                log.warning("ray: a rollout worker missed a weight push (%s); it catches up before it "
                            "generates again", type(result).__name__)

    async def _weights_for(self, worker: _WorkerState) -> WeightsHandle | None:
        """What a call to `worker` carries: the object-store handle (that transport), or under broadcast a
        copy only for a worker that may have missed a push."""
        if self.config.weight_transport != "broadcast":
            return self._weights
        return await asyncio.to_thread(self.learners.current_weights) if worker.stale else None

    # InferenceEngine, for the driver's evaluations: each generation on a live worker at the run's version
    name = "ray"

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """`request` on the least-loaded live worker at the current version; another one if it dies."""
        ray = ray_module()
        stale_retries = 0
        while True:
            worker = await self._live_worker()
            worker.in_flight += 1
            try:
                weights = await self._weights_for(worker)
                result: GenerationResult = await self._call(worker, "generate", request, weights,
                                                            self._version)
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, StaleWeights):
                    raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None
                stale_retries += 1
                if stale_retries > 2:
                    raise EngineUnavailable("ray", f"a rollout worker cannot catch up: {exc.cause}") from None
                worker.stale = True
                continue
            except ray.exceptions.RayActorError as exc:
                worker.stale = True
                log.warning("ray: rollout worker died during an evaluation's generation (%s); retrying it "
                            "on another", type(exc).__name__)
                await self._mark_down(worker, dead=isinstance(exc, ray.exceptions.ActorDiedError))
                continue
            finally:
                worker.in_flight -= 1
            worker.stale = False
            return result

    async def run_group(self, ticket: GroupTicket) -> list[Trajectory]:
        """Run the group on the least-loaded live worker; regenerate it elsewhere if that actor dies."""
        ray = ray_module()
        regenerated, stale_retries = False, 0
        while True:
            worker = await self._live_worker()
            worker.in_flight += 1
            try:
                weights = await self._weights_for(worker)
                result: GroupResult = await self._call(worker, "run_group", ticket, weights, self._version)
            except ray.exceptions.RayTaskError as exc:
                if not isinstance(exc.cause, StaleWeights):  # the group failed: raise it as local mode does
                    raise (exc.cause if isinstance(exc.cause, Exception) else exc) from None
                stale_retries += 1
                if stale_retries > 2:  # a copy was sent and still not loaded: a broken weight path
                    raise EngineUnavailable("ray", f"a rollout worker cannot catch up: {exc.cause}") from None
                worker.stale = True  # restarted while idle (broadcast): retry with an object-store copy
                continue
            except ray.exceptions.RayActorError as exc:  # died (Ray restarts it unless out of restarts)
                worker.stale = True
                if not regenerated:
                    regenerated = True
                    self.regenerated_groups += 1
                    log.warning("ray: rollout worker died with group %d in flight (%s); regenerating it",
                                ticket.group_index, type(exc).__name__)
                await self._mark_down(worker, dead=isinstance(exc, ray.exceptions.ActorDiedError))
                continue
            finally:
                worker.in_flight -= 1
            worker.stale = False
            worker.incarnation = result.incarnation
            worker.reward_errors[result.incarnation] = result.reward_errors
            return [Trajectory.from_msgpack(blob) for blob in result.trajectories]

    async def _live_worker(self) -> _WorkerState:
        """The least-loaded worker that is up; waits (bounded) while every one is restarting."""
        def usable() -> list[_WorkerState]:
            return [w for w in self.workers if not w.down and not w.dead]

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(
                    lambda: bool(usable()) or all(w.dead for w in self.workers)), self.config.start_timeout_s)
            except TimeoutError:
                raise EngineUnavailable("ray", f"no rollout worker came back within ray.start_timeout_s="
                                        f"{self.config.start_timeout_s:.0f} s") from None
            if not usable():
                raise EngineUnavailable("ray", "every rollout worker died and Ray gave up restarting them "
                                        f"(ray.max_actor_restarts={self.config.max_actor_restarts})")
            return min(usable(), key=lambda w: w.in_flight)

    async def _mark_down(self, worker: _WorkerState, *, dead: bool) -> None:
        """Take `worker` out of rotation; a probe puts it back once Ray has restarted it."""
        async with self._changed:
            worker.dead = worker.dead or dead
            if worker.dead or worker.down:
                self._changed.notify_all()
                return
            worker.down = True
        self._probes.add(asyncio.create_task(self._probe(worker)))

    async def _probe(self, worker: _WorkerState) -> None:
        ray = ray_module()
        while True:
            try:
                await asyncio.wait_for(_await_ref(worker.handle.incarnation.remote()), 10)
                break
            except ray.exceptions.ActorDiedError:
                worker.dead = True
                break
            except (ray.exceptions.RayActorError, TimeoutError):
                await asyncio.sleep(0.5)
        async with self._changed:
            worker.down = False
            self._changed.notify_all()

    async def close(self) -> None:
        for probe in self._probes:
            probe.cancel()
        closes = [self._call(w, "close") for w in self.workers if not w.dead]
        results = await asyncio.gather(*closes, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                log.warning("ray: closing a rollout worker failed: %s", result)


async def _await_ref(ref: Any) -> Any:
    return await ref


class RayLearnerGroup:
    """The driver's learner: every call goes to all ranks; rank 0's answer is the result.

    `replicated`: the ranks are data-parallel replicas (the torch learner), identical after every step,
    so a checkpoint holds rank 0's state once and a resume hands it to every rank (any number of them).
    Otherwise (megatron) each rank holds its own shard and the checkpoint holds them all."""

    device = torch.device("cpu")
    """Where checkpoints are loaded on the driver before being sent to the ranks."""

    def __init__(self, ranks: list[Any], timeout_s: float, replicated: bool = False) -> None:
        self.ranks, self.timeout_s, self.replicated = ranks, timeout_s, replicated

    def current_weights(self) -> WeightsHandle | None:
        return self.call_all("current_weights")[0]

    def call_all(self, method: str, *args: Any) -> list[Any]:
        ray = ray_module()
        refs = [getattr(rank, method).remote(*args) for rank in self.ranks]
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            for ref in refs:
                ray.cancel(ref)
            raise RayLaunchError(f"learner call {method} took over call_timeout_s={self.timeout_s:.0f} s"
                                 ) from None

    def step(self, batch: StepInput) -> dict[str, Any]:
        return self.call_all("step", ray_module().put(batch))[0]

    def named_weights(self) -> RemoteWeights:
        return RemoteWeights(self)

    def state_dict(self) -> dict[str, Any]:
        if self.replicated:
            return {"replica": ray_module().get(self.ranks[0].state_dict.remote(), timeout=self.timeout_s)}
        return {"ranks": self.call_all("state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "replica" in state:
            ranks = [state["replica"]] * len(self.ranks)
        elif self.replicated and len(state["ranks"]) == 1:  # a one-rank run resumed data-parallel
            ranks = state["ranks"] * len(self.ranks)
        else:
            ranks = state["ranks"]
        if len(ranks) != len(self.ranks):
            raise RayLaunchError(f"the checkpoint has {len(ranks)} learner ranks, this layout "
                                 f"{len(self.ranks)}; resume with the same ray.learner_ranks")
        ray_module().get([rank.load_state_dict.remote(s) for rank, s in zip(self.ranks, ranks, strict=True)],
                   timeout=self.timeout_s)

    def save_pretrained(self, path: Path) -> None:
        self.call_all("save_pretrained", str(path))


# --- launch ----------------------------------------------------------------------------------------


def check_layout(config: RunConfig) -> None:
    """Layout errors that need no cluster (the config names the field and the fix)."""
    ray_config = config.ray
    backend = getattr(config.learner, "backend", "torch")
    if backend == "torch" and ray_config.learner_ranks > config.rollout.groups_per_step:
        raise RayLaunchError(
            f"ray.learner_ranks={ray_config.learner_ranks}: the torch learner's ranks are data-parallel "
            "replicas that each train whole groups, and a step has only "
            f"rollout.groups_per_step={config.rollout.groups_per_step}; set ray.learner_ranks ≤ "
            "rollout.groups_per_step (ideally a divisor of it)")
    if backend == "megatron":
        layout = config.learner.megatron
        world = (layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
                 * layout.context_parallel_size)
        replicas, rest = divmod(ray_config.learner_ranks, world)
        if rest or not replicas:
            raise RayLaunchError(f"ray.learner_ranks={ray_config.learner_ranks}, but learner.megatron's "
                                 f"tensor × pipeline × context parallel size is {world}: set "
                                 f"ray.learner_ranks to a multiple of {world} (the multiple is the number of "
                                 "data-parallel replicas)")
        if replicas > config.rollout.groups_per_step:
            raise RayLaunchError(f"ray.learner_ranks={ray_config.learner_ranks} makes {replicas} data-"
                                 "parallel megatron replicas, each training whole groups, but a step has "
                                 f"only rollout.groups_per_step={config.rollout.groups_per_step}; lower "
                                 "ray.learner_ranks")
    if ray_config.placement == "colocated":
        if ray_config.rollout_workers != ray_config.learner_ranks:
            raise RayLaunchError("ray.placement=colocated pairs rollout worker i with learner rank i: set "
                                 "ray.rollout_workers equal to ray.learner_ranks")
        if ray_config.rollout_gpus + ray_config.learner_gpus > 1:
            raise RayLaunchError("ray.placement=colocated shares one GPU per bundle: ray.rollout_gpus + "
                                 "ray.learner_gpus must be ≤ 1")


def _resource_needs(rc: RayConfig) -> tuple[float, float]:
    """(CPUs, GPUs) the layout reserves."""
    gpus = rc.rollout_workers * rc.rollout_gpus + rc.learner_ranks * rc.learner_gpus
    if rc.placement == "colocated":  # learner rank i and rollout worker i share one GPU
        gpus = rc.learner_ranks * (1.0 if gpus else 0.0)
    cpus = rc.rollout_workers * rc.rollout_cpus + rc.learner_ranks * rc.learner_cpus
    cpus += rc.sandbox_workers * rc.sandbox_cpus
    return cpus, gpus


def _check_resources(ray: Any, rc: RayConfig) -> None:
    """Fail at once, naming the resource, when the cluster can never place the layout."""
    total = ray.cluster_resources()
    cpus, gpus = _resource_needs(rc)
    problems = []
    if gpus > total.get("GPU", 0.0) + 1e-9:
        problems.append(f"{gpus:g} GPUs (ray.rollout_workers × ray.rollout_gpus + ray.learner_ranks × "
                        f"ray.learner_gpus) but the cluster has {total.get('GPU', 0.0):g}")
    if cpus > total.get("CPU", 0.0) + 1e-9:
        problems.append(f"{cpus:g} CPUs (rollout, learner and sandbox actors) but the cluster has "
                        f"{total.get('CPU', 0.0):g}; lower ray.rollout_cpus / ray.learner_cpus")
    if problems:
        raise RayLaunchError("the Ray cluster cannot place this layout: " + "; ".join(problems))


@contextlib.contextmanager
def ray_session(ray_config: RayConfig, run_dir: Path) -> Iterator[Any]:
    """Join (address set) or start (a local cluster) Ray for the run; shut it down on exit. A local
    cluster's session lives in a short temp dir (Unix socket paths are capped at 107 bytes) that is
    deleted on exit; if the run failed, its logs are kept in run_dir/ray-logs first."""
    ray = ray_module()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    driver_paths = [p for p in sys.path if p and Path(p).is_dir()]
    env_vars = {"PYTHONPATH": os.pathsep.join(driver_paths), "RAY_AUTH_MODE": "disabled",
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for key in ("VCPO_CACHE_DIR", "HF_HOME", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        if key in os.environ:
            env_vars[key] = os.environ[key]
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if ray_config.worker_setup_hook:
        runtime_env["worker_process_setup_hook"] = ray_config.worker_setup_hook
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "runtime_env": runtime_env, "log_to_driver": True}
    temp_dir = None
    if ray_config.address is None:
        temp_dir = tempfile.mkdtemp(prefix="vcpo-ray-")
        kwargs.update(num_cpus=ray_config.num_cpus, include_dashboard=False, _temp_dir=temp_dir)
    else:
        kwargs["address"] = ray_config.address
    started = not ray.is_initialized()
    if started:
        ray.init(**kwargs)
    failed = True
    try:
        yield ray
        failed = False
    finally:
        if started:
            ray.shutdown()
        if started and temp_dir is not None:
            if failed:
                with contextlib.suppress(OSError):
                    logs = Path(temp_dir) / "session_latest" / "logs"
                    shutil.copytree(logs, run_dir / "ray-logs", dirs_exist_ok=True)
                    log.warning("ray: the run failed; the cluster's logs are in %s", run_dir / "ray-logs")
            shutil.rmtree(temp_dir, ignore_errors=True)


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}


def _placement_groups(ray: Any, rc: RayConfig, run_name: str) -> tuple[Any, Any]:
    """(learner group, rollout group) — one shared group when colocated; waits until placed."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if rc.placement == "colocated":
        gpu = 1.0 if rc.learner_gpus or rc.rollout_gpus else 0.0
        shared = placement_group([_bundle(rc.learner_cpus + rc.rollout_cpus, gpu)] * rc.learner_ranks,
                                 strategy="PACK", name=f"{run_name}-colocated")
        groups = (shared, shared)
    else:
        groups = (placement_group([_bundle(rc.learner_cpus, rc.learner_gpus)] * rc.learner_ranks,
                                  strategy="PACK", name=f"{run_name}-learner"),
                  placement_group([_bundle(rc.rollout_cpus, rc.rollout_gpus)] * rc.rollout_workers,
                                  strategy="SPREAD", name=f"{run_name}-rollout"))
    unique = list({id(g): g for g in groups}.values())
    try:
        ray.get([g.ready() for g in unique], timeout=rc.start_timeout_s)
    except ray.exceptions.GetTimeoutError:
        for group in unique:
            remove_placement_group(group)
        raise RayLaunchError(f"the cluster did not place the actors within ray.start_timeout_s="
                             f"{rc.start_timeout_s:.0f} s (free now: {ray.available_resources()})") from None
    return groups


@dataclass
class _Actors:
    workers: list[Any]
    ranks: list[Any]
    sandboxes: list[Any]
    skipped_samples: int

    def all(self) -> list[Any]:
        return [*self.workers, *self.ranks, *self.sandboxes]


async def _start_actors(ray: Any, config: RunConfig, task: TaskConfig, task_path: Path, settings: Any,
                        cache_dir: Path, run_name: str) -> _Actors:
    """Placement, then learner ranks, sandbox actors and rollout workers; waits until all started."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    rc = config.ray
    _check_resources(ray, rc)
    learner_pg, rollout_pg = _placement_groups(ray, rc, run_name)

    def on(group: Any, index: int) -> Any:
        return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index)

    master = (node_ip(), free_port()) if rc.learner_ranks > 1 else None
    spec = LearnerSpec(config, task, cache_dir, torch_threads=max(1, int(rc.learner_cpus)))
    learner_cls = ray.remote(LearnerRank)
    ranks = [learner_cls.options(num_cpus=rc.learner_cpus, num_gpus=rc.learner_gpus,
                                 scheduling_strategy=on(learner_pg, i), name=f"{run_name}-learner-{i}")
             .remote(spec, i, rc.learner_ranks, master) for i in range(rc.learner_ranks)]
    sandboxes: list[Any] = []
    # sandbox actors run a code-fence task's one tool; function-calling tools start in each rollout worker
    if rc.sandbox_workers and task.tool is not None and task.loop.tool_format == "code_fence":
        sandbox_cls = ray.remote(SandboxActor)
        sandboxes = [sandbox_cls.options(num_cpus=rc.sandbox_cpus, max_restarts=rc.max_actor_restarts,
                                         max_task_retries=1, name=f"{run_name}-sandbox-{i}").remote(task.tool)
                     for i in range(rc.sandbox_workers)]
    worker_spec = WorkerSpec(task, task_path, config.model.path, cache_dir, settings, config.algo.group_size,
                             config.seed, tuple(sandboxes), torch_threads=max(1, int(rc.rollout_cpus)))
    worker_cls = ray.remote(RolloutWorker)
    workers = [worker_cls.options(num_cpus=rc.rollout_cpus, num_gpus=rc.rollout_gpus,
                                  scheduling_strategy=on(rollout_pg, i % len(rollout_pg.bundle_specs)),
                                  max_restarts=rc.max_actor_restarts, max_task_retries=0,
                                  name=f"{run_name}-rollout-{i}").remote(worker_spec)
               for i in range(rc.rollout_workers)]
    started = [_await_ref(w.start.remote()) for w in workers] + [_await_ref(r.specs.remote()) for r in ranks]
    try:
        infos = await asyncio.wait_for(asyncio.gather(*started), rc.start_timeout_s)
    except TimeoutError:
        for actor in [*workers, *ranks, *sandboxes]:
            ray.kill(actor, no_restart=True)
        raise RayLaunchError(f"actors did not start within ray.start_timeout_s={rc.start_timeout_s:.0f} s"
                             ) from None
    return _Actors(workers, ranks, sandboxes, int(infos[0]["skipped_samples"]))


async def run_training_ray(config: RunConfig, task: TaskConfig, task_path: Path, settings: Any,
                           cache_dir: Path, run_dir: Path, *, progress: bool = True,
                           stop_after_step: int | None = None,
                           report: Callable[[str], None] = log.info) -> Any:
    """`run_training` for launcher=ray: the same `train` loop over Ray actors (see the module docstring)."""
    from rollout.models import load_tokenizer
    from run.train.trainer import train

    check_layout(config)
    run_name = f"vcpo-{os.getpid()}-{int(time.time())}"
    tokenizer = load_tokenizer(config.model.path, cache_dir)
    with ray_session(config.ray, run_dir) as ray:
        with heartbeat(report, "starting the Ray actors (rollout workers, learner ranks, sandboxes)"):
            actors = await _start_actors(ray, config, task, task_path, settings, cache_dir, run_name)
        learners = RayLearnerGroup(actors.ranks, config.ray.call_timeout_s,
                                   replicated=config.learner.backend == "torch")
        pool = RayRolloutPool(actors.workers, config.ray, task, tokenizer, learners, actors.skipped_samples)
        try:
            async with contextlib.AsyncExitStack() as stack:
                heldout, eval_sets = await _driver_evaluators(stack, config, task, task_path, tokenizer, pool,
                                                              actors.sandboxes, run_dir)
                return await train(config, pool, learners, run_dir, progress=progress,
                                   stop_after_step=stop_after_step, heldout=heldout, eval_sets=eval_sets)
        finally:
            await pool.close()
            for sandbox in actors.sandboxes:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(_await_ref(sandbox.close.remote()), 30)
            for actor in actors.all():
                ray.kill(actor, no_restart=True)


async def _driver_evaluators(stack: contextlib.AsyncExitStack, config: RunConfig, task: TaskConfig,
                             task_path: Path, tokenizer: Any, pool: RayRolloutPool, sandboxes: list[Any],
                             run_dir: Path) -> tuple[Any, list[Any]]:
    """The run's evaluations as local mode's (run/launch/evaluators.py): the episodes run on the driver,
    each generation on a rollout worker at the evaluated version (`RayRolloutPool.generate`), each tool
    call on the sandbox actors when there are some, else on the task's tools started here."""
    from run.launch.evaluators import run_evaluators
    from run.train.wiring import remote_engine_runtime

    if not (config.trainer.eval_every or config.trainer.eval_sets):
        return None, []
    tool = None
    if sandboxes:
        tool = RemoteTool(list(sandboxes), code_fence_of(resolve_tool_class(task.tool["type"])))
    runtime = await remote_engine_runtime(stack, task, task_path, tokenizer=tokenizer, engine=pool, tool=tool)
    return await run_evaluators(stack, config, runtime, task_path, run_dir)
