"""The megatron-core learner equals the torch learner on the same batch: packed logits, the step's metrics,
VCPO's per-trajectory squared gradient norms and the weights after one optimizer step (compared in HF
names through mbridge's export) — in process at TP = 1, and at TP = 2, DP = 2, PP = 2 and 3, CP = 2,
PP × CP = 2 × 2 and TP × PP = 2 × 2 under torchrun, all on the CPU with gloo and the test-only CUDA shim
(tests/learner/megatron_cpu.py). VCPO's norms take the fast packed path (megatron's layers hooked) on every
one of these layouts and under activation recompute, checked against the per-trajectory path on the same
layout.

Tolerances (fp32 throughout; measured maxima on this machine in brackets): logits 1e-5 absolute
[2e-7]; metrics 1e-5 relative [2e-6]; ‖∇ℓ_i‖² 1e-5 relative [3e-7]; weights after one Adam step at
lr 1e-3, eps 1e-6: 1e-5 absolute, i.e. 1% of the step [3e-6].
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from configs.schema import AlgoConfig, MegatronConfig, RunConfig
from learner.backends.torch_learner import StepInput
from learner.forward.logprobs import packed_target_logprobs, trajectory_logliks
from learner.forward.packing import build_microbatch, plan_microbatches
from tests.learner import megatron_parity
from tests.learner.conftest import random_trajectories, tiny_model

LOGIT_ATOL, METRIC_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5, 1e-5


def _needs_megatron() -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install vcpo[megatron])")
    pytest.importorskip("mbridge", reason="mbridge is not installed (pip install vcpo[megatron])")


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """A gloo world of one process with megatron's TP = 1 groups, for this module's in-process tests."""
    _needs_megatron()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from learner.backends.megatron.learner import init_model_parallel
    from tests.learner.megatron_cpu import cuda_on_cpu

    with cuda_on_cpu():
        init_model_parallel(MegatronConfig(), backend="gloo")
    yield
    with cuda_on_cpu():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron-ckpt")
    return {kind: megatron_parity.write_checkpoint(kind, root / kind) for kind in ("llama_tied", "qwen2")}


CONDITIONED_METRIC_ABS = {"is/log_w_reward_corr": 1e-4}
"""Metrics that amplify the backends' ~1e-7 log-prob differences: a correlation of log w (a sum of
small per-token differences, ~0.1 here) with R moves by ~1e-5 when the log-ratios move by 1e-6."""


def _megatron_learner(hf_dir: Path, algo_name: str, grad_norm_path: str | None = None,
                      dtype: torch.dtype = torch.float32, proximal: str = "separate",
                      logits_chunk_mib: float | None = None, **megatron: object) -> object:
    from learner.backends.megatron.learner import MegatronLearner
    from tests.learner.megatron_cpu import cuda_on_cpu

    algo = megatron_parity.algo(algo_name)
    if grad_norm_path is not None:
        opob = algo.objective.opob.model_copy(update={"grad_norm_path": grad_norm_path})
        algo = algo.model_copy(update={"objective": algo.objective.model_copy(update={"opob": opob})})
    with cuda_on_cpu():
        return MegatronLearner(hf_dir, algo, megatron_parity.OPTIM,
                               MegatronConfig.model_validate(megatron),
                               micro_batch_tokens=megatron_parity.MICRO_BATCH_TOKENS, dtype=dtype,
                               proximal=proximal, logits_chunk_mib=logits_chunk_mib)


def _step(learner: object, batch: object) -> megatron_parity.StepRecord:
    from tests.learner.megatron_cpu import cuda_on_cpu

    with cuda_on_cpu():
        return megatron_parity.run_step(learner, batch)


def _assert_same_step(got: megatron_parity.StepRecord, want: megatron_parity.StepRecord) -> None:
    assert set(got.metrics) == set(want.metrics)
    for key, value in want.metrics.items():
        tolerance = CONDITIONED_METRIC_ABS.get(key, 1e-6)
        assert got.metrics[key] == pytest.approx(value, rel=METRIC_RTOL, abs=tolerance, nan_ok=True), key
    if want.sq_norms is None:
        assert got.sq_norms is None
    else:
        torch.testing.assert_close(got.sq_norms, want.sq_norms, rtol=NORM_RTOL, atol=0)
    assert set(got.weights) == set(want.weights)  # same HF names: engines accept either backend's weights
    for name, weight in want.weights.items():
        torch.testing.assert_close(got.weights[name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_packed_logits_match_the_hf_model(megatron_world: None, checkpoints: dict[str, Path],
                                          kind: str) -> None:
    from learner.backends.megatron.model import MegatronCausalLM, load_megatron_gpt
    from tests.learner.megatron_cpu import cuda_on_cpu

    tokens = random_trajectories(num_groups=2, per_group=2)
    plan = plan_microbatches([len(t.token_ids) for t in tokens], [t.group_id for t in tokens], 4096)[0]
    batch = build_microbatch(tokens, plan, "mean")  # 4 trajectories in one packed row
    call = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "use_cache": False,
            "logits_to_keep": batch.target_positions}
    with cuda_on_cpu():
        model = MegatronCausalLM(load_megatron_gpt(checkpoints[kind], MegatronConfig(), torch.float32,
                                                   torch.device("cpu")))
        got = model(**call).logits
    want = tiny_model(kind)(**call).logits
    assert got.shape == want.shape == (1, batch.target_positions.numel(), want.shape[-1])
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize(("kind", "algo_name", "use_distributed_optimizer"), [
    ("llama_tied", "grpo", False), ("llama_tied", "vcpo", False), ("qwen2", "vcpo", True),
    ("llama_tied", "vcpo_reference", False)])
def test_one_step_matches_the_torch_learner(megatron_world: None, checkpoints: dict[str, Path], kind: str,
                                            algo_name: str, use_distributed_optimizer: bool) -> None:
    batch = megatron_parity.parity_batch(kind)
    want = megatron_parity.run_step(megatron_parity.torch_learner(kind, algo_name), batch)
    learner = _megatron_learner(checkpoints[kind], algo_name,
                                use_distributed_optimizer=use_distributed_optimizer)
    got = _step(learner, batch)
    assert got.metrics["grad/norm"] > 0.1  # a real update, not a vanishing one that would match anything
    _assert_same_step(got, want)


@pytest.mark.parametrize(("kind", "algo_name", "proximal"), [
    ("llama_tied", "vcpo", "separate"), ("qwen2", "vcpo_reference", "auto")])
def test_vcpo_on_whole_layers_takes_the_fast_norm_path_with_the_per_trajectory_paths_step(
        megatron_world: None, checkpoints: dict[str, Path], kind: str, algo_name: str, proximal: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP = PP = CP = 1 megatron's VCPO takes the fast packed path — its own layers hooked (column- and
    row-parallel linears, the word embedding tied to the output projection or not, torch RMSNorms, Qwen2's
    qkv bias), one backward per micro-batch — and takes the step the per-trajectory path takes: the same
    ‖∇ℓ_i‖², metrics and weights (and the torch learner's, test above). With `proximal: auto` in fp32 it
    takes log π_old from that pass's forward (no separate one), as the torch learner does."""
    from learner.backends import torch_learner
    from learner.backends.megatron.packed_grads import MegatronPackedGradHooks

    used: list[type] = []
    packed = torch_learner.accumulate_opob_grad_packed

    def spy(*args: object, **kwargs: object) -> object:
        used.append(kwargs["hooks_class"])
        return packed(*args, **kwargs)

    monkeypatch.setattr(torch_learner, "accumulate_opob_grad_packed", spy)
    batch = megatron_parity.parity_batch(kind)
    fast = _megatron_learner(checkpoints[kind], algo_name, proximal=proximal)
    assert fast.fast_norms and fast.reuses_gradient_forward == (proximal == "auto")
    got = _step(fast, batch)
    assert used and set(used) == {MegatronPackedGradHooks}
    per_trajectory = _megatron_learner(checkpoints[kind], algo_name, grad_norm_path="per_trajectory",
                                       proximal=proximal)
    assert not per_trajectory.fast_norms and not per_trajectory.reuses_gradient_forward
    want = _step(per_trajectory, batch)
    assert len(used) == 1  # the per-trajectory learner did not take the packed path
    if fast.reuses_gradient_forward:  # its norms stay inside the pass that reuses the forward, unrecorded
        want = dataclasses.replace(want, sq_norms=None)
    assert got.metrics["grad/norm"] > 0.1
    _assert_same_step(got, want)


