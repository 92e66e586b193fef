"""Plan.load on mutated files: every file loads as a valid plan or raises PlanFileError."""

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import partita
from partita.errors import PlanFileError
from partita.types import Plan, Schedule, StagePlan
from partita.types.plan_file import plan_from_json


def _plan_dict() -> dict:
    cluster = partita.Cluster(device="h100", num_devices=4, devices_per_node=4)
    stages = tuple(
        StagePlan(
            index=k,
            start=10 * k,
            stop=10 * (k + 1),
            first_node=f"n{10 * k}",
            last_node=f"n{10 * k + 9}",
            module_range=f"layers.{k}",
            ranks=(2 * k, 2 * k + 1),
            rank_group=k,
            recompute=False,
            forward_s=0.01,
            backward_s=0.02,
            memory_bytes=2**30,
            param_bytes=2**20,
            cut_bytes=4096,
        )
        for k in range(2)
    )
    plan = Plan(
        graph_fingerprint="abc",
        cluster=cluster,
        stages=stages,
        schedule=Schedule.ONE_F_ONE_B,
        global_batch_size=16,
        num_microbatches=4,
        microbatch_size=2,
        options={"x": 1},
    )
    return json.loads(plan.to_json())


BASE = _plan_dict()
LEAF_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(-3, 9), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


PATHS = [p for p in _paths(BASE) if p]


def _mutate(data, path, action, value):
    data = copy.deepcopy(data)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if action == "delete":
        del parent[key]
    elif action == "replace":
        parent[key] = value
    elif action == "duplicate" and isinstance(parent, list):
        parent.append(copy.deepcopy(parent[key]))
    elif action == "extra" and isinstance(parent, dict):
        parent["unexpected_field"] = value
    return data


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(st.sampled_from(PATHS), st.sampled_from(["delete", "replace", "duplicate", "extra"]), LEAF_VALUES),
        min_size=1,
        max_size=3,
    ),
    st.one_of(st.none(), st.integers(0, 4000)),
)
@pytest.mark.slow  # hypothesis: many plan files
def test_mutated_plan_files_load_or_raise_plan_file_error(mutations, truncate_at):
    data = BASE
    for path, action, value in mutations:
        try:
            data = _mutate(data, path, action, value)
        except (KeyError, IndexError, TypeError):
            continue  # the path no longer exists after an earlier mutation
    text = json.dumps(data)
    if truncate_at is not None:
        text = text[:truncate_at]
    try:
        plan = plan_from_json(text)
    except PlanFileError:
        return
    assert isinstance(plan, Plan)
    assert plan.stages[0].start == 0 and all(a.stop == b.start for a, b in zip(plan.stages, plan.stages[1:]))


def test_the_unmutated_plan_loads():
    assert plan_from_json(json.dumps(BASE)).num_stages == 2


@pytest.mark.parametrize("text", ["", "[]", "null", "{", '{"schema_version": 1}', "\udc80"])
def test_garbage_is_rejected(text):
    with pytest.raises(PlanFileError):
        plan_from_json(text)
