"""Real training data and real jobs on gloo (workers.job_exact_losses and the jobs after it):

- padded labels (-100 in a different number of positions per sample) and a masked mean train
  exactly like full-batch training, pipelined (2 stages x 4 micro-batches, 1F1B) and data
  parallel (2 replicas); a loss partita cannot normalise warns once, at the first step;
- one plan per job: ranks given different plans all raise PlanFileError at once; ``shared_plan``
  plans on rank 0 only;
- dropout: replicas draw different masks, and a run with the same seed repeats itself;
- stages without trainable parameters (frozen, loss only) train and checkpoint;
- a hung rank: CollectiveTimeoutError names the step and the rank, within the timeout.
"""

from __future__ import annotations

import pytest
import torch
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5
STEPS = 2
MODELS = ["tiny_lm", "masked_lm", "gpt2"]
CONFIGS = [
    dict(label="1f1b-2x4", schedule="1f1b", num_stages=2, num_rank_groups=2, num_microbatches=4),
    dict(label="dp-2", schedule="gpipe", num_stages=1, num_rank_groups=1, replicas=2, num_microbatches=1),
    dict(label="dp-2x2", schedule="gpipe", num_stages=1, num_rank_groups=1, replicas=2, num_microbatches=2),
    # a manual plan may recompute under ZB-V (the planner does not): a selectively recomputed stage runs
    # its whole backward in the input-gradient pass (torch's selective checkpoint allows one backward)
    dict(
        label="zbv-selective",
        schedule="zbv",
        num_stages=4,
        num_rank_groups=2,
        num_microbatches=4,
        recompute="selective",
        models=["gpt2"],
    ),
    # recomputing some blocks (Megatron's "recompute N layers"): GPT-2's first layer recomputed, the
    # second and the nodes around them keeping every tensor
    *(
        dict(
            label=f"dp-2x2-{level}-1-of-2-blocks",
            schedule="gpipe",
            num_stages=1,
            num_rank_groups=1,
            replicas=2,
            num_microbatches=2,
            recompute=level,
            recompute_blocks=1,
            models=["gpt2"],
        )
        for level in ("full", "selective")
    ),
]
HANG_TIMEOUT_S = 3  # the collective timeout of the hung-rank job
# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "exact": Job("workers:job_exact_losses", 2, 300, dict(models=MODELS, configs=CONFIGS, steps=STEPS)),
    "unrecognised_loss": Job("workers:job_unrecognised_loss", 2, 120),
    "one_plan": Job("workers:job_one_plan", 2, 120),
    "dropout": Job("workers:job_dropout", 2, 120),
    "frozen": Job("workers:job_frozen", 2, 120, dir_params=("dir",)),
    # last: the peers of its hung rank give up on it
    "hung": Job("workers:job_hang", 2, 120, dict(sleep_s=10, collective_timeout_s=HANG_TIMEOUT_S), last=True),
}


@pytest.fixture(scope="module")
def exact(launches):
    return launches.results_of(__name__, "exact")


@pytest.mark.parametrize("key", [f"{m}/{c['label']}" for m in MODELS for c in CONFIGS if m in c.get("models", MODELS)])
def test_padded_labels_train_like_the_full_batch(exact, key):
    """Each micro-batch's loss is its sum over the count of valid labels in the whole global batch."""
    mine = exact[0][key]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from full-batch training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (key, mine["losses"], mine["ref_losses"])
    assert exact[1][key]["losses"] == mine["losses"], "every rank returns the same loss"
    assert mine["normalised"]
    assert mine["warnings"] == [] and exact[1][key]["warnings"] == []


@pytest.fixture(scope="module")
def unrecognised_loss(launches):
    return launches.results_of(__name__, "unrecognised_loss")


def test_a_loss_that_squares_a_batch_mean_is_refused_on_every_rank_before_training(unrecognised_loss):
    for result in unrecognised_loss:
        error = result["error"]
        assert error is not None and "pow" in error and "workers.py" in error, error
        assert "statistic of the whole batch" in error and "one micro-batch and one replica" in error


@pytest.fixture(scope="module")
def one_plan(launches):
    return launches.results_of(__name__, "one_plan")


def test_ranks_with_different_plans_all_raise_naming_the_ranks(one_plan):
    for rank, result in enumerate(one_plan):
        message = result["mismatch"]
        assert message is not None, f"rank {rank} started training with a plan the other rank does not hold"
        assert "rank 0: plan" in message and "rank 1: plan" in message and "shared_plan" in message, message
        assert result["mismatch_s"] < 30
    assert one_plan[0]["mismatch"] == one_plan[1]["mismatch"]


def test_shared_plan_plans_on_rank_0_and_every_rank_trains_it(one_plan):
    assert one_plan[0]["shared"]["calls"] == [0] and one_plan[1]["shared"]["calls"] == []
    assert one_plan[0]["shared"]["boundaries"] == one_plan[1]["shared"]["boundaries"]
    assert one_plan[0]["shared"]["loss"] == one_plan[1]["shared"]["loss"]
    assert one_plan[0]["broken"][0] == "ValueError"
    name, message = one_plan[1]["broken"]
    assert name == "PlanFileError" and "rank 0 failed to make the plan" in message and "no cluster given" in message


@pytest.fixture(scope="module")
def dropout(launches):
    return launches.results_of(__name__, "dropout")


def test_replicas_draw_their_own_dropout_masks(dropout):
    """Both replicas see the same samples: equal micro-batch losses would mean equal masks."""
    for step, (a, b) in enumerate(zip(dropout[0]["first"]["local"], dropout[1]["first"]["local"], strict=True)):
        assert a != b, f"step {step + 1}: both replicas drew the same dropout masks ({a})"


def test_the_same_seed_repeats_a_run_and_another_seed_does_not(dropout):
    for result in dropout:
        assert result["first"]["losses"] == result["again"]["losses"]
        assert result["first"]["losses"] != result["other"]["losses"]
    assert dropout[0]["first"]["losses"] == dropout[1]["first"]["losses"]


def test_the_trainer_leaves_the_callers_random_stream_alone(dropout):
    torch.manual_seed(123)
    expected = torch.rand(4)
    for result in dropout:
        for run in result.values():
            assert torch.equal(run["after"], expected)


@pytest.fixture(scope="module")
def frozen(launches):
    return launches.results_of(__name__, "frozen")


@pytest.mark.parametrize("label", ["frozen-tail", "loss-only", "frozen-head"])
def test_a_stage_without_trainable_parameters_trains(frozen, label):
    mine = frozen[0][label]
    assert (frozen[1] if label != "frozen-head" else frozen[0])[label]["num_params"] == 0
    assert max(abs(a - b) for a, b in zip(mine["losses"], mine["ref_losses"], strict=True)) <= TOLERANCE, mine
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: {where} differs from unsplit training by {diff:.3g}"


@pytest.fixture(scope="module")
def hung(launches):
    return launches.results_of(__name__, "hung")


def test_a_hung_rank_ends_in_a_timeout_naming_the_step_and_the_rank(hung):
    """Rank 1 sleeps 10 s before step 2; rank 0 waits at most the 3 s timeout for it."""
    timeout_s = HANG_TIMEOUT_S
    waiting = hung[0]
    assert waiting["raised"] is not None, "rank 0 did not time out"
    assert waiting["step"] == 2 and waiting["rank"] == 0 and waiting["behind"] == (1,), waiting
    assert "step 2: rank 0" in waiting["raised"] and "rank 1 (its last step started is 1)" in waiting["raised"]
    assert waiting["seconds"] < timeout_s + 10