RECOMPUTE = {
    "full": ({"recompute_granularity": "full"}, 2),
    "full_chunk_of_2": ({"recompute_granularity": "full", "recompute_num_layers": 2}, 2),
    "block_1": ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, 1),
    "selective": ({"recompute_granularity": "selective"}, 0),
}
"""megatron's recompute settings, with how many of the 2 layers' forwards the backward runs again."""


@pytest.mark.parametrize("setting", list(RECOMPUTE))
def test_under_activation_recompute_the_fast_norm_path_takes_the_step_without_recompute(
        megatron_world: None, checkpoints: dict[str, Path], setting: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron's recompute ('full': whole layers, one by one, two per chunk, or the first only; 'selective':
    the core attention, which owns no parameter): VCPO stays on the fast norm path, its hooks take a
    recomputed layer's input in the recompute — once per layer — and the step is the one the per-trajectory
    path takes without recompute — and with it: the same ‖∇ℓ_i‖², metrics and weights (qwen2: its qkv bias
    too). The
    layers really are recomputed: the hooks' own count of forwards says so (a handler whose layer was
    marked recomputed but not recomputed, or the reverse, raises)."""
    from learner.backends.megatron.packed_grads import MegatronPackedGradHooks

    megatron, layers_recomputed = RECOMPUTE[setting]
    marked: list[int] = []
    recomputed = MegatronPackedGradHooks._recomputed_modules

    def spy(hooks: MegatronPackedGradHooks) -> set[int]:
        found = recomputed(hooks)
        layers = hooks.model.gpt.decoder.layers
        marked.append(sum(id(layer.self_attention.linear_qkv) in found for layer in layers))
        return found

    monkeypatch.setattr(MegatronPackedGradHooks, "_recomputed_modules", spy)
    forwards = _count_layer_forwards(monkeypatch)
    batch = megatron_parity.parity_batch("qwen2")
    fast = _megatron_learner(checkpoints["qwen2"], "vcpo", **megatron)
    assert fast.fast_norms
    got = _step(fast, batch)
    assert marked and set(marked) == {layers_recomputed}
    in_backward = forwards["backward"]
    assert in_backward == (layers_recomputed * forwards["micro_batches"] if layers_recomputed else 0)
    want = _step(_megatron_learner(checkpoints["qwen2"], "vcpo", grad_norm_path="per_trajectory"), batch)
    assert got.metrics["grad/norm"] > 0.1
    _assert_same_step(got, want)
    # the per-trajectory path under the same recompute (each trajectory's gradient through backward(), which
    # megatron's reentrant checkpoint allows and autograd.grad does not): the same step again
    per_trajectory = _megatron_learner(checkpoints["qwen2"], "vcpo", grad_norm_path="per_trajectory",
                                       **megatron)
    _assert_same_step(_step(per_trajectory, batch), want)


@pytest.mark.parametrize(("kind", "algo_name", "grad_norm_path"), [
    ("llama_tied", "grpo", None), ("llama_tied", "vcpo", None), ("qwen2", "vcpo", None),
    ("llama_tied", "vcpo", "per_trajectory")])
def test_the_output_head_in_chunks_of_target_rows_takes_the_same_step(
        megatron_world: None, checkpoints: dict[str, Path], kind: str, algo_name: str,
        grad_norm_path: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """At TP = PP = CP = 1 the output product runs in chunks of target rows where its logits would pass
    `logits_chunk_mib` (here ~16 rows: every micro-batch is cut), so no (K, V) block is ever whole: the
    step — GRPO, VCPO on the fast path (its head handler takes the weight gradient chunk by chunk, a tied
    embedding's cross term from the chunks' rows) and per trajectory — equals the one-pass step."""
    from learner.forward import chunked_head

    calls: list[int] = []
    chunked = chunked_head.ChunkedHeadLogprobs.apply

    def spy(*args: object) -> torch.Tensor:
        calls.append(len(args[5]))  # the chunks
        return chunked(*args)

    monkeypatch.setattr(chunked_head.ChunkedHeadLogprobs, "apply", spy)
    batch = megatron_parity.parity_batch(kind)
    rows_mib = 16 * 160 * 4 / 2**20  # 16 fp32 rows of the 160-token vocabulary
    got = _step(_megatron_learner(checkpoints[kind], algo_name, grad_norm_path, logits_chunk_mib=rows_mib),
                batch)
    assert calls and max(calls) > 1
    want = _step(_megatron_learner(checkpoints[kind], algo_name, grad_norm_path), batch)
    _assert_same_step(got, want)


def test_under_full_recompute_grpo_takes_the_step_without_recompute(megatron_world: None,
                                                                    checkpoints: dict[str, Path]) -> None:
    batch = megatron_parity.parity_batch("llama_tied")
    got = _step(_megatron_learner(checkpoints["llama_tied"], "grpo", recompute_granularity="full"), batch)
    want = _step(_megatron_learner(checkpoints["llama_tied"], "grpo"), batch)
    _assert_same_step(got, want)


def _count_layer_forwards(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the first layer's attention projection (`linear_qkv`) forwards that ran inside a backward
    (a recompute) — summed over layers — and of VCPO's packed micro-batches with targets."""
    from learner.backends.megatron.packed_grads import MegatronPackedGradHooks
    from learner.traj_grads.handlers import _in_backward

    counts = {"backward": 0, "micro_batches": 0}
    enter, backward = MegatronPackedGradHooks.__enter__, MegatronPackedGradHooks.backward

    def count(module: object, args: object, output: object) -> None:
        counts["backward"] += int(_in_backward())

    def entered(hooks: MegatronPackedGradHooks) -> MegatronPackedGradHooks:
        for layer in hooks.model.gpt.decoder.layers:
            hooks._handles.append(layer.self_attention.linear_qkv.register_forward_hook(count))
        return enter(hooks)

    def counted_backward(hooks: MegatronPackedGradHooks, state: object, *args: object) -> None:
        counts["micro_batches"] += int(state.batch.target_positions.numel() > 0)  # type: ignore[attr-defined]
        backward(hooks, state, *args)

    monkeypatch.setattr(MegatronPackedGradHooks, "__enter__", entered)
    monkeypatch.setattr(MegatronPackedGradHooks, "backward", counted_backward)
    return counts


