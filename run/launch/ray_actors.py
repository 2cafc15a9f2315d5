"""The Ray actors of launcher=ray, as plain classes (`ray.remote` wraps them at launch, so importing
this module needs no Ray): `RolloutWorker` (an engine plus its agent loops), `LearnerRank` (a
learner), `SandboxActor` (the task's tool) and `RemoteTool` (the `Tool` protocol over sandbox actors).
Each wraps the object local mode uses; `run/launch/ray_launcher.py` places and drives them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from configs.schema import RunConfig
from configs.task_schema import TaskConfig
from learner.backends.torch_learner import StepInput
from learner.distributed.weight_transport import (
    WeightSpec,
    broadcast_weights,
    pack_weights,
    receive_weights,
    unpack_weights,
    weight_specs,
)
from rollout.engines.weight_group import WeightGroup
from rollout.manager import GroupTicket, RunGroup
from rollout.types import GenerationRequest, GenerationResult
from tools.base import DEFAULT_CODE_FENCE, ToolCall, ToolResult, code_fence_of
from tools.registry import resolve_tool_class


class RayLaunchError(RuntimeError):
    """The cluster cannot run this layout (missing resources, an actor that cannot start, a timeout)."""


class StaleWeights(RuntimeError):
    """A rollout worker (restarted) does not hold the run's current weights yet."""


def ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise RayLaunchError('launcher=ray needs Ray: pip install "vcpo[ray]" (ray==2.60.0)') from None
    return ray


@dataclass(frozen=True)
class WorkerSpec:
    """What a rollout worker needs to build its runtime (pickled to the actor)."""

    task: TaskConfig
    task_path: Path
    model_path: str
    cache_dir: Path
    settings: Any
    group_size: int
    seed: int
    sandboxes: tuple[Any, ...] = ()
    """SandboxActor handles; empty = the worker builds its task's tool itself."""
    torch_threads: int = 1


@dataclass(frozen=True)
class WeightsHandle:
    """Weights of one version in the object store. The ref is wrapped in a tuple so Ray passes the
    reference to the actor instead of resolving it in the call."""

    version: int
    refs: tuple[Any, ...]


@dataclass(frozen=True)
class GroupResult:
    trajectories: list[bytes]
    """msgpack of each trajectory (`Trajectory.to_msgpack`)."""
    reward_errors: int
    """The worker's running total of failed reward calls."""
    incarnation: str
    """Changes when Ray restarts the actor (pid@host)."""


def _incarnation() -> str:
    return f"{os.getpid()}@{socket.gethostname()}"


