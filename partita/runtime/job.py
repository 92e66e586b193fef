"""One plan per job, by construction: ``plan`` (``partita.plan``) searches on rank 0 and gives every
rank the same Plan; ``shared_plan`` does the same for any planning function of the user's."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from partita.cost.job_ranks import alone_on_this_rank, job_world_size
from partita.errors import InputError, PlanFileError
from partita.planning import api as planning_api
from partita.planning.options import PlanOptions
from partita.runtime.process_groups import init_process_group, timeout_of
from partita.types import OpGraph, Plan
from partita.types.cluster import Cluster
from partita.types.plan_file import plan_from_json, plan_to_json

__all__ = ["plan", "shared_plan"]


def plan(
    model: torch.nn.Module | OpGraph,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    cluster: Cluster,
    global_batch_size: int,
    loss_fn: Callable | None = None,
    target: Any = None,
    options: PlanOptions = PlanOptions(),
    batch_dims: dict | None = None,
) -> Plan:
    """The plan with the shortest simulated step that fits every device's memory: ``partita.plan``.

    ``model`` is an ``nn.Module`` called as ``model(*args, **kwargs)`` (returning its loss, or an
    output that ``loss_fn(output, target)`` turns into one), or a graph from ``partita.capture``.
    ``options`` pins any choice (``PlanOptions(schedules="1f1b", num_stages=4)``); the search
    fills in the rest, the tensor-parallel degree included. ``batch_dims`` says where the batch is
    in each input, as ``partita.capture`` takes it. Raises InfeasiblePlanError when nothing fits,
    saying what would.

    One plan per job, by construction: in a job of several processes (torch.distributed
    initialised with a world of more than one, or torchrun's ``WORLD_SIZE`` above 1; the process
    group is then initialised from torchrun's environment if needed), rank 0 captures, measures
    and searches while the other ranks wait, and every rank returns rank 0's Plan
    (``shared_plan``), so the natural torchrun script -- every rank calls ``partita.plan`` then
    builds its ``partita.Trainer`` -- holds one plan even with measured costs. Collective then:
    call it on every rank. In a single process it plans here (``partita.planning.api.plan``).
    """
    make = functools.partial(
        planning_api.plan,
        model,
        args,
        kwargs,
        cluster=cluster,
        global_batch_size=global_batch_size,
        loss_fn=loss_fn,
        target=target,
        options=options,
        batch_dims=batch_dims,
    )
    return shared_plan(make) if job_world_size() > 1 else make()


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
            with alone_on_this_rank():  # partita.plan or Cluster.local inside: this rank's alone
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
