"""A vLLM worker extension for in-place weight loads (`worker_extension_cls=` of the engine args).

vLLM mixes this class into its worker, so these methods run inside the worker with `self` being
the worker; the engine calls them by name through `collective_rpc`. In-process (our default) the
call is direct and tensors pass by reference; with a multiprocess executor they are pickled, so
use `vcpo_load_weights_from_path` there.

The tied-lm_head fix: on CPU, vLLM pre-packs the output layer's GEMM weight once at
load. With tied embeddings, `reload_weights` updates the embedding but skips `lm_head`, so the
packed copy goes stale and logprobs stop matching the learner. Re-running the lm_head's
`process_weights_after_loading` re-packs it from the (shared, updated) weight; it is idempotent
and a no-op on GPUs.

Imports nothing from vLLM at module level, so importing it is free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


class VcpoWorkerExtension:
    """Weight-sync methods for vLLM workers (mixed into the worker class by vLLM)."""

    # Attributes provided by the vLLM worker this class is mixed into.
    model_runner: Any
    reload_weights: Any

    def vcpo_load_weights(self, named_tensors: list[tuple[str, Tensor]]) -> None:
        """Load HF-named tensors in place (fused qkv / gate-up handled by the model's loader)."""
        self.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        self._vcpo_repack_tied_lm_head()

    def vcpo_load_weights_from_path(self, path: str) -> None:
        """Load a directory of HF-named *.safetensors in place (multiprocess executors)."""
        self.reload_weights(weights_path=path, is_checkpoint_format=True)
        self._vcpo_repack_tied_lm_head()

    def vcpo_weight_sum(self) -> float:
        """Sum of all parameters in fp64: a cheap fingerprint for tests."""
        return float(sum(p.double().sum().item() for p in self.model_runner.model.parameters() if p.numel()))

    def _vcpo_repack_tied_lm_head(self) -> None:
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False)
        if tied and lm_head is not None and getattr(lm_head, "quant_method", None) is not None:
            lm_head.quant_method.process_weights_after_loading(lm_head)
