"""Data-parallel torch learner (learner/distributed/data_parallel.py): two
replicas under torchrun (gloo, CPU) take
exactly the single-process step — same metrics, same weights after the step, VCPO's per-trajectory
norms split disjointly between the ranks — and stay identical to each other. The single process trains
the minibatch in ONE micro-batch, so every statistic a replica's loss takes from the minibatch (group and
batch statistics, masks, bounds, denominators) must be the whole minibatch's, not its own groups'.

Tolerances as the megatron parity tests (fp32; only the summation order differs): metrics 1e-5
relative, ‖∇ℓ_i‖² 1e-5 relative, weights after one Adam step at lr 1e-3 1e-5 absolute.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from learner.distributed.data_parallel import assign_groups
from tests.learner import dp_worker, megatron_parity

METRIC_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5


def test_groups_go_largest_first_to_the_least_loaded_rank() -> None:
    tokens = {0: 100, 1: 300, 2: 200, 3: 100, 4: 50}
    owner = assign_groups(tokens, 2)
    assert owner == {1: 0, 2: 1, 0: 1, 3: 0, 4: 1}  # loads 400 / 350
    assert assign_groups(tokens, 2) == owner  # deterministic: every rank computes the same
    assert assign_groups({7: 10, 8: 10}, 2) == {7: 0, 8: 1}  # ties: first seen, lowest rank
    assert set(assign_groups({0: 5}, 4).values()) == {0}  # fewer groups than ranks: the rest idle
    assert assign_groups(tokens, 1) == dict.fromkeys(tokens, 0)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp") / "result"
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(dp_worker.__file__)), str(out)]
    run = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("name", list(dp_worker.ALGOS))
def test_two_replicas_take_the_single_process_step(replicas: list[dict], name: str) -> None:
    batch = dp_worker.batch(name)
    want = megatron_parity.run_step(dp_worker.learner(name, None, micro_batch_tokens=1_000_000), batch)
    # one micro-batch; a degenerate group is packed apart, into a second
    assert want.metrics["train/micro_batches"] == (2 if name.endswith("_degenerate") else 1)
    rank0, rank1 = replicas[0][name], replicas[1][name]

    for key in rank0["weights"]:  # replicas never drift: identical gradients, identical updates
        assert torch.equal(rank0["weights"][key], rank1["weights"][key]), key
    initial = dict(dp_worker.learner(name, None).named_weights())
    moved = max(float((want.weights[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 50 * WEIGHT_ATOL  # the comparison below is about a real update (Adam: ~lr per weight)
    for key, tensor in want.weights.items():
        torch.testing.assert_close(rank0["weights"][key], tensor, rtol=0, atol=WEIGHT_ATOL)

    got = rank0["metrics"]
    assert got["train/dp_ranks"] == 2 and got["train/dp_max_rank_tokens_over_mean"] > 1  # 3 groups on 2
    assert set(got) - set(want.metrics) == {"train/dp_ranks", "train/dp_max_rank_tokens_over_mean"}
    for key, value in want.metrics.items():
        if key != "train/micro_batches":
            assert got[key] == pytest.approx(value, rel=METRIC_RTOL, abs=1e-6, nan_ok=True), key
    if name.endswith("_corrected"):  # the stages did act on this batch
        assert 0 < want.metrics["correction/rejected_tokens"] < 0.8
    assert got["train/micro_batches"] > 1  # the replicas did split the minibatch

    if name.endswith("_degenerate"):  # one group left out of the gradient pass, counted once over the ranks
        assert want.metrics["train/skipped_groups"] == 1 and got["train/skipped_groups"] == 1
    if want.sq_norms is not None:  # VCPO: each rank's norms cover its own groups only (a skipped one: 0)
        part0, part1 = rank0["sq_norms"], rank1["sq_norms"]
        computed = want.sq_norms > 0
        assert ((part0 > 0) ^ (part1 > 0))[computed].all() and not (part0 + part1)[~computed].any()
        assert (part0 > 0).any() and (part1 > 0).any()
        torch.testing.assert_close(part0 + part1, want.sq_norms, rtol=NORM_RTOL, atol=0)
