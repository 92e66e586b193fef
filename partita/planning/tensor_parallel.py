"""Tensor parallelism in the search: the degrees tried, the cluster and layout of each.

The planning context of each degree is made by ``partita.planning.degree_contexts``.

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

import numpy as np

from partita.cost.tensor_parallel import split_values
from partita.errors import InputError
from partita.types import Cluster, OpGraph
from partita.types.tensor_parallel import TensorParallelLayout

__all__ = ["DEGREES", "candidate_degrees", "check_degree", "find_layout", "group_cluster", "split_crossings"]

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