def test_in_bf16_the_fast_norm_path_gives_the_per_trajectory_norms_to_bf16_rounding(
        megatron_world: None, checkpoints: dict[str, Path]) -> None:
    """bf16 weights (no autocast): both paths round differently (the fast one's Gram products, the other's
    autograd), so their ‖∇ℓ_i‖² agree to bf16 rounding [1.3e-3 relative measured], not to fp32's."""
    batch = megatron_parity.parity_batch("llama_tied")
    fast = _step(_megatron_learner(checkpoints["llama_tied"], "vcpo", dtype=torch.bfloat16), batch)
    per_trajectory = _step(_megatron_learner(checkpoints["llama_tied"], "vcpo", "per_trajectory",
                                             dtype=torch.bfloat16), batch)
    torch.testing.assert_close(fast.sq_norms, per_trajectory.sq_norms, rtol=1e-2, atol=0)
    assert fast.metrics["grad/norm"] == pytest.approx(per_trajectory.metrics["grad/norm"], rel=1e-2)


BATCH_STATISTIC_ALGOS = {
    "reinforce": {"objective": {"type": "reinforce"}, "group_size": 3},
    "dr_grpo": {"objective": {"type": "dr_grpo"}, "group_size": 3},
    "m2po": {"objective": {"type": "m2po", "tau": 0.001}, "group_size": 3},
}
"""Objectives whose loss takes statistics of the whole minibatch across groups (REINFORCE's mean, Dr. GRPO's
constant N, M2PO's mask: τ small enough to mask tokens of the parity batch)."""


