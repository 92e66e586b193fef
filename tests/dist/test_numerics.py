"""The numerics guard on gloo (2 ranks, 2 stages): a NaN/inf loss or gradient stops the step on
every rank with a NumericsError that names where, before the optimizer touches a weight; or,
with on_nonfinite="skip", the update is skipped with a warning (workers.job_numerics)."""

from __future__ import annotations

import pytest
from dist_launch import Job
from workers import max_diff

TOLERANCE = 1e-6
SHARED_JOBS = {"results": Job("workers:job_numerics", 2, 120)}  # shared launches: tests/dist/conftest.py


@pytest.fixture(scope="module")
def results(launches):
    return launches.results_of(__name__, "results")


def _unchanged(result: dict, initial: dict) -> None:
    diff, where = max_diff(result, initial)
    assert diff == 0.0, f"{where} changed by {diff:.3g} in a step whose loss or gradient was not finite"


def test_nonfinite_loss_raises_on_every_rank_naming_stage_and_microbatch(results):
    errors = [r["inf"]["raised"] for r in results]
    assert errors[0] is not None, "an inf input did not raise"
    assert errors[0] == errors[1], "the ranks disagree on the error"
    message = errors[0]
    assert message.startswith(
        "step 1: non-finite loss: micro-batch 1 (samples 4-7 of the global batch) gave nan on "
        "stage 1, the last stage (rank 1)."
    ), message
    assert "on_nonfinite='skip'" in message, message
    losses = [f for f in results[0]["inf"]["findings"] if f.kind == "loss"]
    assert [(f.stage_indices, f.microbatch_index, f.rank) for f in losses] == [((1,), 1, 1)]
    _unchanged(results[0]["inf"]["state"], results[0]["initial"])


def test_nonfinite_gradient_with_finite_loss_names_the_parameters_and_stage(results):
    message = results[0]["zero"]["raised"]
    assert message is not None, "NaN gradients did not raise"
    assert message == results[1]["zero"]["raised"]
    assert message.startswith(
        "step 1: non-finite gradients (the loss is finite) in 2 parameter(s): "
        "a.weight (nan; stage 0, rank 0), a.bias (nan; stage 0, rank 0)."
    ), message
    assert "backward op overflowed or divided by zero" in message
    assert {f.parameter for f in results[0]["zero"]["findings"]} == {"a.weight", "a.bias"}
    _unchanged(results[0]["zero"]["state"], results[0]["initial"])


def test_skip_mode_warns_keeps_weights_and_then_trains_as_if_the_step_never_was(results):
    skip = results[0]["skip"]
    assert skip["loss"] != skip["loss"], "the skipped step returns its (NaN) loss"
    assert len(skip["warnings"]) == 1 and "The optimizer step was skipped" in skip["warnings"][0]
    assert "micro-batch 1" in skip["warnings"][0]
    assert skip["counts"] == (2, 1)  # num_steps, num_skipped_steps
    assert [r["skip"]["counts"] for r in results] == [(2, 1), (2, 1)]
    _unchanged(skip["state"], results[0]["initial"])
    # AdamW's state was untouched too: the clean step is the unsplit model's first step.
    diff, where = max_diff(skip["final"], results[0]["reference"])
    assert diff <= TOLERANCE, f"after skip + clean step, {where} differs from one unsplit AdamW step by {diff:.3g}"


def test_a_batch_other_than_the_plans_global_batch_is_refused(results):
    message = results[0]["wrong_batch"]
    assert (
        message is not None and "the trainer takes 8 (the plan's global batch 8)" in message and "6 samples" in message
    ), message