class RolloutWorker:
    """One engine plus its agent loops; the weights it serves arrive by handle or broadcast."""

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(spec.torch_threads)
        self.spec = spec
        self._stack = contextlib.AsyncExitStack()
        self._runtime: Any = None
        self._run_group: RunGroup | None = None
        self._ready_lock = asyncio.Lock()
        self._weights_lock = asyncio.Lock()
        self._group: WeightGroup | None = None

    async def _ready(self) -> Any:
        async with self._ready_lock:
            if self._runtime is None:
                from rollout.models import load_tokenizer, resolve_model
                from run.train.wiring import task_runtime

                spec = self.spec
                resolved = resolve_model(spec.model_path, spec.cache_dir)
                tokenizer = load_tokenizer(spec.model_path, spec.cache_dir)
                task = spec.task.model_copy(update={"tool": None}) if spec.sandboxes else spec.task
                runtime = await self._stack.enter_async_context(task_runtime(
                    task, spec.task_path, model_dir=resolved.name_or_path, tokenizer=tokenizer,
                    settings=spec.settings, which="train"))
                if spec.sandboxes:
                    runtime.task, runtime.tool = spec.task, RemoteTool(
                        list(spec.sandboxes), code_fence_of(resolve_tool_class(spec.task.tool["type"])))
                self._run_group = runtime.group_runner(spec.group_size, spec.seed)
                self._runtime = runtime
        return self._runtime

    async def start(self) -> dict[str, Any]:
        runtime = await self._ready()
        return {"version": runtime.engine.version, "skipped_samples": runtime.skipped_samples,
                "incarnation": _incarnation()}

    def incarnation(self) -> str:
        return _incarnation()

    async def run_group(self, ticket: GroupTicket, weights: WeightsHandle | None,
                        min_version: int) -> GroupResult:
        """The group's trajectories, generated at `weights` (loaded first if newer than the engine's)."""
        runtime = await self._ready()
        if weights is not None:
            await self.load_handle(weights)
        if runtime.engine.version < min_version:  # restarted since the last broadcast: ask for a copy
            raise StaleWeights(f"serving version {runtime.engine.version}, the run is at {min_version}")
        assert self._run_group is not None
        trajectories = await self._run_group(ticket)
        return GroupResult([t.to_msgpack() for t in trajectories], runtime.reward_errors, _incarnation())

    async def generate(self, request: GenerationRequest, weights: WeightsHandle | None,
                       min_version: int) -> GenerationResult:
        """One generation on this worker's engine at `min_version` or newer (the driver's evaluations)."""
        runtime = await self._ready()
        if weights is not None:
            await self.load_handle(weights)
        if runtime.engine.version < min_version:
            raise StaleWeights(f"serving version {runtime.engine.version}, the run is at {min_version}")
        return await runtime.engine.generate(request)

    async def load_handle(self, weights: WeightsHandle) -> int:
        """Load `weights` unless this engine already serves that version or a newer one."""
        runtime = await self._ready()
        async with self._weights_lock:
            if runtime.engine.version < weights.version:
                named = unpack_weights(await weights.refs[0])
                await _swap(runtime.engine, named, weights.version)
        return runtime.engine.version

    async def join_group(self, address: str, port: int, world_size: int, rank: int, name: str,
                         backend: str, timeout_s: float) -> None:
        await self._ready()
        if self._group is not None:
            with contextlib.suppress(Exception):
                self._group.destroy()
        self._group = await asyncio.to_thread(WeightGroup.join, backend, address, port, world_size, rank,
                                              name, timeout_s)

    async def receive(self, specs: list[WeightSpec], version: int, bucket_mb: int, device: str) -> int:
        runtime = await self._ready()
        if self._group is None:
            raise RayLaunchError("receive() before join_group()")
        async with self._weights_lock:
            named = await asyncio.to_thread(receive_weights, self._group, specs, bucket_mb, device)
            await _swap(runtime.engine, named, version)
        return runtime.engine.version

    async def close(self) -> None:
        await self._stack.aclose()
        self._runtime = None


async def _swap(engine: Any, named: list[tuple[str, Tensor]], version: int) -> None:
    """Local mode's weight swap (`RolloutManager.sync_weights`): pause at a step boundary, load, resume."""
    await engine.pause()
    try:
        await engine.load_weights(named, version)
    finally:
        await engine.resume()


@dataclass(frozen=True)
class LearnerSpec:
    config: RunConfig
    task: TaskConfig
    cache_dir: Path
    torch_threads: int = 1


