"""One planning run's shared state (``PlanningContext``), and turning a split into a simulated Plan.

Everything after the search proper goes through here: a candidate's node boundaries become a
draft Plan (``draft_plan``: predicted stage times and memory), the draft is checked against the
memory limit, recomputation is switched on where a stage needs it, at the least level with which it
fits (``fit_with_recompute``), and
the fitting plan's step is simulated on its real schedule (``simulated``). ``step_lower_bound_s``
lets callers skip simulating splits that cannot beat a known step.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import partita
from partita.capturing import capture, flatten_call_inputs
from partita.checks import positive_int
from partita.cost.analytic import analytic_costs
from partita.cost.profiler import profile
from partita.cost.recompute import extra_backward_s
from partita.cost.table import contended
from partita.errors import InputError
from partita.planning.build import BuildMemo, block_to_node_boundaries, build_plan, fits, total_compute_s
from partita.planning.chain import coarsen, legal_cuts, per_sample_cuts
from partita.planning.options import CostSource, PlanOptions, resolve_precision
from partita.planning.search import Candidate, SearchOptions
from partita.planning.simulate import simulate
from partita.planning.tensor_parallel import check_degree, group_cluster, split_crossings
from partita.types import RECOMPUTE_LEVELS, CostTable, OpGraph, Plan, Precision, Recompute, Sharding, StagePlan
from partita.types.cluster import Cluster
from partita.types.tensor_parallel import TensorParallelLayout


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
    """Capture (unless ``model`` is already an OpGraph; ``batch_dims`` as ``partita.capture`` takes
    it), pick the cost source, coarsen the graph into a chain of blocks, and resolve ``options``
    against the cluster: everything one planning run shares. InputError for options the cluster
    or the graph cannot honour. The context is degree 1's; ``degree_contexts`` makes those of the
    tensor-parallel degrees to search (a pinned ``options.tensor_parallel`` is checked here).

    A graph whose loss couples samples (``OpGraph.couples_samples``) is planned with one
    micro-batch and one replica per stage (``whole_batch_options``)."""
    if not isinstance(cluster, Cluster):
        raise InputError(f"cluster must be a partita.Cluster, got {type(cluster).__name__}")
    if not isinstance(options, PlanOptions):
        raise InputError(f"options must be a partita.PlanOptions, got {type(options).__name__}")
    positive_int(global_batch_size, "global_batch_size")
    check_batch_divisible(global_batch_size, options.num_microbatches, options.replicas)
    uniform_replicas = _resolve_uniform(options.uniform_replicas, options.replicas)
    if options.tensor_parallel is not None:
        check_degree(options.tensor_parallel, cluster, replicas=options.replicas, num_stages=options.num_stages)
    graph = (
        model
        if isinstance(model, OpGraph)
        else capture(model, args, kwargs, loss_fn=loss_fn, target=target, batch_dims=batch_dims)
    )
    if not graph.dynamic_batch:
        raise InputError(static_batch_message(graph))
    if graph.couples_samples is not None:
        options, uniform_replicas = whole_batch_options(options, graph), True
    precision = resolve_precision(options.precision, cluster.device)
    _check_sharding_pin(options, cluster)
    search_options = SearchOptions(
        num_devices=cluster.num_devices,
        global_batch_size=global_batch_size,
        memory_limit_bytes=cluster.usable_memory_bytes,
        schedules=options.schedules,
        num_stages=options.num_stages,
        replicas=options.replicas,
        num_microbatches=options.num_microbatches,
        recompute=options.recompute,
        optimizer=options.optimizer,
        precision=precision,
        sharding=options.sharding,
        uniform_replicas=uniform_replicas,
    )
    source = _cost_source(options.costs, graph, cluster, precision)
    if source is CostSource.MEASURED and (args or kwargs or target is not None):
        flatten_call_inputs(graph, args, kwargs, target)  # InputError: a tensor where None was captured, ...
    inputs = (args, dict(kwargs or {}), target)
    if isinstance(model, OpGraph) and not args and not kwargs and target is None and graph.example_inputs is not None:
        inputs = graph.example_inputs  # a graph alone: profile it on the inputs it was captured from
    costs_at = _costs_provider(graph, cluster, source, inputs, options.cache_dir, precision)
    reference = costs_at(_reference_microbatch(graph, global_batch_size, cluster.num_devices))
    chain = coarsen(graph, reference, max_blocks=options.max_blocks)
    resolved = {  # the plan file's "options": what was pinned, and what the search was allowed
        "schedules": [s.value for s in options.schedules],
        "num_stages": options.num_stages,
        "replicas": options.replicas,
        "num_microbatches": options.num_microbatches,
        "recompute": None if options.recompute is None else options.recompute.value,
        "uniform_replicas": uniform_replicas,
        "optimizer": options.optimizer.value,
        "precision": precision.value,
        "sharding": None if options.sharding is None else options.sharding.value,
        "tensor_parallel": options.tensor_parallel,
        "sequence_parallel": options.sequence_parallel,
        "costs": source.value,
        "max_blocks": options.max_blocks,
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
    why, rewrite = _coupling_words(graph)
    if pinned:
        raise InputError(
            f"{', '.join(pinned)} would split the batch, but {why}. Unpin them (partita then plans one "
            f"micro-batch on one replica per stage, which is exact), or {rewrite}"
        )
    warnings.warn(
        f"{why}: planning one micro-batch and one replica per stage (exact, but without the speed of "
        f"micro-batching and data parallelism); to get those, {rewrite}",
        stacklevel=4,
    )
    return options.replace(num_microbatches=1, replicas=1, uniform_replicas=True)


def check_whole_batch(graph: OpGraph, num_microbatches: int, replicas: Sequence[int]) -> None:
    """InputError when a plan would split the batch of a graph whose loss couples samples
    (``num_microbatches`` > 1, or a stage with several replicas): for plans not made by the
    search (manual plans, plan files), before training."""
    if graph.couples_samples is None or (num_microbatches == 1 and all(r == 1 for r in replicas)):
        return
    why, rewrite = _coupling_words(graph)
    raise InputError(
        f"the plan splits every step's batch into {num_microbatches} micro-batches on "
        f"{max(replicas, default=1)} replicas, but {why}: use one micro-batch and one replica per "
        f"stage, or {rewrite}"
    )


def _coupling_words(graph: OpGraph) -> tuple[str, str]:
    why = (
        f"the loss couples the samples of the batch: {graph.couples_samples.describe()}, so every sample's loss "
        "depends on the other samples of the same batch, and splitting the batch would train another loss"
    )
    rewrite = (
        "rewrite the loss so that each sample's term depends on that sample alone (e.g. gather the "
        "embeddings of the whole batch before the similarity matrix), or keep the whole batch together"
    )
    return why, rewrite


def _resolve_uniform(uniform_replicas: bool | None, replicas: int | None) -> bool:
    """Whether the search is restricted to uniform replica counts (see ``PlanOptions``): when asked,
    or when the replicas are pinned; InputError when both pinned replicas and uneven counts are."""
    if uniform_replicas is None:
        return replicas is not None
    if uniform_replicas:
        return True
    if replicas is not None:
        raise InputError(
            f"replicas={replicas} pins the same replica count for every stage, but uniform_replicas=False "
            "asks for different counts: drop one of the two"
        )
    return False


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


def _cost_source(costs: CostSource, graph: OpGraph, cluster: Cluster, precision: Precision) -> CostSource:
    """The profiler measures the graph as captured (fp32): a bf16 plan is costed analytically, and
    costs='measured' with bf16 is refused."""
    on_meta = any(p.device.type == "meta" for p in graph.graph_module.parameters())
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
    graph: OpGraph, cluster: Cluster, source: CostSource, inputs, cache_dir, precision: Precision
) -> Callable[[int], CostTable]:
    """Cost tables per micro-batch size in the plan's ``precision`` (measured ones: fp32 only),
    compute times slowed by ``cluster.compute_slowdown`` (ranks that share one host's memory
    system run slower together than a solo profile says)."""
    if source is CostSource.ANALYTIC:
        return functools.lru_cache(maxsize=None)(
            lambda b: contended(analytic_costs(graph, cluster.device, b, precision=precision), cluster.compute_slowdown)
        )
    return functools.lru_cache(maxsize=None)(
        lambda b: contended(profile(graph, inputs, microbatch_size=b, cache_dir=cache_dir), cluster.compute_slowdown)
    )


def _reference_microbatch(graph: OpGraph, global_batch_size: int, num_devices: int) -> int:
    return max(1, min(graph.batch_size, global_batch_size // num_devices or 1))


def plan_key(p: Plan) -> tuple:
    return (round(p.predicted_step_s, 12), p.num_devices, p.boundaries)


def routable(ctx: PlanningContext, config, node_boundaries: Sequence[int]) -> bool:
    """Whether every cut between stages with different replica counts splits by sample (the
    runtime cannot route a merged batch dim such as ``(B*T, H)`` between them)."""
    if not config.stage_replicas:
        return True
    counts = config.stage_replicas
    return all(
        counts[k] == counts[k + 1] or ctx.per_sample_cuts[node_boundaries[k + 1]] for k in range(len(counts) - 1)
    )


def plan_from_candidate(ctx: PlanningContext, candidate: Candidate, method: str = "partita") -> Plan | None:
    """Build, check memory exactly (rank groups with several stages) and simulate one candidate."""
    config = candidate.config
    node_boundaries = block_to_node_boundaries(ctx.chain, candidate.boundaries)
    return finish_plan(ctx, config, node_boundaries, candidate.recompute, method)


def finish_plan(ctx: PlanningContext, config, node_boundaries, recompute, method: str) -> Plan | None:
    if not routable(ctx, config, node_boundaries):
        return None
    p = draft_plan(ctx, config, node_boundaries, recompute, method)
    return simulated(ctx, p) if fits(p, ctx.options.memory_limit_bytes) else None


def draft_plan(ctx: PlanningContext, config, node_boundaries, recompute, method: str) -> Plan:
    """The Plan with predicted stage times and memory, its step not yet simulated. Its
    ``total_compute_s`` is the unsplit graph's (degree 1), so that the ideal step counts every
    device once."""
    p = build_plan(
        ctx.graph,
        ctx.costs_at,
        config,
        node_boundaries,
        recompute,
        ctx.options,
        cluster=ctx.cluster,
        method=method,
        resolved_options=ctx.resolved,
        versions=(partita.__version__, torch.__version__),
        memo=ctx.build_memo,
    )
    if ctx.unsharded is None:
        return p
    whole = total_compute_s(ctx.unsharded.costs_at, config, ctx.options.global_batch_size)
    return dataclasses.replace(p, total_compute_s=whole)


def with_result(p: Plan, result) -> Plan:
    """``p`` with the step and bubble of its simulation ``result``."""
    return p.__class__(
        **{**p.__dict__, "predicted_step_s": result.step_s, "predicted_bubble_fraction": result.bubble_fraction}
    )


def simulated(ctx: PlanningContext, p: Plan, step_to_beat: float | None = None) -> Plan | None:
    """``p`` with its simulated step and bubble; None when ``step_to_beat`` is given and the step
    surely exceeds it (``cannot_beat``), which the simulator may tell before the end."""
    result = simulate(
        p, ctx.costs_at, ctx.cluster, keep_timeline=False, memo=ctx.build_memo, step_to_beat=step_to_beat
    )  # only the step and bubble are kept
    return None if result is None else with_result(p, result)


def fit_with_recompute(
    ctx: PlanningContext,
    config,
    boundaries: list[int],
    method: str,
    mode: Recompute | None = None,
    *,
    step_to_beat: float | None = None,
) -> Plan | None:
    """Recompute only the stages that do not fit without it, at the least level with which they
    fit (a pinned or config-wide mode is kept).

    With ``step_to_beat``, also None when the plan cannot be faster than that: without simulating
    when ``step_lower_bound_s`` shows it, else as soon as the simulation does (``simulated``).
    """
    draft = fitting_draft(ctx, config, boundaries, method, mode, step_to_beat=step_to_beat)
    return None if draft is None else simulated(ctx, draft, step_to_beat)


def fitting_draft(
    ctx: PlanningContext,
    config,
    boundaries: list[int],
    method: str,
    mode: Recompute | None = None,
    *,
    step_to_beat: float | None = None,
) -> Plan | None:
    """``fit_with_recompute`` but for the simulation: the draft plan that fits (its step not yet
    simulated), or None (it does not fit, or ``step_lower_bound_s`` shows it cannot beat
    ``step_to_beat``). The stages of rank groups that do not fit recompute selectively, and
    those that still do not, fully."""
    if not routable(ctx, config, boundaries):
        return None
    pinned = ctx.options.recompute if mode is None else mode
    limit = ctx.options.memory_limit_bytes
    recompute = [pinned or Recompute.NONE] * config.num_stages
    draft = draft_plan(ctx, config, boundaries, recompute, method)
    if not fits(draft, limit):
        if pinned is not None:
            return None
        for level in RECOMPUTE_LEVELS[1:]:
            recompute = [
                Recompute.most([r, level]) if s.memory_bytes > limit else r for s, r in zip(draft.stages, recompute)
            ]
            if step_to_beat is not None and cannot_beat(
                draft_lower_bound_s(ctx, config, draft, recompute), step_to_beat
            ):
                return None
            draft = draft_plan(ctx, config, boundaries, recompute, method)
            if fits(draft, limit):
                break
        else:
            return None
    final = [s.recompute for s in draft.stages]
    if step_to_beat is not None and cannot_beat(draft_lower_bound_s(ctx, config, draft, final), step_to_beat):
        return None
    return draft


def step_lower_bound_s(config, compute_s: Sequence[float], forward_s: Sequence[float] | None = None) -> float:
    """A bound below the simulated step, from each stage's F + B seconds per micro-batch (and,
    with several stages per rank group, each stage's F seconds, ``forward_s``).

    Every rank group runs its actions one at a time, so the step is at least the busiest group's
    m (F + B). With one stage per group (GPipe, 1F1B) group g's first action is a forward, which
    waits for that micro-batch's forwards on groups 0 .. g-1, and its last a backward, after which
    that micro-batch's backwards on groups g-1 .. 0 still run: step >= sum_{k<g} (F_k + B_k) + m (F_g + B_g).
    With v stages per group (interleaved 1F1B, ZBV) group g's first action is stage g's forward of
    micro-batch 0, after the forwards of stages 0 .. g-1 (on groups 0 .. g-1), and then the group
    computes m L_g (L_g: its stages' F + B): step >= sum_{k<g} F_k + m L_g.
    """
    m = config.num_microbatches
    if config.virtual_stages == 1:
        before, bound = 0.0, 0.0
        for load in compute_s:
            bound = max(bound, before + m * load)
            before += load
        return bound
    loads = [0.0] * config.num_rank_groups
    for s, load in enumerate(compute_s):
        loads[config.rank_group_of(s)] += load
    if forward_s is None:
        return m * max(loads)
    before, bound = 0.0, 0.0
    for g, load in enumerate(loads):
        bound = max(bound, before + m * load)
        before += forward_s[g]  # stage g is group g's first
    return bound


def draft_lower_bound_s(ctx: PlanningContext, config, draft: Plan, recompute: Sequence[Recompute]) -> float:
    """``step_lower_bound_s`` of ``draft`` with ``recompute`` (a rank group recomputes all its
    stages at the most any of them takes, as the plan and the simulator count it)."""
    by_group: dict[int, Recompute] = {}
    for s in draft.stages:
        by_group[s.rank_group] = Recompute.most([by_group.get(s.rank_group, Recompute.NONE), recompute[s.index]])
    return step_lower_bound_s(
        config,
        [
            s.forward_s
            + s.backward_s
            - _recompute_s(ctx, config, s, s.recompute)
            + _recompute_s(ctx, config, s, by_group[s.rank_group])
            for s in draft.stages
        ],
        [s.forward_s for s in draft.stages],
    )


def _recompute_s(ctx: PlanningContext, config, stage: StagePlan, level: Recompute) -> float:
    """Seconds ``level`` adds to ``stage``'s backward per micro-batch (``extra_backward_s``)."""
    if level is Recompute.NONE:
        return 0.0
    table = ctx.costs_at(config.microbatch_size_of(stage.index))
    a, b = stage.start, stage.stop
    sums = ctx.build_memo.get(table, ("recomputed seconds", a, b), _forward_and_selective_s, table, a, b)
    return float(extra_backward_s(level, *sums))


def _forward_and_selective_s(table: CostTable, start: int, stop: int) -> tuple[float, float]:
    return float(table.forward_s[start:stop].sum()), float(table.selective_recompute_s[start:stop].sum())


def cannot_beat(lower_bound_s: float, step_s: float) -> bool:
    """Whether a plan whose step is at least ``lower_bound_s`` surely simulates slower than ``step_s``
    (with a margin for rounding: plans compare by their step rounded to 1e-12 s)."""
    return lower_bound_s > step_s * (1 + 1e-9) + 2e-12