@pytest.mark.parametrize("name", list(BATCH_STATISTIC_ALGOS))
def test_micro_batches_take_the_minibatch_statistics_as_the_torch_learner_in_one_micro_batch(
        megatron_world: None, checkpoints: dict[str, Path], name: str) -> None:
    """The megatron learner reuses the torch learner's step: at a budget of several micro-batches it takes
    the step the torch learner takes with the whole minibatch in one."""
    from learner.backends.megatron.learner import MegatronLearner
    from learner.backends.torch_learner import TorchLearner
    from learner.forward.varlen_attention import register_varlen_sdpa
    from tests.learner.megatron_cpu import cuda_on_cpu

    algo = AlgoConfig.model_validate(BATCH_STATISTIC_ALGOS[name])
    batch = megatron_parity.parity_batch("llama_tied")
    model = tiny_model("llama_tied", attn_implementation=register_varlen_sdpa()).train()
    want = megatron_parity.run_step(
        TorchLearner(model, algo, megatron_parity.OPTIM, micro_batch_tokens=1_000_000), batch)
    with cuda_on_cpu():
        learner = MegatronLearner(checkpoints["llama_tied"], algo, megatron_parity.OPTIM, MegatronConfig(),
                                  micro_batch_tokens=megatron_parity.MICRO_BATCH_TOKENS)
    got = _step(learner, batch)
    assert want.metrics.pop("train/micro_batches") == 1 and got.metrics.pop("train/micro_batches") > 1
    assert got.metrics["grad/norm"] > 0.1
    _assert_same_step(got, want)


