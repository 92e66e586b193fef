"""Per-rank compute orders of the pipeline schedules, as torch.distributed.pipelining runs them.

Facts about the schedules that the planner (which simulates these orders) and the runtime (which
runs them, ``partita.runtime.uneven``) share; ``UNEVEN_SCHEDULES`` are those that run stages with
different replica counts.

Each rank group executes a fixed list of actions, strictly in order (the runtime blocks on the
receive an action needs). These lists reproduce torch 2.13's schedules action for action, so that
the simulator times the order the runtime will actually run:

    GPIPE             ScheduleGPipe            all F, then all B                    1 stage per rank
    ONE_F_ONE_B       Schedule1F1B             ``min(m, G - r)`` warm-up F, then B/F alternating
    INTERLEAVED_1F1B  ScheduleInterleaved1F1B  ``_get_1f1b_rank_ops`` with v stages per rank
    ZBV               ScheduleZBVZeroBubble    its own builder; backward split into I and W

Glossary
--------
action       ``Action(stage, microbatch, kind)``; prints as torch does: ``2F0`` is the forward of
             micro-batch 0 on stage 2.
kind         "F" forward; "B" full backward; "I" input-gradient half of the backward (sent on to
             the previous stage at once); "W" weight-gradient half (can wait, fills bubbles).
rank group   one pipeline position: the ranks that hold one replica each of the same stages.
             ``G`` rank groups, ``S`` stages in all.
placement    stage ``k`` runs on rank group ``k % G`` ("loop"), except ZBV, whose rank group
             ``g`` holds stages ``g`` and ``2G - 1 - g`` ("V": the last stage is on rank group 0).
round        interleaved schedules cycle through their local stages every ``microbatches_per_round``
             micro-batches: ``m // max(1, m // G)``, i.e. ``G`` whenever ``G`` divides ``m``.

Worked example (1F1B, G = S = 4, m = 8), rank group 1: ``1F0 1F1 1F2 1B0 1F3 1B1 ... 1F7 1B5 1B6 1B7``
- three warm-up forwards (``S - r``), then one backward and one forward until the forwards run out.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from partita.checks import positive_int
from partita.errors import InputError
from partita.types.choices import Schedule

__all__ = [
    "Action",
    "KINDS",
    "UNEVEN_SCHEDULES",
    "rank_orders",
    "stage_rank_groups",
    "check_schedule",
    "default_num_stages",
]

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)

# The schedules whose stages may have different replica counts (one stage per rank group): the
# runtime runs them with its own per-rank orders (``partita.runtime.uneven``), the planner searches
# them (``partita.planning.uneven``).
UNEVEN_SCHEDULES = tuple(s for s in Schedule if s.one_stage_per_rank_group)


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a rank group: ``kind`` of ``microbatch`` on ``stage``."""

    stage: int
    microbatch: int
    kind: str  # "F", "B", "I" or "W"

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """``"2F0"`` -> ``Action(2, 0, "F")`` (torch's action notation)."""
        for i, ch in enumerate(text):
            if ch in KINDS and text[:i].isdigit() and text[i + 1 :].isdigit():
                return cls(int(text[:i]), int(text[i + 1 :]), ch)
        raise InputError(f"cannot parse action {text!r}: write STAGE KIND MICROBATCH, e.g. '2F0' or '5W3'")


def default_num_stages(schedule: Schedule, num_rank_groups: int) -> int:
    """Stages in all when the schedule fixes the stages per rank group (not interleaved)."""
    per_rank = Schedule.parse(schedule).virtual_stages_per_rank
    if per_rank is None:
        raise InputError("interleaved1f1b needs num_stages (a multiple of the number of rank groups)")
    return per_rank * num_rank_groups


