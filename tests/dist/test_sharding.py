"""Stages sharded with FSDP2 inside their replica group (workers_sharding.py), on 2 and 4 gloo ranks:
every level, with gradients accumulated whole or in shards, trains like unsplit full-batch training (AdamW, clipped, 3 steps, the second on a batch
padded to a shorter length than the plan's: the model captured again runs through the same FSDP2
modules), each rank keeping a 1/r shard; checkpoints written sharded load into a replicated trainer and into the plain model;
tied weights across a sharded stage are refused, and train exactly on replicated stages around
one that is sharded."""

from __future__ import annotations

import pytest
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5

TWO_RANKS = [
    dict(label="gpt2-zero3", model="gpt2", levels=["full_shard"], num_stages=1, replicas=2),
    # by block (issue 56): each of GPT-2's two layers its own FSDP2 unit, recomputed on its own
    dict(label="gpt2-zero3-full", model="gpt2", levels=["full_shard"], num_stages=1, replicas=2, recompute="full"),
    dict(
        label="gpt2-zero2-selective-grads-sharded",
        model="gpt2",
        levels=["shard_grads_and_optimizer"],
        num_stages=1,
        replicas=2,
        num_microbatches=2,
        recompute="selective",
        accumulation="sharded",  # each micro-batch's gradients reduce-scattered as its backward ends
    ),
    # GPT-2's first layer recomputed alone, the second keeping its tensors, in a sharded stage
    dict(
        label="gpt2-zero3-full-1-of-2-blocks",
        model="gpt2",
        levels=["full_shard"],
        num_stages=1,
        replicas=2,
        num_microbatches=2,
        recompute="full",
        recompute_blocks=1,
    ),
    dict(label="lm-zero3-2mb", model="tiny_lm", levels=["full_shard"], num_stages=1, replicas=2, num_microbatches=2),
]
FOUR_RANKS = [
    dict(label="lm-pp2-zero3", model="tiny_lm", levels=["full_shard", "full_shard"], num_stages=2, replicas=2),
    dict(
        label="lm-pp2-mixed",
        model="tiny_lm",
        levels=["shard_grads_and_optimizer", "replicate"],
        num_stages=2,
        replicas=2,
    ),
    dict(label="gpt2-pp2-tied", model="gpt2", levels=["full_shard", "full_shard"], num_stages=2, replicas=2),
    # gradients reduce-scattered every micro-batch under the schedules with several stages per rank
    # group: ZB-V's split backward (ZeRO-2) and interleaved 1F1B (ZeRO-3)
    dict(
        label="lm-zbv-zero2-grads-sharded",
        model="tiny_lm",
        levels=["shard_grads_and_optimizer"] * 4,
        num_stages=4,
        rank_groups=2,
        replicas=2,
        schedule="zbv",
        accumulation="sharded",
    ),
    dict(
        label="lm-interleaved-zero3-grads-sharded",
        model="tiny_lm",
        levels=["full_shard"] * 4,
        num_stages=4,
        rank_groups=2,
        replicas=2,
        schedule="interleaved1f1b",
        accumulation="sharded",
    ),
    # GPT-2's tied embedding and LM head on replicated stages 0 and 2 (rank 0, rank 3), the stage
    # between them fully sharded over ranks 1 and 2: what the planner offers under a pinned level
    dict(
        label="gpt2-tied-around-sharded",
        model="gpt2",
        levels=["replicate", "full_shard", "replicate"],
        num_stages=3,
        replicas=[1, 2, 1],
        num_microbatches=4,
    ),
]
UNEVEN = [  # stage 0 on rank 0, stage 1 sharded over ranks 1 and 2 (partita's uneven executor)
    dict(label="lm-uneven-zero3", model="tiny_lm", levels=["replicate", "full_shard"], replicas=[1, 2]),
    dict(
        label="lm-uneven-zero2",
        model="tiny_lm",
        levels=["replicate", "shard_grads_and_optimizer"],
        replicas=[1, 2],
        schedule="gpipe",
        num_microbatches=4,
        accumulation="sharded",
    ),
]
for config in UNEVEN:
    config.setdefault("num_stages", 2)
