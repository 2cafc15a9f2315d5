"""The `vcpo bench staleness` configurations: the methods compared and the matrix's presets (their
files are benchmarks/configs/staleness*.yaml). Imports only pydantic and the run's schemas."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from configs.base import StrictModel
from configs.schema import AlgoConfig, AutoLagConfig, SimulatedClockConfig


class StalenessMethodConfig(StrictModel):
    """One row of `vcpo bench staleness`: an objective + step-size rule and its own learning rate."""

    name: str
    """Row name in the tables and plots."""
    algo: dict[str, Any]
    """The run config's `algo` section for this method (objective, ess_lr, staleness_lr, ...);
    `group_size` comes from the benchmark."""
    lr: float = Field(gt=0)
    """Peak learning rate of this method (chosen by the k = 0 sweep, see
    benchmarks/configs/staleness.yaml)."""

    @model_validator(mode="after")
    def _valid_algo(self) -> StalenessMethodConfig:
        AlgoConfig.model_validate({**self.algo, "group_size": 8})  # a bad method fails at load time
        return self


class StalenessMatrixConfig(StrictModel):
    """What every `vcpo bench staleness` preset shares: methods × lag bounds k × seeds, every batch at
    exactly lag min(k, step), the runs stored and reused by key (benchmarks/staleness/bench.py)."""

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
    common_lr: float | None = Field(None, gt=0)
    """matrix: run every method at this lr instead of its own (robustness and step size unconfounded)."""
    collapse_fraction: float = Field(0.5, gt=0, lt=1)
    """A run has collapsed at the first step whose trailing-10-step reward falls below this share of
    its first 10 steps' reward (or whose loss / grad norm is not finite)."""
    run_root: str = "runs/bench-staleness"
    """Where every run directory, the summaries and the plots go."""
    results_dir: str | None = None
    """Where each finished run's row is stored and found again (resume); None = run_root/results."""

    def numerics_at(self, lag: int) -> list[str]:
        """The engine/learner numerics each run at lag `lag` is made with (a column of the tables)."""
        return ["matched"]

    @model_validator(mode="after")
    def _check_methods(self) -> StalenessMatrixConfig:
        names = [method.name for method in self.methods]
        if len(set(names)) != len(names):
            raise ValueError(f"methods: duplicate names in {names}; give every method its own name")
        unknown = sorted(set(self.only or ()) - set(names))
        if unknown:
            raise ValueError(f"only: {unknown} are not method names; valid: {names}")
        return self


class StalenessBenchConfig(StalenessMatrixConfig):
    """`vcpo bench staleness`: methods × lag bounds × seeds through the real asynchronous pipeline on
    a tiny pre-taught policy (benchmarks/staleness/bench.py)."""

    task: Literal["count", "alphabet", "addition"] = "count"
    """The verifiable task (benchmarks/staleness_tasks.py):
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
    workers: int = Field(2, ge=1)
    """Runs in parallel (one process and one CPU thread each)."""
    device: str = "cpu"
    """torch device of every run's learner and engine: 'cpu', or 'cuda' / 'cuda:N' (the workers share
    it). Part of a stored run's key when not 'cpu': a GPU run is never reused for a CPU one."""
    lr_grid: list[Annotated[float, Field(gt=0)]] = Field(
        default_factory=lambda: [1e-4, 3e-4, 1e-3, 3e-3])
    """Learning rates tried by `mode: lr_sweep`."""
    sweep_seed: int = 1000
    """Seed of the lr sweep (not one of `seeds`, so the lr is not chosen on the reported runs)."""
    mode: Literal["matrix", "lr_sweep"] = "matrix"
    """matrix: the full table; lr_sweep: `cap_method` at k = 1 with every lr in lr_grid (the grid's cap:
    median ESS ≥ ess_floor), then each method at k = 0 with every lr up to the cap (seed `sweep_seed`)."""
    def numerics_at(self, lag: int) -> list[str]:
        return [n for n in self.numerics
                if n == "matched" or self.numerics_lags is None or lag in self.numerics_lags]

    @model_validator(mode="after")
    def _check(self) -> StalenessBenchConfig:
        names = [method.name for method in self.methods]
        if self.count_min > self.count_max:
            raise ValueError(f"count_min={self.count_min} > count_max={self.count_max}; "
                             "make count_min ≤ count_max")
        if self.task == "alphabet" and self.count_max > 26:
            raise ValueError(f"count_max={self.count_max}: an alphabet range holds at most 26 letters; "
                             "make count_max ≤ 26")
        if self.mode == "lr_sweep" and self.cap_method not in names:
            raise ValueError(f"cap_method={self.cap_method!r} is not a method name; valid: {names}")
        return self


