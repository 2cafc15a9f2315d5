"""Shared fixtures and markers. GPU tests skip with a reason when no CUDA device is present."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    reason = "needs a CUDA device; none is visible (torch.cuda.is_available() is False)"
    skip_gpu = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def shared_data() -> Path:
    """The public benchmark files beside the repo (../shared/data); skips when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared benchmark data not found at {SHARED_DATA} (CI provides ../shared/data)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """A persistent, git-ignored cache of converted models inside the repo (.cache/models), so the
    one-time GGUF conversion of the default model is paid once per checkout, not per test."""
    path = REPO_ROOT / ".cache" / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def default_model_dir(model_cache_dir: Path) -> Path:
    """The default model (SmolLM2-135M-Instruct) as a safetensors directory; skips without it."""
    from rollout.models import ModelLoadError, ensure_default_model

    try:
        return ensure_default_model(model_cache_dir)
    except ModelLoadError as exc:
        pytest.skip(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (tied embeddings) with the byte tokenizer, as an HF directory."""
    from rollout.tiny import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))
