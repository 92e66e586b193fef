"""Pipeline schedule simulator core: the step time, bubble and activation peak of a schedule's real order.

This module knows stages only as arrays of seconds and bytes (``PipelineInputs``);
``partita.planning.simulate`` turns a Plan and its cost tables into them.

Each rank group runs its actions (``partita.types.schedule_orders.rank_orders``, the order torch runs)
strictly in order, one at a time; an action starts when its rank group is free and its inputs
have arrived. The simulator computes every start and end time exactly, in dependency order.

Glossary
--------
S, G, m      stages in all, rank groups (pipeline positions), micro-batches per step.
F, B, I, W   forward; full backward; input-gradient half; weight-gradient half (B = I + W).
dependency   F(k, i) needs F(k-1, i) + send_s[k-1]. B/I(k, i) needs F(k, i) and B/I(k+1, i) +
             send_s[k] (the gradient of stage k's output comes back the same link). W(k, i) needs
             I(k, i). The last stage's B/I needs only its own F (the loss is part of that F).
send         point-to-point transfer of a stage's output (or its gradient), asynchronous: it
             delays the receiver but does not occupy either rank group's compute.
all-reduce   stage k's gradients summed over its replicas, once per step, beside compute. DDP
             (replicate) all-reduces its buckets while the stage's last B (or W) runs: it starts
             with that action and ends no earlier than the action's end plus the last bucket's
             all-reduce (``allreduce_tail_s``). A sharded stage reduce-scatters instead, after its
             last B (or W). A rank group's collectives share one communication stream: they run
             one after another, in the order they become ready.
all-gather   a sharded stage's parameters gathered over its replicas (``gather_s``), on the
             rank group's stream at the start of the step, before the stage's first F; under
             full_shard again for every F and B, prefetched during the rank group's previous
             action, so F and B take max(compute, all-gather) (``pipeline_inputs``).
tensor par.  with a tensor-parallel degree t > 1 the cost tables are one device's of a group of t
             (``partita.cost.tensor_parallel``): F and B include the group's all-reduces of
             activations and of their gradients, which block the compute that follows them.
busy         seconds a rank group computes in one step (gradient collectives excluded; a
             tensor-parallel group's all-reduces count, as part of F and B).
bubble       1 - mean busy / step time: the share of device time spent idle or only communicating.
in flight    micro-batches whose activations a rank group keeps: added at F, freed at B. With the
             I/W split (ZBV), freed at W: torch's ``stage_backward_input`` keeps the autograd graph
             (``retain_graph=True``) for ``stage_backward_weight``, so all saved tensors live on.
             The peak follows from the order alone (a rank group runs its actions one at a time).

Worked example (GPipe, S = 2, m = 1, f = 1 s, b = 2 s, send 0.5 s): F(0,0) 0-1, F(1,0) 1.5-2.5,
B(1,0) 2.5-4.5, B(0,0) 5-7: step 7 s = (f + b)·(m + S - 1) + 2·send.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NotRequired, TypedDict

import numpy as np

from partita.errors import InputError
from partita.types import Schedule, SimResult, TimelineEvent
from partita.types.schedule_orders import rank_orders, stage_rank_groups

__all__ = ["PipelineInputs", "SimResult", "TimelineEvent", "simulate_pipeline"]

_F, _B, _I, _W = 0, 1, 2, 3
KIND_CODES = {"F": _F, "B": _B, "I": _I, "W": _W}
_KIND_NAMES = ("F", "B", "I", "W")
ALLREDUCE = "allreduce"  # also a sharded stage's reduce-scatter
ALLGATHER = "allgather"  # a sharded stage's parameters gathered at the start of the step
OPTIMIZER = "optimizer"  # a rank group's optimizer step, after its last backward and all-reduce

Orders = tuple[tuple[tuple[int, int, int], ...], ...]  # per rank group: (stage, microbatch, kind code)
# An action on the slots of ``slotted_orders``: (end slot, duration index, first dependency's slot,
# its latency index, second dependency's slot, its latency index).
SlottedAction = tuple[int, int, int, int, int, int]


class PipelineInputs(TypedDict):
    """``simulate_pipeline``'s inputs (but ``keep_timeline`` and ``step_to_beat``), as keyword
    arguments: what ``partita.planning.simulate.pipeline_inputs`` makes of a Plan."""

    schedule: Schedule
    num_microbatches: int
    num_rank_groups: int
    forward_s: Sequence[float]
    backward_s: Sequence[float]
    backward_weight_s: Sequence[float]
    send_s: Sequence[float]
    allreduce_s: Sequence[float]
    split_backward_s: NotRequired[Sequence[float] | None]
    activation_bytes: NotRequired[Sequence[int] | None]
    optimizer_s: NotRequired[Sequence[float] | None]
    allreduce_tail_s: NotRequired[Sequence[float] | None]
    gather_s: NotRequired[Sequence[float] | None]


@lru_cache(maxsize=256)
def compiled_orders(schedule: Schedule, m: int, g: int, s: int) -> Orders:
    """rank_orders as plain int triples (stage, microbatch, kind code): no attribute lookups in the hot loop."""
    return tuple(
        tuple((a.stage, a.microbatch, KIND_CODES[a.kind]) for a in order) for order in rank_orders(schedule, m, g, s)
    )


def simulate_pipeline(
    *,
    schedule: Schedule,
    num_microbatches: int,
    num_rank_groups: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    backward_weight_s: Sequence[float],
    send_s: Sequence[float],
    allreduce_s: Sequence[float],
    activation_bytes: Sequence[int] | None = None,
    keep_timeline: bool = True,
    optimizer_s: Sequence[float] | None = None,
    allreduce_tail_s: Sequence[float] | None = None,
    gather_s: Sequence[float] | None = None,
    split_backward_s: Sequence[float] | None = None,
    step_to_beat: float | None = None,
) -> SimResult | None:
    """Simulate one step of ``schedule``; all per-stage arrays are indexed by stage (length S).

    forward_s, backward_s    seconds per micro-batch; backward_s is the whole backward (I + W).
    backward_weight_s        the W part of backward_s (used only by schedules that split it).
    split_backward_s         what splitting stage k's backward adds to its I part: collectives its
                             W hides when they run together (None: 0; ``CostTable.split_backward_s``).
    send_s                   length S - 1: seconds to send stage k's output to stage k + 1 (and its
                             gradient back); 0 when both stages run on the same rank group.
    allreduce_s              seconds of stage k's gradient all-reduce (0 for one replica).
    activation_bytes         bytes per micro-batch that stage k keeps from F until B (until W with
                             the I/W split); None: peaks are reported as 0.
    optimizer_s              seconds of the optimizer step over stage k's parameters; a rank group
                             steps once its last backward and all-reduce are done (None: 0).
    allreduce_tail_s         what of allreduce_s[k] cannot overlap stage k's last backward (DDP's last
                             bucket); None, or allreduce_s[k]: the collective starts after that backward.
    gather_s                 seconds of stage k's all-gather before its first forward (None: 0).
    step_to_beat             None: simulate to the end. A step: return None as soon as the step
                             surely exceeds it (``partita.planning.plan_builder.cannot_beat``): a rank
                             group that has run until t and has r seconds of actions and s of
                             optimizer step left ends its step after t + r + s.
    Raises InputError (a ValueError) for a schedule torch cannot run with these counts.
    """
    prep = prepared_pipeline(
        schedule=schedule,
        num_microbatches=num_microbatches,
        num_rank_groups=num_rank_groups,
        forward_s=forward_s,
        backward_s=backward_s,
        backward_weight_s=backward_weight_s,
        send_s=send_s,
        allreduce_s=allreduce_s,
        activation_bytes=activation_bytes,
        optimizer_s=optimizer_s,
        allreduce_tail_s=allreduce_tail_s,
        gather_s=gather_s,
        split_backward_s=split_backward_s,
    )
    limit = None if step_to_beat is None else (step_to_beat * (1 + 1e-9) + 2e-12, prep.stepping_s)
    events: list[TimelineEvent] = list(prep.gather_events)
    ran = _run(prep, keep_timeline, events, limit)
    if ran is None:
        return None
    return finished_pipeline(prep, *ran, keep_timeline=keep_timeline)


@dataclass(frozen=True)
class PreparedPipeline:
    """``simulate_pipeline``'s inputs checked and laid out for the event loop (``prepared_pipeline``).
    ``dur``: durations per kind code (F, B, I, W), each per stage."""

    schedule: Schedule
    s: int
    m: int
    g: int
    orders: Orders
    groups: tuple[int, ...]  # each stage's rank group
    dur: tuple[list[float], list[float], list[float], list[float]]
    send: list[float]
    ar: list[float]
    tail: list[float]
    gathered: list[float]  # when each stage's start-of-step all-gather ends
    gather_events: tuple[TimelineEvent, ...]
    stepping_s: list[float]  # each rank group's optimizer seconds
    activation_bytes: Sequence[int] | None


def prepared_pipeline(
    *,
    schedule: Schedule | str,
    num_microbatches: int,
    num_rank_groups: int,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    backward_weight_s: Sequence[float],
    send_s: Sequence[float],
    allreduce_s: Sequence[float],
    activation_bytes: Sequence[int] | None = None,
    optimizer_s: Sequence[float] | None = None,
    allreduce_tail_s: Sequence[float] | None = None,
    gather_s: Sequence[float] | None = None,
    split_backward_s: Sequence[float] | None = None,
) -> PreparedPipeline:
    """Check ``simulate_pipeline``'s inputs (InputError) and lay them out for the event loop."""
    schedule = Schedule.parse(schedule)
    s, m, g = len(forward_s), num_microbatches, num_rank_groups
    fwd, bwd, wgt, send, ar = _check_arrays(s, forward_s, backward_s, backward_weight_s, send_s, allreduce_s)
    tail = ar if allreduce_tail_s is None else _per_stage(allreduce_tail_s, s, "allreduce_tail_s")
    gather = [0.0] * s if gather_s is None else _per_stage(gather_s, s, "gather_s")
    split = [0.0] * s if split_backward_s is None else _per_stage(split_backward_s, s, "split_backward_s")
    orders = compiled_orders(schedule, m, g, s)
    groups = stage_rank_groups(schedule, g, s)
    events: list[TimelineEvent] = []
    gathered = _gathers(groups, gather, events)
    opt = [0.0] * s if optimizer_s is None else [float(x) for x in optimizer_s]
    if len(opt) != s or any(not x >= 0 for x in opt):
        raise InputError(f"optimizer_s needs {s} values >= 0 (one per stage), got {opt}")
    stepping_s = [0.0] * g  # each rank group's stages' steps, added in stage order
    for k, r in enumerate(groups):
        stepping_s[r] += opt[k]
    # Durations per kind code: F, B (whole backward), I (backward less W, and what the split adds), W.
    dur = (fwd, bwd, [max(0.0, b - w) + x for b, w, x in zip(bwd, wgt, split)], wgt)
    return PreparedPipeline(
        schedule,
        s,
        m,
        g,
        orders,
        tuple(groups),
        dur,
        send,
        ar,
        tail,
        gathered,
        tuple(events),
        stepping_s,
        activation_bytes,
    )


