"""Compiled blocks (``Plan.compile``, partita/runtime/compiled_segments.py) on 2 gloo ranks: every
block of every stage runs through torch.compile, and training equals the unsplit model's, trained
eagerly (SGD, 3 steps; in one config the second at a shorter sequence length: a graph captured
again and compiled at its shapes), under a pipeline of the zero-bubble schedule (its split backward:
two passes over one compiled graph), per-block FSDP2 with selective recomputation, and tensor +
sequence parallelism with full recomputation. Each compilation costs seconds on this CPU, so the
configs are few and each covers several features.

Inductor computes in another order inside its fused kernels, so the numbers agree to fp32
rounding, not bit for bit: SGD keeps the parameters' differences at the gradients' (AdamW's first
steps move every element by about its learning rate, whatever the gradient's size, and so turn a
rounding difference in a near-zero gradient into one of the learning rate)."""

from __future__ import annotations

import pytest
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5

CONFIGS = [
    # ZB-V's split backward (input, then weight gradients: two passes over one compiled graph); the
    # layout the planner gives this example on 4 H100s (test_batch_shapes.py runs its plans eagerly)
    dict(label="own-data-zbv", model="own_data", schedule="zbv", num_stages=4, num_rank_groups=2, num_microbatches=2),
    dict(
        label="gpt2-zero3-selective",
        model="gpt2",
        schedule="gpipe",
        num_stages=1,
        replicas=2,
        num_microbatches=2,
        sharding="full_shard",
        recompute="selective",
        shorter=True,  # the second step at a shorter length
    ),
    dict(
        label="llama-tp2-sp-full",
        model="llama",
        schedule="gpipe",
        num_stages=1,
        num_microbatches=2,
        tensor_parallel=2,
        recompute="full",
    ),
]
SHARED_JOBS = {"compiled": Job("workers_compiled:job_compiled", 2, 600, dict(configs=CONFIGS))}


@pytest.fixture(scope="module")
def compiled(launches):
    return launches.results_of(__name__, "compiled")


@pytest.mark.parametrize("label", [c["label"] for c in CONFIGS])
def test_compiled_blocks_train_like_the_unsplit_eager_model(compiled, label):
    mine = compiled[0][label]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["train_programs"] == r[label]["lengths"] for r in compiled), "one graph per length"


def test_repeated_blocks_share_one_compiled_function(compiled):
    """GPT-2's stage of two layers in four segments (before, two layers, after) compiles at most
    three functions at each of its two lengths (fewer where an earlier config compiled the same):
    its two layers share one."""
    mine = compiled[0]["gpt2-zero3-selective"]
    assert mine["segments"] == 4, mine
    assert mine["compiled"] <= 3 * 2, mine
