"""Many plans of one schedule shape simulated at once: the refinement's neighbours, side by side.

``partita.planning.simulator``'s event loop takes the actions of each rank group in order, and
which action it can take next depends only on which actions it has already taken, never on the
times: the order in which it takes them is fixed by the schedule (S stages, G rank groups, m
micro-batches) alone. So are the *waves* of that order: wave 0 holds the actions that wait for
nothing, wave w + 1 those whose inputs and whose rank group's previous action are in waves up to
w. Here every wave runs as a few array operations over all plans and all its actions, with the very operations of the event loop::

    ready = max(end[first] + latency[first], end[second] + latency[second])
    start = max(clock[rank group], ready);  end[out] = start + duration

so each plan's step, bubble and activation peaks equal ``simulate_pipeline``'s bit for bit
(busy seconds too: each rank group adds its durations in its own order, one wave at a time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from partita.planning.build import BuildMemo
from partita.planning.simulate import Costs, pipeline_inputs
from partita.planning.simulator import (
    PipelineInputs,
    PreparedPipeline,
    finished_pipeline,
    prepared_pipeline,
    simulate_pipeline,
    slotted_orders,
)
from partita.types import Plan, Schedule, SimResult
from partita.types.cluster import Cluster

__all__ = ["simulate_many", "simulate_pipelines"]

# Fewer plans than this run one by one (the array operations cost more than they save).
MIN_BATCH = 4


def simulate_many(
    plans: Sequence[Plan],
    costs: Costs,
    cluster: Cluster | Mapping[str, Any] | None = None,
    *,
    memo: BuildMemo | None = None,
) -> list[SimResult]:
    """``simulate_plan(plan, costs, cluster, keep_timeline=False, memo=memo)`` of each plan (the plans of
    one schedule, rank groups, stages and micro-batches run as one batch)."""
    return simulate_pipelines([pipeline_inputs(p, costs, cluster, memo=memo) for p in plans])


def simulate_pipelines(inputs: Sequence[PipelineInputs], *, activation_peaks: bool = True) -> list[SimResult]:
    """``simulate_pipeline(**kwargs, keep_timeline=False)`` of each set of keyword arguments.
    ``activation_peaks`` False: the results hold no activation peaks (an empty tuple), which the
    step does not depend on (``finished_pipeline``)."""
    prepared = [prepared_pipeline(**kwargs) for kwargs in inputs]
    results: list[SimResult | None] = [None] * len(prepared)
    shapes: dict[tuple, list[int]] = {}
    for n, prep in enumerate(prepared):
        shapes.setdefault((prep.schedule, prep.m, prep.g, prep.s), []).append(n)
    for shape, members in shapes.items():
        if len(members) < MIN_BATCH:
            for n in members:
                results[n] = simulate_pipeline(**inputs[n], keep_timeline=False)
            continue
        runs = _run_batch(shape, [prepared[n] for n in members])
        for n, ran in zip(members, runs):
            results[n] = finished_pipeline(
                prepared[n], *ran, [], keep_timeline=False, activation_peaks=activation_peaks
            )
    return results


def _run_batch(
    shape: tuple[Schedule, int, int, int], plans: list[PreparedPipeline]
) -> list[tuple[list[float], list[float], list[tuple[float, float]]]]:
    """(clock, busy per rank group, (start, end) of each stage's last B/W) of each plan."""
    schedule, m, g, s = shape
    waves, last_grads = _waves(schedule, m, g, s)
    count, num_slots = len(plans), 3 * s * m
    # Axis 0: slots, stages or rank groups; axis 1: the plans (rows gather contiguously).
    durations = np.array([[x for per_kind in p.dur for x in per_kind] for p in plans]).T  # (4 S, N)
    latency = np.array([[0.0, *p.send] for p in plans]).T  # (S, N): 0, then the sends
    end = np.zeros((num_slots + s + 1, count))
    end[num_slots : num_slots + s] = np.array([p.gathered for p in plans]).T  # the all-gathers' ends, then a 0
    begin = np.zeros((num_slots, count))
    clock, busy = np.zeros((g, count)), np.zeros((g, count))
    for out, duration, first, first_latency, second, second_latency, rank in waves:
        ready = np.maximum(end[first] + latency[first_latency], end[second] + latency[second_latency])
        start = np.maximum(clock[rank], ready)
        spent = durations[duration]
        busy[rank] += spent
        clock[rank] = end[out] = start + spent
        begin[out] = start
    runs = []
    clock, busy = clock.T.tolist(), busy.T.tolist()
    for n in range(count):
        grads = [(float(begin[k, n]), float(end[k, n])) if k >= 0 else (0.0, 0.0) for k in last_grads]
        runs.append((clock[n], busy[n], grads))
    return runs


@lru_cache(maxsize=64)
def _waves(schedule: Schedule, m: int, g: int, s: int) -> tuple[tuple, tuple]:
    """The actions of ``slotted_orders`` in waves (module docstring): per wave, arrays of their
    end slots, duration indices, first and second inputs with their latency indices, and rank
    groups; and each stage's last B/W slot. AssertionError when the order deadlocks."""
    slotted, last_grads, _ = slotted_orders(schedule, m, g, s)
    wave_of: dict[int, int] = {}  # slot -> its action's wave; the all-gather and zero slots: -1
    pos, ready_after = [0] * g, [-1] * g
    members: list[list] = []
    remaining = sum(len(o) for o in slotted)
    while remaining:
        progressed = False
        for r in range(g):
            order = slotted[r]
            while pos[r] < len(order):
                out, duration, first, first_latency, second, second_latency = order[pos[r]]
                inputs = [wave_of.get(x, -1) if x < 3 * s * m else -1 for x in (first, second)]
                if any(x < 3 * s * m and x not in wave_of for x in (first, second)):
                    break
                wave = max(*inputs, ready_after[r]) + 1
                wave_of[out] = ready_after[r] = wave
                if wave == len(members):
                    members.append([])
                members[wave].append((out, duration, first, first_latency, second, second_latency, r))
                pos[r] += 1
                remaining -= 1
                progressed = True
        assert progressed, "schedule order deadlocks"
    waves = tuple(tuple(np.array(column, dtype=np.int64) for column in zip(*wave)) for wave in members)
    return waves, last_grads