class StalenessTimedBenchConfig(StalenessBenchConfig):
    """`vcpo bench staleness --config benchmarks/configs/staleness_timed.yaml`: fixed lag bounds and
    `max_lag: auto` on a simulated clock (rollout/sim_clock.py) — the synthetic preset's task and policy,
    the lags decided by timing instead of saturated, the score's curve measured every `eval_every` steps,
    so each (method, k) has a final score and a simulated time to reach 95% of its k = 0 final score
    (benchmarks/staleness/timed.py)."""

    kind: Literal["timed"]
    """Marks this preset: `vcpo bench staleness` picks the schema by it."""
    lags: list[Annotated[int, Field(ge=0)] | Literal["auto"]] = Field(  # type: ignore[assignment]
        default_factory=lambda: [0, 4, 32, 128, "auto"])
    """Fixed bounds k (the timeline decides each batch's lag, ≤ k) and 'auto' (`auto_lag`)."""
    clock: SimulatedClockConfig
    """The timeline every run is put on (`rollout.simulated_clock`); its seed stays unset: each run draws its
    episode times from its own seed, so the k's of one seed share their draws."""
    auto_lag: AutoLagConfig = Field(default_factory=AutoLagConfig)
    """The controller of the 'auto' runs."""
    eval_every: int = Field(20, ge=1)
    """Steps between two measurements of the score (checkpoints scored after the run)."""
    target_fraction: float = Field(0.95, gt=0, le=1)
    """Time to score: the first measurement at or above this share of the method's k = 0 final score."""
    score_tolerance: float = Field(0.05, ge=0, lt=1)
    """The goal: 'auto' within this share of the best fixed k's final score …"""
    time_tolerance: float = Field(1.1, ge=1)
    """… at most this multiple of the fastest fixed k's time to the score."""
    policy_dir: str | None = None
    """Where the pre-taught policy is kept and found (None = results_dir): the synthetic preset's
    folder, so both presets start from the very same policy."""

    @model_validator(mode="after")
    def _check_timed(self) -> StalenessTimedBenchConfig:
        if 0 not in self.lags:
            raise ValueError(f"lags={self.lags}: the timed preset needs k = 0 (its final score defines the "
                             "target every time to score is measured against); add 0")
        if self.mode != "matrix":
            raise ValueError("mode: the timed preset runs its matrix only; sweep lrs with the synthetic "
                             "preset")
        if self.clock.seed is not None:
            raise ValueError(f"clock.seed={self.clock.seed}: every run draws its episode times from its own "
                             "seed (the k's of a seed share them); remove clock.seed")
        if self.steps % self.eval_every:
            raise ValueError(f"steps={self.steps} is not a multiple of eval_every={self.eval_every}: the "
                             "last step must be measured; make steps a multiple of it")
        return self


class StalenessRealBenchConfig(StalenessMatrixConfig):
    """`vcpo bench staleness --config benchmarks/configs/staleness_real.yaml`: the same matrix on a real
    language model doing the main job's agent task — every run is `vcpo train` of `run_config` started
    from one shared warm-started policy, every batch at exactly lag min(k, step), scored by the final
    policy's held-out success (benchmarks/staleness/real.py)."""

    kind: Literal["real"]
    """Marks this preset (the synthetic one has no `kind`): `vcpo bench staleness` picks the schema by it."""
    run_config: str = "configs/default.yaml"
    """The run config every run trains (model, task, warm start, engine, learner); relative paths start at
    the repository root. Each method replaces the `algo` keys it names."""
    overrides: list[str] = Field(default_factory=list)
    """a.b.c=value overrides of `run_config` for every run (what the matrix shrank, with its reasons in
    the preset)."""
    eval_samples: int = Field(128, ge=8)
    """Held-out prompts scored at the start and after the last step (trainer.eval_samples)."""
    warm_start_seed: int = 0
    """Seed of the one warm start every run starts from (run_config's warm start, trained once and cached)."""
    checkpoint_every: int = Field(20, ge=1)
    """Steps between a run's checkpoints: an interrupted run resumes from its newest one."""
    run: bool = True
    """False: train nothing, recompute the summary from the stored rows (a missing run shows as not run)."""

    def numerics_at(self, lag: int) -> list[str]:
        """The run config's own numerics (the main job's: engine and log π_old in fp32, bf16-autocast
        gradient), so the IS weights are ~1 but not exactly 1 at k = 0."""
        return ["fp32"]

    @model_validator(mode="after")
    def _check_real(self) -> StalenessRealBenchConfig:
        reserved = {"seed", "run_dir", "model.path", "warm_start.enabled", "optim.lr", "rollout.max_lag",
                    "rollout.saturate_lag", "rollout.groups_per_step", "algo.group_size",
                    "trainer.total_steps", "trainer.eval_every", "trainer.eval_samples",
                    "trainer.checkpoint_every"}
        clashing = sorted(o.partition("=")[0].strip() for o in self.overrides
                          if o.partition("=")[0].strip() in reserved)
        if clashing:
            raise ValueError(f"overrides: {clashing} are set by the bench per run (seed, lag, lr, steps, "
                             "batch); use the bench's own fields instead")
        return self


def staleness_schema(raw: Any) -> type[StalenessMatrixConfig]:
    """The schema of a `vcpo bench staleness` config: the real-model preset carries `kind: real`, the
    simulated-clock one `kind: timed`, the synthetic one no kind."""
    kind = raw.get("kind") if isinstance(raw, dict) else None
    return {"real": StalenessRealBenchConfig, "timed": StalenessTimedBenchConfig}.get(
        kind, StalenessBenchConfig)
