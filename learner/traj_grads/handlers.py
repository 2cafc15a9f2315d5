"""Per-module hooks that split one packed backward pass into per-trajectory gradients.

Trajectories of a packed micro-batch do not interact (block-diagonal attention), so for the
loss `Σ_j ℓ_j` the gradient reaching a layer output at a position of trajectory `j` is exactly
`∂ℓ_j/∂out_t`. Each handler turns the output gradients `δ` and inputs `x` of its module into

* the per-trajectory squared norms `‖g_j‖²` restricted to its parameters (fp32), added to
  `MicroBatchState.sq_norms` during the backward, and
* the coefficient-weighted gradient `Σ_j c_j g_j` for coefficients known only after the
  backward (`ApplyPlan`, because `b*_g` needs every layer's norm first), in `apply`.

`nn.Linear` weight, per trajectory `j` with rows `t ∈ τ_j`: `G_j = Σ_t δ_t x_tᵀ`. Two exact ways:

* *Gram*: `‖G_j‖² = Σ_{t,s} (x_t·x_s)(δ_t·δ_s)`, cost `2 T_j² (in + out)` flops, no `G_j`;
  the weighted gradient is then ONE deferred GEMM over all rows with per-row coefficients,
  i.e. exactly the work of autograd's ordinary weight gradient. Costs memory: `δ` of the
  layer stays alive until `apply` (about one more activation-sized tensor per layer).
* *Dense*: form `G_j` (GEMM with the same total flops as the weight gradient), take its norm
  and add `−a_j G_j` to `.grad` and `s_j G_j` to the group buffer `S_g` right away (3 passes over
  an `out × in` matrix per trajectory, memory-bound).

The choice is per (layer, trajectory): Gram when `2 T² (in + out) ≤ dense_cost_flops · in · out`,
where `dense_cost_flops` is the price of one element of those memory passes in flops. A trajectory
whose group is still open after this micro-batch costs the Gram route one more GEMM (`S_g` gets
its own deferred product, `2 T · in · out` flops), so for it the left side carries that term too.

RMSNorm weight: `Σ_t δ_t ⊙ x̂_t` per trajectory; bias: `Σ_t δ_t`; input embedding: the rows of
the trajectory's tokens receive `δ` of the embedding output. All three are tiny per trajectory
and kept until `apply`. Tied embeddings (`lm_head.weight is embed_tokens.weight`): the shared
tensor's per-trajectory gradient is `G_j + E_j`, so `‖G_j‖² + ‖E_j‖² + 2⟨G_j, E_j⟩`; `E_j` only has
rows at the trajectory's input tokens `u_j`, so the cross term needs only `G_j[u_j]`
(`(|u_j| × T_j)·(T_j × H)` flops), which the lm_head handler leaves in `tied_rows`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from learner.forward.chunked_head import HeadChunk
from learner.forward.packing import PackedMicroBatch
from learner.traj_grads.buffers import GroupBuffers, add_to_grad, grad_of
from learner.traj_grads.split_rows import Segments, SplitRows


class UniqueInputs(NamedTuple):
    """The distinct input tokens of every trajectory of a micro-batch, trajectory-major.

    `tokens`: (U,) token ids; `row_trajectory`: (U,) owning trajectory; `inverse`: (N,) row of
    each packed position; `segments`: rows of each trajectory in `tokens`.
    """

    tokens: Tensor
    row_trajectory: Tensor
    inverse: Tensor
    segments: Segments


@dataclass(frozen=True)
class ApplyPlan:
    """Coefficients decided after the backward of one micro-batch.

    `grad_coefs`: (n,) fp32, the coefficient of `g_j` in `.grad`: `−(a_j − b*_g s_j)` when `j`'s
    group closed with this micro-batch, else `−a_j`. `open_groups`: (group id, its local
    trajectories) for groups still open; their `s_j g_j` go to `S_g`.
    """

    grad_coefs: Tensor
    open_groups: tuple[tuple[int, tuple[int, ...]], ...]


def _cumulative_segments(lengths: tuple[int, ...]) -> Segments:
    segments, start = [], 0
    for length in lengths:
        segments.append((start, start + length))
        start += length
    return tuple(segments)


@dataclass
class MicroBatchState:
    """What the handlers of one micro-batch share; `sq_norms` grows during the backward.

    Host copies (coefficients, group ids, segment bounds) are made once here, so the per-layer
    hooks never synchronise with the device for them.
    """

    batch: PackedMicroBatch
    reward_coefs: Tensor
    """(n,) fp32 `a_j` on the model device."""
    baseline_coefs: Tensor
    """(n,) fp32 `s_j` on the model device."""
    buffers: GroupBuffers
    dense_cost_flops: float
    vocab_size: int
    closing_groups: frozenset[int] | None = None
    """Groups whose last member is in this micro-batch (their `b*_g` is known at `apply`, so the Gram
    route needs no `S_g` product for them); None: treat every group as open."""
    sq_norms: Tensor = field(init=False)
    """(n,) fp32 running `‖g_j‖²`."""
    group_of: tuple[int, ...] = field(init=False)
    """Host group id of each packed trajectory."""
    tied_rows: list[Tensor] | None = None
    """Per trajectory, `G_j[u_j]` of a tied lm_head, rows aligned with `unique_inputs().segments`."""
    split: SplitRows | None = None
    """This rank's share of the rows when the micro-batch's tokens are split over ranks (context
    parallelism; learner/traj_grads/split_rows.py); None: the handlers see every row."""
    gram_cache: dict[tuple[object, ...], tuple[Tensor, Tensor]] = field(default_factory=dict)
    """(input, its Gram matrices) keyed by storage address, shape and segments: shared by layers
    reading the same tensor (q/k/v, gate/up)."""
    _last_cast: tuple[tuple[object, ...], Tensor, Tensor] | None = None
    """(key, input, its cast) of the latest `cast_input`."""
    _coefs_host: tuple[tuple[float, float], ...] = ()
    _token_rows: tuple[Segments, Tensor] | None = None
    _target_rows: tuple[Segments, Tensor] | None = None
    _unique: UniqueInputs | None = None

    def __post_init__(self) -> None:
        batch = self.batch
        self.sq_norms = torch.zeros(batch.num_trajectories, dtype=torch.float32, device=self.device)
        self.group_of = tuple(batch.group_ids.tolist())
        self._coefs_host = tuple(zip(self.reward_coefs.tolist(), self.baseline_coefs.tolist(), strict=True))
        self._token_rows = (_cumulative_segments(batch.seq_lengths), batch.token_trajectory)
        self._target_rows = (
            _cumulative_segments(batch.target_counts),
            batch.token_trajectory[batch.target_positions],
        )

    @property
    def device(self) -> torch.device:
        return self.batch.input_ids.device

    def set_coefficients(self, reward_coefs: Tensor, baseline_coefs: Tensor) -> None:
        """Replace `a_j`, `s_j` — between the forward and the backward, when they depend on log-probs
        only the forward computes (`learner.proximal: reuse`)."""
        self.reward_coefs, self.baseline_coefs = reward_coefs, baseline_coefs
        self._coefs_host = tuple(zip(reward_coefs.tolist(), baseline_coefs.tolist(), strict=True))

    def all_open_plan(self) -> ApplyPlan:
        """The plan that treats every group of the micro-batch as open: `.grad += −a_j g_j` and
        `S_g += s_j g_j` for all, `b*_g S_g` added when the group closes. What a handler that must apply
        during the backward uses (its layer was recomputed: its input is gone after the backward)."""
        members: dict[int, list[int]] = {}
        for j, group in enumerate(self.group_of):
            members.setdefault(group, []).append(j)
        return ApplyPlan(-self.reward_coefs, tuple((g, tuple(js)) for g, js in members.items()))

    def group_open(self, j: int) -> bool:
        """Whether trajectory `j`'s group stays open after this micro-batch."""
        return self.closing_groups is None or self.group_of[j] not in self.closing_groups

    def coefs_of(self, j: int) -> tuple[float, float]:
        """Host `(a_j, s_j)`."""
        return self._coefs_host[j]

    def rows(self, num_rows: int, name: str, targets: bool = False) -> tuple[Segments, Tensor]:
        """Segments and (R,) row → trajectory map for a module that saw `num_rows` rows: all
        packed tokens (decoder layers) or only the target positions (lm_head; `targets`, which a split
        micro-batch needs told: its rank's token and target rows may be as many)."""
        batch = self.batch
        if self.split is not None:
            start, end = self.split.targets if targets else self.split.tokens
            if num_rows != end - start:
                raise RuntimeError(f"{name} saw {num_rows} rows, not its rank's {end - start} "
                                   f"{'target positions' if targets else 'packed tokens'}")
            return self.split.window(targets, *(self._target_rows if targets else self._token_rows))
        if num_rows == batch.num_tokens:
            return self._token_rows
        if num_rows == batch.target_positions.numel():
            return self._target_rows
        raise RuntimeError(
            f"{name} saw {num_rows} rows, neither the {batch.num_tokens} packed tokens nor the "
            f"{batch.target_positions.numel()} target positions; this model's layout is not supported by "
            "the packed path, use accumulate_opob_grad_per_trajectory"
        )

    def cast_input(self, source: Tensor, dtype: torch.dtype) -> Tensor:
        """`source.to(dtype)`, shared by the layers that read one tensor (q/k/v, gate/up under autocast: an
        fp32 input each would otherwise cast again). They run one after another (their forward pre-hooks,
        `LinearHandler.forward_pre_hook`), so only the latest cast is kept (it holds `source`, so the
        address cannot be reused); a miss only casts again."""
        key = (source.data_ptr(), tuple(source.shape), source.stride(), source._version, dtype)
        if self._last_cast is None or self._last_cast[0] != key:
            self._last_cast = (key, source, source.to(dtype))
        return self._last_cast[2]

    def unique_inputs(self) -> UniqueInputs:
        """Distinct (trajectory, input token) pairs, computed once per micro-batch."""
        if self._unique is None:
            batch = self.batch
            keys = batch.token_trajectory * self.vocab_size + batch.input_ids[0]
            unique_keys, inverse = torch.unique(keys, sorted=True, return_inverse=True)
            row_trajectory = unique_keys // self.vocab_size
            counts = torch.bincount(row_trajectory, minlength=batch.num_trajectories).tolist()
            self._unique = UniqueInputs(
                unique_keys % self.vocab_size, row_trajectory, inverse, _cumulative_segments(tuple(counts))
            )
        return self._unique