def check_schedule(schedule: Schedule, num_microbatches: int, num_rank_groups: int, num_stages: int) -> None:
    """Raise InputError (a ValueError) when torch's schedule cannot run this configuration."""
    schedule = Schedule.parse(schedule)
    m, g, s = num_microbatches, num_rank_groups, num_stages
    for name, value in (("num_microbatches", m), ("num_rank_groups", g), ("num_stages", s)):
        positive_int(value, name)
    if schedule.one_stage_per_rank_group and s != g:
        raise InputError(
            f"{schedule.value} runs one stage per rank group, got {s} stages on {g} rank groups: "
            f"use interleaved1f1b for several stages per rank group"
        )
    if schedule is Schedule.ONE_F_ONE_B and m < s:
        raise InputError(
            f"1f1b needs at least as many micro-batches as stages (torch's Schedule1F1B), got "
            f"{m} micro-batches for {s} stages: use >= {s} micro-batches or gpipe"
        )
    if schedule is Schedule.ZBV and s != 2 * g:
        raise InputError(
            f"zbv runs exactly 2 stages per rank group, got {s} stages on {g} rank groups: use {2 * g} stages"
        )
    if schedule is Schedule.INTERLEAVED_1F1B:
        if s % g:
            raise InputError(f"interleaved1f1b needs the stages ({s}) to be a multiple of the rank groups ({g})")
        rounds = max(1, m // g)
        if m % rounds:
            raise InputError(
                f"interleaved1f1b (torch's ScheduleInterleaved1F1B) needs num_microbatches to be a multiple of "
                f"max(1, num_microbatches // num_rank_groups) = {rounds}, got {m} micro-batches on {g} rank "
                f"groups: use a multiple of {g}, e.g. {rounds * g} or {(rounds + 1) * g}"
            )


def stage_rank_groups(schedule: Schedule, num_rank_groups: int, num_stages: int) -> tuple[int, ...]:
    """The rank group of every stage: ``k % G`` (loop), or the V shape for ZBV."""
    g = num_rank_groups
    if Schedule.parse(schedule) is Schedule.ZBV:
        return tuple(k if k < g else 2 * g - 1 - k for k in range(num_stages))
    return tuple(k % g for k in range(num_stages))


@lru_cache(maxsize=256)
def rank_orders(
    schedule: Schedule, num_microbatches: int, num_rank_groups: int, num_stages: int | None = None
) -> tuple[tuple[Action, ...], ...]:
    """The compute actions of every rank group, in the order torch 2.13 runs them.

    ``num_stages`` defaults to ``G`` (GPipe, 1F1B) or ``2G`` (ZBV); interleaved needs it.
    Raises InputError (a ValueError) for configurations torch rejects.
    """
    schedule = Schedule.parse(schedule)
    g = num_rank_groups
    s = default_num_stages(schedule, g) if num_stages is None else num_stages
    check_schedule(schedule, num_microbatches, g, s)
    build = {
        Schedule.GPIPE: lambda r: _gpipe(r, num_microbatches),
        Schedule.ONE_F_ONE_B: lambda r: _one_f_one_b(r, num_microbatches, g),
        Schedule.INTERLEAVED_1F1B: lambda r: _interleaved(r, num_microbatches, g, s // g),
        Schedule.ZBV: lambda r: _zbv(r, num_microbatches, g),
    }[schedule]
    return tuple(tuple(build(r)) for r in range(g))


# ----------------------------------------------------------------------------- builders


def _gpipe(rank: int, m: int) -> list[Action]:
    """ScheduleGPipe: every forward, then every backward."""
    return [Action(rank, i, FORWARD) for i in range(m)] + [Action(rank, i, BACKWARD) for i in range(m)]


def _one_f_one_b(rank: int, m: int, num_stages: int) -> list[Action]:
    """Schedule1F1B._step_microbatches: ``min(m, S - r)`` warm-up forwards, then "1B1F" pairs."""
    warmup = min(m, num_stages - rank)
    actions = [Action(rank, i, FORWARD) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:
        actions.append(Action(rank, bwd, BACKWARD))
        bwd += 1
        if fwd == m:
            break
        actions.append(Action(rank, fwd, FORWARD))
        fwd += 1
    actions.extend(Action(rank, i, BACKWARD) for i in range(bwd, m))
    return actions


def _interleaved(rank: int, m: int, g: int, v: int) -> list[Action]:
    """ScheduleInterleaved1F1B._calculate_single_rank_operations + _get_1f1b_rank_ops (no zero bubble).

    Step ``op`` forwards local stage ``(op // per_round) % v``; backwards walk the local stages in
    reverse, counted from the end of warm-up. Warm-up: ``(v - 1)·per_round + 2·(G - 1 - r)`` forwards.
    """
    per_round = m // max(1, m // g)
    total = m * v  # forwards (and backwards) on this rank
    warmup = min((v - 1) * per_round + 2 * (g - 1 - rank), total)
    next_fwd, next_bwd = [0] * v, [0] * v
    actions: list[Action] = []
    for op in range(total + warmup):
        if op < total:
            local = (op // per_round) % v
            actions.append(Action(local * g + rank, next_fwd[local], FORWARD))
            next_fwd[local] += 1
        if op >= warmup:
            local = v - 1 - ((op - warmup) // per_round) % v
            actions.append(Action(local * g + rank, next_bwd[local], BACKWARD))
            next_bwd[local] += 1
    return actions


def _zbv(rank: int, m: int, g: int) -> list[Action]:
    """ScheduleZBVZeroBubble._calculate_single_rank_operations, its phases in the same order.

    torch builds the order for ``max(2G - 1, m)`` micro-batches and drops the ones ``>= m``.
    """
    n = max(2 * g - 1, m)
    c0, c1 = rank, 2 * g - 1 - rank  # the V: chunk 0 on the way down, chunk 1 on the way back
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    out: list[Action] = []

    def act(stage: int, key: str, kind: str, advance: bool = True) -> None:
        out.append(Action(stage, cnt[key], kind))
        cnt[key] += advance

    for _ in range(2 * (g - rank) - 1):  # warm-up 1: chunk-0 forwards
        act(c0, "f0", FORWARD)
    for _ in range(rank):  # warm-up 2
        act(c1, "f1", FORWARD)
        act(c0, "f0", FORWARD)
    for _ in range(g - rank):  # warm-up 3: chunk 1 starts its backwards
        act(c1, "f1", FORWARD)
        act(c1, "b1", BACKWARD_INPUT, advance=False)
        act(c1, "b1", BACKWARD_WEIGHT)
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:  # steady state
        if cnt["f0"] < n:
            act(c0, "f0", FORWARD)
        act(c0, "b0", BACKWARD_INPUT, advance=False)
        act(c0, "b0", BACKWARD_WEIGHT)
        act(c1, "f1", FORWARD)
        act(c1, "b1", BACKWARD_INPUT, advance=False)
        act(c1, "b1", BACKWARD_WEIGHT)
    cnt["w0"], cnt["w1"] = cnt["b0"], cnt["b1"]
    for _ in range(rank):  # cool-down 1: input gradients only
        act(c0, "b0", BACKWARD_INPUT)
        act(c1, "b1", BACKWARD_INPUT)
    for _ in range(g - rank):  # cool-down 2
        act(c0, "b0", BACKWARD_INPUT)
        act(c0, "w0", BACKWARD_WEIGHT)
    while cnt["w1"] < cnt["b1"]:
        act(c1, "w1", BACKWARD_WEIGHT)
    while cnt["w0"] < cnt["b0"]:
        act(c0, "w0", BACKWARD_WEIGHT)
    return [a for a in out if a.microbatch < m]
