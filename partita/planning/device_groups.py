"""A planning run over a mixed cluster: one graph, and per device group its costs on one chain.

A mixed cluster (``Cluster(groups=...)``, several device types) is planned from the same pieces as
a one-type cluster, once per device group: ``graph_context`` on the group's one-type cluster
gives that type's costs (``costs_at``: its CostTable at a micro-batch size), its memory limit and
its resolved options. The groups' contexts share one chain of blocks (the first group's), so a
stage is the same block range whichever type runs it, and the search compares the types' times
of the same range (``MixedRun.blocks_at``).

The plan computes in one precision on every type (``mixed_precision``): bf16 when every type
computes faster in it, else fp32 (a V100 has no bf16: a bf16 plan would run it at its fp32 rate).

Tensor parallelism: a run at degree ``t`` (``degree_runs``) holds each group's context at that
degree (``partita.planning.degree_contexts.with_layout``: one device's costs of a group of ``t``,
the chain without the cuts inside a split region), and the search places tensor-parallel groups,
not devices, on ``search_cluster`` (every device group in groups of ``t``). A run may also give
each device type a degree of its own (``MixedRun.degrees``: the fast type's stages at one, the
slow type's at another, on the chain that both degrees allow); a stage then runs on one group
only (a stage's replicas share one degree), and partita's executor routes the boundary between
stages of different degrees (``partita.runtime.uneven``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from partita.capturing import capture
from partita.errors import InputError
from partita.planning.build import BuildMemo
from partita.planning.chain import BlockCosts, block_costs
from partita.planning.context import PlanningContext, check_options, graph_context
from partita.planning.degree_contexts import degree_contexts, with_layout
from partita.planning.options import PlanOptions, resolve_precision
from partita.planning.tensor_parallel import candidate_degrees, check_degree, group_cluster
from partita.types import CostTable, DeviceSpec, OpGraph, Precision
from partita.types.cluster import Cluster
from partita.types.tensor_parallel import TensorParallelLayout

__all__ = ["MixedRun", "degree_runs", "mixed_precision", "mixed_run", "per_type_degree_runs", "slowest_cluster"]


@dataclass(frozen=True)
class MixedRun:
    """What the mixed search shares: the graph, the mixed ``cluster``, per device group a degree-1
    planning context (``contexts[g]``: its one-type cluster, memory limit and costs) on the common
    ``chain``, the options as given (precision resolved) and the plan-file options record.
    ``every_share``: the search tries every split of a micro-batch over a stage's replicas, not only
    the best balanced ones and the even one (``partita.planning.hetero_search``; for studies and
    the brute-force tests: much slower on small clusters with large micro-batches).
    ``tensor_parallel``: devices per tensor-parallel group (the largest, where ``degrees`` gives
    each device group its own), with ``layout`` what a group of that size splits and ``unsharded``
    the degree-1 run it was made from (``degree_runs``)."""

    graph: OpGraph
    cluster: Cluster
    contexts: tuple[PlanningContext, ...]
    options: PlanOptions
    global_batch_size: int
    resolved: dict
    every_share: bool = False
    tensor_parallel: int = 1
    layout: TensorParallelLayout | None = None
    unsharded: MixedRun | None = None
    degrees: tuple[int, ...] | None = None  # per device group, where they differ; None: tensor_parallel for all

    def degree_of(self, group: int) -> int:
        """The tensor-parallel degree of device group ``group``'s stages."""
        return self.tensor_parallel if self.degrees is None else self.degrees[group]

    @property
    def sequence_parallel(self) -> bool:
        """Whether the tensor-parallel groups (of a degree above 1) also split tokens."""
        return self.layout is not None and self.layout.sequence_parallel

    @property
    def key(self) -> int | tuple[int, ...]:
        """The run's degree (one for all groups), or its degree per group where they differ."""
        return self.tensor_parallel if self.degrees is None else self.degrees

    @functools.cached_property
    def search_cluster(self) -> Cluster:
        """The cluster the search places its units on: ``cluster`` with every device group in
        tensor-parallel groups of its degree (``partita.planning.tensor_parallel.group_cluster``);
        ``cluster`` at degree 1."""
        if self.tensor_parallel == 1:
            return self.cluster
        groups = []
        for g, (group, c) in enumerate(zip(self.cluster.groups, self.cluster.group_clusters)):
            units = group_cluster(c, self.degree_of(g))
            groups.append(
                dataclasses.replace(group, num_devices=units.num_devices, devices_per_node=units.devices_per_node)
            )
        shared = ("reserved_memory_fraction", "compute_slowdown", "collective_efficiency")
        inter = ("inter_group_bandwidth_bytes_per_s", "inter_group_latency_s")
        return Cluster(groups=groups, **{f: getattr(self.cluster, f) for f in (*shared, *inter)})

    @property
    def base(self) -> MixedRun:
        """The degree-1 run (this one at degree 1)."""
        return self if self.unsharded is None else self.unsharded

    @property
    def num_groups(self) -> int:
        return len(self.contexts)

    @property
    def chain(self) -> Any:
        return self.contexts[0].chain

    @property
    def num_blocks(self) -> int:
        return len(self.chain) - 1

    def costs_at(self, group: int, samples: int) -> CostTable:
        """Device group ``group``'s CostTable at ``samples`` samples per micro-batch (remembered by its context)."""
        return self.contexts[group].costs_at(samples)

    def blocks_at(self, group: int, samples: int) -> BlockCosts:
        """``costs_at`` summed over the chain's blocks (remembered)."""
        return self._blocks(group, samples)

    @functools.cached_property
    def _blocks(self) -> Callable[[int, int], BlockCosts]:
        return functools.lru_cache(maxsize=None)(lambda g, n: block_costs(self.costs_at(g, n), self.chain))

    @functools.cached_property
    def build_memo(self) -> BuildMemo:
        """Per-range results the run's plans share (``partita.planning.build.BuildMemo``)."""
        return BuildMemo()

    @functools.cached_property
    def cuttable(self) -> np.ndarray:
        """Per block boundary: whether stages whose replicas hold different samples may meet there
        (``partita.planning.chain.per_sample_cuts``: the tensors crossing it split by sample)."""
        cuttable = np.array(self.contexts[0].per_sample_cuts[np.asarray(self.chain)], bool)
        cuttable[[0, -1]] = True  # the ends of the chain are no cuts
        return cuttable

    def seconds_per_sample(self, group: int, reference: int) -> tuple[float, float]:
        """(fixed seconds, seconds per sample) of one forward + backward of the whole chain on device
        group ``group``: a line through its costs at 1 and at ``reference`` samples (the roofline is
        piecewise linear in the samples; the search picks sample shares with it, and the plans it
        makes are costed exactly)."""
        return self._line(group, max(2, reference))

    @functools.cached_property
    def _line(self) -> Callable[[int, int], tuple[float, float]]:
        def line(group: int, reference: int) -> tuple[float, float]:
            one, many = (self.blocks_at(group, n) for n in (1, reference))
            t1 = float(one.forward_s.sum() + one.backward_s.sum())
            tn = float(many.forward_s.sum() + many.backward_s.sum())
            slope = max(0.0, (tn - t1) / (reference - 1))
            return max(0.0, t1 - slope), slope

        return functools.lru_cache(maxsize=None)(line)