class _SharedCast(torch.autograd.Function):
    """`source` as the already-cast `cast` in the forward; in the backward the gradient cast back to
    `source`'s dtype — autocast's cast and its backward, with one cast shared by several readers. Each
    reader gets its own node, so their gradients reach `source` cast one by one and are summed in its
    dtype, as after separate autocast casts (summing them in the cast dtype first would round more)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, source: Tensor, cast: Tensor) -> Tensor:
        ctx.source_dtype = source.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.source_dtype), None


def _in_backward() -> bool:
    """Whether autograd is running a backward in this thread: a forward hook that fires then is a
    checkpointed layer's recompute."""
    return torch._C._current_graph_task_id() != -1


def _sq_norm(t: Tensor) -> Tensor:
    """`‖t‖²` accumulated in fp32 (a 0-dim tensor; no host sync)."""
    flat = t.reshape(-1).float()
    return torch.dot(flat, flat)


def _segment_grams(rows: Tensor, segments: Segments) -> Tensor:
    """(m, T_max, T_max) fp32 Gram matrices `X_j X_jᵀ` of the given row segments (zero padded).

    In the rows' own dtype: under bf16 autocast the rows are bf16 already, the products are exact and
    accumulate in fp32 inside the GEMM, and only the output is rounded to bf16 — a few 1e-4 relative
    on a trajectory's norm, at the bf16 GEMM's speed (6× fp32's here)."""
    padded = pad_sequence([rows[start:end] for start, end in segments], batch_first=True)
    return torch.bmm(padded, padded.transpose(1, 2)).float()


