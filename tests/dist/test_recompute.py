"""Selective recomputation (``Recompute.SELECTIVE``) on gloo: alone (one stage, two replicas), in a
two-stage pipeline and with tensor parallelism of degree 2, GPT-2, Llama and T5 train like unsplit
full-batch training (AdamW, clipped, 3 steps: losses and every parameter within 1e-5); their
checkpoints load into the plain model, and ``evaluate()`` gives the unsplit model's loss. All in
one launch of workers_tensor_parallel.py's ``tp`` job."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_launch import run_ranks

pytest.importorskip("transformers")

WORKERS = Path(__file__).with_name("workers_tensor_parallel.py")
TOLERANCE = 1e-5

SELECTIVE = dict(recompute="selective")
TWO_RANKS = [
    dict(label="gpt2-selective-dp2", model="gpt2", replicas=2, num_microbatches=2, **SELECTIVE),
    dict(label="llama-selective-dp2", model="llama", replicas=2, num_microbatches=2, **SELECTIVE),
    dict(label="gpt2-selective-pp2", model="gpt2", num_stages=2, num_microbatches=4, schedule="1f1b", **SELECTIVE),
    dict(label="t5-selective-pp2", model="t5", num_stages=2, num_microbatches=2, schedule="1f1b", **SELECTIVE),
    dict(label="gpt2-selective-tp2", model="gpt2", tensor_parallel=2, **SELECTIVE),
    dict(label="llama-selective-tp2", model="llama", tensor_parallel=2, **SELECTIVE),
]
for config in TWO_RANKS:
    config.setdefault("tensor_parallel", 1)
    config.setdefault("num_stages", 1)
    config.setdefault("replicas", 1)
    config.setdefault("num_microbatches", 1)
    config.setdefault("schedule", "gpipe")


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute2")
    return run_ranks("tp", 2, out, timeout_s=900, workers=WORKERS, configs=TWO_RANKS, checkpoints=str(out))


@pytest.mark.parametrize("label", [c["label"] for c in TWO_RANKS])
def test_selective_recomputation_equals_unsplit_training(two, label):
    mine = two[0][label]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert all(r[label]["losses"] == mine["losses"] for r in two)
    assert mine["loaded_plain"][0] <= TOLERANCE, mine["loaded_plain"]  # the checkpoint into the plain model
    assert mine["loaded_tp"][0] == 0.0 and mine["loaded_other"][0] == 0.0, (mine["loaded_tp"], mine["loaded_other"])
    assert abs(mine["next_loss"] - mine["ref_next_loss"]) <= TOLERANCE, (mine["next_loss"], mine["ref_next_loss"])
    assert abs(mine["eval_short"] - mine["ref_eval_short"]) <= TOLERANCE, (mine["eval_short"], mine["ref_eval_short"])
    assert mine["recompute"] == ["selective"] * len(mine["recompute"]), mine["recompute"]
    if label.endswith("tp2"):
        assert mine["split"], f"{label}: nothing was split"
