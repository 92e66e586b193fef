"""A plan file whose ``options`` record a choice its stages do not run is refused (issue 54, item 6),
as ``options.tensor_parallel`` against the stages' degrees is (tests/unit/test_input_checks.py):
``options.sequence_parallel`` against every stage of a degree above 1 -- a stage of degree 1 has
none, whatever options say -- and ``options.replica_samples`` against the stages' shares. The
executed part (the plan digest's) holds ``sequence_parallel`` too."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import partita
from partita.errors import PlanFileError
from partita.runtime.plan_digest import plan_digest
from partita.types.plan_file import plan_from_json, plan_to_json

BATCH = 8


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(BATCH, 16), torch.randint(0, 4, (BATCH,))
    return partita.capture(model, (x,), loss_fn=nn.functional.cross_entropy, target=y)


def _manual(graph, **kwargs) -> partita.Plan:
    n = graph.num_nodes
    return partita.manual_plan(
        graph,
        [0, n // 2, n],
        schedule="gpipe",
        num_rank_groups=2,
        num_microbatches=2,
        global_batch_size=BATCH,
        **kwargs,
    )


def _load(data: dict) -> partita.Plan:
    return plan_from_json(json.dumps(data), source="plan.json")


def _edited(plan: partita.Plan, edit) -> dict:
    data = json.loads(plan_to_json(plan))
    edit(data)
    return data


def _set_stages(**values):
    def edit(data: dict) -> None:
        for stage in data["stages"]:
            stage.update(values)

    return edit


def test_stages_without_sequence_parallelism_under_options_that_record_it_are_refused(graph):
    plan = _manual(graph, tensor_parallel=2, sequence_parallel=True)
    assert _load(_edited(plan, lambda data: None)) == plan  # as written: they agree
    with pytest.raises(
        PlanFileError,
        match=r"plan.json: stages\[0\]\.sequence_parallel is false, but options\.sequence_parallel is true: .*"
        r"\(stages\[0\] has 2\).*set stages\[0\]\.sequence_parallel back to true, or re-plan with "
        r"sequence_parallel=False",
    ):
        _load(_edited(plan, _set_stages(sequence_parallel=False)))


def test_stages_with_sequence_parallelism_under_options_that_record_it_off_are_refused(graph):
    plan = _manual(graph, tensor_parallel=2, sequence_parallel=False)
    with pytest.raises(
        PlanFileError, match=r"stages\[0\]\.sequence_parallel is true, but options\.sequence_parallel is false"
    ):
        _load(_edited(plan, _set_stages(sequence_parallel=True)))


def test_one_stage_edited_names_it_and_both_values(graph):
    plan = _manual(graph, tensor_parallel=2, sequence_parallel=True)

    def second_off(data: dict) -> None:
        data["stages"][1]["sequence_parallel"] = False

    with pytest.raises(
        PlanFileError, match=r"stages\[1\]\.sequence_parallel is false, but options\.sequence_parallel is true"
    ):
        _load(_edited(plan, second_off))
    searched = _edited(plan, lambda data: data["options"].update(sequence_parallel=None))
    second_off(searched)
    with pytest.raises(PlanFileError, match=r"stages\[1\]\.sequence_parallel is false, but stages\[0\]'s is true"):
        _load(searched)
    with pytest.raises(PlanFileError, match=r"options\.sequence_parallel is 'yes', expected true, false or null"):
        _load(_edited(plan, lambda data: data["options"].update(sequence_parallel="yes")))


def test_a_stage_of_degree_1_has_no_sequence_parallelism_under_options_that_record_it(graph):
    """Sequence parallelism applies to the stages of a degree above 1 (manual_plan's docstring)."""
    plan = _manual(graph, tensor_parallel=(2, 1), sequence_parallel=True)
    assert [(s.tensor_parallel, s.sequence_parallel) for s in plan.stages] == [(2, True), (1, False)]
    assert _load(_edited(plan, lambda data: None)) == plan
    searched = _manual(graph, tensor_parallel=2)
    assert searched.options["sequence_parallel"] is False
    data = _edited(searched, lambda data: data["options"].update(sequence_parallel=None))  # searched
    assert _load(_edited(_load(data), _set_stages(sequence_parallel=True))).sequence_parallel  # nothing recorded


def test_replica_samples_that_options_record_must_be_the_stages(graph):
    plan = _manual(graph, replicas=[2, 1], replica_samples=[(3, 1), None])
    assert _load(_edited(plan, lambda data: None)) == plan

    def swapped(data: dict) -> None:
        data["stages"][0]["replica_samples"] = [1, 3]

    with pytest.raises(
        PlanFileError,
        match=r"options\.replica_samples is \[\[3, 1\], None\], but the plan's stages run \[\[1, 3\], None\]",
    ):
        _load(_edited(plan, swapped))


def test_the_executed_part_holds_sequence_parallelism(graph):
    on, off = (_manual(graph, tensor_parallel=2, sequence_parallel=sp) for sp in (True, False))
    assert plan_digest(on) != plan_digest(off)  # ranks holding these two would run different jobs