def _segment_sums(rows: Tensor, row_trajectory: Tensor, num_trajectories: int) -> Tensor:
    """(n, D) fp32 per-trajectory sums of (R, D) rows."""
    sums = torch.zeros(num_trajectories, rows.shape[1], dtype=torch.float32, device=rows.device)
    return sums.index_add_(0, row_trajectory, rows.float())


def _rows_of(segments: Segments, trajectories: list[int], device: torch.device) -> slice | Tensor:
    """Rows of `trajectories`: a slice when they are consecutive, else an index tensor."""
    first, last = trajectories[0], trajectories[-1]
    if trajectories == list(range(first, last + 1)):
        return slice(segments[first][0], segments[last][1])
    pieces = [torch.arange(*segments[j], device=device) for j in trajectories]
    return torch.cat(pieces)


def _shard_rows(tokens: Tensor, vocab_range: tuple[int, int] | None) -> tuple[Tensor, Tensor | None]:
    """Rows of a vocabulary shard `[start, end)` for global token ids, and which of the tokens it holds
    (None: a whole vocabulary, all of them). The rows of tokens it does not hold are clamped into range:
    their values must be multiplied by zero."""
    if vocab_range is None:
        return tokens, None
    start, end = vocab_range
    return (tokens - start).clamp(0, end - start - 1), (tokens >= start) & (tokens < end)


def _gram_is_cheaper(length: int, in_features: int, out_features: int, dense_cost_flops: float,
                     open_group: bool = False) -> bool:
    """Gram norm (`2T²(in+out)` flops, plus the `S_g` GEMM's `2T·in·out` while the group stays open)
    vs materialising `G_j` (`in·out` elements, memory-bound)."""
    gram = 2.0 * length * length * (in_features + out_features)
    if open_group:
        gram += 2.0 * length * in_features * out_features
    return gram <= dense_cost_flops * in_features * out_features