def test_two_steps_with_weight_exports_between_match_the_torch_learner(megatron_world: None,
                                                                        checkpoints: dict[str, Path]) -> None:
    """As in training: step, export the weights for the engines, step again (the second from the first's
    optimizer state and updated weights)."""
    batch = megatron_parity.parity_batch("llama_tied")
    reference = megatron_parity.torch_learner("llama_tied", "vcpo")
    learner = _megatron_learner(checkpoints["llama_tied"], "vcpo")
    for _ in range(2):
        want, got = megatron_parity.run_step(reference, batch), _step(learner, batch)
        _assert_same_step(got, want)


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_resuming_from_state_dict_continues_exactly(megatron_world: None, checkpoints: dict[str, Path],
                                                   use_distributed_optimizer: bool) -> None:
    from tests.learner.megatron_cpu import cuda_on_cpu

    batch = megatron_parity.parity_batch("llama_tied")
    first = _megatron_learner(checkpoints["llama_tied"], "grpo",
                              use_distributed_optimizer=use_distributed_optimizer)
    _step(first, batch)
    buffer = io.BytesIO()  # through serialisation, as a checkpoint: no tensor shared with `first`
    with cuda_on_cpu():
        torch.save(first.state_dict(), buffer)
    resumed = _megatron_learner(checkpoints["llama_tied"], "grpo",
                                use_distributed_optimizer=use_distributed_optimizer)
    buffer.seek(0)
    with cuda_on_cpu():
        resumed.load_state_dict(torch.load(buffer, weights_only=False))
    assert resumed.step_count == 1
    want, got = _step(first, batch), _step(resumed, batch)
    for name, weight in want.weights.items():
        torch.testing.assert_close(got.weights[name], weight, rtol=0, atol=0, msg=name)