class LearnerRank:
    """One learner rank (the torch learner: rank 0 of 1; Megatron: one rank of its TP × PP × DP grid)."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, master: tuple[str, int] | None) -> None:
        torch.set_num_threads(spec.torch_threads)
        if world_size > 1 and master is not None:  # torch.distributed's env:// rendezvous for the ranks
            os.environ.update(MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK="0")
        from run.train.learner_setup import build_learner

        self.rank = rank
        self.learner = build_learner(spec.config, spec.task, spec.cache_dir)
        self._group: WeightGroup | None = None

    def step(self, batch: StepInput) -> dict[str, Any]:
        from run.train.step_resources import step_and_trim

        return step_and_trim(self.learner, batch)

    def current_weights(self) -> WeightsHandle | None:
        """Rank 0: the current weights labelled with their version (a restarted worker's catch-up)."""
        refs = self.weights_refs()
        return WeightsHandle(int(self.learner.step_count), refs) if refs else None

    def weights_refs(self) -> tuple[Any, ...]:
        """Rank 0: the current weights in the object store (every rank takes part in gathering them)."""
        packed = pack_weights(self.learner.named_weights())
        return (ray_module().put(packed),) if self.rank == 0 else ()

    def specs(self) -> list[WeightSpec]:
        return weight_specs(self.learner.named_weights())

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.learner.load_state_dict(state)

    def save_pretrained(self, path: str) -> None:
        self.learner.save_pretrained(Path(path))

    def free_port(self) -> tuple[str, int]:
        return node_ip(), free_port()

    def join_group(self, address: str, port: int, world_size: int, name: str, backend: str,
                   timeout_s: float) -> None:
        if self._group is not None:
            with contextlib.suppress(Exception):
                self._group.destroy()
        self._group = WeightGroup.join(backend, address, port, world_size, 0, name, timeout_s)

    def broadcast(self, bucket_mb: int) -> int:
        """Rank 0 sends; the other ranks only take part in gathering their shards (TP export)."""
        if self.rank != 0:
            for _ in self.learner.named_weights():
                pass
            return 0
        if self._group is None:
            raise RayLaunchError("broadcast() before join_group()")
        return broadcast_weights(self._group, self.learner.named_weights(), bucket_mb, self.learner.device)


class SandboxActor:
    """The task's tool (e.g. the bubblewrap Python sandbox) serving every rollout worker."""

    def __init__(self, tool_spec: Any) -> None:
        self.tool_spec = tool_spec
        self._stack = contextlib.AsyncExitStack()
        self._tool: Any = None
        self._lock = asyncio.Lock()
        self._sessions: dict[str, Any] = {}
        self._next = 0

    async def _ready(self) -> Any:
        async with self._lock:
            if self._tool is None:
                from tools.registry import build_tool

                self._tool = await self._stack.enter_async_context(build_tool(self.tool_spec))
        return self._tool

    async def run(self, call: ToolCall) -> ToolResult:
        return await (await self._ready()).run(call)

    async def open_session(self) -> str:
        tool = await self._ready()
        self._next += 1
        key = f"s{self._next}"
        stack = contextlib.AsyncExitStack()
        self._sessions[key] = (stack, await stack.enter_async_context(tool.session()))
        return key

    async def session_run(self, key: str, call: ToolCall) -> ToolResult:
        return await self._sessions[key][1].run(call)

    async def close_session(self, key: str) -> None:
        stack, _ = self._sessions.pop(key, (None, None))
        if stack is not None:
            await stack.aclose()

    async def close(self) -> None:
        for key in list(self._sessions):
            await self.close_session(key)
        await self._stack.aclose()


class RemoteTool:
    """The `Tool` protocol over sandbox actors: calls go to the least busy one; a session stays on one."""

    name = "remote"

    def __init__(self, actors: list[Any], code_fence: str = DEFAULT_CODE_FENCE) -> None:
        self.actors = actors
        self._busy = [0] * len(actors)
        self.code_fence = code_fence
        """The fence language of the tool the actors run (the agent loop reads it, `code_fence_of`)."""

    async def __aenter__(self) -> RemoteTool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    @contextlib.contextmanager
    def _lease(self) -> Iterator[Any]:
        index = min(range(len(self.actors)), key=self._busy.__getitem__)
        self._busy[index] += 1
        try:
            yield self.actors[index]
        finally:
            self._busy[index] -= 1

    async def run(self, call: ToolCall) -> ToolResult:
        with self._lease() as actor:
            return await actor.run.remote(call)

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[Any]:
        with self._lease() as actor:
            key = await actor.open_session.remote()
            try:
                yield _RemoteSession(actor, key)
            finally:
                await actor.close_session.remote(key)


@dataclass
class _RemoteSession:
    actor: Any
    key: str

    async def run(self, call: ToolCall) -> ToolResult:
        return await self.actor.session_run.remote(self.key, call)


def node_ip() -> str:
    with contextlib.suppress(Exception):
        return ray_module().util.get_node_ip_address()
    return "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])
