"""The per-group baseline buffers `S_g` of the OPOB two-buffer gradient.

The OPOB update needs `Σ_{i∈g} (a_i − b*_g s_i) g_i`, but `b*_g` is known only once every
member's gradient norm is. Both gradient paths therefore keep `S_g = Σ_{i∈g} s_i g_i` for each
group still *open* (some member not yet back-propagated); when the group closes, `b*_g S_g` is
subtracted from the ascent direction `A = Σ a_i g_i` (`.grad` holds `−A`, so it is added there).
Memory: one parameter-sized tensor per trainable parameter per open group, allocated lazily
(only parameters that actually received an `S_g` contribution get a buffer), freed on close.
"""

from __future__ import annotations

from torch import Tensor, nn


def grad_of(param: nn.Parameter) -> Tensor:
    """`param.grad`, created as zeros first if absent (the accumulation target, like autograd's)."""
    if param.grad is None:
        param.grad = param.detach().new_zeros(param.shape)
    return param.grad


def add_to_grad(param: nn.Parameter, update: Tensor, alpha: float = 1.0) -> None:
    """`param.grad += alpha · update`; a first contribution is written directly (no zero fill)."""
    if param.grad is None:
        param.grad = update.to(param.dtype) * alpha
    else:
        param.grad.add_(update.to(param.grad.dtype), alpha=alpha)


class GroupBuffers:
    """`S_g` per open group: group id → parameter → buffer (same dtype/device as the parameter)."""

    def __init__(self) -> None:
        self._buffers: dict[int, dict[nn.Parameter, Tensor]] = {}
        self.max_open_groups = 0
        """Most groups that held a buffer at the same time (peak memory ≈ this × trainable size)."""

    def get(self, group_id: int, param: nn.Parameter) -> Tensor:
        """The buffer of `param` in group `group_id`, zeros on first use."""
        group = self._buffers.setdefault(group_id, {})
        self.max_open_groups = max(self.max_open_groups, len(self._buffers))
        if param not in group:
            group[param] = param.detach().new_zeros(param.shape)
        return group[param]

    def add(self, group_id: int, param: nn.Parameter, update: Tensor, alpha: float = 1.0) -> None:
        """`S_g[param] += alpha · update`; a first contribution is written directly (no zero fill)."""
        group = self._buffers.setdefault(group_id, {})
        self.max_open_groups = max(self.max_open_groups, len(self._buffers))
        if param in group:
            group[param].add_(update.to(group[param].dtype), alpha=alpha)
        else:
            group[param] = update.to(param.dtype) * alpha

    def pop(self, group_id: int) -> dict[nn.Parameter, Tensor]:
        """Remove and return group `group_id`'s buffers (empty when it never needed one)."""
        return self._buffers.pop(group_id, {})

    @property
    def open_groups(self) -> tuple[int, ...]:
        return tuple(self._buffers)
