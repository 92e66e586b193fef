"""One planning run's shared state (``PlanningContext``, made by ``planning_context``).

``planning_context`` checks the options against the cluster (``check_options``, before the capture:
it needs no graph), captures the model, checks them against the graph (``graph_context``), picks
the cost source (measured or analytic, ``CostSource``) and coarsens the graph into a chain
of blocks: everything the search, the baselines and the refinement share. Turning their splits
into simulated Plans is ``partita.planning.plan_builder``'s; the contexts of the tensor-parallel
degrees, ``partita.planning.degree_contexts``'s.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from partita.capturing import capture, flatten_call_inputs
from partita.checks import positive_int
from partita.cost.analytic import analytic_costs
from partita.cost.profiler import profile
from partita.cost.table import contended
from partita.errors import InputError
from partita.planning.build import BuildMemo
from partita.planning.chain import coarsen, default_max_blocks, legal_cuts, per_sample_cuts
from partita.planning.configs import SearchOptions
from partita.planning.memory_bound import ONE_STAGE
from partita.planning.options import CostSource, PlanOptions, resolve_compile, resolve_precision
from partita.planning.tensor_parallel import check_degree, group_cluster, split_crossings
from partita.types import CostTable, OpGraph, Precision, Sharding
from partita.types.cluster import Cluster
from partita.types.tensor_parallel import TensorParallelLayout
from partita.types.whole_batch import check_coupled_batch_size, coupling_words


@dataclass(frozen=True)
class PlanningContext:
    """Everything the search and the baselines share for one planning run, at one tensor-parallel
    degree ``options.tensor_parallel`` (``partita.planning.tensor_parallel``).

    ``cluster`` is the real one (plans hold device ranks); ``search_cluster`` is what the search
    places its units on. ``costs_at(b)``: the CostTable of one device at micro-batch size b, of
    a tensor-parallel group when the degree is above 1. ``unsharded``: the degree-1 context a
    tensor-parallel one was made from (None: this is it); ``layout``: what its groups split."""

    graph: OpGraph
    cluster: Cluster
    options: SearchOptions
    costs_at: Callable[[int], CostTable]
    chain: Any  # block boundaries in node positions
    resolved: dict
    unsharded: PlanningContext | None = None
    layout: TensorParallelLayout | None = None

    @functools.cached_property
    def per_sample_cuts(self) -> np.ndarray:
        """``partita.planning.chain.per_sample_cuts`` of the graph: where replica counts may change."""
        return per_sample_cuts(self.graph)

    @functools.cached_property
    def legal_cuts(self) -> np.ndarray:
        """``partita.planning.chain.legal_cuts`` of the graph, less the cuts inside a split region of
        ``layout`` (``partita.planning.tensor_parallel.split_crossings``): where stages may start."""
        legal = legal_cuts(self.graph)
        return legal if self.layout is None else legal & ~split_crossings(self.graph, self.layout)

    @functools.cached_property
    def build_memo(self) -> BuildMemo:
        """Per-range results that this run's plans share (``partita.planning.build.BuildMemo``);
        a context made with ``dataclasses.replace`` (other options or cluster) starts its own."""
        return BuildMemo()

    @functools.cached_property
    def search_cluster(self) -> Cluster:
        """The cluster in tensor-parallel groups (``group_cluster``): ``cluster`` at degree 1."""
        return group_cluster(self.cluster, self.options.tensor_parallel)


def planning_context(
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
) -> PlanningContext:
    """Check the options against the cluster (``check_options``, before capturing: a capture takes
    seconds to minutes), capture (unless ``model`` is already an OpGraph; ``batch_dims`` as
    ``partita.capture`` takes it), then ``graph_context``: everything one planning run shares.
    InputError for options the cluster or the graph cannot honour. The context is degree 1's;
    ``degree_contexts`` makes those of the tensor-parallel degrees to search (a pinned
    ``options.tensor_parallel`` is checked here)."""
    check_options(options, cluster, global_batch_size)
    precision = resolve_precision(options.precision, cluster.device)
    _cost_source(options.costs, _on_meta(model), cluster, precision)  # costs="measured" it cannot honour
    graph = (
        model
        if isinstance(model, OpGraph)
        else capture(model, args, kwargs, loss_fn=loss_fn, target=target, batch_dims=batch_dims)
    )
    return graph_context(
        graph, args, kwargs, target, cluster=cluster, global_batch_size=global_batch_size, options=options
    )


def check_options(options: PlanOptions, cluster: Cluster, global_batch_size: int) -> None:
    """InputError for pins that no plan on ``cluster`` can honour, whatever the model: the batch
    against the pinned micro-batches and replicas, a pinned tensor-parallel degree (one-type
    clusters; a mixed cluster's device groups are checked by ``device_groups.degree_runs``), the
    devices the pinned stages and replicas need, a sharding level or schedules with nothing to
    work on, and costs="measured" for a device that is not this machine's. Needs no graph, so
    planning runs it before capturing. On a mixed cluster the pins are checked against all its
    devices, every group counted."""
    if not isinstance(cluster, Cluster):
        raise InputError(f"cluster must be a partita.Cluster, got {type(cluster).__name__}")
    if not isinstance(options, PlanOptions):
        raise InputError(f"options must be a partita.PlanOptions, got {type(options).__name__}")
    positive_int(global_batch_size, "global_batch_size")
    check_batch_divisible(global_batch_size, options.num_microbatches, options.replicas)
    if options.tensor_parallel is not None and not cluster.is_mixed:
        check_degree(options.tensor_parallel, cluster, replicas=options.replicas, num_stages=options.num_stages)
    _check_pinned_devices(options, cluster)
    _check_sharding_pin(options, cluster)
    _check_schedules_pin(options, cluster)
    for group in cluster.group_clusters:
        _cost_source(options.costs, False, group, resolve_precision(options.precision, group.device))


def graph_context(
    graph: OpGraph,
    args: tuple,
    kwargs: dict | None,
    target: Any,
    *,
    cluster: Cluster,
    global_batch_size: int,
    options: PlanOptions,
) -> PlanningContext:
    """``planning_context`` after the capture, its options checked (``check_options``, on this
    cluster or on the mixed cluster ``cluster`` is a device group of): pick the cost source, coarsen
    the graph into a chain of blocks, and resolve ``options`` against the cluster. ``args``,
    ``kwargs`` and ``target`` are the call's inputs, measured costs' profile inputs.

    A graph whose loss couples samples (``OpGraph.couples_samples``) is planned with one
    micro-batch and one replica per stage (``whole_batch_options``)."""
    if not graph.dynamic_batch:
        raise InputError(static_batch_message(graph))
    if graph.couples_samples is not None:
        check_coupled_batch_size(graph, global_batch_size)  # a batch taken from the wrong dim?
        options = whole_batch_options(options, graph)
        _check_sharding_pin(options, cluster)  # one replica per stage now: nothing to shard over
    precision = resolve_precision(options.precision, cluster.device)
    compiled = resolve_compile(options.compile, cluster.device)
    search_options = SearchOptions.from_plan_options(
        options,
        num_devices=cluster.num_devices,
        global_batch_size=global_batch_size,
        memory_limit_bytes=cluster.usable_memory_bytes,
        precision=precision,
        compile=compiled,
    )
    source = _cost_source(options.costs, _on_meta(graph), cluster, precision)
    if source is CostSource.MEASURED and (args or kwargs or target is not None):
        flatten_call_inputs(graph, args, kwargs, target)  # InputError: a tensor where None was captured, ...
    inputs = (args, dict(kwargs or {}), target)
    if not args and not kwargs and target is None and graph.example_inputs is not None:
        inputs = graph.example_inputs  # a graph alone: profile it on the inputs it was captured from
    costs_at = _costs_provider(graph, cluster, source, inputs, options.cache_dir, precision, compiled)
    reference = costs_at(_reference_microbatch(graph, global_batch_size, cluster.num_devices))
    max_blocks = options.max_blocks or default_max_blocks(graph)
    chain = coarsen(graph, reference, max_blocks=max_blocks)
    resolved = {  # the plan file's "options": what was pinned, and what the search was allowed
        "schedules": [s.value for s in options.schedules],
        "num_stages": options.num_stages,
        "replicas": options.replicas,
        "num_microbatches": options.num_microbatches,
        "recompute": None if options.recompute is None else options.recompute.value,
        "uniform_replicas": search_options.uniform_replicas,
        "optimizer": options.optimizer.value,
        "precision": precision.value,
        "compile": compiled,
        "sharding": None if options.sharding is None else options.sharding.value,
        "tensor_parallel": options.tensor_parallel,
        "sequence_parallel": options.sequence_parallel,
        "costs": source.value,
        "max_blocks": max_blocks,
        "memory_limit_bytes": search_options.memory_limit_bytes,
    }
    return PlanningContext(graph, cluster, search_options, costs_at, chain, resolved)


def check_batch_divisible(
    global_batch_size: int,
    num_microbatches: int | None,
    replicas: int | None,
    names: tuple[str, str, str] = ("global_batch_size", "num_microbatches", "replicas"),
) -> None:
    """InputError unless the global batch splits evenly into the pinned micro-batches and replicas
    (every micro-batch of every replica runs the same number of samples): no search could then
    find a plan, and "nothing fits" would name the wrong cause. ``names`` are how the caller spells
    the three values (the command line: its flags)."""
    unit = (num_microbatches or 1) * (replicas or 1)
    if global_batch_size % unit == 0:
        return
    batch_name, microbatches_name, replicas_name = names
    pinned = [
        f"{name} {value}" for name, value in ((microbatches_name, num_microbatches), (replicas_name, replicas)) if value
    ]
    lower = global_batch_size // unit * unit
    fix = f"use {batch_name} " + " or ".join(str(b) for b in (lower, lower + unit) if b > 0)
    share, rest = divmod(global_batch_size, replicas or 1)
    if num_microbatches and not rest:
        divisors = {d for k in range(1, math.isqrt(share) + 1) if share % k == 0 for d in (k, share // k)}
        closest = sorted(sorted(divisors, key=lambda d: (abs(d - num_microbatches), d))[:4])
        fix += f", or {microbatches_name} " + ", ".join(map(str, closest))
    raise InputError(
        f"{batch_name} {global_batch_size} is not divisible by {' x '.join(pinned)}"
        f"{f' = {unit}' if len(pinned) > 1 else ''}: every micro-batch of every replica needs the same "
        f"number of samples; {fix}"
    )


def static_batch_message(graph: OpGraph) -> str:
    """Why a graph with a static batch cannot be planned, and what to do."""
    head = (
        f"the graph has a static batch dimension (captured at batch {graph.batch_size}): it runs that batch "
        "size only, so its costs cannot be scaled to micro-batches"
    )
    if graph.batch_fixed_at and graph.batch_fixed_at != "unknown":
        return (
            f"{head}. The model fixes the batch size at {graph.batch_fixed_at} (torch.export specialised it "
            "there, e.g. len(x) or a Python int where x.shape[0] would keep it symbolic): make that line work "
            "for any batch size and capture again"
        )
    if graph.batch_fixed_at:
        return (
            f"{head}. The model fixes the batch size somewhere (torch.export specialised it; run with "
            "TORCH_LOGS=+dynamic to see where): make that code work for any batch size and capture again"
        )
    return f"{head}: capture with dynamic_batch=True (the default)"


def whole_batch_options(options: PlanOptions, graph: OpGraph) -> PlanOptions:
    """``options`` with one micro-batch and one replica per stage, for a graph whose loss couples the
    samples of the batch: every split of the batch (micro-batches, data-parallel replicas) would
    train another loss, so each step runs the whole batch through one pipeline, which is exact.
    InputError when the options pin a split; a warning otherwise, since the plan loses the speed
    of micro-batches and data parallelism."""
    pinned = [
        f"{name}={value}"
        for name, value in (("num_microbatches", options.num_microbatches), ("replicas", options.replicas))
        if value not in (None, 1)
    ]
    if options.uniform_replicas is False:
        pinned.append("uniform_replicas=False")
    why, rewrite = coupling_words(graph)
    if pinned:
        raise InputError(
            f"{', '.join(pinned)} would split the batch, but {why}. Unpin them (partita then plans one "
            f"micro-batch on one replica per stage, which is exact), or {rewrite}"
        )
    warnings.warn(
        f"{why}: planning one micro-batch and one replica per stage (exact, but without the speed of "
        f"micro-batching and data parallelism); to get those, {rewrite}",
        stacklevel=5,
    )
    return options.replace(num_microbatches=1, replicas=1, uniform_replicas=True)


def _check_sharding_pin(options: PlanOptions, cluster: Cluster) -> None:
    """InputError when a pinned sharding level has nothing to shard over: one replica per stage."""
    if options.sharding in (None, Sharding.REPLICATE):
        return
    groups = cluster.num_devices // (options.tensor_parallel or 1)
    if options.replicas == 1 or groups == 1:
        if options.replicas == 1:
            why = "replicas=1 pins one replica per stage"
        elif cluster.num_devices == 1:
            why = "the cluster has one device"
        else:
            why = f"tensor_parallel={options.tensor_parallel} makes all {cluster.num_devices} devices one group"
        raise InputError(
            f"sharding={options.sharding.value!r} shards a stage over its replicas, but {why}: "
            "unpin sharding (or pin 'replicate'), or plan with several replicas per stage"
        )


def _check_pinned_devices(options: PlanOptions, cluster: Cluster) -> None:
    """InputError when the pinned stages and replicas need more devices than the cluster has, at any
    tensor-parallel degree (``check_degree`` checks a pinned degree's): no memory makes that fit."""
    units = (options.replicas or 1) * (options.num_stages or 1)
    if units > cluster.num_devices:
        pinned = _pinned_text(options, "num_stages", "replicas")
        raise InputError(
            f"{pinned} needs at least {units} devices (one per replica of each rank group), but the cluster has "
            f"{_devices_text(cluster)}: pin fewer stages or replicas, or plan on at least {units} devices"
        )


def _check_schedules_pin(options: PlanOptions, cluster: Cluster) -> None:
    """InputError when only schedules of several stages per rank group are allowed (interleaved
    1F1B, ZB-V: a pipeline of at least 2 rank groups) and the pins leave room for one rank group:
    no plan of any memory could run, so memory is not the cause to name."""
    if any(s in ONE_STAGE for s in options.schedules):
        return
    degree, replicas = options.tensor_parallel or 1, options.replicas or 1
    if options.num_stages == 1:
        why = "num_stages=1 pins one rank group"
    elif cluster.num_devices == 1:
        why = "the cluster has one device"
    elif cluster.num_devices // (degree * replicas) < 2:
        pinned = _pinned_text(options, "tensor_parallel", "replicas")
        why = f"{pinned} makes all {cluster.num_devices} devices one rank group"
    else:
        return
    names = ", ".join(repr(s.value) for s in options.schedules)
    raise InputError(
        f"schedules=({names},) run several stages on each rank group, in a pipeline of at least 2 rank "
        f"groups, but {why}: allow 'gpipe' or '1f1b' (or unpin schedules), or plan over at least 2 rank groups"
    )


def _devices_text(cluster: Cluster) -> str:
    """The cluster's device count, with its groups' where it has several: ``3 (2 x cpu + 1 x cpu)``."""
    if not cluster.is_mixed:
        return str(cluster.num_devices)
    return f"{cluster.num_devices} ({' + '.join(f'{g.num_devices} x {g.device.name}' for g in cluster.group_clusters)})"


def _pinned_text(options: PlanOptions, *names: str) -> str:
    """The pinned ones of ``names`` as a user writes them: ``num_stages=2 x replicas=2``."""
    return " x ".join(f"{name}={getattr(options, name)}" for name in names if getattr(options, name))


def _on_meta(model: torch.nn.Module | OpGraph) -> bool:
    """Whether ``model`` (a module, or a captured graph) holds its weights on the meta device."""
    module = model.graph_module if isinstance(model, OpGraph) else model
    return isinstance(module, torch.nn.Module) and any(p.device.type == "meta" for p in module.parameters())


def _cost_source(costs: CostSource, on_meta: bool, cluster: Cluster, precision: Precision) -> CostSource:
    """The profiler measures the graph as captured (fp32), on this machine, with real weights
    (``on_meta``: the model has none): a bf16 plan is costed analytically, and costs='measured'
    that it cannot honour is refused."""
    local = cluster.device.name == "cpu"
    if costs is CostSource.MEASURED and (on_meta or not local or precision is Precision.BF16):
        if on_meta:
            why = "the model is on the meta device"
        elif not local:
            why = f"the target device {cluster.device.name!r} is not this machine's"
        else:
            why = "the profiler measures the captured dtype (fp32) only, and the plan computes in bf16"
        fix = "use costs='analytic'" + (" or precision='fp32'" if local and not on_meta else "")
        raise InputError(f"costs='measured' is impossible: {why}; {fix}")
    if costs is CostSource.AUTO:
        measurable = local and not on_meta and precision is Precision.FP32
        return CostSource.MEASURED if measurable else CostSource.ANALYTIC
    return costs


def _costs_provider(
    graph: OpGraph, cluster: Cluster, source: CostSource, inputs, cache_dir, precision: Precision, compiled: bool
) -> Callable[[int], CostTable]:
    """Cost tables per micro-batch size in the plan's ``precision`` (measured ones: fp32 only),
    compute times slowed by ``cluster.compute_slowdown`` (ranks that share one host's memory
    system run slower together than a solo profile says). Analytic ones of ``compiled`` blocks
    cost the operations between two matmuls as fused kernels (``partita.cost.fusion``); measured
    ones are the eager operations' (the profiler times each operation alone)."""
    if source is CostSource.ANALYTIC:
        return functools.lru_cache(maxsize=None)(
            lambda b: contended(
                analytic_costs(graph, cluster.device, b, precision=precision, compiled=compiled),
                cluster.compute_slowdown,
            )
        )
    return functools.lru_cache(maxsize=None)(
        lambda b: contended(profile(graph, inputs, microbatch_size=b, cache_dir=cache_dir), cluster.compute_slowdown)
    )


def _reference_microbatch(graph: OpGraph, global_batch_size: int, num_devices: int) -> int:
    return max(1, min(graph.batch_size, global_batch_size // num_devices or 1))
