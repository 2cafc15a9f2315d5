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


def _scaled_copy(update: Tensor, param: nn.Parameter, alpha: float) -> Tensor:
    """A new tensor `alpha · update` in the parameter's dtype (never `update` itself: callers reuse it)."""
    if alpha == 1.0:
        return update.to(param.dtype, copy=True)
    return update.to(param.dtype) * alpha


def add_to_grad(param: nn.Parameter, update: Tensor, alpha: float = 1.0) -> None:
    """`param.grad += alpha · update`; a first contribution is written directly (no zero fill).

    A bf16 `update` is added to the fp32 gradient as it is read (the in-place add promotes it):
    the same sums as casting it first, without a gradient-sized temporary."""
    if param.grad is None:
        param.grad = _scaled_copy(update, param, alpha)
    else:
        param.grad.add_(update, alpha=alpha)


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
            group[param].add_(update, alpha=alpha)  # promoted as read, as in add_to_grad
        else:
            group[param] = _scaled_copy(update, param, alpha)

    def pop(self, group_id: int) -> dict[nn.Parameter, Tensor]:
        """Remove and return group `group_id`'s buffers (empty when it never needed one)."""
        return self._buffers.pop(group_id, {})

    @property
    def open_groups(self) -> tuple[int, ...]:
        return tuple(self._buffers)
