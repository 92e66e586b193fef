"""The Python user's first hour, on 2 gloo ranks (workers.job_natural_script and the jobs after it):

- the natural torchrun script -- every rank calls ``partita.Cluster.local`` and ``partita.plan``
  with measured costs, then ``partita.Trainer(model, plan, <example inputs>)``, then ``step`` --
  holds one plan (made on rank 0) and trains exactly like the unsplit model, for a pipeline plan
  and a fully sharded one; partita initialises the process group itself;
- every schedule the planner may emit trains exactly on models of several shapes, a layer's
  weights used at several depths among them (torch's ZBV weight pass cannot split such a stage's
  backward: partita runs its whole backward at once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dist_launch import Job, run_ranks

pytest.importorskip("transformers")

TOLERANCE = 1e-5
STEPS = 3
WORKERS = Path(__file__).with_name("workers_python_api.py")


@pytest.fixture(scope="module")
def natural(tmp_path_factory):
    out = tmp_path_factory.mktemp("natural")
    return run_ranks("natural_script", 2, out, timeout_s=600, workers=WORKERS, cache=str(out / "cache"), steps=STEPS)


def test_the_natural_script_initialises_the_job_itself(natural):
    assert natural[0]["initialised_by_partita"] and natural[1]["initialised_by_partita"]
    assert natural[0]["cluster"] == natural[1]["cluster"], "every rank holds rank 0's measured cluster"


@pytest.mark.parametrize("label", ["pipeline", "sharded"])
def test_the_natural_script_holds_one_plan_and_trains_exactly(natural, label):
    mine, other = natural[0][label], natural[1][label]
    assert mine["plan"] == other["plan"], "both ranks hold the plan rank 0 made, byte for byte"
    expected = {"pipeline": (2, [1, 1], ["replicate", "replicate"]), "sharded": (1, [2], ["full_shard"])}[label]
    assert mine["layout"] == expected
    assert json.loads(mine["plan"])["cost_source"] == "measured"
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{label}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (label, mine["losses"], mine["ref_losses"])
    assert other["losses"] == mine["losses"]


SCHEDULES = ["gpipe", "1f1b", "interleaved1f1b", "zbv"]
SHAPES = ["reused", "tied", "gated"]


# launched with the other 2-rank jobs of the suite (tests/dist/conftest.py); the natural script
# launches alone: it starts without a process group, as a user's script does
SHARED_JOBS = {
    "by_shape": Job("workers_python_api:job_schedules_by_shape", 2, 600, dict(schedules=SCHEDULES, steps=STEPS)),
}


@pytest.fixture(scope="module")
def by_shape(launches):
    return launches.results_of(__name__, "by_shape")


@pytest.mark.parametrize(
    "key", [f"{shape}/{schedule}" for shape in SHAPES for schedule in SCHEDULES] + ["reused/zbv-one-stage"]
)
def test_every_schedule_the_planner_emits_trains_every_model_shape_exactly(by_shape, key):
    mine = by_shape[0][key]
    assert mine["schedule"] == key.split("/")[1].split("-")[0]
    diff, where = mine["param"]
    assert diff <= TOLERANCE, f"{key}: parameter {where} differs from unsplit training's by {diff:.3g}"
    for got, want in zip(mine["losses"], mine["ref_losses"], strict=True):
        assert abs(got - want) <= TOLERANCE, (key, mine["losses"], mine["ref_losses"])
    assert by_shape[1][key]["losses"] == mine["losses"]