def finished_pipeline(
    prep: PreparedPipeline,
    clock: Sequence[float],
    busy: Sequence[float],
    grads_done: Sequence[tuple[float, float]],
    events: list[TimelineEvent],
    *,
    keep_timeline: bool,
    activation_peaks: bool = True,
) -> SimResult:
    """The SimResult of a run of the event loop (``_run``, or ``simulate_batch``'s): the gradient
    collectives after it, the optimizer steps, the step, bubble and activation peaks (with
    ``activation_peaks`` False: none, an empty tuple; the step does not depend on them)."""
    g, s, groups = prep.g, prep.s, prep.groups
    comm_end = _allreduces(groups, grads_done, prep.ar, prep.tail, prep.gathered, events if keep_timeline else None)
    step = 0.0
    for r in range(g):
        done = max(clock[r], comm_end.get(r, 0.0))
        stepping = prep.stepping_s[r]
        if stepping > 0 and keep_timeline:
            events.append(TimelineEvent(r, -1, -1, OPTIMIZER, done, done + stepping))
        step = max(step, done + stepping)
    bubble = 1.0 - sum(busy) / (g * step) if step > 0 else 0.0
    split = prep.schedule is Schedule.ZBV
    peaks = (
        peak_activations(prep.orders, prep.activation_bytes, s, free_kind=_W if split else _B)
        if activation_peaks
        else ()
    )
    timeline = tuple(sorted(events, key=lambda e: (e.start_s, e.rank_group, e.end_s))) if keep_timeline else ()
    return SimResult(
        step_s=step,
        bubble_fraction=bubble,
        rank_busy_s=tuple(busy),
        rank_peak_activation_bytes=peaks,
        timeline=timeline,
    )