for config in TWO_RANKS + FOUR_RANKS + UNEVEN:
    config.setdefault("num_microbatches", 2 if config["num_stages"] > 1 else 1)
    config.setdefault("schedule", "1f1b" if config["num_stages"] > 1 else "gpipe")


@pytest.fixture(scope="module")
def two(launches):
    return launches.results_of(__name__, "two")


@pytest.fixture(scope="module")
def four(launches):
    return launches.results_of(__name__, "four")


@pytest.fixture(scope="module")
def uneven(launches):
    return launches.results_of(__name__, "uneven")


def _check_exact(results: list, label: str, replicas: int) -> None:
    mine = results[0][label]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["losses"] == mine["losses"] for r in results)
    assert mine["shards"], "the sharded stage's parameters are DTensors"
    for name, (local, whole) in mine["shards"].items():
        assert local <= -(-whole // replicas) * max(1, whole // max(1, whole)), (name, local, whole)
    assert sum(local for local, _ in mine["shards"].values()) < sum(whole for _, whole in mine["shards"].values())
    assert mine["loaded_plain"][0] <= TOLERANCE, mine["loaded_plain"]
    assert mine["loaded_replicated"][0] == 0.0, mine["loaded_replicated"]
    assert abs(mine["eval"] - mine["ref_eval"]) <= TOLERANCE, (mine["eval"], mine["ref_eval"])
    assert all(r[label]["train_programs"] == 2 for r in results), "a step at a shorter length ran its own graph"


@pytest.mark.parametrize("label", [c["label"] for c in TWO_RANKS])
def test_sharded_data_parallelism_trains_like_the_unsplit_model(two, label):
    _check_exact(two, label, replicas=2)
    if label.startswith("gpt2"):  # GPT-2's two layers: a unit each beside the root; four segments
        assert all(r[label]["units"] == {0: 3} for r in two), two[0][label]["units"]
        assert all(r[label]["segments"] == {0: 4} for r in two), two[0][label]["segments"]


@pytest.mark.parametrize(
    "label", ["lm-pp2-zero3", "lm-pp2-mixed", "lm-zbv-zero2-grads-sharded", "lm-interleaved-zero3-grads-sharded"]
)
def test_pipeline_of_sharded_stages_trains_like_the_unsplit_model(four, label):
    _check_exact(four, label, replicas=2)


@pytest.mark.parametrize("label", [c["label"] for c in UNEVEN])
def test_a_sharded_stage_of_an_uneven_plan_trains_like_the_unsplit_model(uneven, label):
    assert "shards" not in uneven[0][label] or not uneven[0][label]["shards"], "rank 0 replicates stage 0"
    results = [uneven[1], uneven[2], uneven[0]]  # rank 1 holds a shard; rank 0 compared with the reference
    mine = uneven[0][label]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["losses"] == mine["losses"] for r in results)
    assert uneven[1][label]["shards"] and uneven[2][label]["shards"]
    assert mine["loaded_plain"][0] <= TOLERANCE and mine["loaded_replicated"][0] == 0.0
    assert abs(mine["eval"] - mine["ref_eval"]) <= TOLERANCE, (mine["eval"], mine["ref_eval"])
    assert all(r[label]["train_programs"] == 2 for r in results), "a step at a shorter length ran its own graph"


def test_tied_stages_replicated_around_a_sharded_stage_train_like_the_unsplit_model(four):
    label = "gpt2-tied-around-sharded"
    mine = four[0][label]
    assert "refused" not in mine, mine.get("refused")
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["losses"] == mine["losses"] for r in four)
    assert not mine["shards"] and not four[3][label]["shards"], "ranks 0 and 3 replicate the tied stages"
    assert four[1][label]["shards"] and four[2][label]["shards"], "ranks 1 and 2 hold shards of stage 1"
    assert mine["loaded_plain"][0] <= TOLERANCE and mine["loaded_replicated"][0] == 0.0
    assert abs(mine["eval"] - mine["ref_eval"]) <= TOLERANCE, (mine["eval"], mine["ref_eval"])


