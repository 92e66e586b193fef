"""The memory bound: "nothing fits" without searching, the binding constraint named, each fix checked,
and never a refusal of what the search can plan (partita.planning.memory_bound, infeasible)."""

import dataclasses

import pytest
from clusters import h100s
from oracle import all_splits
from planning_instances import random_instance

import partita
from partita.cost.memory import device_memory, microbatches_in_flight
from partita.errors import InfeasiblePlanError
from partita.planning import api, infeasible
from partita.planning.configs import enumerate_configs
from partita.planning.context import planning_context
from partita.planning.degree_contexts import degree_contexts
from partita.planning.driver import best_plan
from partita.planning.infeasible import memory_bound
from partita.planning.memory_bound import MemoryBound
from partita.planning.options import PlanOptions
from partita.planning.sharding import levels
from partita.types import Schedule


def _error(graph, cluster, batch=8, **pins) -> InfeasiblePlanError:
    with pytest.raises(InfeasiblePlanError) as info:
        partita.plan(graph, cluster=cluster, global_batch_size=batch, options=PlanOptions(**pins))
    return info.value


def _applied(fix, cluster, batch, pins):
    changes = dict(fix.changes)
    cluster = dataclasses.replace(
        cluster,
        num_devices=changes.pop("num_devices", cluster.num_devices),
        memory_bytes=changes.pop("memory_bytes", cluster.memory_bytes),
    )
    return cluster, changes.pop("global_batch_size", batch), {**pins, **changes}