class _Hooked:
    """Shared plumbing: bind to a micro-batch, capture the input, hook the output gradient."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.recomputed = False
        """Its module runs inside a checkpointed (recomputed) layer: the input is taken from the recompute
        in the backward, not kept from the forward, and the gradient applied at once (`all_open_plan`)."""
        self.reads_targets = False
        """Its module sees the target positions only (the output head), not every packed token."""
        self._state: MicroBatchState | None = None
        self._x: Tensor | None = None
        self._source: Tensor | None = None
        """The forward input as the module received it (under autocast the shared cast
        `forward_pre_hook` handed it): layers reading one tensor (q/k/v, gate/up) share its Gram
        matrices, keyed by its address."""
        self._delta: Tensor | None = None

    @property
    def state(self) -> MicroBatchState:
        assert self._state is not None, f"{self.name}: handler used outside a micro-batch"
        return self._state

    def bind(self, state: MicroBatchState | None) -> None:
        """Start a micro-batch (or, with None, drop every saved tensor)."""
        self._state, self._x, self._source, self._delta = state, None, None, None
        self._forwarded = self._output_hooked = self._applied = False
        self.clear()

    @property
    def pending(self) -> bool:
        """An output gradient arrived and its input never did (a recompute that did not run)."""
        return self._delta is not None and self._x is None and not self._applied

    def clear(self) -> None:
        """Drop what the subclass saved in `on_backward`."""

    def forward_hook(self, module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        if self._state is None:
            return  # a forward outside the packed pass (e.g. generation) is not ours to track
        if isinstance(output, tuple):  # megatron's parallel linears: (output, bias the caller adds later)
            output = output[0]
        if not output.requires_grad:
            return  # no gradient flows back through this call (a reentrant checkpoint's first pass)
        if _in_backward():  # the recompute (`recompute_input_hook` took the input)
            if not self._output_hooked:  # reentrant: the backward runs through the recomputed graph
                self._output_hooked = True
                output.register_hook(self._on_output_grad)
            return
        if self._forwarded:
            raise RuntimeError(
                f"{self.name} ran more than once in one forward pass; calling a module several times is "
                "not supported by the packed path, use accumulate_opob_grad_per_trajectory"
            )
        self._forwarded = self._output_hooked = True
        if not self.recomputed:  # a recomputed layer hands its input again in the backward
            self._x = self._source = args[0].detach()
        output.register_hook(self._on_output_grad)

    def recompute_input_hook(self, module: nn.Module, args: tuple[Tensor, ...]) -> None:
        """A forward pre-hook of a recomputed module: in the backward's recompute, take the input the layer
        runs on again (as it receives it: after the autocast pre-hook's cast). A pre-hook, because a
        non-reentrant checkpoint stops its recompute as soon as the saved tensors it needs are back — for
        the layer's last module, inside that module's call, before its forward hook would run."""
        if self._state is None or not _in_backward() or not args:
            return
        self._x = self._source = args[0].detach()
        if self._delta is not None and not self._applied:  # the gradient came before the recompute
            self._take()

    def _on_output_grad(self, grad: Tensor) -> None:
        self._delta = grad.detach().reshape(-1, grad.shape[-1])
        if self._x is not None:
            self._take()

    def _take(self) -> None:
        """Both the input and the output gradient are here: the per-trajectory norms (and, for a recomputed
        layer, the weighted gradient at once, so neither tensor outlives this layer's backward)."""
        if self._x.dtype != self._delta.dtype and self._x.is_floating_point():
            # The module computed in the output's dtype under an autocast the pre-hooks did not cast for
            # (hooks built without autocast_dtype inside an outer autocast): the weight gradient is taken
            # in that dtype too, as autograd's would be. With autocast_dtype the input arrives cast.
            self._x = self.state.cast_input(self._x, self._delta.dtype)
        self.on_backward(self._delta, self._x.reshape(-1, self._x.shape[-1]))
        self._source = None  # a Gram cache entry that needs it holds its own reference
        if self.recomputed:
            self.apply(self.state.all_open_plan())
            self._applied = True
            self._x = self._delta = None
            self.clear()

    def apply_deferred(self, plan: ApplyPlan) -> None:
        """`apply(plan)` unless the handler applied during the backward already."""
        if not self._applied:
            self.apply(plan)

    def apply(self, plan: ApplyPlan) -> None:
        raise NotImplementedError

    def on_backward(self, delta: Tensor, x: Tensor) -> None:
        raise NotImplementedError


class LinearHandler(_Hooked):
    """Per-trajectory gradients of a linear layer `x Wᵀ + b` (weight and/or bias, whichever is trainable):
    an `nn.Linear`, or any module whose first input is `x` and whose output (or its first element) is
    `x Wᵀ + b` — `weight` and `bias` are passed, not read from the module, so a projection that receives
    its weight as an argument (megatron's output layer) is hooked the same way.

    `tied`: the weight is also the input embedding (tied lm_head); then `G_j[u_j]` is left in
    `state.tied_rows` for `EmbeddingHandler`'s cross term. `vocab_range`: the tokens `[start, end)` whose
    rows a vocabulary-parallel shard of that weight holds (None: all).
    """

    def __init__(self, name: str, weight: nn.Parameter | None, bias: nn.Parameter | None, tied: bool,
                 vocab_range: tuple[int, int] | None = None) -> None:
        super().__init__(name)
        self.weight = weight if weight is not None and weight.requires_grad else None
        self.bias = bias if bias is not None and bias.requires_grad else None
        self.tied = tied
        self.vocab_range = vocab_range
        self.clear()

    def forward_pre_hook(self, module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...] | None:
        """Under autocast, hand the layer its fp32 input already cast to the autocast dtype: layers that
        read one tensor (q/k/v, gate/up) share one cast of it (`MicroBatchState.cast_input`) where autocast
        would cast it once per layer, and the output-gradient hook has the cast it needs at hand. The same
        rounding, so the same forward and — `_SharedCast` — the same gradients bit for bit."""
        if self._state is None or not args:
            return None
        x, device = args[0], args[0].device.type
        if x.dtype != torch.float32 or not torch.is_autocast_enabled(device):
            return None
        cast = self.state.cast_input(x, torch.get_autocast_dtype(device))
        return (_SharedCast.apply(x, cast), *args[1:])

    def clear(self) -> None:
        self._gram: list[int] = []
        self._bias_grads: Tensor | None = None
        self._segments: Segments = ()
        self._row_trajectory: Tensor | None = None
        self._long: tuple[int, Tensor, list[Tensor]] | None = None
        """A trajectory longer than one head chunk: (j, its G_j so far in fp32, its tied rows' pieces)."""
        self._chunk_tied: dict[int, Tensor] = {}

    # --- the output head in chunks of target rows (learner/forward/chunked_head.py) ------------------

    def on_chunk(self, chunk: HeadChunk) -> None:
        """The head's per-trajectory gradients from one chunk of target rows, applied at once (every group
        treated as open: `.grad += −a_j G_j`, `S_g += s_j G_j`), so no `(K, V)` tensor is ever kept. A
        chunk holds whole trajectories (Gram or dense, as `_gram_is_cheaper` prices them) or one piece of
        a trajectory longer than a chunk, whose `G_j` is summed over its pieces (`head_chunks` plans so)."""
        state = self.state
        if self.bias is not None:
            raise RuntimeError(f"{self.name}: a chunked output head with a trainable bias is not supported")
        segments, _ = state.rows(state.batch.target_positions.numel(), self.name)
        delta, x = chunk.delta, chunk.x
        gram: list[tuple[int, int, int]] = []  # (j, first row, end row) within the chunk
        for j, (start, end) in enumerate(segments):
            low, high = max(start, chunk.start) - chunk.start, min(end, chunk.end) - chunk.start
            if low >= high:
                continue
            if (start, end) != (low + chunk.start, high + chunk.start):
                self._long_piece(j, delta[low:high], x[low:high], last=end <= chunk.end)
            elif _gram_is_cheaper(end - start, x.shape[1], delta.shape[1], state.dense_cost_flops, True):
                gram.append((j, low, high))
            else:
                product = delta[low:high].T @ x[low:high]  # G_j, (V, H)
                self._finish_trajectory(j, product, delta[low:high], x[low:high], None)
        if gram:
            self._chunk_gram(gram, delta, x)

    def _long_piece(self, j: int, delta: Tensor, x: Tensor, last: bool) -> None:
        if self._long is None or self._long[0] != j:
            shape = (delta.shape[1], x.shape[1])
            self._long = (j, torch.zeros(shape, dtype=torch.float32, device=x.device), [])
        _, total, tied = self._long
        total.addmm_(delta.T.float(), x.float())
        if self.tied:
            tied.append(delta[:, self._unique_tokens(j)].T.float() @ x.float())
        if last:
            self._long = None
            self._finish_trajectory(j, total, None, None, torch.stack(tied).sum(0) if tied else None)

    def _finish_trajectory(self, j: int, product: Tensor, delta: Tensor | None, x: Tensor | None,
                           tied_rows: Tensor | None) -> None:
        """A whole `G_j`: its norm, `.grad += −a_j G_j`, `S_g += s_j G_j`, and its tied rows."""
        state = self.state
        state.sq_norms[j] += _sq_norm(product)
        reward_coef, baseline_coef = state.coefs_of(j)
        add_to_grad(self.weight, product, -reward_coef)
        state.buffers.add(state.group_of[j], self.weight, product, baseline_coef)
        if self.tied:
            self._chunk_tied[j] = product[self._unique_tokens(j)].float() if tied_rows is None else tied_rows

    def _chunk_gram(self, trajectories: list[tuple[int, int, int]], delta: Tensor, x: Tensor) -> None:
        """Whole short trajectories of one chunk: Gram norms, then one GEMM into `.grad` and one per group
        into `S_g`, with per-row coefficients."""
        state = self.state
        segments = tuple((low, high) for _, low, high in trajectories)
        norms = (_segment_grams(x, segments) * _segment_grams(delta, segments)).sum((1, 2))
        index = torch.tensor([j for j, _, _ in trajectories], device=norms.device)
        state.sq_norms.index_add_(0, index, norms)
        owner = torch.full((delta.shape[0],), -1, dtype=torch.long, device=x.device)
        for j, low, high in trajectories:
            owner[low:high] = j
        rows = (owner >= 0).nonzero().squeeze(1)
        reward = state.reward_coefs[owner[rows]].to(delta.dtype).unsqueeze(1)
        add_to_grad(self.weight, (delta[rows] * -reward).T @ x[rows])
        groups: dict[int, list[int]] = {}
        for j, _, _ in trajectories:
            groups.setdefault(state.group_of[j], []).append(j)
        for group, members in groups.items():
            picked = torch.isin(owner, torch.tensor(members, device=x.device)).nonzero().squeeze(1)
            baseline = state.baseline_coefs[owner[picked]].to(delta.dtype).unsqueeze(1)
            state.buffers.add(group, self.weight, (delta[picked] * baseline).T @ x[picked])
        if self.tied:
            for j, low, high in trajectories:
                self._chunk_tied[j] = (delta[low:high, self._unique_tokens(j)].T @ x[low:high]).float()

    def finish_chunks(self) -> None:
        """After the last chunk: the tied rows of every trajectory, for the embedding's cross term."""
        if self.tied:
            state = self.state
            count = state.batch.num_trajectories
            missing = [j for j in range(count) if j not in self._chunk_tied]
            for j in missing:  # no target rows: G_j = 0
                self._chunk_tied[j] = torch.zeros(len(self._unique_tokens(j)), self.weight.shape[1],
                                                  dtype=torch.float32, device=self.weight.device)
            state.tied_rows = [self._chunk_tied[j] for j in range(count)]
        self._chunk_tied = {}

    def on_backward(self, delta: Tensor, x: Tensor) -> None:
        state = self.state
        self._segments, self._row_trajectory = state.rows(delta.shape[0], self.name, self.reads_targets)
        if self.bias is not None:
            self._bias_grads = _segment_sums(delta, self._row_trajectory, state.batch.num_trajectories)
            state.sq_norms += (self._bias_grads.square().sum(1) if state.split is None
                               else state.split.complete_norms(self._bias_grads))
        if self.weight is not None:
            self._weight_norms(delta, x)
        if not self._gram:  # nothing deferred: free the layer's input and output gradient now
            self._x = self._delta = None

    def _weight_norms(self, delta: Tensor, x: Tensor) -> None:
        state, weight = self.state, self.weight
        in_features, out_features = x.shape[1], delta.shape[1]
        shared = () if state.split is None else state.split.shared
        self._gram, dense = [], []
        for j, (start, end) in enumerate(self._segments):
            if end == start or j in shared:
                continue
            cheap = _gram_is_cheaper(end - start, in_features, out_features, state.dense_cost_flops,
                                     self.recomputed or state.group_open(j))
            (self._gram if cheap else dense).append(j)
        if self._gram:
            segments = tuple(self._segments[j] for j in self._gram)
            source = self._source
            key = (source.data_ptr(), tuple(source.shape), x.dtype, segments)
            if key not in state.gram_cache:  # the entry holds `source`, so its address cannot be reused
                state.gram_cache[key] = (source, _segment_grams(x, segments))
            norms = (state.gram_cache[key][1] * _segment_grams(delta, segments)).sum((1, 2))
            state.sq_norms.index_add_(0, torch.tensor(self._gram, device=norms.device), norms)
        tied_rows = {}
        group_of = state.group_of
        # One G_j buffer reused for every trajectory: a fresh lm_head-sized allocation per
        # trajectory would page-fault its whole size each time on CPU.
        per_trajectory = delta.new_empty(out_features, in_features) if dense else None
        for j in dense:
            start, end = self._segments[j]
            torch.mm(delta[start:end].T, x[start:end], out=per_trajectory)  # G_j, (out, in)
            state.sq_norms[j] += _sq_norm(per_trajectory)
            reward_coef, baseline_coef = state.coefs_of(j)
            add_to_grad(weight, per_trajectory, -reward_coef)
            state.buffers.add(group_of[j], weight, per_trajectory, baseline_coef)
            if self.tied:
                tied_rows[j] = per_trajectory[self._unique_tokens(j)]
        if shared:
            self._shared_weight_norms(delta, x, shared, tied_rows)
        if self.tied:
            state.tied_rows = self._tied_rows(delta, x, tied_rows)

    def _shared_weight_norms(self, delta: Tensor, x: Tensor, shared: tuple[int, ...],
                             tied_rows: dict[int, Tensor]) -> None:
        """Trajectories with rows on other ranks too (`SplitRows`): this rank's partial `G_j` applied as on
        the dense route, its norm (and tied rows) from the partials summed over the ranks."""
        state = self.state
        partials = torch.stack([delta[start:end].T.float() @ x[start:end].float()
                                for start, end in (self._segments[j] for j in shared)])
        for j, partial in zip(shared, partials.to(delta.dtype), strict=True):
            reward_coef, baseline_coef = state.coefs_of(j)
            add_to_grad(self.weight, partial, -reward_coef)
            state.buffers.add(state.group_of[j], self.weight, partial, baseline_coef)
        state.split.reduce(partials)  # now each trajectory's whole G_j
        if state.split.counts_shared:
            state.sq_norms.index_add_(0, torch.tensor(shared, device=partials.device),
                                      partials.square().sum((1, 2)))
        if self.tied:
            for i, j in enumerate(shared):
                tied_rows[j] = partials[i][self._unique_tokens(j)]

    def _unique_tokens(self, j: int) -> Tensor:
        """This weight's rows of trajectory `j`'s distinct input tokens (a shard's: clamped where it does not
        hold the token, whose embedding gradient here is zero — `EmbeddingHandler`)."""
        unique = self.state.unique_inputs()
        start, end = unique.segments[j]
        return _shard_rows(unique.tokens[start:end], self.vocab_range)[0]

    def _tied_rows(self, delta: Tensor, x: Tensor, dense_rows: dict[int, Tensor]) -> list[Tensor]:
        """`G_j[u_j] = δ_j[:, u_j]ᵀ x_j` for every trajectory (dense ones already sliced)."""
        rows = []
        for j, (start, end) in enumerate(self._segments):
            if j not in dense_rows:
                dense_rows[j] = delta[start:end, self._unique_tokens(j)].T @ x[start:end]
            rows.append(dense_rows[j].float())
        return rows

    def apply(self, plan: ApplyPlan) -> None:
        """Add the deferred (Gram-path and bias) contributions to `.grad` and open `S_g`."""
        state = self.state
        if self._bias_grads is not None:
            _apply_per_trajectory(self.bias, self._bias_grads, plan, state)
        if self.weight is None or not self._gram:
            return
        self.weight.grad = self._accumulate(self.weight.grad, self._gram, plan.grad_coefs)
        for group_id, members in plan.open_groups:
            trajectories = [j for j in self._gram if j in members]
            if trajectories:
                state.buffers.add(
                    group_id, self.weight, self._accumulate(None, trajectories, state.baseline_coefs)
                )

    def _accumulate(self, target: Tensor | None, trajectories: list[int], coefs: Tensor) -> Tensor:
        """`target += Σ_{t ∈ rows} coefs[traj(t)] δ_t x_tᵀ`: one GEMM, the ordinary weight-grad cost.

        With `target=None` the product is returned as a new tensor (no zero fill, no extra read).
        """
        if len(trajectories) == len(self._segments):
            rows: slice | Tensor = slice(None)
        else:
            rows = _rows_of(self._segments, trajectories, self._delta.device)
        delta, x = self._delta[rows], self._x.reshape(-1, self._x.shape[-1])[rows]
        row_coefs = coefs[self._row_trajectory[rows]].to(delta.dtype).unsqueeze(1)
        # Scale whichever operand is narrower: same result, fewer elementwise ops.
        if delta.shape[1] <= x.shape[1]:
            delta = delta * row_coefs
        else:
            x = x * row_coefs
        dtype = self.weight.dtype if target is None else target.dtype
        if delta.dtype != dtype:  # autocast: the GEMM in the compute dtype, accumulated in the weight's
            product = torch.mm(delta.T, x.to(delta.dtype))
            # The in-place add promotes the product as it reads it: no weight-sized fp32 temporary.
            return product.to(dtype) if target is None else target.add_(product)
        if target is None:
            return torch.mm(delta.T, x.to(dtype))
        return target.addmm_(delta.T, x.to(dtype))


def _apply_per_trajectory(
    param: nn.Parameter, per_trajectory: Tensor, plan: ApplyPlan, state: MicroBatchState
) -> None:
    """`.grad += Σ_j c_j p_j` and `S_g += Σ_{j∈g} s_j p_j` for small per-trajectory grads `p`: (n, *shape)."""
    flat = per_trajectory.reshape(per_trajectory.shape[0], -1)
    add_to_grad(param, (plan.grad_coefs @ flat).reshape(param.shape))
    for group_id, members in plan.open_groups:
        index = torch.tensor(members, device=flat.device)
        state.buffers.add(group_id, param, (state.baseline_coefs[index] @ flat[index]).reshape(param.shape))


class RMSNormHandler(_Hooked):
    """Per-trajectory `Σ_t δ_t ⊙ x̂_t` of an RMSNorm weight, recomputing `x̂` from the saved input."""

    def __init__(self, name: str, weight: nn.Parameter, epsilon: float | None, counted: bool = True) -> None:
        super().__init__(name)
        self.weight = weight
        self.epsilon = epsilon
        """None: the input dtype's machine epsilon (`torch.nn.RMSNorm(eps=None)`)."""
        self.counted = counted
        """Whether its norms count here: False on every tensor-parallel rank but one, which all hold the
        same weight and compute the same gradient."""
        self.clear()

    def clear(self) -> None:
        self._per_trajectory: Tensor | None = None

    def on_backward(self, delta: Tensor, x: Tensor) -> None:
        state = self.state
        x32 = x.float()
        epsilon = torch.finfo(x.dtype).eps if self.epsilon is None else self.epsilon
        normalised = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + epsilon)).to(x.dtype)
        _, row_trajectory = state.rows(delta.shape[0], self.name)
        self._per_trajectory = _segment_sums(
            delta.float() * normalised.float(), row_trajectory, len(state.sq_norms)
        )
        norms = (self._per_trajectory.square().sum(1) if state.split is None
                 else state.split.complete_norms(self._per_trajectory))
        if self.counted:
            state.sq_norms += norms

    def apply(self, plan: ApplyPlan) -> None:
        if self._per_trajectory is not None:
            _apply_per_trajectory(self.weight, self._per_trajectory, plan, self.state)


