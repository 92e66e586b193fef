"""One plan per job: make it on rank 0 and share it (``shared_plan``), and start the job's process
groups after every rank has shown it holds the same plan (``start_topology``)."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from partita.errors import InputError, PartitaError, PlanFileError
from partita.runtime.data_parallel import Topology, init_process_group, init_topology, timeout_of
from partita.runtime.progress import Progress, is_timeout
from partita.types import Plan
from partita.types.plan_file import plan_from_json, plan_to_json

__all__ = ["shared_plan", "start_topology"]


def shared_plan(make_plan: Callable[[], Plan], *, collective_timeout_s: float | None = None) -> Plan:
    """Make the plan on rank 0 only and give it to every rank: the plan of a torchrun script.

    ::

        plan = shared_plan(lambda: partita.plan(model, kwargs=batch, cluster=cluster, global_batch_size=64))
        trainer = partita.Trainer(model, plan, graph=graph, optimizer=...)

    Initialises torch.distributed from torchrun's environment if needed (with
    ``collective_timeout_s``, as the Trainer would), calls ``make_plan()`` on rank 0 while the other
    ranks wait, and broadcasts the plan as JSON (``plan_to_json``): every rank returns the same
    Plan, and the Trainer's start-up check (one digest per rank) passes. When ``make_plan`` raises
    on rank 0, rank 0 re-raises it and every other rank raises PlanFileError naming it. Collective:
    call it on every rank.
    """
    init_process_group(timeout_of(collective_timeout_s))
    rank = dist.get_rank()
    payload: tuple[str, str] | None = None
    failure: BaseException | None = None
    if rank == 0:
        try:
            plan = make_plan()
            if not isinstance(plan, Plan):
                raise InputError(
                    f"make_plan returned {type(plan).__name__}, not a partita.Plan: return the plan "
                    "(partita.plan(...), partita.Plan.load(path) or manual_plan(...))"
                )
            payload = ("plan", plan_to_json(plan))
        except Exception as e:  # noqa: BLE001 - told to every rank, then re-raised here
            failure, payload = e, ("error", f"{type(e).__name__}: {e}")
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    kind, text = box[0]
    if kind == "error":
        if failure is not None:
            raise failure
        raise PlanFileError(
            f"rank 0 failed to make the plan, so no rank has one: {text}. Fix the planning call (its "
            "error is in rank 0's log); the plan is made on rank 0 only"
        )
    return plan_from_json(text, source="the plan shared by rank 0")


def start_topology(plan: Plan, collective_timeout_s: float | None) -> Topology:
    """init_topology, with a timed-out wait (a rank that never starts its trainer) as CollectiveTimeoutError."""
    try:
        return init_topology(plan, collective_timeout_s=collective_timeout_s)
    except (RuntimeError, TimeoutError) as e:
        if isinstance(e, PartitaError) or not is_timeout(e) or not dist.is_initialized():
            raise
        progress = Progress(dist.get_rank(), dist.get_world_size(), enabled=False)
        raise progress.timeout_error(
            e,
            step=0,
            doing="checking that every rank holds the same plan and creating "
            "the process groups (a rank has not started its trainer)",
            stages="starting",
            timeout_s=collective_timeout_s,
        ) from e