def _per_stage(values: Sequence[float], s: int, name: str) -> list[float]:
    out = [float(x) for x in values]
    if len(out) != s or any(not x >= 0 for x in out):
        raise InputError(f"{name} needs {s} values >= 0 seconds (one per stage), got {out}")
    return out


def _gathers(groups: Sequence[int], gather: Sequence[float], events: list[TimelineEvent]) -> list[float]:
    """When each stage's start-of-step all-gather ends: a rank group's run one after another from
    time 0, in stage order (0 for stages that gather nothing)."""
    end, free = [0.0] * len(groups), {}
    for k, r in enumerate(groups):
        if gather[k] > 0:
            start = free.get(r, 0.0)
            end[k] = free[r] = start + gather[k]
            events.append(TimelineEvent(r, k, -1, ALLGATHER, start, end[k]))
    return end


def _check_arrays(s: int, *arrays: Sequence[float]) -> tuple[list[float], ...]:
    names = ("forward_s", "backward_s", "backward_weight_s", "send_s", "allreduce_s")
    out = []
    for name, values in zip(names, arrays):
        want = s - 1 if name == "send_s" else s
        values = [float(x) for x in values]
        if len(values) != want:
            raise InputError(
                f"{name} needs {want} values (one per stage{' boundary' if name == 'send_s' else ''}), "
                f"got {len(values)}"
            )
        if any(not x >= 0 for x in values):  # also rejects NaN
            raise InputError(f"{name} must be >= 0 seconds, got {values}")
        out.append(values)
    fwd, bwd, wgt = out[:3]
    if any(w > b * (1 + 1e-9) for w, b in zip(wgt, bwd)):
        raise InputError(f"backward_weight_s {wgt} exceeds backward_s {bwd}: W is a part of the whole backward")
    return tuple(out)


