"""partita.Trainer on gloo: pipelined, replicated training equals unsplit full-batch training.

Each job runs many model x config checks in one set of ranks, and shares its launch with the other
jobs of its world size (dist_launch.py, conftest.py), to amortise process start-up and graph capture;
the tests then assert on the recorded numbers.
fp32, tiny zoo models, batch 8, sequence 16, dropout off; BERT's masks are made equally
many per sample (workers._exact_batch) so that micro-batch means average to the batch mean.
"""

from __future__ import annotations

import pytest
from dist_launch import Job, run_ranks

pytest.importorskip("transformers")

TOLERANCE = 1e-5
MODELS = ["gpt2", "bert", "llama", "t5"]
WITH_LOSS_FN = MODELS + ["mlp"]  # the MLP takes loss_fn(output, target): step(x, target=y)

# label -> config (see workers.make_plan); "models" limits a config to some models.
TWO_RANKS = [
    dict(label="gpipe-2", schedule="gpipe", num_stages=2, num_rank_groups=2, num_microbatches=4),
    dict(label="1f1b-2-clip", schedule="1f1b", num_stages=2, num_rank_groups=2, num_microbatches=4, clip=True),
    dict(label="interleaved-4", schedule="interleaved1f1b", num_stages=4, num_rank_groups=2, num_microbatches=4),
    dict(label="zbv-4", schedule="zbv", num_stages=4, num_rank_groups=2, num_microbatches=4),
    dict(
        label="1f1b-2-recompute",
        schedule="1f1b",
        num_stages=2,
        num_rank_groups=2,
        num_microbatches=2,
        recompute=True,
        models=["gpt2", "t5"],
    ),
    dict(
        label="zbv-4-recompute-clip",
        schedule="zbv",
        num_stages=4,
        num_rank_groups=2,
        num_microbatches=4,
        recompute=True,
        clip=True,
        models=["gpt2", "t5"],
    ),
]
FOUR_RANKS = [
    dict(
        label="1f1b-2x2-clip",
        schedule="1f1b",
        num_stages=2,
        num_rank_groups=2,
        replicas=2,
        num_microbatches=2,
        clip=True,
    ),
    dict(
        label="zbv-4x2",
        schedule="zbv",
        num_stages=4,
        num_rank_groups=2,
        replicas=2,
        num_microbatches=2,
        models=["gpt2"],
    ),
    dict(
        label="dp-4", schedule="gpipe", num_stages=1, num_rank_groups=1, replicas=4, num_microbatches=2, models=["gpt2"]
    ),
]
CHECKPOINT_RUNS = [
    dict(
        label="gpt2-1f1b-to-interleaved",
        model="gpt2",
        steps_per_plan=5,
        plans=[
            dict(schedule="1f1b", num_stages=2, num_rank_groups=2, num_microbatches=2),
            dict(schedule="interleaved1f1b", num_stages=4, num_rank_groups=2, num_microbatches=2),
        ],
    ),
    dict(
        label="t5-zbv-to-dp",
        model="t5",
        steps_per_plan=5,
        plans=[
            dict(schedule="zbv", num_stages=4, num_rank_groups=2, num_microbatches=2),
            dict(schedule="gpipe", num_stages=1, num_rank_groups=1, replicas=2, num_microbatches=2),
        ],
    ),
]


def _keys(configs: list[dict], models: list[str] = MODELS) -> list[str]:
    return [f"{m}/{c['label']}" for m in models for c in configs if m in c.get("models", models)]


@pytest.fixture(scope="module")
def two_rank_results(launches):
    return launches.results_of(__name__, "two_rank_results")


@pytest.fixture(scope="module")
def four_rank_results(launches):
    return launches.results_of(__name__, "four_rank_results")


@pytest.fixture(scope="module")
def checkpoint_results(launches):
    return launches.results_of(__name__, "checkpoint_results")


def _check_one_step(results: list[dict], key: str) -> None:
    mine = results[0][key]
    assert abs(mine["loss"] - mine["ref_loss"]) <= TOLERANCE, (key, mine)
    assert {r[key]["loss"] for r in results} == {mine["loss"]}, "every rank returns the same loss"
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from the unsplit model's by {diff:.3g}"


