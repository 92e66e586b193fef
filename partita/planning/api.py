"""``partita.plan``: capture -> costs -> chain -> search -> simulate -> refine -> the best Plan.

The planning package's one entry point. The modules behind it, in the order a run uses them:
``options`` (PlanOptions), ``context`` (one run's shared state and turning splits into
simulated Plans), ``search`` and ``uneven`` (the DPs), ``driver`` (candidates -> best plan),
``refine`` (hill-climbing with bounds), ``baselines`` (other tools' splits, also refinement
seeds) and ``infeasible`` (what would fit when nothing does).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.errors import InputError
from partita.planning.baselines import baseline_outcomes
from partita.planning.configs import divisors
from partita.planning.context import PlanningContext, planning_context
from partita.planning.degree_contexts import degree_contexts
from partita.planning.driver import best_of_contexts
from partita.planning.hetero import MixedOutcome, plan_mixed
from partita.planning.infeasible import has_shape, infeasible_error, memory_bound
from partita.planning.options import PlanOptions
from partita.planning.plan_builder import plan_key
from partita.planning.sharding import shards_as_pinned
from partita.types import OpGraph, Plan, Sharding
from partita.types.cluster import Cluster

__all__ = ["PlanningResult", "check_sharding_applied", "plan", "plan_with_baselines"]


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
    """The plan with the shortest simulated step that fits every device's memory.

    ``model`` is an ``nn.Module`` called as ``model(*args, **kwargs)`` (returning its loss, or an
    output that ``loss_fn(output, target)`` turns into one), or a graph from ``partita.capture``.
    ``options`` pins any choice (``PlanOptions(schedules="1f1b", num_stages=4)``); the search
    fills in the rest, the tensor-parallel degree included (``partita.planning.tensor_parallel``:
    each degree's search on its own, the best plan of all). Raises InfeasiblePlanError when
    nothing fits, saying what would.
    ``batch_dims`` says where the batch is in each input, as ``partita.capture`` takes it
    (``{"src": 1}`` for a sequence-first input). A loss that couples the samples of the batch
    (CLIP, in-batch negatives: ``OpGraph.couples_samples``) is planned with one micro-batch and
    one replica per stage, which is exact, with a warning.
    """
    if isinstance(cluster, Cluster) and cluster.is_mixed:  # several device types: partita.planning.hetero
        return _mixed(model, args, kwargs, cluster, global_batch_size, loss_fn, target, options, batch_dims).plan
    ctx = planning_context(
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
    contexts = degree_contexts(
        ctx,
        options.tensor_parallel,
        uneven=options.uniform_replicas is False,
        sequence_parallel=options.sequence_parallel,
    )
    best = _best_or_raise(contexts)[0]
    check_sharding_applied(best, options)
    return best


@dataclass(frozen=True)
class PlanningResult:
    """A plan, the baselines' splits under its configuration, and the run that made them at the
    plan's tensor-parallel degree (``context.costs_at`` gives its cost tables, e.g. to simulate
    the plan with a timeline; ``context.unsharded`` the degree-1 run when the degree is above 1).
    ``baseline_reasons``: for each baseline without a plan (None), why: "cannot split into N
    stages: ..." or "does not fit". On a mixed cluster (several device types) the baselines are
    the fastest type alone and the slowest type everywhere, ``context`` is the first device
    group's, and ``mixed`` (``partita.planning.hetero.MixedOutcome``) simulates any of the plans on
    its own cluster (``mixed.simulate(plan)``); None on one-type clusters."""

    plan: Plan
    baselines: dict[str, Plan | None]
    context: PlanningContext
    baseline_reasons: dict[str, str] = field(default_factory=dict)
    mixed: MixedOutcome | None = None


def plan_with_baselines(
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
) -> PlanningResult:
    """``plan``, and each baseline's split under the plan's configuration, its tensor-parallel
    degree included (None: it does not fit or cannot make that many stages), from one capture and
    one set of costs. The ``fsdp`` baseline never splits matmuls: plain FSDP2 over every device.
    On a mixed cluster: ``partita.planning.hetero`` (its two baselines)."""
    if isinstance(cluster, Cluster) and cluster.is_mixed:
        outcome = _mixed(model, args, kwargs, cluster, global_batch_size, loss_fn, target, options, batch_dims)
        return PlanningResult(
            outcome.plan, outcome.baselines, outcome.run.contexts[0], outcome.baseline_reasons, outcome
        )
    ctx = planning_context(
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
    best, chosen = _best_or_raise(
        degree_contexts(
            ctx,
            options.tensor_parallel,
            uneven=options.uniform_replicas is False,
            sequence_parallel=options.sequence_parallel,
        )
    )
    check_sharding_applied(best, options)
    baselines, reasons = baseline_outcomes(chosen, best)
    return PlanningResult(best, baselines, chosen, reasons)


def _mixed(model, args, kwargs, cluster, global_batch_size, loss_fn, target, options, batch_dims) -> MixedOutcome:
    """``partita.planning.hetero.plan_mixed``, which plans each device type alone with ``plan``."""
    return plan_mixed(
        model,
        args,
        kwargs,
        cluster=cluster,
        global_batch_size=global_batch_size,
        plan_one_type=plan,
        loss_fn=loss_fn,
        target=target,
        options=options,
        batch_dims=batch_dims,
    )


def check_sharding_applied(plan: Plan, options: PlanOptions) -> None:
    """InputError when a pinned sharding level other than replicate shards no stage of ``plan``, the
    best that fits (the search keeps only plans with the level, so ``_refuse_unshardable`` passes the
    best found without that requirement: stages that share a weight with another stage always
    replicate): a pin is never dropped without a word."""
    pinned = options.sharding
    if shards_as_pinned(plan, pinned):
        return
    shape = ", ".join(f"stage {s.index}: {s.num_replicas} replica(s)" for s in plan.stages)
    raise InputError(
        f"sharding={pinned.value!r} is pinned, but no plan that fits shards a stage (the best: {shape}): stages "
        "that share a weight with another stage (tied embeddings) always replicate; pin replicas and num_stages "
        "so that a stage without tied weights has several replicas, or unpin sharding"
    )


def _best_or_raise(contexts: list[PlanningContext]) -> tuple[Plan, PlanningContext]:
    """The best plan over the contexts (one per tensor-parallel degree; ties: the first, the
    smallest degree) and their idle-unit variants (``idle_unit_contexts``), and its context;
    InfeasiblePlanError when none fits. Degrees that the memory bound refuses are not searched
    (``partita.planning.memory_bound``: nothing of theirs fits, at any replica count)."""
    bounds = [memory_bound(ctx) for ctx in contexts]
    fitting = [c for c, b in zip(contexts, bounds) if b.may_fit()]
    variants = idle_unit_contexts(fitting)
    base_of = {id(variant): ctx for variant, ctx in variants}
    searched = [*fitting, *(variant for variant, _ in variants)]
    started = time.monotonic()
    found = best_of_contexts(searched) if searched else []  # the degrees refine what can win
    if not found:
        every = [*contexts, *(variant for variant, _ in idle_unit_contexts(contexts))]
        shapeless = not any(has_shape(c) for c in every)
        if not shapeless and searched and contexts[0].options.sharding not in (None, Sharding.REPLICATE):
            _refuse_unshardable(searched)
        raise infeasible_error(contexts, bounds, searched_s=time.monotonic() - started, shapeless=shapeless)
    best, chosen = min(found, key=lambda pair: plan_key(pair[0]))
    return best, base_of.get(id(chosen), chosen)


def _refuse_unshardable(searched: list[PlanningContext]) -> None:
    """InputError when plans fit but none has the pinned sharding level (their stages all share a
    weight with another stage): searched again without that requirement, memory not being the cause."""
    relaxed = [
        dataclasses.replace(c, options=dataclasses.replace(c.options, sharding_must_apply=False)) for c in searched
    ]
    found = best_of_contexts(relaxed)
    if found:
        check_sharding_applied(min(found, key=lambda pair: plan_key(pair[0]))[0], searched[0].options)


def idle_unit_contexts(contexts: list[PlanningContext]) -> list[tuple[PlanningContext, PlanningContext]]:
    """(variant, context): each context again with the replica counts that divide the batch but
    not its units (``SearchOptions.idle_units``: plans that leave some devices idle, with counts
    no plan over all of them can have), searched as a context of its own, so that the first kind
    searches as without them and the best of both wins (ties: the first kind). None where the
    replicas are pinned or every count that divides the batch divides the units."""
    found = []
    for ctx in contexts:
        o = ctx.options
        if o.replicas is None and any(o.num_devices % r for r in divisors(o.global_batch_size) if r <= o.num_devices):
            options = dataclasses.replace(o, idle_units=True, uniform_replicas=True)  # uneven: searched once
            found.append((dataclasses.replace(ctx, options=options), ctx))
    return found