@lru_cache(maxsize=256)
def slotted_orders(
    schedule: Schedule, m: int, g: int, s: int
) -> tuple[tuple[tuple[SlottedAction, ...], ...], tuple[int, ...], tuple[tuple[tuple[int, int], ...], ...]]:
    """``compiled_orders`` for ``_run``: per rank group, its actions as (end slot, duration index,
    first dependency's slot, its latency index, second dependency's slot, its latency index), per
    stage the slot of its last B or W (its gradients are done then; -1: none), and per rank group
    how many actions it runs of each duration index.

    Slots of ``_run``'s end-time list: F(k, i) at k m + i, B or I at S m + k m + i, W at
    2 S m + k m + i, stage k's all-gather end at 3 S m + k, and a constant 0 at 3 S m + S.
    Durations: kind * S + k in the flat (F, B, I, W) list. Latencies: 0 (none) or 1 + k (the send
    between stages k and k + 1)."""
    orders = compiled_orders(schedule, m, g, s)
    zero, gather = 3 * s * m + s, 3 * s * m
    slotted, last_grads, counts = [], [-1] * s, []
    for order in orders:
        actions, count = [], {}
        for k, i, kind in order:
            if kind == _F:
                out = k * m + i
                first, first_latency = (out - m, k) if k else (zero, 0)  # the previous stage's forward
                second, second_latency = gather + k, 0
            elif kind == _W:
                out = 2 * s * m + k * m + i
                first, first_latency, second, second_latency = s * m + k * m + i, 0, zero, 0
            else:  # B or I: after the own forward and the next stage's B/I (its gradient comes back)
                out = s * m + k * m + i
                first, first_latency = k * m + i, 0
                second, second_latency = (out + m, k + 1) if k < s - 1 else (zero, 0)
            actions.append((out, kind * s + k, first, first_latency, second, second_latency))
            count[kind * s + k] = count.get(kind * s + k, 0) + 1
            if kind in (_B, _W):
                last_grads[k] = out
        slotted.append(tuple(actions))
        counts.append(tuple(sorted(count.items())))
    return tuple(slotted), tuple(last_grads), tuple(counts)