class EmbeddingHandler:
    """Per-trajectory gradients of the input `nn.Embedding`, fed the gradient of its output.

    The packed pass (`PackedGradHooks.backward`) computes the embedding itself and starts the
    autograd graph at its output, so no hook is needed. Rows at `padding_idx` get no gradient,
    as in `F.embedding`. `vocab_range`: a vocabulary-parallel shard's tokens `[start, end)` (None: all);
    it takes the gradient of the rows it holds, the other shards the rest.
    """

    def __init__(self, name: str, weight: nn.Parameter, padding_idx: int | None, tied: bool,
                 vocab_range: tuple[int, int] | None = None) -> None:
        self.name = name
        self.weight = weight
        self.padding_idx = padding_idx
        self.tied = tied
        self.vocab_range = vocab_range
        self._state: MicroBatchState | None = None
        self._delta: Tensor | None = None
        self._rows: Tensor | None = None
        """(N,) the weight's row of each packed position's token."""

    def bind(self, state: MicroBatchState | None) -> None:
        self._state, self._delta, self._rows = state, None, None

    def on_backward(self, embedding_grad: Tensor) -> None:
        """`embedding_grad`: (1, N, H) gradient of the embedding output (the leaf's `.grad`)."""
        state = self._state
        input_ids = state.batch.input_ids[0]
        delta = embedding_grad.reshape(-1, embedding_grad.shape[-1])
        self._rows, keep = _shard_rows(input_ids, self.vocab_range)
        if self.padding_idx is not None:
            not_pad = input_ids != self.padding_idx
            keep = not_pad if keep is None else keep & not_pad
        if keep is not None:  # no gradient for the pad token, nor for tokens another shard holds
            delta = delta * keep.unsqueeze(1).to(delta.dtype)
        self._delta = delta
        unique = state.unique_inputs()
        # E_j restricted to its rows u_j: (U, H), trajectory-major like tied_rows.
        rows = torch.zeros(len(unique.tokens), delta.shape[1], dtype=torch.float32, device=delta.device)
        rows.index_add_(0, unique.inverse, delta.float())
        if self.tied and state.tied_rows is None:
            raise RuntimeError(f"{self.name} is tied to an lm_head whose gradient hook never ran")
        tied_rows = torch.cat(state.tied_rows) if self.tied else None
        row_norms = _embedding_row_norms(rows, tied_rows)
        split = state.split
        if split is not None and split.shared:  # their rows summed over the ranks, counted on one
            picked = torch.cat([torch.arange(*unique.segments[j], device=rows.device) for j in split.shared])
            summed = rows[picked].clone()
            split.reduce(summed)
            shared_tied = None if tied_rows is None else tied_rows[picked]
            row_norms[picked] = _embedding_row_norms(summed, shared_tied) if split.counts_shared else 0.0
        state.sq_norms.index_add_(0, unique.row_trajectory, row_norms)

    def apply(self, plan: ApplyPlan) -> None:
        if self._delta is None:
            return
        state, delta = self._state, self._delta
        token_trajectory = state.batch.token_trajectory
        coefs = plan.grad_coefs[token_trajectory].to(delta.dtype).unsqueeze(1)
        grad_of(self.weight).index_add_(0, self._rows, (delta * coefs).to(self.weight.dtype))
        segments = _cumulative_segments(state.batch.seq_lengths)
        for group_id, members in plan.open_groups:
            rows = _rows_of(segments, list(members), delta.device)
            coefs = state.baseline_coefs[token_trajectory[rows]].to(delta.dtype).unsqueeze(1)
            buffer = state.buffers.get(group_id, self.weight)
            buffer.index_add_(0, self._rows[rows], (delta[rows] * coefs).to(buffer.dtype))


def _embedding_row_norms(rows: Tensor, tied_rows: Tensor | None) -> Tensor:
    """Per row of `E_j` (fp32), its squared norm, plus the cross term `2⟨G_j, E_j⟩` of that row when the
    embedding is tied to an output head whose `G_j` rows are `tied_rows`."""
    norms = rows.square().sum(1)
    if tied_rows is not None:
        norms += 2.0 * (tied_rows * rows).sum(1)
    return norms
