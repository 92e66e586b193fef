"""`partita train --plan`: the planner's flags against the plan they would have made.

With ``--plan`` nothing is planned, so a planner flag cannot change the run. A flag that agrees
with the plan is fine (the command that made the plan, repeated); one that disagrees is refused
before any process starts, naming the flag, the plan's value and the fix, instead of training as
the plan says while the user believes otherwise. ``--optimizer`` is honoured (it is the torch
optimizer built) unless it keeps more state per parameter than the plan's memory fit counted.
Flags that only steer planning (``--cache-dir``, ``--plan-out``) are refused by the launcher.
"""

from __future__ import annotations

import argparse
from typing import Any

from partita.errors import InputError
from partita.types import OptimizerKind, Plan
from partita.units import fmt_bytes

__all__ = ["check_plan_flags", "check_planning_only_flags"]


def check_plan_flags(args: argparse.Namespace, plan: Plan, path: str, *, memory_bytes: int | None) -> None:
    """InputError for the first planner flag of ``args`` that disagrees with ``plan`` (from ``path``);
    ``memory_bytes`` is ``--memory`` parsed (None when not given)."""
    for flag, given, planned in _flags_and_plan(args, plan, memory_bytes):
        if given is not None and given != planned:
            show = fmt_bytes if flag == "memory" else _text
            raise InputError(
                f"--{flag} {show(given)} disagrees with the plan {path}, which has {flag.replace('-', ' ')} "
                f"{show(planned)}: with --plan nothing is planned, so the flag would change nothing; drop "
                f"--{flag} to train as the plan says, or re-plan with --{flag} {show(given)} (without --plan)"
            )
    _check_optimizer(args.optimizer, plan, path)


def check_planning_only_flags(args: argparse.Namespace) -> None:
    """InputError for flags that only steer planning, given with ``--plan`` (launcher side: the
    training processes get ``--plan`` from the launcher also when it planned itself)."""
    for flag, value in (("--cache-dir", args.cache_dir), ("--plan-out", args.plan_out)):
        if value is not None:
            raise InputError(
                f"{flag} {value} with --plan {args.plan}: {flag} is where planning writes, and with --plan nothing "
                f"is planned; drop {flag}, or drop --plan to plan now"
            )


def _flags_and_plan(args: argparse.Namespace, plan: Plan, memory_bytes: int | None) -> list[tuple[str, Any, Any]]:
    """(flag, its value or None when not given, what the plan says) for every planner flag of train."""
    counts = {s.num_replicas for s in plan.stages}
    levels = {s.sharding.value for s in plan.stages}
    recomputes = {s.recompute.value for s in plan.stages}
    return [
        ("precision", args.precision, plan.precision.value),
        ("tensor-parallel", args.tensor_parallel, plan.tensor_parallel),
        ("schedule", args.schedule, plan.schedule.value),
        ("num-stages", args.num_stages, plan.num_rank_groups),
        ("microbatches", args.microbatches, plan.num_microbatches),
        ("replicas", args.replicas, counts.pop() if len(counts) == 1 else sorted(counts)),
        ("uniform-replicas", True if args.uniform_replicas else None, plan.uniform_replicas),
        ("sharding", args.sharding, _sharding_of(plan, args.sharding, levels)),
        ("sequence-parallel", args.sequence_parallel, "yes" if plan.sequence_parallel else "no"),
        ("compile", args.compile, plan.compile),
        (
            "recompute",
            args.recompute,
            recomputes.pop() if len(recomputes) == 1 else [s.recompute.value for s in plan.stages],
        ),
        ("costs", None if args.costs in (None, "auto") else args.costs, plan.cost_source),  # auto: either
        ("memory", memory_bytes, plan.cluster.memory_bytes),
    ]


def _sharding_of(plan: Plan, given: str | None, levels: set[str]) -> Any:
    """The plan's sharding as the flag would say it: ``given`` when the plan shards as that pin does
    (every stage the pinned level or replicate, one at least the pinned level; all replicate for
    replicate), else the levels per stage."""
    if given is not None and levels <= {given, "replicate"} and given in levels:
        return given
    return [s.sharding.value for s in plan.stages]


def _check_optimizer(name: str, plan: Plan, path: str) -> None:
    """The torch optimizer may keep less state per parameter than the plan counted, never more."""
    planned = plan.options.get("optimizer")
    if not isinstance(planned, str):
        return  # a manual plan: no memory fit was made
    kind, planned_kind = OptimizerKind.parse(name), OptimizerKind.parse(planned)
    if kind.states_per_parameter > planned_kind.states_per_parameter:
        raise InputError(
            f"--optimizer {name} keeps {kind.states_per_parameter} state tensor(s) per parameter, but the plan {path} "
            f"was made for optimizer {planned_kind.value!r} ({planned_kind.states_per_parameter}), so its memory fit "
            f"does not hold: re-plan with --optimizer {name} (without --plan), or train with an optimizer that keeps "
            f"at most {planned_kind.states_per_parameter}"
        )


def _text(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