def _run(
    prep: PreparedPipeline,
    keep_timeline: bool,
    events: list[TimelineEvent],
    limit: tuple[float, Sequence[float]] | None = None,
) -> tuple[list[float], list[float], list[tuple[float, float]], list[TimelineEvent]] | None:
    """Event loop: advance every rank group through its order while the next action's inputs are ready.

    ``prep.gathered[k]``: when stage k's parameters are gathered (its first F waits). Returns (clock per
    rank group, busy per rank group, (start, end) of the last B/W per stage, events). Each action
    starts at max(its rank group free, first input + latency, second input + latency), on the
    slots of ``slotted_orders``. ``limit``: (a step, each rank group's optimizer seconds): None
    once a rank group's clock plus its actions left and its optimizer step exceed that step.
    """
    orders, s, m, gathered = prep.orders, prep.s, prep.m, prep.gathered
    g = len(orders)
    slotted, last_grads, counts = slotted_orders(prep.schedule, m, g, s)
    durations = [x for per_kind in prep.dur for x in per_kind]
    if limit is not None:  # each rank group's busy seconds plus its optimizer step, less the limit
        ahead = [
            sum(n * durations[d] for d, n in per_rank) + limit[1][r] - limit[0] for r, per_rank in enumerate(counts)
        ]
    latency = [0.0, *prep.send]
    end: list[float | None] = [None] * (3 * s * m) + [float(x) for x in gathered] + [0.0]
    begin = [0.0] * (3 * s * m)
    pos, clock, busy = [0] * g, [0.0] * g, [0.0] * g
    remaining = sum(len(o) for o in slotted)
    while remaining:
        progressed = False
        for r in range(g):
            order, p, t, spent = slotted[r], pos[r], clock[r], busy[r]
            n = len(order)
            while p < n:
                out, d, first, first_latency, second, second_latency = order[p]
                a, b = end[first], end[second]
                if a is None or b is None:
                    break
                ready = a + latency[first_latency]
                other = b + latency[second_latency]
                if other > ready:
                    ready = other
                start = t if t > ready else ready
                spent += durations[d]  # in order, as the step ran: the busy seconds
                t = start + durations[d]
                end[out], begin[out] = t, start
                p += 1
            if p != pos[r]:
                remaining -= p - pos[r]
                pos[r], clock[r], busy[r], progressed = p, t, spent, True
                if limit is not None and t + ahead[r] - spent > 0:  # t + seconds left + optimizer > limit
                    return None
        if not progressed:
            stuck = {r: str(orders[r][pos[r]]) for r in range(g) if pos[r] < len(orders[r])}
            raise AssertionError(f"schedule order deadlocks: next (stage, microbatch, kind) per rank group {stuck}")
    grads_done = [(begin[slot], end[slot]) if slot >= 0 else (0.0, 0.0) for slot in last_grads]
    if not keep_timeline:
        return clock, busy, grads_done, []
    for r in range(g):
        for (k, i, kind), (out, *_) in zip(orders[r], slotted[r]):
            events.append(TimelineEvent(r, k, i, _KIND_NAMES[kind], begin[out], end[out]))
    return clock, busy, grads_done, events


