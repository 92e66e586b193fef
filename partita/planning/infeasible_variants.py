"""The request with one change: the planning contexts whose fit ``partita.planning.infeasible``
checks for each fix it names (more devices or memory, another degree, finer blocks, a smaller batch,
bf16, other options), and the device counts and memory sizes a cluster can have."""

from __future__ import annotations

import dataclasses

import numpy as np

from partita.errors import InputError
from partita.planning.chain import coarsen
from partita.planning.context import PlanningContext
from partita.planning.degree_contexts import with_layout
from partita.planning.tensor_parallel import check_degree, find_layout, split_crossings
from partita.planning.uneven import MAX_DEVICES as UNEVEN_MAX_DEVICES
from partita.types.cluster import Cluster

__all__ = [
    "memory_for_usable",
    "valid_device_count",
    "with_batch",
    "with_blocks",
    "with_degree",
    "with_devices",
    "with_memory",
    "with_options",
    "with_precision",
]


def with_options(ctx: PlanningContext, **changes) -> PlanningContext:
    return dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, **changes))


def with_devices(ctx: PlanningContext, devices: int) -> PlanningContext | None:
    t = ctx.options.tensor_parallel
    cluster = dataclasses.replace(ctx.cluster, num_devices=devices)
    try:
        check_degree(t, cluster, replicas=ctx.options.replicas, num_stages=ctx.options.num_stages)
    except InputError:
        return None
    # beyond UNEVEN_MAX_DEVICES the uneven search starts from uniform plans: a uniform trial decides
    uniform = ctx.options.uniform_replicas or devices > UNEVEN_MAX_DEVICES
    options = dataclasses.replace(ctx.options, num_devices=devices // t, uniform_replicas=uniform)
    return dataclasses.replace(ctx, cluster=cluster, options=options)


def with_memory(ctx: PlanningContext, usable: int) -> PlanningContext:
    return with_options(ctx, memory_limit_bytes=usable)


def with_degree(base: PlanningContext, degree: int) -> PlanningContext | None:
    """The context of ``degree`` made from the degree-1 ``base`` (None: the cluster or the model
    cannot split that way)."""
    try:
        check_degree(degree, base.cluster, replicas=base.options.replicas, num_stages=base.options.num_stages)
    except InputError:
        return None
    if degree == 1:
        return base
    layout = find_layout(base.graph, degree, sequence_parallel=base.resolved.get("sequence_parallel") is not False)
    if layout.sequence_parallel and not layout.sequence_nodes:  # no region splits by token
        layout = find_layout(base.graph, degree)
    return None if layout.is_trivial else with_layout(base, layout)


def reference_microbatch(ctx: PlanningContext, batch: int) -> int:
    """The micro-batch size whose costs ``planning_context`` coarsens the graph with."""
    return max(1, min(ctx.graph.batch_size, batch // ctx.cluster.num_devices or 1))


def rechained(ctx: PlanningContext, max_blocks: int, batch: int) -> np.ndarray:
    """The chain a run with ``max_blocks`` and global batch ``batch`` coarsens (as ``planning_context``)."""
    base = ctx.unsharded or ctx
    reference = reference_microbatch(ctx, batch)
    chain = coarsen(ctx.graph, base.costs_at(reference), max_blocks=max_blocks)
    return chain if ctx.layout is None else chain[~split_crossings(ctx.graph, ctx.layout)[chain]]


def max_blocks_of(ctx: PlanningContext) -> int:
    """The ``max_blocks`` the run coarsened its chain with (a context made by hand: its chain's blocks)."""
    return int(ctx.resolved.get("max_blocks") or len(ctx.chain) - 1)


def with_blocks(ctx: PlanningContext, max_blocks: int) -> PlanningContext:
    chain = rechained(ctx, max_blocks, ctx.options.global_batch_size)
    return dataclasses.replace(ctx, chain=chain, resolved={**ctx.resolved, "max_blocks": max_blocks})


def with_batch(ctx: PlanningContext, batch: int) -> PlanningContext:
    chain = ctx.chain
    if reference_microbatch(ctx, batch) != reference_microbatch(ctx, ctx.options.global_batch_size):
        chain = rechained(ctx, max_blocks_of(ctx), batch)
    return dataclasses.replace(ctx, chain=chain, options=dataclasses.replace(ctx.options, global_batch_size=batch))


def with_precision(ctx: PlanningContext) -> PlanningContext | None:
    """``ctx`` in bf16 (analytic costs only: the profiler measures fp32)."""
    from partita.planning.context import planning_context
    from partita.planning.options import PlanOptions

    if ctx.resolved.get("costs") != "analytic":
        return None
    r = ctx.resolved
    base = ctx.unsharded or ctx
    options = PlanOptions(
        schedules=tuple(base.options.schedules),
        num_stages=r.get("num_stages"),
        replicas=r.get("replicas"),
        num_microbatches=r.get("num_microbatches"),
        recompute=r.get("recompute"),
        uniform_replicas=base.options.uniform_replicas,
        optimizer=base.options.optimizer,
        precision="bf16",
        sharding=r.get("sharding"),
        costs="analytic",
        max_blocks=max_blocks_of(ctx),
    )
    try:
        again = planning_context(
            ctx.graph, cluster=base.cluster, global_batch_size=base.options.global_batch_size, options=options
        )
    except InputError:
        return None
    return again if ctx.layout is None else with_layout(again, ctx.layout)


def valid_device_count(cluster: Cluster, tensor_parallel: int = 1):
    """Round a device count up to one the cluster can have (whole nodes beyond one node) and
    that holds whole tensor-parallel groups (a degree that divides a node's devices, as
    ``check_degree`` has made sure)."""

    def valid(count: int) -> int:
        per_node, t = cluster.devices_per_node, tensor_parallel
        return -(-count // t) * t if count <= per_node else -(-count // per_node) * per_node

    return valid


def memory_for_usable(cluster: Cluster, usable: int) -> int:
    """The least device memory whose usable part (less the reserved fraction) is ``usable``."""
    memory = int(usable / (1 - cluster.reserved_memory_fraction)) + 1
    while dataclasses.replace(cluster, memory_bytes=memory).usable_memory_bytes < usable:
        memory += 1
    return memory