def degree_runs(run: MixedRun) -> list[MixedRun]:
    """The runs to search, one per tensor-parallel degree, smallest first: ``run`` (degree 1) and
    one per degree whose groups tile every device group without crossing a node and whose layout
    splits something (``partita.planning.degree_contexts``: with sequence parallelism where a
    region splits by token), as the user's ``tensor_parallel`` and ``sequence_parallel`` allow.
    InputError when a pinned degree cannot tile some device group (or splits nothing).
    ``per_type_degree_runs`` gives the groups degrees of their own."""
    options = run.options
    pinned = options.tensor_parallel
    for g, c in enumerate(run.cluster.group_clusters if pinned not in (None, 1) else ()):
        try:  # a pinned degree must tile every device group
            check_degree(pinned, c)
        except InputError as e:
            raise InputError(f"device group {g} ({c.num_devices} x {c.device.name}): {e}") from None
    tiling = [set(candidate_degrees(c)) for c in run.cluster.group_clusters]
    degrees = {pinned} if pinned is not None else set.intersection(*tiling)
    if degrees == {1} and options.sequence_parallel is None:
        return [run]
    found = []
    for ctx in degree_contexts(run.contexts[0], pinned, sequence_parallel=options.sequence_parallel):
        t = ctx.options.tensor_parallel
        if t not in degrees:
            continue
        if t == 1:
            found.append(run)
            continue
        contexts = [ctx, *(with_layout(other, ctx.layout) for other in run.contexts[1:])]
        contexts = [contexts[0], *(dataclasses.replace(c, chain=ctx.chain) for c in contexts[1:])]
        resolved = {**run.resolved, "tensor_parallel": t, "sequence_parallel": ctx.layout.sequence_parallel}
        found.append(
            dataclasses.replace(
                run, contexts=tuple(contexts), resolved=resolved, tensor_parallel=t, layout=ctx.layout, unsharded=run
            )
        )
    return found


