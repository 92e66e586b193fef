"""Batches as real data brings them, on gloo (workers_batches.py), against unsplit training:

- a plan made at the longest length trains batches padded to their own shorter lengths (32, 17,
  25) without re-planning, pipelined and data parallel, HF GPT-2 included; a longer batch is refused;
- gradient accumulation: 2 pipeline rounds per optimizer step equal one step on the whole batch;
- evaluate(): the eval-mode loss (dropout off, batch norm from running statistics), changing nothing.
"""

from __future__ import annotations

import pytest
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5
MODELS = ["tiny_lm", "masked_lm", "gpt2"]
# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "lengths": Job("workers_batches:job_lengths", 2, 400, dict(models=MODELS)),
    "accumulation": Job("workers_batches:job_accumulation", 2, 300),
    "evaluated": Job("workers_batches:job_evaluate", 2, 300),
}


@pytest.fixture(scope="module")
def lengths(launches):
    return launches.results_of(__name__, "lengths")


@pytest.mark.parametrize("key", [f"{m}/{c}" for m in MODELS for c in ("1f1b-2x4", "dp-2")])
def test_batches_of_other_lengths_train_like_the_unsplit_model(lengths, key):
    mine = lengths[0][key]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (key, mine["losses"], mine["ref_losses"])
    assert lengths[1][key]["losses"] == mine["losses"]
    assert mine["programs"] == 3, "one graph per length: 32 (planned), 17 and 25"


def test_a_batch_longer_than_the_plan_is_refused_on_every_rank(lengths):
    for result in lengths:
        message = result["tiny_lm/1f1b-2x4"]["longer"]
        assert message is not None and "[35]" in message and "[32]" in message and "never longer" in message


@pytest.fixture(scope="module")
def accumulation(launches):
    return launches.results_of(__name__, "accumulation")


@pytest.mark.parametrize("key", [f"{m}/{c}" for m in ("tiny_lm", "mean_mlp") for c in ("1f1b-2x2", "dp-2")])
def test_accumulated_rounds_equal_one_step_on_the_whole_batch(accumulation, key):
    mine = accumulation[0][key]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (key, mine["losses"], mine["ref_losses"])
    assert mine["normalised"] == key.startswith("tiny_lm")
    assert "8 (the plan's global batch 4 x 2 accumulation steps)" in mine["small"], mine["small"]


@pytest.fixture(scope="module")
def evaluated(launches):
    return launches.results_of(__name__, "evaluated")


def test_evaluate_is_the_eval_mode_loss_and_changes_nothing(evaluated):
    run = evaluated[0]["evaluating"]
    assert abs(run["eval"] - run["ref_eval"]) <= TOLERANCE, (run["eval"], run["ref_eval"])
    assert abs(run["eval"] - run["train_mode_loss"]) > 1e-3, "dropout and batch statistics were on"
    assert run["eval_again"] == run["eval"] and evaluated[1]["evaluating"]["eval"] == run["eval"]
    assert run["unchanged"][0] == 0.0, run["unchanged"]
    assert run["num_steps"] == 1
    assert run["losses"] == evaluated[0]["plain"]["losses"], "the step after evaluate() is the one without it"


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_evaluate_between_steps_at_another_length(evaluated, schedule):
    """Eval at length 20 of a plan made at 32, a step, eval again: the unsplit model's eval loss."""
    lm = evaluated[0][f"lm/{schedule}"]
    assert abs(lm["eval_after"] - lm["ref_eval_after"]) <= TOLERANCE, lm
    assert lm["eval_after"] != lm["eval"], "the step changed the weights evaluate() reads"
    assert evaluated[1][f"lm/{schedule}"] == {k: v for k, v in lm.items() if k != "ref_eval_after"}
