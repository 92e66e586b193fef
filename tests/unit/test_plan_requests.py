"""Random plan requests (tiny zoo models, catalog devices, random pins; analytic costs): every answer is
a plan the runtime runs that honours every pin, or a PartitaError; and where memory cannot be the
cause (a model under a million parameters, a GiB or more per device), an InfeasiblePlanError names
the pins (``binding == "pins"``), never memory. The probe that found the cases of
``test_input_checks.py``'s pinned schedules and stages, kept as a guard."""

from __future__ import annotations

import random

import pytest

import partita
from partita import examples
from partita.errors import PartitaError
from partita.runtime.layout import check_layout, stage_shares
from partita.types.plan_file import plan_from_json
from partita.types.schedule_orders import check_schedule

NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def graphs():
    built = {name: examples.build(name, batch_size=8) for name in ("gpt2", "mlp", "llama")}
    return {
        name: partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        for name, ex in built.items()
    }


def _request(rng: random.Random) -> tuple[str, partita.Cluster, int, dict]:
    per_node, nodes = rng.choice([1, 2, 4, 8]), rng.choice([1, 1, 2, 3])
    memory = rng.choice([None, 2**30])
    cluster = partita.Cluster(
        device=rng.choice(["h100", "a100-80gb", "l4"]),
        num_devices=per_node * nodes,
        devices_per_node=per_node,
        **({} if memory is None else {"memory_bytes": memory}),
    )
    choices = {
        "schedules": [("gpipe",), ("1f1b",), ("interleaved1f1b",), ("zbv",)],
        "tensor_parallel": [1, 2, 4],
        "sharding": ["replicate", "full_shard", "shard_grads_and_optimizer"],
        "recompute": ["none", "selective", "full"],
        "precision": ["fp32", "bf16"],
        "num_stages": [1, 2, 3, 4],
        "num_microbatches": [1, 2, 4],
        "replicas": [1, 2, 4],
    }
    pins = {name: rng.choice(values) for name, values in choices.items() if rng.random() < 0.25}
    return rng.choice(["gpt2", "mlp", "llama"]), cluster, rng.choice([8, 16, 24, 32]), pins


def _violations(plan: partita.Plan, pins: dict, global_batch: int) -> list[str]:
    check_layout(plan)
    check_schedule(plan.schedule, plan.num_microbatches, plan.num_rank_groups, plan.num_stages)
    for stage in plan.stages:
        stage_shares(stage, global_batch // plan.num_microbatches)
    assert plan_from_json(plan.to_json()).stages == plan.stages
    honoured = {
        "schedules": plan.schedule.value == pins.get("schedules", ("",))[0],
        "tensor_parallel": plan.tensor_parallel == pins.get("tensor_parallel"),
        "recompute": all(s.recompute.value == pins.get("recompute") for s in plan.stages),
        "precision": plan.precision.value == pins.get("precision"),
        "num_stages": plan.num_rank_groups == pins.get("num_stages"),
        "num_microbatches": plan.num_microbatches == pins.get("num_microbatches"),
        "replicas": all(s.num_replicas == pins.get("replicas") for s in plan.stages),
        # stages holding a weight shared with another stage replicate under any pinned level
        "sharding": all(s.sharding.value in (pins.get("sharding"), "replicate") for s in plan.stages),
    }
    return [name for name in pins if not honoured[name]]


@pytest.mark.parametrize("seed", range(NUM_REQUESTS))
def test_a_random_request_gets_a_runnable_plan_or_a_named_cause(graphs, seed):
    name, cluster, global_batch, pins = _request(random.Random(seed))
    options = partita.PlanOptions(costs="analytic", **pins)
    try:
        plan = partita.plan(graphs[name], cluster=cluster, global_batch_size=global_batch, options=options)
    except partita.InfeasiblePlanError as e:
        ample = cluster.memory_bytes >= 2**30 and graphs[name].num_parameters < 10**6
        assert not ample or e.binding == "pins", f"{name} {pins}: memory blamed: {e}"
        return
    except PartitaError:
        return
    assert not _violations(plan, pins, global_batch), (name, pins, _violations(plan, pins, global_batch))