def test_save_pretrained_writes_an_hf_directory_of_the_current_weights(
        megatron_world: None, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.learner.megatron_cpu import cuda_on_cpu

    learner = _megatron_learner(checkpoints["qwen2"], "grpo")
    trained = _step(learner, megatron_parity.parity_batch("qwen2")).weights
    with cuda_on_cpu():
        learner.save_pretrained(tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    assert set(reloaded) == set(trained)
    for name, weight in trained.items():
        torch.testing.assert_close(reloaded[name], weight, rtol=0, atol=0, msg=name)


def test_objectives_needing_a_reference_model_are_refused(megatron_world: None,
                                                          checkpoints: dict[str, Path]) -> None:
    from learner.backends.megatron.learner import MegatronLearner
    from tests.learner.megatron_cpu import cuda_on_cpu

    algo = AlgoConfig.model_validate({"objective": {"type": "grpo"}, "group_size": 3, "kl_coef": 0.1})
    with cuda_on_cpu(), pytest.raises(ValueError, match="kl_coef=0"):
        MegatronLearner(checkpoints["llama_tied"], algo, megatron_parity.OPTIM, MegatronConfig(),
                        micro_batch_tokens=64)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_tensor_parallel_2_under_torchrun_matches_the_torch_learner(checkpoints: dict[str, Path], kind: str,
                                                                   tmp_path: Path) -> None:
    """TP = 2: every sharded quantity is gathered or summed back to the torch learner's value; VCPO's
    ‖∇ℓ_i‖² — on the fast path, each rank's hooks on its shards — is the sum of the two ranks' partial sums,
    the replicated RMSNorm weights counted once, the tied embedding's and output product's vocabulary
    shards each on their rank (Qwen2: untied, its qkv bias split with the output)."""
    _needs_megatron()
    results = megatron_parity.run_tp_worker(
        [str(checkpoints[kind]), kind, str(tmp_path / "tp2.pt")], timeout=300,
        env={"OMP_NUM_THREADS": "1"})
    batch = megatron_parity.parity_batch(kind)
    for name in ("grpo", "vcpo", "vcpo_reference"):  # the reference form needs whole norms too
        got = results[name]
        assert got["shards"] == [(80, 48), (80, 48)]  # the 160-token vocabulary split over the 2 ranks
        want = megatron_parity.run_step(megatron_parity.torch_learner(kind, name), batch)
        _assert_same_step(megatron_parity.StepRecord(got["metrics"], got["sq_norms"], got["weights"]), want)
    assert results["vcpo"]["fast_norms"] and results["vcpo_reference"]["fast_norms"]
    rank0, rank1 = results["vcpo"]["partials"]
    assert (rank0 > 0).all() and (rank1 > 0).all()  # both shards carry part of every trajectory's norm
    torch.testing.assert_close(rank0 + rank1, results["vcpo"]["sq_norms"], rtol=1e-6, atol=0)
    # the check has teeth: counting the replicated weights twice would move every norm by more than 10×
    # the tolerance (their share is ~2e-4 here)
    replicated = _replicated_share(kind, batch)
    assert (replicated / want.sq_norms > 10 * NORM_RTOL).all()


def test_data_parallel_2_under_torchrun_matches_the_torch_learner(checkpoints: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    """TP = 1, two data-parallel replicas (the 3 groups dealt 2 + 1): gradients summed over the replicas
    — reduce-scattered into the distributed optimizer's shards for VCPO — give the torch learner's step;
    the replicas end identical; each one's ‖∇ℓ_i‖² covers its own groups."""
    _needs_megatron()
    results = megatron_parity.run_tp_worker(
        [str(checkpoints["llama_tied"]), "llama_tied", str(tmp_path / "dp2.pt"), "--layout=1,1,1"],
        timeout=300, env={"OMP_NUM_THREADS": "1"})
    batch = megatron_parity.parity_batch("llama_tied")
    for name in ("grpo", "vcpo"):
        got = results[name]
        assert got["shards"] == [(160, 48), (160, 48)]  # TP = 1: every replica holds the whole model
        replica0, replica1 = got["rank_weights"]
        assert all(torch.equal(replica0[key], replica1[key]) for key in replica0)
        metrics = dict(got["metrics"])
        assert metrics.pop("train/dp_ranks") == 2 and metrics.pop("train/dp_max_rank_tokens_over_mean") > 1
        assert got["fast_norms"] == (name == "vcpo")  # whole layers on each replica: the fast path
        want = megatron_parity.run_step(megatron_parity.torch_learner("llama_tied", name), batch)
        sq_norms = None
        if want.sq_norms is not None:
            part0, part1 = got["rank_sq_norms"]
            assert ((part0 > 0) ^ (part1 > 0)).all() and (part0 > 0).any() and (part1 > 0).any()
            sq_norms = part0 + part1
        _assert_same_step(megatron_parity.StepRecord(metrics, sq_norms, got["weights"]), want)


@pytest.mark.parametrize(("kind", "stages", "recompute"), [
    ("llama_tied", 2, None), ("qwen2", 2, "full"), ("llama_tied", 3, None)])
def test_pipeline_parallel_under_torchrun_matches_the_torch_learner(checkpoints: dict[str, Path], kind: str,
                                                                   stages: int, recompute: str | None,
                                                                   tmp_path: Path) -> None:
    """PP = 2 and 3 (one layer per stage; 3 has a middle stage that both receives and sends): hidden
    states and their gradients sent between the stages, logits broadcast from the last. Every rank takes
    the torch learner's step; VCPO's ‖∇ℓ_i‖² — on the fast path, each stage's hooks on its own layers — is
    the sum of the stages' partial sums and equals the per-trajectory path's on the same layout. Tied
    (llama_tied): the last stage's copy of the embedding gets the output layer's gradient, the two copies'
    gradients are summed into the update and, before squaring, into the norm — on the fast path through the
    cross term, the last stage's rows sent to the first. Counting the copies apart in the norm (the fast
    path without the cross term included), or leaving their gradients unsummed, fails this test (tried).
    Qwen2 runs with megatron's full activation recompute: each stage's hooks take their layer's input in the
    recompute."""
    _needs_megatron()
    hf_dir = (checkpoints[kind] if stages == 2
              else megatron_parity.write_checkpoint(kind, tmp_path / f"{kind}-{stages}", layers=stages))
    flags = ["--per-trajectory"] + ([f"--recompute={recompute}"] if recompute else [])
    results = megatron_parity.run_tp_worker(
        [str(hf_dir), kind, str(tmp_path / "pp.pt"), f"--layout=1,{stages},1", *flags], timeout=300,
        env={"OMP_NUM_THREADS": "1"}, ranks=stages)
    batch = megatron_parity.parity_batch(kind, layers=stages)
    assert results["vcpo"]["fast_norms"] and not results["vcpo_per_trajectory"]["fast_norms"]
    torch.testing.assert_close(results["vcpo"]["sq_norms"], results["vcpo_per_trajectory"]["sq_norms"],
                               rtol=NORM_RTOL, atol=0)
    for name in ("grpo", "vcpo", "vcpo_per_trajectory"):
        got = results[name]
        assert got["layers"] == [1] * stages  # the layers split over the stages
        # the embedding on the first stage, the output layer on the last, neither in between
        assert got["shards"] == [(160, 48)] + [None] * (stages - 2) + [(160, 48)]
        assert all(torch.equal(rank[key], weight) for rank in got["rank_weights"]
                   for key, weight in got["weights"].items())  # every stage exports the same whole model
        want = megatron_parity.run_step(megatron_parity.torch_learner(kind, name, layers=stages), batch)
        _assert_same_step(megatron_parity.StepRecord(got["metrics"], got["sq_norms"], got["weights"]), want)
    partials = results["vcpo"]["partials"]
    assert all((partial > 0).all() for partial in partials)  # every stage carries part of every norm
    torch.testing.assert_close(sum(partials), results["vcpo"]["sq_norms"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", ["llama_tied", "qwen2"])
def test_context_parallel_2_under_torchrun_matches_the_torch_learner(checkpoints: dict[str, Path], kind: str,
                                                                    tmp_path: Path) -> None:
    """CP = 2: each rank runs half of every packed row (padded to even length), attention gathers the
    keys and values of the whole row, the halves' target logits are gathered. The ranks' partial
    gradients summed (DDP over the data × context group) give the torch learner's update; VCPO's
    ‖∇ℓ_i‖² is of the summed per-trajectory gradient — the same on both ranks, not a sum of two shares.
    On the fast path each rank's hooks see its half; the trajectories that cross the middle of a row
    (the batch has some, and some that do not) have their partial gradients summed over the ranks before
    the norm — equal to the per-trajectory path's norms on the same layout (summing the ranks' squares
    instead misses them by up to 3%: tried)."""
    _needs_megatron()
    results = megatron_parity.run_tp_worker(
        [str(checkpoints[kind]), kind, str(tmp_path / "cp2.pt"), "--layout=1,1,2", "--per-trajectory"],
        timeout=300, env={"OMP_NUM_THREADS": "1"})
    batch = megatron_parity.parity_batch(kind)
    assert _crossing_counts(kind, batch, ranks=2) == (True, True)
    assert results["vcpo"]["fast_norms"] and not results["vcpo_per_trajectory"]["fast_norms"]
    torch.testing.assert_close(results["vcpo"]["sq_norms"], results["vcpo_per_trajectory"]["sq_norms"],
                               rtol=NORM_RTOL, atol=0)
    for name in ("grpo", "vcpo", "vcpo_per_trajectory"):
        got = results[name]
        assert got["shards"] == [(160, 48), (160, 48)]  # CP keeps every weight whole on every rank
        assert all(torch.equal(rank[key], weight) for rank in got["rank_weights"]
                   for key, weight in got["weights"].items())
        want = megatron_parity.run_step(megatron_parity.torch_learner(kind, name), batch)
        _assert_same_step(megatron_parity.StepRecord(got["metrics"], got["sq_norms"], got["weights"]), want)
    rank0, rank1 = results["vcpo"]["rank_sq_norms"]
    torch.testing.assert_close(rank0, rank1, rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["1,2,2", "2,2,1"])
def test_combined_layouts_with_tied_weights_match_the_torch_learner(checkpoints: dict[str, Path], layout: str,
                                                                    tmp_path: Path) -> None:
    """4 ranks, TP,PP,CP = 1,2,2: each stage's chunk goes to the same CP rank of the next stage, the tied
    embedding's copies summed after the CP sum; 2,2,1: the vocabulary shards of the embedding and of the
    last stage's copy of it pair up rank by rank. Both on VCPO's fast norm path too — each last stage
    sends its rows for the tied cross term to the first stage of its own TP and CP rank — with the
    per-trajectory path's norms on the same layout."""
    _needs_megatron()
    results = megatron_parity.run_tp_worker(
        [str(checkpoints["llama_tied"]), "llama_tied", str(tmp_path / "combined.pt"), f"--layout={layout}",
         "--per-trajectory"], timeout=300, env={"OMP_NUM_THREADS": "1"}, ranks=4)
    batch = megatron_parity.parity_batch("llama_tied")
    assert results["vcpo"]["fast_norms"] and not results["vcpo_per_trajectory"]["fast_norms"]
    torch.testing.assert_close(results["vcpo"]["sq_norms"], results["vcpo_per_trajectory"]["sq_norms"],
                               rtol=NORM_RTOL, atol=0)
    for name in ("grpo", "vcpo"):
        got = results[name]
        want = megatron_parity.run_step(megatron_parity.torch_learner("llama_tied", name), batch)
        _assert_same_step(megatron_parity.StepRecord(got["metrics"], got["sq_norms"], got["weights"]), want)


def _crossing_counts(kind: str, batch: StepInput, ranks: int) -> tuple[bool, bool]:
    """Whether the torch learner's packing of `batch` has trajectories that cross a boundary of `ranks`
    contiguous chunks of their row, and trajectories that do not."""
    from learner.traj_grads.split_rows import shared_trajectories

    learner = megatron_parity.torch_learner(kind, "vcpo")
    crossing = inside = False
    for mb in learner._pack(learner._tokens(batch)):
        shared = shared_trajectories(mb.seq_lengths, -(-mb.num_tokens // ranks))
        crossing |= bool(shared)
        inside |= len(shared) < mb.num_trajectories
    return crossing, inside


def _replicated_share(kind: str, batch: StepInput) -> torch.Tensor:
    """Per trajectory, the part of the torch learner's ‖∇ℓ_i‖² from the 1-D (RMSNorm) weights, which
    every TP rank holds whole."""
    learner = megatron_parity.torch_learner(kind, "vcpo")
    microbatches = learner._pack(learner._tokens(batch))
    replicated = [p for p in learner.model.parameters() if p.ndim == 1]
    shares = torch.zeros(len(batch.trajectories))
    for mb in microbatches:
        for j in range(mb.num_trajectories):
            single = mb.select(j)
            loglik = trajectory_logliks(packed_target_logprobs(learner.model, single), single)[0]
            grads = torch.autograd.grad(loglik, replicated)
            shares[int(mb.trajectory_indices[j])] = sum(float(g.square().sum()) for g in grads)
    return shares


def test_building_the_megatron_backend_without_cuda_says_what_to_do(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the refusal is for CPU-only machines")
    from run.train.learner_setup import build_learner

    config = RunConfig.model_validate({"learner": {"backend": "megatron"}})
    with pytest.raises(ValueError, match=r"learner\.backend='torch'"):
        build_learner(config, task=None, cache_dir=tmp_path)  # type: ignore[arg-type]
