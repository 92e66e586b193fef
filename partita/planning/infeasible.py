"""What would fit when nothing does: the ``InfeasiblePlanError`` and the numbers it names."""

from __future__ import annotations

import dataclasses

from partita.errors import InfeasiblePlanError
from partita.planning.context import PlanningContext
from partita.planning.driver import best_plan
from partita.planning.options import recompute_allowed
from partita.planning.search import SearchOptions
from partita.types import Precision, Sharding
from partita.types.cluster import Cluster
from partita.units import fmt_bytes


def infeasible_error(ctx: PlanningContext) -> InfeasiblePlanError:
    """Say the smallest device count (same device) and the smallest memory per device that fit.

    Both are found by planning again (doubling, then bisection), so the numbers are ones with
    which ``partita.plan`` succeeds; they are also attributes of the error (``min_devices``,
    ``min_memory_bytes``; None when not found within 128x).
    """
    n = ctx.cluster.num_devices
    valid = _valid_device_count(ctx.cluster, ctx.options.tensor_parallel)
    min_devices = _smallest_fitting(lambda d: _fits_with(ctx, devices=d), n, valid)
    min_usable = _smallest_fitting(lambda b: _fits_with(ctx, memory=b), ctx.options.memory_limit_bytes, None)
    min_memory = None
    if min_usable is not None:
        reserved = ctx.cluster.reserved_memory_fraction
        min_memory = int(min_usable / (1 - reserved)) + 1
        while Cluster(**{**_cluster_fields(ctx.cluster), "memory_bytes": min_memory}).usable_memory_bytes < min_usable:
            min_memory += 1
    fixes = []
    if min_devices is not None:
        fixes.append(f"use at least {min_devices} devices")
    if min_memory is not None:
        fixes.append(f"use devices with at least {fmt_bytes(min_memory)} ({min_memory} bytes) of memory")
    if ctx.options.sharding is Sharding.REPLICATE:
        fixes.append("unpin sharding='replicate' (sharded replicas hold 1/r of the optimizer state)")
    if ctx.resolved.get("tensor_parallel") == 1:
        fixes.append("unpin tensor_parallel=1 (tensor-parallel groups hold a part of the largest weights each)")
    if ctx.options.precision is Precision.FP32:
        fixes.append("precision='bf16' (half-size activations)")
    if any(recompute_allowed(s) for s in ctx.options.schedules):
        fixes.append("or a smaller global batch, recompute=True, or a lighter optimizer")
    else:  # ZBV never recomputes
        fixes.append(
            "or a smaller global batch, a lighter optimizer, or schedule '1f1b' or "
            "'interleaved1f1b' with recompute=True"
        )
    err = InfeasiblePlanError(
        f"no plan fits {n} device(s) with {fmt_bytes(ctx.options.memory_limit_bytes)} usable each "
        f"({ctx.graph.num_parameters:,} parameters, optimizer {ctx.options.optimizer.value}): " + ", ".join(fixes)
    )
    err.min_devices, err.min_memory_bytes = min_devices, min_memory
    return err


def _fits_with(ctx: PlanningContext, *, devices: int | None = None, memory: int | None = None) -> bool:
    """Whether ``ctx`` (at its tensor-parallel degree) finds a plan with ``devices`` or ``memory``."""
    cluster, options = ctx.cluster, ctx.options
    if devices is not None:
        cluster = Cluster(**{**_cluster_fields(cluster), "num_devices": devices})
        options = _with(options, num_devices=devices // options.tensor_parallel)
    if memory is not None:
        options = _with(options, memory_limit_bytes=memory)
    trial = dataclasses.replace(ctx, cluster=cluster, options=options)
    return best_plan(trial, num_simulated=4) is not None


def _valid_device_count(cluster: Cluster, tensor_parallel: int = 1):
    """Round a device count up to one the cluster can have (whole nodes beyond one node) and
    that holds whole tensor-parallel groups (a degree that divides a node's devices, as
    ``check_degree`` has made sure)."""

    def valid(count: int) -> int:
        per_node, t = cluster.devices_per_node, tensor_parallel
        return -(-count // t) * t if count <= per_node else -(-count // per_node) * per_node

    return valid


def _smallest_fitting(fits, current: int, valid) -> int | None:
    """Smallest value above ``current`` for which ``fits`` holds: doubling, then bisection."""
    valid = valid or (lambda x: x)
    low, high = current, valid(current * 2)
    for _ in range(7):
        if fits(high):
            break
        low, high = high, valid(high * 2)
    else:
        return None
    while high - low > max(1, high // 256):
        mid = valid((low + high) // 2)
        if mid <= low or mid >= high:
            break
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def _with(options: SearchOptions, **changes) -> SearchOptions:
    return SearchOptions(**{**options.__dict__, **changes})


def _cluster_fields(cluster: Cluster) -> dict:
    return dict(cluster.__dict__)