def test_tied_weights_across_a_sharded_stage_are_refused(four):
    for result in four:
        message = result["gpt2-pp2-tied"]["refused"]
        assert "tied weights" in message and "sharding='replicate'" in message, message


BF16 = [
    dict(label="lm-pp2", model="tiny_lm", levels=["replicate", "replicate"], num_stages=2, replicas=1),
    dict(label="gpt2-pp2", model="gpt2", levels=["replicate", "replicate"], num_stages=2, replicas=1),
    dict(label="gpt2-zero3", model="gpt2", levels=["full_shard"], num_stages=1, replicas=2),
    # autocast's weight casts shared by the micro-batches of a step under the zero-bubble schedule's
    # split backward, and cast afresh by recomputing stages (partita/runtime/precision.py)
    dict(
        label="gpt2-zbv",
        model="gpt2",
        levels=["replicate"] * 4,
        num_stages=4,
        rank_groups=2,
        replicas=1,
        schedule="zbv",
        num_microbatches=4,
    ),
    dict(
        label="gpt2-pp2-recompute",
        model="gpt2",
        levels=["replicate", "replicate"],
        num_stages=2,
        replicas=1,
        recompute=["selective", "full"],
    ),
    # tensor + sequence parallelism with selective recomputation: the row-parallel matmuls run fused
    # with their reduce-scatters (partita::matmul_reduce_scatter), cast by its autocast rule
    dict(
        label="gpt2-tp2-sp-selective",
        model="gpt2",
        levels=["replicate"],
        num_stages=1,
        replicas=1,
        tensor_parallel=2,
        recompute=["selective"],
    ),
]
for config in BF16:
    config.setdefault("num_microbatches", 2)
    config.setdefault("schedule", "1f1b" if config["num_stages"] > 1 else "gpipe")

# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "two": Job("workers_sharding:job_levels", 2, 400, dict(configs=TWO_RANKS), ("checkpoints",)),
    "four": Job("workers_sharding:job_levels", 4, 500, dict(configs=FOUR_RANKS), ("checkpoints",)),
    "uneven": Job("workers_sharding:job_levels", 3, 400, dict(configs=UNEVEN), ("checkpoints",)),
    "bf16": Job("workers_sharding:job_bf16", 2, 400, dict(configs=BF16), ("checkpoints",)),
}


@pytest.fixture(scope="module")
def bf16(launches):
    return launches.results_of(__name__, "bf16")


@pytest.mark.parametrize("label", [c["label"] for c in BF16])
def test_bf16_trains_like_the_unsplit_model_under_autocast(bf16, label):
    """Losses within 1% of unsplit training under autocast; a sharded stage, which gathers its weights
    in bf16 (FSDP2's param_dtype), within 0.1% of unsplit training that reads bf16 weights under the
    same autocast (workers_sharding._bf16_gathered_reference). Parameters after AdamW steps are not
    compared: Adam's normalised steps turn bf16 rounding into updates of either sign."""
    mine = bf16[0][label]
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= 1e-2 * abs(want), (label, mine["losses"], mine["ref_losses"])
    assert mine["losses"] != mine["fp32_losses"], "the steps ran in bf16"
    if "gathered_losses" in mine:  # a sharded stage gathers bf16 weights: its own reference, within bf16 rounding
        for got, want in zip(mine["losses"], mine["gathered_losses"], strict=True):
            assert abs(got - want) <= 1e-3 * abs(want), (label, mine["losses"], mine["gathered_losses"])
    assert mine["stored_dtypes"] == ["torch.float32"], "master weights are checkpointed in fp32"
    for stage, sent in mine["sent"].items():  # activations in bf16; masks and ids as they are
        activations = [dtype for dtype, requires_grad in sent if requires_grad]
        assert activations and set(activations) == {"torch.bfloat16"}, (stage, sent)
