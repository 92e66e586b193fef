"""Uneven plans on gloo: stages with different replica counts train like the unsplit model.

3 ranks, 2 stages: replicas (2, 1) (stage 0 on ranks 0 and 1, stage 1 on rank 2) and (1, 2);
5 ranks: (2, 3) and (3, 2), whose slices overlap in part, and 3 stages (1, 3, 1).
GPT-2 (tied embeddings: wte in both stages, summed over 3 ranks), Llama (rotary cos/sin cross
without batch dim, from their owner), BERT and T5 (masks, the encoder output and T5's position
bias cross), and GatedNet (a batch-less boundary tensor that needs a
gradient: summed by its owner, zero on the replica that serves nobody). Three AdamW steps equal
unsplit full-batch training; one run continues from a checkpoint under the other layout, one
starts from a model built on meta (seed checkpoint), and a non-finite loss names its samples. A plan made for a mixed cluster (its stages on different
device groups, read back from its plan file) trains the same way, and so do plans whose replicas of
one stage take unequal sample shares (replicas of unequal speed): in the first stage, in the last
(each slice's loss weighted by its samples; GPT-2 with labels padded to a different length in every
sample, BERT's ignored labels, GatedNet under a mean squared error, and a stage sharded by FSDP2), on
5 ranks with shares on both sides of the cut, and with the first stage on the second device group.
Replicas that are tensor-parallel groups of 2 ranks train the same way on partita's executor (4 and 6
ranks: TENSOR_PARALLEL, TENSOR_PARALLEL_WIDE), and so do stages of different degrees on 4 ranks (a
TP-2 stage beside two replicas of degree 1, either way round, GPT-2's tied embedding read at both
degrees), also the mixed search's own such plan.
"""

from __future__ import annotations