def _no_search(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("searched")

    monkeypatch.setattr(api, "best_of_contexts", refuse)
    monkeypatch.setattr(infeasible, "best_plan", refuse)


def test_refused_without_any_search(gpt2_graph, monkeypatch):
    """16 devices of 128 KiB, with planning taken as costly (as for a large model on many devices):
    the bound answers and checks the fixes itself, without one call to the search."""
    _no_search(monkeypatch)
    monkeypatch.setattr(infeasible, "_cheap", lambda ctx: False)
    err = _error(gpt2_graph, h100s(16, memory=2**17))
    assert err.refused_by_bound and "refuses it without searching" in str(err)
    assert err.fixes and all(f.checked_by == "bound" for f in err.fixes)
    # each fix, re-run through the bound of a fresh planning run, lets the request through
    for fix in err.fixes:
        cluster, batch, pins = _applied(fix, h100s(16, memory=2**17), 8, {})
        ctx = planning_context(gpt2_graph, cluster=cluster, global_batch_size=batch, options=PlanOptions(**pins))
        assert any(memory_bound(c).may_fit() for c in degree_contexts(ctx, pins.get("tensor_parallel"))), fix


def test_the_binding_block_is_named(gpt2_graph, monkeypatch):
    """A block that fits no device even alone, sharded over every replica, at micro-batch 1: the
    error names it and its bytes without searching the request, and each fix it names plans."""
    calls = []
    monkeypatch.setattr(api, "best_of_contexts", lambda contexts: calls.extend(contexts) or [])
    pins, cluster = dict(tensor_parallel=1, max_blocks=4), h100s(4, memory=2**19)
    err = _error(gpt2_graph, cluster, **pins)
    assert not calls and err.refused_by_bound and err.binding == "block"
    text = str(err)
    assert "one block (" in text.lower() and "of parameters + gradients + optimizer state" in text
    assert "needs at least" in text and "micro-batch 1" in text
    assert err.fixes
    monkeypatch.undo()
    assert any(fix.checked_by == "search" for fix in err.fixes)
    for fix in err.fixes:  # those the bound alone checked (marked "[bound]") are what it cannot rule out
        if fix.checked_by == "bound":
            assert f"{fix.text} [bound]" in text
            continue
        fixed_cluster, batch, fixed_pins = _applied(fix, cluster, 8, pins)
        partita.plan(gpt2_graph, cluster=fixed_cluster, global_batch_size=batch, options=PlanOptions(**fixed_pins))


@pytest.mark.parametrize(
    "pins, memory, wanted",
    [  # GPT-2 tiny in 16 blocks on 4 devices, batch 64: plans with ~1,136,000 B, ~1,172,000 without recomputation, ~1,188,000 on ZBV
        (dict(recompute=False), 1_155_000, "recompute"),
        (dict(schedules="zbv"), 1_160_000, "schedules"),
    ],
)
def test_each_fix_plans_when_applied(gpt2_graph, pins, memory, wanted):
    """A pinned choice that makes the request infeasible is offered unpinned, next to more devices
    and more memory; every fix, applied, plans (the search checked each)."""
    cluster, pins, batch = h100s(4, memory=memory), {"max_blocks": 16, **pins}, 64
    err = _error(gpt2_graph, cluster, batch, **pins)
    options = {f.option for f in err.fixes}
    assert {wanted, "num_devices", "memory_bytes"} <= options
    assert all(f.checked_by == "search" for f in err.fixes) and "by planning with it" in str(err)
    for fix in err.fixes:
        fixed_cluster, fixed_batch, fixed_pins = _applied(fix, cluster, batch, pins)
        p = partita.plan(
            gpt2_graph, cluster=fixed_cluster, global_batch_size=fixed_batch, options=PlanOptions(**fixed_pins)
        )
        assert all(s.memory_bytes <= fixed_cluster.usable_memory_bytes for s in p.stages), fix
    assert err.min_devices > 4 and err.min_memory_bytes > memory


def test_what_the_search_tried_is_never_advised(mlp_graph):
    """Recomputation, sharding levels and tensor-parallel degrees left unpinned were searched: the
    error does not offer them (it used to say recompute=True whatever was searched)."""
    err = _error(mlp_graph, h100s(4, memory=2**16))
    assert not {"recompute", "sharding", "tensor_parallel"} & {f.option for f in err.fixes}
    assert "recompute" not in " ".join(f.text for f in err.fixes)


@pytest.mark.parametrize(
    "name, devices, pins",
    [
        ("mlp", 1, {}),
        ("gpt2", 2, dict(schedules="1f1b")),
        ("mlp", 3, dict(uniform_replicas=False)),
        ("gpt2", 4, dict(schedules=("interleaved1f1b", "zbv"), max_blocks=16)),
        ("mlp", 4, dict(sharding="full_shard", precision="fp32")),
        ("gpt2", 2, dict(recompute=True, optimizer="sgd-momentum", max_blocks=16)),
    ],
)
def test_the_bound_never_refuses_a_plan_the_search_finds(name, devices, pins, mlp_graph, gpt2_graph):
    """Soundness: a plan the search finds still fits with the memory limit set to its fullest
    device, so the bound must let that limit through (on each degree the plan could use)."""
    _check_sound(mlp_graph if name == "mlp" else gpt2_graph, devices, pins)


@pytest.mark.parametrize("virtual", [(3,), (2, 3)])
def test_the_bound_never_refuses_interleaved_plans_of_three_stages_per_rank_group(virtual, gpt2_graph):
    """The same on interleaved 1F1B with 3 stages per rank group, alone or beside 2: its fullest
    group's memory passes the bound."""
    pins = dict(schedules="interleaved1f1b", max_blocks=16)
    found = _check_sound(gpt2_graph, 4, pins, interleaved_virtual_stages=virtual)
    assert found and all(p.num_stages // p.num_rank_groups in virtual for p in found)
    if virtual == (3,):
        assert all(p.num_stages == 3 * p.num_rank_groups for p in found)


def _check_sound(graph, devices: int, pins: dict, **knobs) -> list:
    """The plans found on each degree, after checking the bound against each (``knobs``: SearchOptions')."""
    ctx = planning_context(graph, cluster=h100s(devices), global_batch_size=12, options=PlanOptions(**pins))
    found = []
    for c in degree_contexts(ctx, None, uneven=pins.get("uniform_replicas") is False):
        c = dataclasses.replace(c, options=dataclasses.replace(c.options, **knobs))
        p = best_plan(c)
        if p is None:  # e.g. interleaved schedules on a chain too short for them at this degree
            continue
        found.append(p)
        fullest = max(s.memory_bytes for s in p.stages)
        tight = dataclasses.replace(c, options=dataclasses.replace(c.options, memory_limit_bytes=fullest))
        assert memory_bound(tight).may_fit(), (graph.fingerprint, devices, pins, c.options.tensor_parallel)
        small = dataclasses.replace(c, options=dataclasses.replace(c.options, memory_limit_bytes=fullest // 4))
        if not memory_bound(small).may_fit():  # what the bound refuses, the search cannot plan
            assert best_plan(small) is None
    return found


@pytest.mark.parametrize("seed", range(4))
def test_rank_groups_of_several_stages_hold_at_least_the_bound_on_every_split(seed):
    """The several-stage bound's derivation checked on every plan shape: for every config of
    interleaved 1F1B (2 and 3 stages per rank group) and ZB-V the search enumerates on a random
    chain, and every split of its blocks, the exact memories of the G rank groups (each at its
    least sharding level) sum to at least ``groups_least[G]``."""
    ctx = random_instance(seed, (9, 12))
    options = dataclasses.replace(
        ctx.options,
        num_devices=4,
        max_microbatch_choices=3,
        schedules=(Schedule.INTERLEAVED_1F1B, Schedule.ZBV),
        interleaved_virtual_stages=(2, 3),
    )
    bound = MemoryBound(ctx.graph, ctx.chain, ctx.costs_at, options)
    num_blocks, checked = len(ctx.chain) - 1, set()
    for config in enumerate_configs(options, num_blocks):
        g, v, r, m = config.num_rank_groups, config.virtual_stages, config.replicas, config.num_microbatches
        least = bound.groups_least(r, num_blocks // v, v)[g]
        table = ctx.costs_at(config.microbatch_size)
        for split in all_splits(num_blocks, config.num_stages):
            total = 0.0
            for group in range(g):
                ranges = [
                    (ctx.chain[split[s]], ctx.chain[split[s + 1]])
                    for s in range(config.num_stages)
                    if config.rank_group_of(s) == group
                ]
                in_flight = microbatches_in_flight(config.schedule, m, g, group, v)
                total += min(
                    float(
                        device_memory(
                            table,
                            ranges,
                            in_flight=in_flight,
                            optimizer=options.optimizer,
                            recompute=config.recompute_mode,
                            precision=options.precision,
                            sharding=level,
                            num_replicas=r,
                            num_microbatches=m,
                        ).total_bytes
                    )
                    for level in levels(options.sharding, r)
                )
            assert total >= least, (seed, config, split, total, least)
        checked.add((config.schedule, v, g))
    assert {(Schedule.INTERLEAVED_1F1B, 3, 2), (Schedule.INTERLEAVED_1F1B, 2, 2), (Schedule.ZBV, 2, 2)} <= checked


@pytest.mark.slow  # an infeasible search with its checked fixes (about 8 s)
def test_when_the_state_cannot_spread_neither_blocks_nor_batch_are_tried(gpt2_graph, monkeypatch):
    """Memory below what the whole model's parameters, gradients and optimizer state need spread
    over every device (sharded): the error offers more devices and more memory only, without
    rebuilding the chain at finer blocks or costing a smaller batch (at 530B on 64 GPUs that took
    over 30 min); and indeed neither the finest blocks nor the smallest batch plans."""
    ctx = planning_context(gpt2_graph, cluster=h100s(4), global_batch_size=8, options=PlanOptions(tensor_parallel=1))
    blocks = infeasible.block_costs(ctx.costs_at(1), ctx.chain)
    k = blocks.num_blocks
    least = min(
        infeasible.spread_state_bytes(
            int(blocks.param_bytes_matrix[0, k]),
            int(blocks.trainable_bytes_matrix[0, k]),
            4 // r,
            r,
            r > 1,
            ctx.options,
            foreach_step=blocks.foreach_step,
        )
        for r in range(1, 5)
    )
    cluster = h100s(4, memory=int((least - 1) / (1 - h100s(4).reserved_memory_fraction)))
    assert cluster.usable_memory_bytes < least

    def never(*args, **kwargs):
        raise AssertionError("tried")

    monkeypatch.setattr(infeasible, "with_blocks", never)
    monkeypatch.setattr(infeasible, "with_batch", never)
    err = _error(gpt2_graph, cluster, tensor_parallel=1)
    assert {f.option for f in err.fixes} == {"num_devices", "memory_bytes"}
    monkeypatch.undo()
    finest = int(ctx.legal_cuts.sum()) - 1
    for batch, pins in ((8, dict(max_blocks=finest)), (4, {})):
        _error(gpt2_graph, cluster, batch=batch, tensor_parallel=1, **pins)


def test_costly_fixes_are_not_searched_when_the_bound_cannot_answer(gpt2_graph, monkeypatch):
    """A request the bound lets through and the search cannot plan (ZBV pinned), with planning taken
    as costly: only variants no larger than the request (devices x blocks) are searched; finer
    blocks and more devices, which the bound cannot answer either, are not offered. (A 1T GPT on
    3,072 A100s with ZBV pinned took over 15 minutes to list its fixes this way; now 36 s.)"""
    monkeypatch.setattr(infeasible, "_cheap", lambda ctx: False)
    searched = []
    real_best_plan = infeasible.best_plan
    monkeypatch.setattr(infeasible, "best_plan", lambda ctx, **kw: searched.append(ctx) or real_best_plan(ctx, **kw))
    cluster, pins = h100s(4, memory=1_160_000), {"max_blocks": 16, "schedules": "zbv", "tensor_parallel": 1}
    err = _error(gpt2_graph, cluster, 64, **pins)
    assert not err.refused_by_bound and searched
    request = 4 * 16**2  # devices x blocks squared
    assert all(ctx.options.num_devices * (len(ctx.chain) - 1) ** 2 <= request for ctx in searched)
    options = {f.option for f in err.fixes}
    assert "schedules" in options and not {"num_devices", "max_blocks"} & options
    assert all(f.checked_by == "search" for f in err.fixes)


def test_no_fix_is_searched_past_the_checks_budget(gpt2_graph, monkeypatch):
    """With the budget spent, a request the bound cannot answer is refused at once, saying which
    changes were left unchecked rather than that none would fit."""
    monkeypatch.setattr(infeasible, "_cheap", lambda ctx: False)
    monkeypatch.setattr(infeasible, "_CHECKS_BUDGET_S", -1.0)
    monkeypatch.setattr(api, "time", type("Clock", (), {"monotonic": staticmethod(lambda: 0.0)}))
    monkeypatch.setattr(infeasible, "best_plan", lambda *a, **k: pytest.fail("a fix was searched"))
    err = _error(gpt2_graph, h100s(4, memory=1_160_000), 64, max_blocks=16, schedules="zbv")
    assert not err.fixes and "not checked, since planning with them takes long here" in str(err)


def test_a_size_found_by_a_bisection_cut_short_is_not_called_the_least(gpt2_graph, monkeypatch):
    """More memory or devices found while some smaller size went unchecked (the budget spent) is
    named as a size that fits, not as the least one ("at least")."""
    ctx = planning_context(
        gpt2_graph, cluster=h100s(4, memory=1_160_000), global_batch_size=64, options=PlanOptions(max_blocks=16)
    )
    contexts = degree_contexts(ctx, 1)
    checker = infeasible._Checker(contexts, [memory_bound(c) for c in contexts], False, budget_s=0.0)
    limit = contexts[0].options.memory_limit_bytes

    def fits_scaled(devices=None, usable=None):  # sizes from twice today's fit; the rest went unchecked
        size = devices if devices is not None else usable
        if size >= (16 if devices is not None else 2 * limit):
            return "search"
        checker.unchecked += 1
        return None

    monkeypatch.setattr(checker, "fits_scaled", fits_scaled)
    (memory,) = checker.more_memory()
    (devices,) = checker.more_devices()
    assert "(less not checked)" in memory.text and "at least" not in memory.text
    assert "fewer not checked" in devices.text and "at least" not in devices.text
