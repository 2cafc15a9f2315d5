"""Inference engines behind one protocol and the Trajectory contract. Also the default-model loader
(shared by engines and learners, so it lives at the lowest layer that both may import).

May import: `vcpo`."""

from rollout.base import InferenceEngine
from rollout.engines.factory import build_engine, choose_backend, start_engine, vllm_unavailable_reason
from rollout.errors import (
    EngineError,
    EngineOOM,
    EngineTimeout,
    EngineUnavailable,
    GenerationAborted,
    InvalidRequest,
    MalformedResponse,
    UnsupportedOperation,
    WeightLoadError,
)
from rollout.fakes import ScriptedEngine, ScriptedReply
from rollout.settings import (
    AutoEngineSettings,
    EngineSettings,
    HFEngineSettings,
    OpenAIEngineSettings,
    SGLangEngineSettings,
    SGLangLaunchSettings,
    VLLMEngineSettings,
)
from rollout.trajectory import TaskInfo, Trajectory, TrajectoryBuilder, TrajectoryTimings, TrajectoryVersions
from rollout.types import FinishReason, GenerationRequest, GenerationResult, GenerationTimings, SamplingParams

__all__ = [
    "AutoEngineSettings",
    "EngineError",
    "EngineOOM",
    "EngineSettings",
    "EngineTimeout",
    "EngineUnavailable",
    "FinishReason",
    "GenerationAborted",
    "GenerationRequest",
    "GenerationResult",
    "GenerationTimings",
    "HFEngineSettings",
    "InferenceEngine",
    "InvalidRequest",
    "MalformedResponse",
    "OpenAIEngineSettings",
    "SGLangEngineSettings",
    "SGLangLaunchSettings",
    "SamplingParams",
    "ScriptedEngine",
    "ScriptedReply",
    "TaskInfo",
    "Trajectory",
    "TrajectoryBuilder",
    "TrajectoryTimings",
    "TrajectoryVersions",
    "UnsupportedOperation",
    "VLLMEngineSettings",
    "WeightLoadError",
    "build_engine",
    "choose_backend",
    "start_engine",
    "vllm_unavailable_reason",
]