import pytest
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5
MODELS = ["gpt2", "llama", "gated", "bert", "t5"]  # BERT: the attention mask crosses; T5: the encoder output
# run by the configs that name them only: GPT-2 with padded labels (-100 to a different length in every
# sample), GatedNet with a mean squared error (averaged slices, not counted over the global batch)
ALL_MODELS = MODELS + ["gpt2-padded", "gated-mse"]
CONFIGS = [
    dict(label="1f1b-2x1", schedule="1f1b", replicas=(2, 1), num_microbatches=2),
    dict(
        label="gpipe-1x2-recompute",
        schedule="gpipe",
        replicas=(1, 2),
        num_microbatches=2,
        recompute=["selective", "full"],  # the uneven executor's runners at both levels
        models=["gpt2", "gated"],
    ),
    dict(
        label="1f1b-2x1-resume-gpipe-1x2",
        schedule="1f1b",
        replicas=(2, 1),
        num_microbatches=2,
        models=["gpt2"],
        # resumed under unequal shares: checkpoints do not depend on how a micro-batch is split
        resume=dict(schedule="gpipe", replicas=(1, 2), num_microbatches=2, replica_samples=[None, (3, 1)]),
    ),
    dict(label="1f1b-2x1-meta", schedule="1f1b", replicas=(2, 1), num_microbatches=2, meta=True, models=["llama"]),
    # a plan for a mixed cluster: stage 0 on the two H100s, stage 1 on the L4 (issue 30)
    dict(
        label="1f1b-2x1-device-groups",
        schedule="1f1b",
        replicas=(2, 1),
        num_microbatches=2,
        groups=[("h100", 2), ("l4", 1)],
        models=["gpt2", "bert"],
    ),
    # unequal sample shares (issue 30): stage 0's replicas, an H100 and an A100, run 3 and 1 samples of
    # every micro-batch of 4; stage 1 runs on the other A100
    dict(
        label="1f1b-2x1-shares",
        schedule="1f1b",
        replicas=(2, 1),
        num_microbatches=2,
        replica_samples=[(3, 1), None],
        groups=[("h100", 1), ("a100-40gb", 2)],
        models=["gpt2"],
    ),
    # the last stage's replicas take 1 and 3 samples: each slice's loss is weighted by its samples
    dict(
        label="gpipe-1x2-shares",
        schedule="gpipe",
        replicas=(1, 2),
        num_microbatches=2,
        replica_samples=[None, (1, 3)],
        models=["gpt2-padded", "bert", "gated-mse"],
    ),
    # the same under FSDP2 (the last stage fully sharded over its replicas of unequal shares)
    dict(
        label="1f1b-1x2-shares-sharded",
        schedule="1f1b",
        replicas=(1, 2),
        num_microbatches=2,
        replica_samples=[None, (3, 1)],
        sharding=["replicate", "full_shard"],
        models=["llama"],
    ),
    # ranks follow the device groups: stage 0 on the two A100s (ranks 1 and 2), stage 1 on the H100 (rank 0)
    dict(
        label="1f1b-2x1-slow-group-first",
        schedule="1f1b",
        replicas=(2, 1),
        num_microbatches=2,
        groups=[("h100", 1), ("a100-40gb", 2)],
        group_counts=[(0, 2), (1, 0)],
        models=["gpt2", "gated-mse"],
    ),
]
# Every stage on one replica, the slow group's first (rank 1, then rank 0): not a pp x dp mesh's order,
# so partita's executor runs it (``Plan.on_mesh``), as a mixed plan with the second group first
REVERSED = [
    dict(
        label=f"{schedule}-1x1-slow-group-first",
        schedule=schedule,
        replicas=(1, 1),
        num_microbatches=2,
        groups=[("h100", 1), ("a100-40gb", 1)],
        group_counts=[(0, 1), (1, 0)],
        models=["gpt2", "gated-mse"],
    )
    for schedule in ("gpipe", "1f1b")
]
REVERSED_KEYS = [f"{m}/{c['label']}" for c in REVERSED for m in c["models"]]
# Tensor parallelism on partita's executor (4 ranks, issue 30): replicas are groups of 2 ranks of one
# device type. Two stages of one group each, the A100s' stage first (ranks 2-3, then 0-1), with and
# without sequence parallelism; one stage whose two groups (the H100s, the A100s) take 3 and 1
# samples of each micro-batch, GPT-2's labels padded to a different length in every sample, its
# checkpoint resumed under a plan of 2 x 2 ranks without tensor parallelism, again fully sharded
# over its replicas, and with sequence parallelism and sharded gradients and optimizer state.
# Gradients clipped.
TENSOR_PARALLEL = [
    dict(
        label="1f1b-1x1-tp2-slow-group-first",
        schedule="1f1b",
        replicas=(1, 1),
        num_microbatches=2,
        tensor_parallel=2,
        groups=[("h100", 2), ("a100-40gb", 2)],
        group_counts=[(0, 2), (2, 0)],
        max_grad_norm=0.5,  # clipped: the gradient norm sums the split parameters' squares over each group
        models=["gpt2", "llama"],
    ),
    dict(
        label="gpipe-1x1-tp2-sp-slow-group-first",
        schedule="gpipe",
        replicas=(1, 1),
        num_microbatches=2,
        tensor_parallel=2,
        sequence_parallel=True,
        groups=[("h100", 2), ("a100-40gb", 2)],
        group_counts=[(0, 2), (2, 0)],
        models=["gpt2"],
    ),
    dict(
        label="1f1b-2-tp2-shares",
        schedule="1f1b",
        replicas=(2,),
        num_microbatches=2,
        tensor_parallel=2,
        replica_samples=[(3, 1)],
        groups=[("h100", 2), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["gpt2-padded", "llama"],
        # the checkpoint continues under a one-type plan without tensor parallelism
        resume=dict(schedule="gpipe", replicas=(2, 2), num_microbatches=2),
    ),
    # the same stage fully sharded (FSDP2) over its two replicas, one group per index
    dict(
        label="gpipe-2-tp2-shares-sharded",
        schedule="gpipe",
        replicas=(2,),
        num_microbatches=2,
        tensor_parallel=2,
        replica_samples=[(1, 3)],
        sharding="full_shard",
        groups=[("h100", 2), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["llama"],
    ),
    # unequal shares with sequence parallelism, gradients and optimizer state sharded (FSDP2's
    # shard_grads_and_optimizer) over the replicas
    dict(
        label="1f1b-2-tp2-sp-shares-sharded-grads",
        schedule="1f1b",
        replicas=(2,),
        num_microbatches=2,
        tensor_parallel=2,
        sequence_parallel=True,
        replica_samples=[(3, 1)],
        sharding="shard_grads_and_optimizer",
        groups=[("h100", 2), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["gpt2-padded"],
    ),
]
# stages of different tensor-parallel degrees (each device type its own, issue 30): a TP-2 group of H100s
# then two A100 replicas without tensor parallelism (GPT-2's tied embedding read at degrees 2 and 1:
# whole in both, its gradient summed over all holders), resumed under a plan without tensor parallelism;
# and the other way round, the two replicas with unequal shares and the TP-2 stage sequence-parallel
TENSOR_PARALLEL += [
    dict(
        label="1f1b-1x2-tp2-then-tp1",
        schedule="1f1b",
        replicas=(1, 2),
        num_microbatches=2,
        tensor_parallel=(2, 1),
        groups=[("h100", 2), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["gpt2", "llama"],
        resume=dict(schedule="gpipe", replicas=(2, 2), num_microbatches=2),
    ),
    dict(
        label="gpipe-2x1-tp1-shares-then-tp2-sp",
        schedule="gpipe",
        replicas=(2, 1),
        num_microbatches=2,
        tensor_parallel=(1, 2),
        sequence_parallel=True,
        replica_samples=[(3, 1), None],
        groups=[("a100-40gb", 2), ("h100", 2)],
        max_grad_norm=0.5,
        models=["gpt2-padded", "llama"],
    ),
    # FSDP2 next to a stage of another degree: the two A100 replicas at degree 1 fully sharded after the
    # H100s' TP-2 stage, and, the other way round, gradients and optimizer state sharded over unequal shares
    dict(
        label="1f1b-1x2-tp2-then-tp1-sharded",
        schedule="1f1b",
        replicas=(1, 2),
        num_microbatches=2,
        tensor_parallel=(2, 1),
        sharding=["replicate", "full_shard"],
        groups=[("h100", 2), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["llama"],
    ),
    dict(
        label="gpipe-2x1-tp1-shares-sharded-grads-then-tp2",
        schedule="gpipe",
        replicas=(2, 1),
        num_microbatches=2,
        tensor_parallel=(1, 2),
        replica_samples=[(1, 3), None],
        sharding=["shard_grads_and_optimizer", "replicate"],
        groups=[("a100-40gb", 2), ("h100", 2)],
        max_grad_norm=0.5,
        models=["llama"],
    ),
    # the mixed search's own plan with the A100s at degree 1 and the H100s at 2 (planned here: its
    # stages, shares, schedule and sequence parallelism are the planner's)
    dict(
        label="planned-tp2-h100-tp1-a100",
        planned_degrees=(2, 1),
        groups=[("h100", 2), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["gpt2", "llama"],
    ),
]
# 6 ranks: stages of different replica counts of TP-2 groups (2 then 1; GPT-2's tied embedding in both),
# recomputing selectively and fully on partita's executor
TENSOR_PARALLEL_WIDE = [
    dict(
        label="1f1b-2x1-tp2-recompute",
        schedule="1f1b",
        replicas=(2, 1),
        num_microbatches=2,
        tensor_parallel=2,
        recompute=["selective", "full"],
        groups=[("h100", 4), ("a100-40gb", 2)],
        max_grad_norm=0.5,
        models=["gpt2"],
    ),
]
TENSOR_PARALLEL_KEYS = [f"{m}/{c['label']}" for c in TENSOR_PARALLEL for m in c["models"]]
TENSOR_PARALLEL_WIDE_KEYS = [f"{m}/{c['label']}" for c in TENSOR_PARALLEL_WIDE for m in c["models"]]
NONFINITE = dict(
    label="gpipe-1x2-nonfinite", schedule="gpipe", replicas=(1, 2), num_microbatches=2, nonfinite=True, models=["gated"]
)
KEYS = [f"{m}/{c['label']}" for m in ALL_MODELS for c in CONFIGS if m in c.get("models", MODELS)]
# 5 ranks, global batch 12: stages of 2 and 3 replicas share samples only in part (6 samples per
# micro-batch: slices 0-2 | 3-5 against 0-1 | 2-3 | 4-5); three stages fan out 1 -> 3 and in 3 -> 1.
WIDE_MODELS = ["gpt2", "llama"]
WIDE_CONFIGS = [
    dict(label="1f1b-2x3-clipped", schedule="1f1b", replicas=(2, 3), num_microbatches=2, max_grad_norm=0.5),
    dict(label="1f1b-1x3x1", schedule="1f1b", replicas=(1, 3, 1), num_microbatches=4, models=["gpt2"]),
    dict(
        label="gpipe-3x2-recompute",
        schedule="gpipe",
        replicas=(3, 2),
        num_microbatches=2,
        recompute=[True, False],
        models=["llama"],
    ),
    # unequal shares on both sides of the cut: slices 0-3 | 4-5 against 0 | 1-2 | 3-5
    dict(
        label="1f1b-2x3-shares",
        schedule="1f1b",
        replicas=(2, 3),
        num_microbatches=2,
        replica_samples=[(4, 2), (1, 2, 3)],
        models=["gpt2"],
    ),
]
WIDE_KEYS = [f"{m}/{c['label']}" for m in WIDE_MODELS for c in WIDE_CONFIGS if m in c.get("models", WIDE_MODELS)]
# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "results": Job(
        "workers:job_uneven",
        3,
        330,
        dict(models=ALL_MODELS, default_models=MODELS, configs=CONFIGS + [NONFINITE]),
        ("dir",),
    ),
    "reversed_results": Job(
        "workers:job_uneven", 2, 200, dict(models=["gpt2", "gated-mse"], configs=REVERSED), ("dir",)
    ),
    "tensor_parallel_results": Job(
        "workers:job_uneven", 4, 300, dict(models=["gpt2", "gpt2-padded", "llama"], configs=TENSOR_PARALLEL), ("dir",)
    ),
    "tensor_parallel_wide_results": Job(
        "workers:job_uneven", 6, 300, dict(models=["gpt2"], configs=TENSOR_PARALLEL_WIDE), ("dir",)
    ),
    "wide_results": Job(
        "workers:job_uneven", 5, 300, dict(models=WIDE_MODELS, configs=WIDE_CONFIGS, batch_size=12), ("dir",)
    ),
}


@pytest.fixture(scope="module")
def results(launches):
    return launches.results_of(__name__, "results")


@pytest.fixture(scope="module")
def wide_results(launches):
    return launches.results_of(__name__, "wide_results")


@pytest.mark.parametrize("key", KEYS)
def test_uneven_replicas_train_like_the_unsplit_model(results, key):
    check_like_unsplit(results, key)


@pytest.fixture(scope="module")
def reversed_results(launches):
    return launches.results_of(__name__, "reversed_results")


@pytest.mark.parametrize("key", REVERSED_KEYS)
def test_stages_in_the_other_order_of_the_ranks_train_like_the_unsplit_model(reversed_results, key):
    check_like_unsplit(reversed_results, key)


@pytest.fixture(scope="module")
def tensor_parallel_results(launches):
    return launches.results_of(__name__, "tensor_parallel_results")


@pytest.fixture(scope="module")
def tensor_parallel_wide_results(launches):
    return launches.results_of(__name__, "tensor_parallel_wide_results")


@pytest.mark.parametrize("key", TENSOR_PARALLEL_KEYS)
def test_tensor_parallel_groups_on_device_groups_and_unequal_shares_train_like_the_unsplit_model(
    tensor_parallel_results, key
):
    check_like_unsplit(tensor_parallel_results, key)


@pytest.mark.parametrize("key", TENSOR_PARALLEL_WIDE_KEYS)
def test_tensor_parallel_stages_of_different_replica_counts_train_like_the_unsplit_model(
    tensor_parallel_wide_results, key
):
    check_like_unsplit(tensor_parallel_wide_results, key)


@pytest.mark.parametrize("key", WIDE_KEYS)
def test_partial_overlaps_three_stages_and_clipping_train_like_the_unsplit_model(wide_results, key):
    check_like_unsplit(wide_results, key)


def check_like_unsplit(results, key):
    mine = results[0][key]
    assert len(mine["losses"]) == len(mine["ref_losses"])
    assert max(abs(a - b) for a, b in zip(mine["losses"], mine["ref_losses"])) <= TOLERANCE, mine
    assert all(r[key]["losses"] == mine["losses"] for r in results), "every rank returns the same losses"
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from the unsplit model's by {diff:.3g}"


def test_a_nonfinite_loss_names_its_slice_on_every_rank(results):
    """Samples 6-7 are inf: micro-batch 1 (samples 4-7) of replica 1 of the last stage (2 replicas)."""
    key = f"gated/{NONFINITE['label']}"
    messages = {r[key]["raised"] for r in results}
    assert len(messages) == 1, "every rank raises the same NumericsError"
    message = messages.pop()
    assert message is not None, "no NumericsError was raised"
    assert "micro-batch 1 of replica 1 (samples 6-7 of the global batch) gave nan" in message, message


def test_partita_train_plans_and_trains_on_three_processes(tmp_path, machine_cache):
    """The command users run: plan for 3 processes with 2 pinned 1F1B stages (an uneven 2 + 1 or
    1 + 2 layout uses all three; a uniform one only two, and then only two processes start),
    build the model on meta in every rank, and train 3 steps."""
    import json
    import os
    import subprocess
    import sys

    from dist_launch import REPO

    losses = tmp_path / "losses.json"
    argv = [
        sys.executable,
        "-m",
        "partita.cli",
        "train",
        "gpt2",
        "--nproc",
        "3",
        "--num-stages",
        "2",
        "--schedule",
        "1f1b",
        "--global-batch",
        "12",
        "--steps",
        "3",
        "--losses-out",
        str(losses),
        "--plan-out",
        str(tmp_path / "plan.json"),
        "--cache-dir",
        str(machine_cache),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recorded = json.loads(losses.read_text())["losses"]
    assert len(recorded) == 3 and recorded[-1] < recorded[0]
    plan = json.loads((tmp_path / "plan.json").read_text())
    started = len({r for stage in plan["stages"] for r in stage["ranks"]})
    assert "stages on 2 rank groups" in done.stdout and (started == 3 or "starting 2 processes" in done.stdout)