def per_type_degree_runs(run: MixedRun, best: int) -> list[MixedRun]:
    """The runs that give the device groups degrees of their own (``MixedRun.degrees``) next to
    ``best``, the degree of the best plan of one degree for all: every vector of ``best / 2``,
    ``best`` and ``2 best`` with at least one group at ``best``, not all equal, each degree tiling its
    group and splitting something (at 1: splitting nothing), as the user's ``sequence_parallel``
    allows. None when a degree is pinned (every stage takes it). Each group's context at its
    degree, all on the chain that every degree of the vector allows; sequence parallelism as the
    largest degree's layout has it (a vector whose split degrees disagree on it is left out).

    Next to ``best`` only: under the cost model a type's best degree is rarely far from the best
    common one, and each vector is a search of its own (bench/results/mixed_clusters.md)."""
    options = run.options
    if options.tensor_parallel is not None or run.num_groups < 2:
        return []
    tiling = [set(candidate_degrees(c)) for c in run.cluster.group_clusters]
    near = sorted({d for d in (best // 2, best, best * 2) if d >= 1})
    layouts: dict[int, TensorParallelLayout | None] = {}
    for d in near:
        if d == 1:
            if not options.sequence_parallel:
                layouts[1] = None
            continue
        try:
            layouts[d] = degree_contexts(run.contexts[0], d, sequence_parallel=options.sequence_parallel)[0].layout
        except InputError:  # nothing splits over d devices
            continue
    choices = [[d for d in near if d in layouts and d in tiling[g]] for g in range(run.num_groups)]
    found = []
    for vector in itertools.product(*choices):
        split = [layouts[d] for d in vector if d > 1]
        if len(set(vector)) == 1 or best not in vector or len({layout.sequence_parallel for layout in split}) > 1:
            continue
        contexts = [ctx if d == 1 else with_layout(ctx, layouts[d]) for ctx, d in zip(run.contexts, vector)]
        chain = functools.reduce(np.intersect1d, [np.asarray(c.chain) for c in contexts])
        contexts = [dataclasses.replace(c, chain=chain, costs_at=_sending_whole(c.costs_at)) for c in contexts]
        top = max(vector)
        resolved = {**run.resolved, "tensor_parallel": None, "sequence_parallel": layouts[top].sequence_parallel}
        found.append(
            dataclasses.replace(
                run,
                contexts=tuple(contexts),
                resolved=resolved,
                tensor_parallel=top,
                layout=layouts[top],
                unsharded=run,
                degrees=tuple(vector),
            )
        )
    return found


def _sending_whole(costs_at: Callable[[int], CostTable]) -> Callable[[int], CostTable]:
    """``costs_at`` with every boundary value sent whole (``CostTable.whole_cut_bytes``): a stage
    meets stages of other degrees, which exchange whole tensors, and the search costs a stage before
    it knows its neighbours (an upper bound where both sides share a degree and exchange parts)."""

    @functools.cache
    def whole(microbatch_size: int) -> CostTable:
        table = costs_at(microbatch_size)
        return dataclasses.replace(table, cut_bytes=table.whole_cut_bytes)

    return whole


def mixed_precision(pinned: Precision | None, cluster: Cluster) -> Precision:
    """The one precision of a plan over ``cluster``'s groups: the pinned one; else bf16 when every
    group's device computes faster in bf16 (``resolve_precision``), else fp32."""
    if pinned is not None:
        return pinned
    chosen = {resolve_precision(None, c.device) for c in cluster.group_clusters}
    return Precision.BF16 if chosen == {Precision.BF16} else Precision.FP32


def slowest_cluster(cluster: Cluster, device: DeviceSpec | None = None) -> Cluster:
    """A mixed cluster seen as one type: every device ``device`` (default: the slowest group's by peak,
    ``Cluster``'s one-type view), with the smallest memory, node size and links of all (nodes that
    divide the total: 4 + 8 devices in nodes of 8 are seen as nodes of 4). The "slowest type
    everywhere" baseline plans for it."""
    return Cluster(
        device=cluster.device if device is None else device,
        num_devices=cluster.num_devices,
        # whole nodes: a group smaller than a node (4 beside 8) leaves the total off the node size
        devices_per_node=math.gcd(cluster.num_devices, cluster.devices_per_node),
        memory_bytes=cluster.memory_bytes,
        intra_node_bandwidth_bytes_per_s=cluster.intra_node_bandwidth_bytes_per_s,
        inter_node_bandwidth_bytes_per_s=cluster.inter_node_bandwidth_bytes_per_s,
        intra_node_latency_s=cluster.intra_node_latency_s,
        inter_node_latency_s=cluster.inter_node_latency_s,
        reserved_memory_fraction=cluster.reserved_memory_fraction,
        compute_slowdown=cluster.compute_slowdown,
        collective_efficiency=cluster.collective_efficiency,
    )


def mixed_run(
    model: torch.nn.Module | OpGraph,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    cluster: Cluster,
    global_batch_size: int,
    loss_fn: Callable | None = None,
    target: Any = None,
    options: PlanOptions = PlanOptions(),
    batch_dims: Any = None,
    every_share: bool = False,
) -> MixedRun:
    """Check the options against the whole cluster (``check_options``: pins such as ``num_stages``
    count the devices of all the groups), capture once (unless ``model`` is an OpGraph), then a
    degree-1 planning context per device group of ``cluster`` on its one-type cluster
    (``graph_context``), all in ``mixed_precision`` and on the first group's chain. The mixed search pins no replica count and ignores ``uniform_replicas``
    (``partita.planning.hetero`` says when that leaves it out); the contexts are made without those
    pins, and at degree 1 (``degree_runs`` makes the others). ``every_share``: ``MixedRun``'s."""
    if not isinstance(cluster, Cluster) or not cluster.is_mixed:
        raise InputError("mixed_run plans a cluster of several device groups: Cluster(groups=[...])")
    check_options(options, cluster, global_batch_size)  # before the capture; every group's devices counted
    given = options.replace(precision=mixed_precision(options.precision, cluster))
    graph = (
        model
        if isinstance(model, OpGraph)
        else capture(model, args, kwargs, loss_fn=loss_fn, target=target, batch_dims=batch_dims)
    )
    per_group = given.replace(tensor_parallel=None, sequence_parallel=None, replicas=None, uniform_replicas=None)
    contexts = [
        graph_context(
            graph, args, kwargs, target, cluster=group, global_batch_size=global_batch_size, options=per_group
        )
        for group in cluster.group_clusters
    ]
    chain = contexts[0].chain
    contexts = [contexts[0], *(dataclasses.replace(ctx, chain=chain) for ctx in contexts[1:])]
    resolved = {
        **contexts[0].resolved,
        "memory_limit_bytes": max(ctx.options.memory_limit_bytes for ctx in contexts),
        "group_memory_limit_bytes": [ctx.options.memory_limit_bytes for ctx in contexts],
        "tensor_parallel": None,
    }
    return MixedRun(graph, cluster, tuple(contexts), given, global_batch_size, resolved, every_share)
