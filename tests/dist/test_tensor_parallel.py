"""Stages split over tensor-parallel groups (workers_tensor_parallel.py), on 2 and 4 gloo ranks: GPT-2
(fused QKV, tied head), Llama (GQA, rotary), BERT and T5 train like unsplit full-batch training
(AdamW, clipped, 3 steps), alone and with pipeline stages or sharded replicas; each rank holds a
part of the weights; checkpoints hold whole tensors under the model's names and load into the
plain model, into another trainer of the same plan (which trains on as the original would) and
into one without tensor parallelism."""

from __future__ import annotations

import pytest
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5

TWO_RANKS = [dict(label=m, model=m) for m in ("gpt2", "llama", "bert", "t5")]
TWO_RANKS.append(dict(label="llama-meta", model="llama", meta=True))  # weights from a seed checkpoint
TWO_RANKS.append(dict(label="gpt2-vocab-1023", model="gpt2", vocab=1023))  # the last part padded
FOUR_RANKS = [
    # the tied embedding and LM head on different stages, both split
    dict(label="gpt2-pp2", model="gpt2", num_stages=2, num_microbatches=2, schedule="1f1b"),
    dict(label="llama-dp2-zero3", model="llama", replicas=2, sharding="full_shard"),
    # with sequence parallelism, the gradients reduce-scattered every micro-batch, and the first of the
    # two layers recomputed alone: the choices the planner makes by memory, together
    dict(
        label="llama-sp-dp2-zero3-grads-sharded-recompute-1-of-2",
        model="llama",
        replicas=2,
        sharding="full_shard",
        num_microbatches=2,
        sequence_parallel=True,
        accumulation="sharded",
        recompute="full",
        recompute_blocks=1,
    ),
]
# matmuls that must stay whole: BERT's masked-LM transform feeds a layer norm over its features
LEFT_WHOLE = {"bert": {"linear_12"}}
for config in TWO_RANKS + FOUR_RANKS:
    config.setdefault("tensor_parallel", 2)
    config.setdefault("num_stages", 1)
    config.setdefault("replicas", 1)
    config.setdefault("num_microbatches", 1)
    config.setdefault("schedule", "gpipe")
# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "two": Job("workers_tensor_parallel:job_tp", 2, 500, dict(configs=TWO_RANKS), ("checkpoints",)),
    "four": Job("workers_tensor_parallel:job_tp", 4, 500, dict(configs=FOUR_RANKS), ("checkpoints",)),
}


@pytest.fixture(scope="module")
def two(launches):
    return launches.results_of(__name__, "two")


@pytest.fixture(scope="module")
def four(launches):
    return launches.results_of(__name__, "four")


def _check(results: list, label: str) -> None:
    mine = results[0][label]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["losses"] == mine["losses"] for r in results)
    left = set(mine["rejected"])
    assert left <= LEFT_WHOLE.get(mine["model"], set()), f"{label}: candidates left whole: {mine['rejected']}"
    assert mine["split"], f"{label}: nothing was split"
    assert mine["loaded_plain"][0] <= TOLERANCE, mine["loaded_plain"]
    assert mine["loaded_tp"][0] == 0.0 and mine["loaded_other"][0] == 0.0, (mine["loaded_tp"], mine["loaded_other"])
    assert abs(mine["next_loss"] - mine["ref_next_loss"]) <= TOLERANCE, (mine["next_loss"], mine["ref_next_loss"])
    assert abs(mine["eval_short"] - mine["ref_eval_short"]) <= TOLERANCE, (mine["eval_short"], mine["ref_eval_short"])


@pytest.mark.parametrize("label", [c["label"] for c in TWO_RANKS if not c.get("meta") and not c.get("vocab")])
def test_tensor_parallel_equals_unsplit_training(two, label):
    _check(two, label)
    mine = two[0][label]
    assert mine["held"] < 0.75 * mine["whole"], f"{label}: a rank holds {mine['held']} of {mine['whole']} parameters"


def test_fused_qkv_and_tied_head_are_split(two):
    split = set(two[0]["gpt2"]["split"])
    assert {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.weight"} <= split
    assert split & {"transformer.wte.weight", "lm_head.weight"}, "the tied embedding / LM head is split"
    assert {"model.layers.0.self_attn.k_proj.weight", "model.embed_tokens.weight"} <= set(two[0]["llama"]["split"])


@pytest.mark.parametrize("label", [c["label"] for c in FOUR_RANKS])
def test_tensor_parallel_with_pipelines_and_sharded_replicas(four, label):
    _check(four, label)


def test_a_model_built_on_meta_takes_its_parts_from_a_seed_checkpoint(two):
    mine = two[0]["llama-meta"]
    assert mine["param"][0] <= TOLERANCE, mine["param"]
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (mine["losses"], mine["ref_losses"])
    assert mine["held"] < 0.75 * two[0]["llama"]["whole"]


def test_a_vocabulary_that_does_not_divide_is_split_with_a_padded_last_part(two):
    mine = two[0]["gpt2-vocab-1023"]
    assert mine["padded"] == ["transformer.wte.weight"], mine["padded"]  # the tied embedding and LM head
    got, want = mine["loss"]
    assert abs(got - want) <= TOLERANCE and mine["grad"] <= TOLERANCE, mine
