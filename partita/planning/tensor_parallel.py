"""Tensor parallelism in the search: the degrees tried, and the context and cluster of each.

A plan has one tensor-parallel degree ``t`` for all its stages (the runtime pipelines each
tensor-parallel index on its own). For each degree the search runs unchanged on the *group
cluster*: ``N / t`` units, each one tensor-parallel group of ``t`` devices in one node, with the
costs of one device of a group (``partita.cost.tensor_parallel.tensor_parallel_costs``). Replica
counts, rank groups and the data-parallel collectives are counted in groups, whose devices run
their data-parallel rings side by side (one per tensor-parallel index, each over its own links);
the plans it makes hold device ranks: group ``u`` is ranks ``[u t, (u + 1) t)``. Stage
boundaries stay outside the split regions (``split_crossings``). The best plan over the degrees
wins (ties: the smaller degree). Each degree above 1 runs with sequence parallelism
(``partita.capturing.sequence_parallel``: its layout also splits, by token, the regions between)
wherever its layout splits a region, unless ``PlanOptions.sequence_parallel`` pins it off: in the
cost model it never keeps more bytes, computes more or moves more bytes over the group than
tensor parallelism alone (a reduce-scatter and an all-gather are the two ring passes of the
all-reduce they replace), only a few small gradient all-reduces more (norm weights), so searching
both would double every degree's search for a rare gain.

Glossary
--------
degree          ``t``: the devices of one tensor-parallel group (1: no tensor parallelism).
group           the ``t`` devices that split one replica of a stage; consecutive ranks starting
                at a multiple of ``t``, never across a node (its all-reduces run in every layer).
index           a device's position ``i`` in its group; the devices with index ``i`` of a
                stage's replicas form its data-parallel group.
group cluster   the Cluster the search sees for degree ``t``: ``N / t`` devices, ``dpn / t`` to a node.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import numpy as np

from partita.cost.tensor_parallel import split_values, tensor_parallel_costs
from partita.errors import InputError
from partita.types import Cluster, OpGraph
from partita.types.tensor_parallel import TensorParallelLayout

if TYPE_CHECKING:
    from partita.planning.context import PlanningContext

__all__ = [
    "DEGREES",
    "candidate_degrees",
    "check_degree",
    "degree_contexts",
    "find_layout",
    "group_cluster",
    "split_crossings",
    "with_layout",
]

DEGREES = (1, 2, 4, 8)  # searched when not pinned: powers of two up to an HGX node


def check_degree(degree: int, cluster: Cluster, *, replicas: int | None = None, num_stages: int | None = None) -> None:
    """InputError unless ``degree`` is a power of two (as ``partita.capturing.tensor_parallel``'s
    rules take it) and groups of that many devices tile ``cluster`` without crossing a node,
    leaving room for the pinned ``replicas`` x ``num_stages`` groups."""
    n, per_node = cluster.num_devices, cluster.devices_per_node
    if degree & (degree - 1):
        raise InputError(
            f"tensor_parallel={degree} is not a power of two: the split rules divide heads, features and "
            "vocabularies in halves; use 1, 2, 4 or 8"
        )
    if degree > per_node:
        raise InputError(
            f"tensor_parallel={degree} exceeds devices_per_node={per_node}: a tensor-parallel group all-reduces "
            f"activations in every layer, so it never spans nodes; use a degree of at most {per_node} that divides it"
        )
    if n % degree:
        raise InputError(
            f"tensor_parallel={degree} does not divide the {n} devices: every device belongs to one group; "
            f"use a degree that divides {n} (e.g. {max(d for d in DEGREES if n % d == 0)})"
        )
    if n > per_node and per_node % degree:
        raise InputError(
            f"tensor_parallel={degree} does not divide devices_per_node={per_node}: some group would span two "
            f"nodes; use a degree that divides {per_node}"
        )
    units = (replicas or 1) * (num_stages or 1)
    if units * degree > n:
        pinned = " x ".join(
            f"{name} {value}" for name, value in (("replicas", replicas), ("num_stages", num_stages)) if value
        )
        raise InputError(
            f"{pinned} x tensor_parallel {degree} = {units * degree} devices, but the cluster has {n}: "
            "pin fewer replicas or stages, or a smaller tensor_parallel"
        )


def candidate_degrees(cluster: Cluster, *, replicas: int | None = None, num_stages: int | None = None) -> list[int]:
    """The degrees of ``DEGREES`` that ``check_degree`` accepts on ``cluster`` (always 1)."""
    found = []
    for degree in DEGREES:
        try:
            check_degree(degree, cluster, replicas=replicas, num_stages=num_stages)
        except InputError:
            continue
        found.append(degree)
    return found or [1]


def group_cluster(cluster: Cluster, degree: int) -> Cluster:
    """``cluster`` seen in tensor-parallel groups of ``degree``: one device per group (same
    memory, links and efficiencies per device), ``devices_per_node / degree`` to a node, so that
    group ``u`` sits in the node of its ranks ``[u t, (u + 1) t)``."""
    if degree == 1:
        return cluster
    per_node = min(cluster.devices_per_node, cluster.num_devices)  # a cluster smaller than a node: one node
    return dataclasses.replace(cluster, num_devices=cluster.num_devices // degree, devices_per_node=per_node // degree)


def find_layout(graph: OpGraph, degree: int, *, sequence_parallel: bool = False) -> TensorParallelLayout:
    """What a group of ``degree`` devices splits in ``graph``: the capture layer's rules (with
    ``sequence_parallel``, also its regions split by token)."""
    if sequence_parallel:
        from partita.capturing.sequence_parallel import find_sequence_layout  # here: degree 1 never needs the rules

        return find_sequence_layout(graph, degree)
    from partita.capturing.tensor_parallel import find_layout as rules

    return rules(graph, degree)


def degree_contexts(
    ctx: PlanningContext, pinned: int | None, *, uneven: bool | None = None, sequence_parallel: bool | None = None
) -> list[PlanningContext]:
    """The contexts to search, one per degree: ``ctx`` (degree 1, from ``planning_context``) and
    one per degree whose layout splits something (``with_layout``), smallest degree first, with
    sequence parallelism where its layout splits a region by token (module docstring);
    ``pinned``: only that degree; ``sequence_parallel``: True only with it, False without.
    ``uneven``: the user's ``uniform_replicas`` is False (per-stage replica counts asked for,
    which tensor-parallel meshes cannot give: degree 1 only). InputError when the pinned degree
    splits nothing, when it is above 1 while per-stage counts are asked for, or when sequence
    parallelism is pinned and no degree splits a region by token."""
    if uneven and pinned is not None and pinned > 1:
        raise InputError(
            f"tensor_parallel={pinned} runs on pp x dp x tp meshes (one replica count for every stage), but "
            "uniform_replicas=False asks for per-stage replica counts: drop one of the two"
        )
    if uneven:
        pinned = 1
    if pinned is not None:
        degrees = [pinned]
    else:
        degrees = candidate_degrees(ctx.cluster, replicas=ctx.options.replicas, num_stages=ctx.options.num_stages)
    contexts, refused = [], {}
    for degree in degrees:
        if degree == 1:
            contexts += [] if sequence_parallel else [ctx]
            continue
        layout = find_layout(ctx.graph, degree)
        if layout.is_trivial:
            if pinned is not None:
                raise InputError(_nothing_splits(degree, layout))
            continue
        if sequence_parallel is not False:
            tokens = find_layout(ctx.graph, degree, sequence_parallel=True)
            if tokens.sequence_nodes:
                contexts.append(with_layout(ctx, tokens))
                continue
            refused[degree] = tokens.sequence_rejected
        if not sequence_parallel:
            contexts.append(with_layout(ctx, layout))
    if sequence_parallel and not contexts:
        raise InputError(_no_sequence_parallelism(degrees, refused))
    return contexts


def with_layout(ctx: PlanningContext, layout: TensorParallelLayout) -> PlanningContext:
    """``ctx`` (degree 1) searched at ``layout.degree``: per-device costs of a group, the search
    over ``N / t`` groups, the chain without the boundaries inside a split region
    (``split_crossings``), uniform replica counts, the degree-1 context kept as ``unsharded``."""
    degree, graph, cluster, costs_at = layout.degree, ctx.graph, ctx.cluster, ctx.costs_at
    # the runtime runs tensor parallelism on pp x dp x tp meshes: one replica count for every stage
    options = dataclasses.replace(
        ctx.options,
        num_devices=ctx.options.num_devices // degree,
        tensor_parallel=degree,
        uniform_replicas=True,
        sequence_parallel=layout.sequence_parallel,
    )
    shared = functools.lru_cache(maxsize=None)(lambda b: tensor_parallel_costs(costs_at(b), graph, layout, cluster))
    chain = np.asarray(ctx.chain)
    chain = chain[~split_crossings(graph, layout)[chain]]
    return dataclasses.replace(ctx, options=options, costs_at=shared, chain=chain, unsharded=ctx, layout=layout)


def split_crossings(graph: OpGraph, layout: TensorParallelLayout) -> np.ndarray:
    """bool[num_nodes + 1]: whether a split value (``partita.cost.tensor_parallel.split_values``)
    crosses cut c.

    The search never places a stage boundary there: a stage then holds whole split regions (a
    column-parallel matmul with the row-parallel one that reduces its parts), as the runtime's
    analysis of each stage's graph finds them (boundary tensors are whole in the group), so the
    stages split what the costs assume. The two ends (cuts 0 and num_nodes) are never inside."""
    diff = np.zeros(graph.num_nodes + 2, dtype=np.int64)  # difference array over cuts
    for p in np.flatnonzero(split_values(graph, layout)):
        last = max(graph.nodes[p].consumers, default=-1)
        if last > p:
            diff[p + 1] += 1
            diff[last + 1] -= 1
    inside = np.cumsum(diff)[: graph.num_nodes + 1] > 0
    inside[0] = inside[-1] = False
    return inside


def _no_sequence_parallelism(degrees: list[int], refused: dict[int, dict]) -> str:
    """Why ``sequence_parallel=True`` has no plan to search: no degree above 1, or no region split by token."""
    if not any(d > 1 for d in degrees):
        return (
            "sequence_parallel=True splits the regions a tensor-parallel group leaves whole, but no tensor-parallel "
            "degree above 1 fits this cluster and these pins: pin tensor_parallel to 2 or more, or unpin "
            "sequence_parallel"
        )
    reasons = "; ".join(f"{node}: {why}" for why_by in refused.values() for node, why in list(why_by.items())[:2])
    return (
        "sequence_parallel=True, but no region of this model splits by token"
        f"{f' ({reasons})' if reasons else ''}: use sequence_parallel=False, or leave it unpinned"
    )


def _nothing_splits(degree: int, layout: TensorParallelLayout) -> str:
    reasons = "; ".join(f"{node}: {why}" for node, why in list(layout.rejected.items())[:3])
    return (
        f"tensor_parallel={degree}, but no parameter of this model splits over {degree} devices"
        f"{f' ({reasons})' if reasons else ' (no matmul or embedding the rules can split)'}: "
        "use tensor_parallel=1, or leave it unpinned"
    )