def _allreduces(
    groups: Sequence[int],
    grads_done: Sequence[tuple[float, float]],
    ar: Sequence[float],
    tail: Sequence[float],
    gathered: Sequence[float],
    events: list[TimelineEvent] | None,
) -> dict[int, float]:
    """Run each rank group's gradient collectives one after another as they become ready (after
    its start-of-step gathers); return when each rank group's last one ends. A collective with a
    tail shorter than itself (DDP's buckets) may start with the last backward, and ends no earlier
    than that backward's end plus the tail."""
    last: dict[int, float] = {}
    stages_of: dict[int, list[int]] = {}
    for k, r in enumerate(groups):
        stages_of.setdefault(r, []).append(k)
    for r in sorted(stages_of):
        stages = sorted((grads_done[k][1], k) for k in stages_of[r] if ar[k] > 0)
        free = max((gathered[k] for k in stages_of[r]), default=0.0)
        for done, k in stages:
            overlapped = tail[k] < ar[k]
            start = max(grads_done[k][0] if overlapped else done, free)
            free = max(start + ar[k], done + tail[k]) if overlapped else start + ar[k]
            if events is not None:
                events.append(TimelineEvent(r, k, -1, ALLREDUCE, start, free))
        last[r] = free
    return last


def peak_activations(
    orders: Orders, activation_bytes: Sequence[int] | None, s: int, *, free_kind: int
) -> tuple[int, ...]:
    """Per rank group: max over its order of the activation bytes held (F adds, free_kind frees)."""
    if activation_bytes is None:
        return (0,) * len(orders)
    act = [int(x) for x in activation_bytes]
    if len(act) != s or any(x < 0 for x in act):
        raise InputError(f"activation_bytes needs {s} values >= 0 (one per stage), got {act}")
    counts, starts, has_forward = _held_counts(orders, s, free_kind)
    if not len(counts):
        return (0,) * len(orders)
    # Whole numbers below 2**53 throughout, so the float product is exact in any summation order.
    held = counts @ np.asarray(act, dtype=np.float64)
    peaks = np.maximum.reduceat(held, starts) if len(starts) else held[:0]
    found = iter(peaks.tolist())
    return tuple(max(0, int(next(found))) if ok else 0 for ok in has_forward)


@lru_cache(maxsize=256)
def _held_counts(orders: Orders, s: int, free_kind: int) -> tuple[np.ndarray, np.ndarray, tuple[bool, ...]]:
    """(rows, S) float: the distinct counts of micro-batches of each stage that a rank group holds
    just after one of its F actions (the peaks come right after one), so the held bytes there are
    ``counts @ act``; the first row of each rank group that has an F; whether it has one. Only
    distinct rows are kept: a deep 1F1B pipeline repeats the same few counts m times."""
    rows, starts, has_forward = [], [], []
    for order in orders:
        held, mine = [0] * s, set()
        for k, _, kind in order:
            if kind == _F:
                held[k] += 1
                mine.add(tuple(held))
            elif kind == free_kind:
                held[k] -= 1
        has_forward.append(bool(mine))
        if mine:
            starts.append(len(rows))
            rows.extend(sorted(mine))
    return np.array(rows, dtype=np.float64).reshape(len(rows), s), np.array(starts, dtype=np.int64), tuple(has_forward)
