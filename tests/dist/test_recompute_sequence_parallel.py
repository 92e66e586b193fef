"""Selective recomputation (``Recompute.SELECTIVE``) and sequence parallelism on gloo, against unsplit
full-batch training (AdamW, clipped, 3 steps: losses and every parameter within 1e-5):

- selective recomputation alone (one stage, two replicas), in a two-stage pipeline, under interleaved
  1F1B with three and five stages per rank group (6 and 10 stages on 2 ranks), and with tensor parallelism of
  degree 2 (GPT-2, Llama, T5);
- sequence parallelism at tensor-parallel degree 2 (GPT-2, Llama, and BERT, whose masked-LM head
  runs whole on its gathered input; GPT-2 also with selective recomputation, which keeps its row-parallel
  matmuls fused with their reduce-scatters), and at degree 2 x 2 pipeline stages (GPT-2 and Llama; Llama
  also with selective recomputation, and Llama built on meta from a seed checkpoint), and two TP-2
  replicas sharding gradients and optimizer state (Llama); between stages
  the residual stream travels as each rank's tokens. Most of them compute the fused row-parallel
  matmuls, and the column-parallel ones fused with their input's all-gather, block by block around
  the ring (``RING``), the others whole, as these small models do by default.

Each run's checkpoint loads into the plain model (and into trainers of the same plan and of one
without tensor parallelism), and ``evaluate()`` on a shorter sequence gives the unsplit model's
loss. workers_tensor_parallel.py's ``tp`` job, in the shared launches of 2 and 4 ranks (tests/dist/conftest.py)."""

from __future__ import annotations

import pytest
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5

SELECTIVE = dict(recompute="selective")
SEQUENCE = dict(tensor_parallel=2, sequence_parallel=True)
# the row-parallel matmuls computed block by block around the ring, as at scale (workers_tensor_parallel's
# ``ring``: these models' blocks are below partita.cost.collective_matmul's thresholds)
RING = dict(ring=True)
PIPELINE = dict(num_stages=2, num_microbatches=2, schedule="1f1b")
TWO_RANKS = [
    dict(label="gpt2-selective-dp2", model="gpt2", replicas=2, num_microbatches=2, **SELECTIVE),
    dict(label="llama-selective-dp2", model="llama", replicas=2, num_microbatches=2, **SELECTIVE),
    dict(label="gpt2-selective-pp2", model="gpt2", num_stages=2, num_microbatches=4, schedule="1f1b", **SELECTIVE),
    dict(label="t5-selective-pp2", model="t5", **PIPELINE, **SELECTIVE),
    dict(label="gpt2-selective-zero3-dp2", model="gpt2", replicas=2, num_microbatches=2, sharding="full_shard", **SELECTIVE),
    dict(label="gpt2-selective-tp2", model="gpt2", tensor_parallel=2, **SELECTIVE),
    dict(label="llama-selective-tp2", model="llama", tensor_parallel=2, **SELECTIVE),
    dict(label="gpt2-sp-tp2", model="gpt2", **SEQUENCE),
    dict(label="gpt2-sp-selective-tp2", model="gpt2", **SEQUENCE, **SELECTIVE, **RING),  # addmm fused with its reduce-scatter
    dict(label="llama-sp-tp2", model="llama", **SEQUENCE, **RING),
    # full recomputation runs the ring again in backward, as it re-runs every forward collective
    dict(label="gpt2-sp-full-tp2", model="gpt2", **SEQUENCE, recompute="full", **RING),
    dict(label="bert-sp-tp2", model="bert", **SEQUENCE),
    # interleaved 1F1B with three stages per rank group, as the planner may pick it at scale
    dict(
        label="gpt2-selective-interleaved-3x2",
        model="gpt2",
        num_stages=6,
        num_rank_groups=2,
        num_microbatches=4,
        schedule="interleaved1f1b",
        **SELECTIVE,
    ),
    # and with five, as the planner picks it for 530B (21 rank groups x 5 one-layer stages)
    dict(
        label="gpt2-interleaved-5x2",
        model="gpt2",
        num_stages=10,
        num_rank_groups=2,
        num_microbatches=4,
        schedule="interleaved1f1b",
        **SELECTIVE,
    ),
]
FOUR_RANKS = [
    dict(label="gpt2-sp-tp2-pp2", model="gpt2", **SEQUENCE, **PIPELINE, **RING),
    # two replicas of a TP-2 group sharding gradients and optimizer state (FSDP2), as the 310B plan does
    dict(
        label="llama-sp-tp2-zero2-dp2",
        model="llama",
        **SEQUENCE,
        replicas=2,
        num_microbatches=2,
        sharding="shard_grads_and_optimizer",
        **RING,
    ),
    dict(label="llama-sp-selective-tp2-pp2", model="llama", **SEQUENCE, **PIPELINE, **SELECTIVE, **RING),
    # the schedules the planner also picks with tensor and sequence parallelism (two stages per rank group)
    dict(
        label="gpt2-sp-tp2-zbv",
        model="gpt2",
        **SEQUENCE,
        **RING,
        num_stages=4,
        num_rank_groups=2,
        num_microbatches=4,
        schedule="zbv",
    ),
    dict(
        label="llama-sp-selective-tp2-interleaved",
        model="llama",
        **SEQUENCE,
        **SELECTIVE,
        **RING,
        num_stages=4,
        num_rank_groups=2,
        num_microbatches=4,
        schedule="interleaved1f1b",
    ),
]
# the model built on meta, each rank loading its parts from a seed checkpoint: the pipeline's shapes
# are found on meta before the stages are split, then reshaped for the values that cross in part
ON_META = dict(label="llama-sp-tp2-pp2-meta", model="llama", meta=True, **SEQUENCE, **PIPELINE)
for config in TWO_RANKS + FOUR_RANKS + [ON_META]:
    config.setdefault("tensor_parallel", 1)
    config.setdefault("num_stages", 1)
    config.setdefault("replicas", 1)
    config.setdefault("num_microbatches", 1)
    config.setdefault("schedule", "gpipe")


# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "two": Job("workers_tensor_parallel:job_tp", 2, 900, dict(configs=TWO_RANKS), ("checkpoints",)),
    "four": Job("workers_tensor_parallel:job_tp", 4, 900, dict(configs=[*FOUR_RANKS, ON_META]), ("checkpoints",)),
}


@pytest.fixture(scope="module")
def two(launches):
    return launches.results_of(__name__, "two")


@pytest.fixture(scope="module")
def four(launches):
    return launches.results_of(__name__, "four")


def _check(results: list, config: dict) -> None:
    label = config["label"]
    mine = results[0][label]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["losses"] == mine["losses"] for r in results)
    assert mine["loaded_plain"][0] <= TOLERANCE, mine["loaded_plain"]  # the checkpoint into the plain model
    assert mine["loaded_tp"][0] == 0.0 and mine["loaded_other"][0] == 0.0, (mine["loaded_tp"], mine["loaded_other"])
    assert abs(mine["next_loss"] - mine["ref_next_loss"]) <= TOLERANCE, (mine["next_loss"], mine["ref_next_loss"])
    assert abs(mine["eval_short"] - mine["ref_eval_short"]) <= TOLERANCE, (mine["eval_short"], mine["ref_eval_short"])
    assert set(mine["recompute"]) == {config.get("recompute", "none")}, mine["recompute"]
    if config["tensor_parallel"] > 1:
        assert mine["split"], f"{label}: nothing was split"
    if config.get("sequence_parallel"):  # every rank splits regions by token: reduce-scattered sources
        assert all(r[label]["token_sources"] for r in results), [r[label]["token_sources"] for r in results]
        # the norms' weights and the row-parallel biases, broadcast over the tokens: each rank's
        # gradient is its tokens' part, summed over the group once per step (as Megatron-LM does),
        # never per micro-batch
        for r in results:
            partial = r[label]["partial_gradients"]
            assert partial and not r[label]["summed_per_microbatch"], r[label]
            norms = [name for name in partial if "norm" in name.lower() or ".ln_" in name]
            assert norms and all(name in norms or name.endswith(".bias") for name in partial), partial
    else:
        assert not mine["token_sources"] and not mine["partial_gradients"]
    ring_calls = [r[label]["ring_calls"] for r in results]  # the fused matmuls computed around the ring
    assert all(ring_calls) if config.get("ring") else not any(ring_calls), ring_calls
    # and the column-parallel ones that gather their input (GPT-2's every one, Llama's LM head alone)
    column_calls = [r[label]["column_ring_calls"] for r in results]
    assert any(column_calls) if config.get("ring") else not any(column_calls), column_calls
    _check_boundaries(config, results)


def _check_boundaries(config: dict, results: list) -> None:
    """Between stages with sequence parallelism the residual stream travels in part: each rank sends
    its tokens (the sizes along the token dim: the captured one over the degree), and what a stage
    sends has the shapes its successor receives."""
    label = config["label"]
    parts = [p for r in results for p in r[label]["parts"]]
    if config.get("sequence_parallel") and config["num_stages"] > 1:
        assert all(r[label]["parts_sent"] for r in results), [r[label]["parts_sent"] for r in results]
        assert any(captured == inner for _, captured, inner, _ in parts), f"{label}: no value of the sequence sent in part"
        for sent, captured, inner, degree in parts:
            assert captured != inner or sent * degree == captured, (label, parts)
    else:
        assert not parts and not any(r[label]["parts_sent"] for r in results)
    shapes = {}
    for r in results:
        shapes.update(r[label]["boundary_shapes"])
    for key, sent in shapes.items():
        if key.startswith("sent "):
            k = int(key.split()[1])
            received = shapes.get(f"received {k + 1}")
            assert received is None or received == sent, (label, k, sent, received)


@pytest.mark.parametrize("config", TWO_RANKS, ids=[c["label"] for c in TWO_RANKS])
def test_on_two_ranks_equals_unsplit_training(two, config):
    _check(two, config)


@pytest.mark.parametrize("config", FOUR_RANKS, ids=[c["label"] for c in FOUR_RANKS])
def test_on_four_ranks_equals_unsplit_training(four, config):
    _check(four, config)


def test_a_model_built_on_meta_sends_parts_and_equals_unsplit_training(four):
    label = ON_META["label"]
    mine = four[0][label]
    assert mine["param"][0] <= TOLERANCE, mine["param"]
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (mine["losses"], mine["ref_losses"])
    parts = [p for r in four for p in r[label]["parts"]]
    assert any(captured == inner and sent * degree == captured for sent, captured, inner, degree in parts), parts
