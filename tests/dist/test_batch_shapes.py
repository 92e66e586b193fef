"""Batches as real data brings them, on gloo (workers_batches.py), against unsplit training:

- a plan made at the longest length trains batches padded to their own shorter lengths (32, 17,
  25) without re-planning, pipelined and data parallel, HF GPT-2 included; a longer batch is refused;
- gradient accumulation: 2 pipeline rounds per optimizer step equal one step on the whole batch;
- evaluate(): the eval-mode loss (dropout off, batch norm from running statistics), changing nothing;
- the planner's choices are runnable for the job's own data: the shipped example (examples/own_data.py,
  rows of several lengths) planned with each sharding level x schedule x tensor-parallel degree
  pinned, and every plan the planner returns trained on batches of three lengths, exactly.
"""

from __future__ import annotations

import dataclasses

import hashlib
import itertools
from pathlib import Path

import pytest
from dist_launch import Job, run_ranks

pytest.importorskip("transformers")

TOLERANCE = 1e-5
WORKERS = Path(__file__).with_name("workers_batches.py")
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


# ----------------------------------------------------------------------------- the planner's choices, runnable

SWEEP_SHARDING = [None, "shard_grads_and_optimizer", "full_shard"]
SWEEP_SCHEDULES = [None, "1f1b", "interleaved1f1b", "zbv"]
SWEEP_DEGREES = [None, 2]
SWEEP = [
    "/".join(str(v) for v in pins)
    for pins in itertools.product(SWEEP_SHARDING, SWEEP_SCHEDULES, SWEEP_DEGREES)
]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Plan the shipped example for 4 h100s (analytic costs: the same plans on every run) with each
    pin of SWEEP; run every distinct plan, on as many ranks as it uses. The planner compiles the
    blocks of GPU plans; they run eagerly here (each compilation costs seconds on this CPU):
    tests/dist/test_compiled_exact.py runs this example compiled under the layout of no pin (ZB-V,
    4 stages on 2 ranks), and compiled blocks under the other kinds of stage."""
    import partita
    from partita.errors import PartitaError
    from partita.types.plan_file import plan_to_json
    from workers_batches import sweep_case

    _, graph, _ = sweep_case()
    cluster = partita.Cluster(device="h100", num_devices=4, devices_per_node=4)
    outcome, by_devices = {}, {}
    for label in SWEEP:
        sharding, schedule, degree = (None if v == "None" else v for v in label.split("/"))
        options = dict(precision="fp32", sharding=sharding, tensor_parallel=int(degree) if degree else None)
        options.update({"schedules": schedule} if schedule else {})
        try:
            plan = partita.plan(graph, cluster=cluster, global_batch_size=8, options=partita.PlanOptions(**options))
        except PartitaError as e:  # a typed refusal is an answer; an untyped one fails the test
            outcome[label] = ("refused", f"{type(e).__name__}: {e}")
            continue
        plan = dataclasses.replace(plan, compile=False, options={**plan.options, "compile": False})
        text = plan_to_json(plan)
        key = hashlib.sha1(text.split('"options"')[0].encode() + text.split('"cluster"')[1].encode()).hexdigest()[:12]
        outcome[label] = ("planned", key, plan)
        by_devices.setdefault(plan.num_devices, {})[key] = text
    results = {}
    for devices, plans in sorted(by_devices.items()):
        out = tmp_path_factory.mktemp(f"sweep{devices}")
        ranks = run_ranks("sweep", devices, out, timeout_s=600, workers=WORKERS, plans=plans)
        results.update({key: [r[key] for r in ranks] for key in plans})
    return outcome, results


@pytest.mark.parametrize("label", SWEEP)
def test_every_plan_the_planner_returns_trains_the_jobs_own_data(sweep, label):
    """sharding/schedule/tensor-parallel pinned (None: searched): the planner returns a plan the
    runtime trains exactly on the data's lengths (30, 32, 28 of a plan made at 32), or refuses with
    a typed error saying what would fit."""
    outcome, results = sweep
    if outcome[label][0] == "refused":
        assert "What would fit" in outcome[label][1], outcome[label][1]
        return
    _, key, plan = outcome[label]
    sharding, _, degree = label.split("/")
    if sharding != "None":
        assert any(s.sharding.value == sharding for s in plan.stages), "the pinned level was dropped"
    if degree != "None":
        assert plan.tensor_parallel == int(degree)
    ranks = results[key]
    mine = ranks[0]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    assert mine["losses"] == pytest.approx(mine["ref_losses"], abs=TOLERANCE)
    assert all(r["losses"] == mine["losses"] for r in ranks)
    assert mine["programs"] == 3, "one graph per length"