@pytest.mark.parametrize("key", _keys(TWO_RANKS, WITH_LOSS_FN))
def test_two_ranks_one_step_equals_unsplit(two_rank_results, key):
    """GPipe, 1F1B (with clipping, with recomputation), Interleaved1F1B and ZBV on 2 ranks."""
    _check_one_step(two_rank_results, key)


@pytest.mark.parametrize("key", _keys(FOUR_RANKS))
def test_four_ranks_pipeline_times_replicas_equals_unsplit(four_rank_results, key):
    """2 stages x 2 replicas (tied weights summed over 4 ranks), ZBV x 2 replicas, pure data parallel."""
    _check_one_step(four_rank_results, key)


@pytest.mark.parametrize("label", [run["label"] for run in CHECKPOINT_RUNS])
def test_checkpoint_resumes_under_another_plan(checkpoint_results, label):
    result = checkpoint_results[0][label]
    run = next(r for r in CHECKPOINT_RUNS if r["label"] == label)
    steps = run["steps_per_plan"]
    assert result["resumed_at"] == [steps * k for k in range(1, len(run["plans"]))]
    for got, want in zip(result["losses"], result["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (result["losses"], result["ref_losses"])
    diff, where = result["param"]
    assert diff <= TOLERANCE, f"{label}: {where} differs from {steps * len(run['plans'])} unsplit steps by {diff:.3g}"
    lr, expected_lr = result["lr"]
    assert lr == pytest.approx(expected_lr), "the LR scheduler's state was not restored"
    assert not result["partial_left"]


@pytest.mark.parametrize("label", [run["label"] for run in CHECKPOINT_RUNS])
def test_load_into_model_matches_gathered_state(checkpoint_results, label):
    result = checkpoint_results[0][label]
    for diff, where in result["load_into_model"]:
        assert diff == 0.0, f"{label}: the plain model loaded {where} differently from gather_state_dict"


def test_a_failing_rank_fails_the_job_at_once_with_its_error(tmp_path):
    # Had the launcher waited for the blocked rank, run_ranks would end in "job timed out".
    with pytest.raises(AssertionError, match="rank 1 failed") as info:
        run_ranks("fail", 2, tmp_path, timeout_s=60)
    assert "deliberate failure on rank 1" in str(info.value)


META_CONFIGS = [
    dict(label="1f1b-2", schedule="1f1b", num_stages=2, num_rank_groups=2, num_microbatches=2),
    dict(label="zbv-4", schedule="zbv", num_stages=4, num_rank_groups=2, num_microbatches=2),
]
META_MODELS = ["gpt2", "llama"]  # llama: a non-persistent buffer (rotary frequencies) comes from the seed too


# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "two_rank_results": Job("workers:job_one_step", 2, 180, dict(models=WITH_LOSS_FN, configs=TWO_RANKS)),
    "four_rank_results": Job("workers:job_one_step", 4, 240, dict(models=MODELS, configs=FOUR_RANKS)),
    "checkpoint_results": Job("workers:job_checkpoint", 2, 180, dict(runs=CHECKPOINT_RUNS), dir_params=("dir",)),
    "meta_results": Job("workers:job_meta_init", 2, 240, dict(models=META_MODELS, configs=META_CONFIGS), ("dir",)),
}


@pytest.fixture(scope="module")
def meta_results(launches):
    return launches.results_of(__name__, "meta_results")


@pytest.mark.parametrize("key", _keys(META_CONFIGS, META_MODELS))
def test_a_model_built_on_meta_trains_from_a_seed_like_the_unsplit_model(meta_results, key):
    """No rank builds the whole model: each allocates its stages' parameters (fewer than all of
    them) and reads their values from the seed; three AdamW steps equal unsplit training."""
    mine = meta_results[0][key]
    for rank, result in enumerate(meta_results):
        r = result[key]
        assert 0 < r["allocated"] < r["total"], f"rank {rank} allocated {r['allocated']} of {r['total']} elements"
    assert max(abs(a - b) for a, b in zip(mine["losses"], mine["ref_losses"])) <= TOLERANCE, mine
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from the unsplit model's by {diff:.3g}"
