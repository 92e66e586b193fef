"""partita.plan(): capture -> costs -> chain -> search -> simulate -> the best Plan.

This module is the one place that wires the layers together for the planner; each layer
stays ignorant of the ones after it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from partita.capture import capture
from partita.cost.cluster import Cluster
from partita.cost.memory import device_memory, microbatches_in_flight
from partita.errors import InfeasiblePlanError, InputError
from partita.plan.build import block_to_node_boundaries, build_plan, fits, stage_tables
from partita.plan.chain import block_costs, coarsen, per_sample_cuts
from partita.plan.search import Candidate, Config, SearchOptions, sort_key, recompute_allowed, search
from partita.plan.uneven import MAX_DEVICES as UNEVEN_MAX_DEVICES
from partita.plan.uneven import search_uneven
from partita.plan.simulate import simulate
from partita.types import CostTable, OpGraph, OptimizerKind, Plan, Schedule

# How many of the best-estimated candidates are simulated on the real schedule, and of how many
# configs the best simulated plan is refined by moving boundaries.
NUM_SIMULATED = 24
NUM_REFINED = 6
# On short chains every config is refined whose best simulated plan is within this factor of the
# best plan (refinement moves boundaries by a block or two; the oracle tests in
# tests/unit/test_search.py and test_uneven_search.py check that no optimum is lost this way).
REFINE_WITHIN = 1.2


@dataclass(frozen=True)
class PlanningContext:
    """Everything the search and the baselines share for one planning run."""

    graph: OpGraph
    cluster: Cluster
    options: SearchOptions
    costs_at: Callable[[int], CostTable]
    chain: Any  # block boundaries in node positions
    resolved: dict

    @functools.cached_property
    def per_sample_cuts(self) -> np.ndarray:
        """``partita.plan.chain.per_sample_cuts`` of the graph: where replica counts may change."""
        return per_sample_cuts(self.graph)


def plan(
    model: torch.nn.Module | OpGraph,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    cluster: Cluster,
    global_batch_size: int,
    loss_fn: Callable | None = None,
    target: Any = None,
    optimizer: OptimizerKind | str = "adam",
    schedules: Sequence[Schedule | str] | None = None,
    schedule: Schedule | str | None = None,
    num_stages: int | None = None,
    replicas: int | None = None,
    num_microbatches: int | None = None,
    recompute: bool | None = None,
    uniform_replicas: bool | None = None,
    mixed_precision: bool = False,
    costs: str = "auto",
    max_blocks: int = 128,
    cache_dir: str | None = None,
) -> Plan:
    """The plan with the shortest simulated step that fits every device's memory.

    Any of ``schedule``, ``num_stages`` (pipeline depth: rank groups), ``replicas`` (devices per
    rank group), ``num_microbatches`` and ``recompute`` pins that choice; the search fills in the
    rest. ZBV plans never recompute (torch's ZBV keeps recomputed activations alive between the
    input- and weight-gradient passes, beyond what the memory model counts): with
    ``recompute=True`` the search leaves ZBV out, and InputError is raised when ZBV is the only
    schedule allowed.

    Stages may have different replica counts (``partita.plan.uneven``: GPipe or 1F1B, one stage
    per rank group, each count dividing the micro-batch) on clusters of at most 64 devices, unless
    ``replicas`` is pinned. ``uniform_replicas=True`` restricts the search to pp x dp meshes;
    ``False`` asks for the uneven search explicitly (InputError with ``replicas`` or beyond 64
    devices); None (default): uneven where it can search.

    Raises InfeasiblePlanError when nothing fits, saying what would.
    """
    ctx = planning_context(model, args, kwargs, cluster=cluster, global_batch_size=global_batch_size,
                           loss_fn=loss_fn, target=target, optimizer=optimizer, schedules=schedules,
                           schedule=schedule, num_stages=num_stages, replicas=replicas,
                           num_microbatches=num_microbatches, recompute=recompute,
                           uniform_replicas=uniform_replicas, mixed_precision=mixed_precision, costs=costs,
                           max_blocks=max_blocks, cache_dir=cache_dir)
    best = best_plan(ctx)
    if best is None:
        raise infeasible_error(ctx)
    return best


def planning_context(model, args, kwargs, *, cluster, global_batch_size, loss_fn, target, optimizer, schedules,
                     schedule, num_stages, replicas, num_microbatches, recompute, uniform_replicas,
                     mixed_precision, costs, max_blocks, cache_dir) -> PlanningContext:
    if not isinstance(cluster, Cluster):
        raise InputError(f"cluster must be a partita.Cluster, got {type(cluster).__name__}")
    uniform_replicas = _resolve_uniform(uniform_replicas, replicas, cluster)
    _check_positive(global_batch_size=global_batch_size, num_stages=num_stages, replicas=replicas,
                    num_microbatches=num_microbatches, max_blocks=max_blocks)
    graph = model if isinstance(model, OpGraph) else capture(model, args, kwargs, loss_fn=loss_fn, target=target)
    if not graph.dynamic_batch:
        raise InputError(
            f"the graph has a static batch dimension (captured at batch {graph.batch_size}), so its costs cannot "
            "be scaled to other micro-batch sizes: capture with an example batch of at least 2 "
            "(torch.export fixes a batch of 1) and without code that specialises on the batch size")
    chosen = _schedules(schedules, schedule)
    _check_recompute(chosen, recompute)
    options = SearchOptions(
        num_devices=cluster.num_devices, global_batch_size=global_batch_size,
        memory_limit_bytes=cluster.usable_memory_bytes, schedules=chosen, num_stages=num_stages,
        replicas=replicas, num_microbatches=num_microbatches, recompute=recompute,
        optimizer=OptimizerKind.parse(optimizer), mixed_precision=mixed_precision, uniform_replicas=uniform_replicas,
    )
    source = _cost_source(costs, graph, cluster)
    costs_at = _costs_provider(graph, cluster, source, (args, dict(kwargs or {}), target), cache_dir)
    reference = costs_at(_reference_microbatch(graph, global_batch_size, cluster.num_devices))
    chain = coarsen(graph, reference, max_blocks=max_blocks)
    resolved = {
        "schedules": [s.value for s in chosen], "num_stages": num_stages, "replicas": replicas,
        "num_microbatches": num_microbatches, "recompute": recompute, "uniform_replicas": uniform_replicas,
        "optimizer": options.optimizer.value, "mixed_precision": mixed_precision, "costs": source,
        "max_blocks": max_blocks, "memory_limit_bytes": options.memory_limit_bytes,
    }
    return PlanningContext(graph, cluster, options, costs_at, chain, resolved)


def _resolve_uniform(uniform_replicas: bool | None, replicas: int | None, cluster: Cluster) -> bool:
    """Whether the search is restricted to uniform replica counts (see ``plan``)."""
    if uniform_replicas is None:
        return replicas is not None or cluster.num_devices > UNEVEN_MAX_DEVICES
    if uniform_replicas:
        return True
    if replicas is not None:
        raise InputError(f"replicas={replicas} pins the same replica count for every stage, but uniform_replicas=False "
                         "asks for different counts: drop one of the two")
    if cluster.num_devices > UNEVEN_MAX_DEVICES:
        raise InputError(f"uniform_replicas=False searches every device count per stage, up to {UNEVEN_MAX_DEVICES} "
                         f"devices; the cluster has {cluster.num_devices}: plan with uniform_replicas=True")
    return False


def best_plan(ctx: PlanningContext, *, num_simulated: int = NUM_SIMULATED) -> Plan | None:
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    num_blocks = len(ctx.chain) - 1
    uneven = []
    if not ctx.options.uniform_replicas and ctx.options.num_devices <= UNEVEN_MAX_DEVICES:  # more: infeasible_error's trials
        uneven = search_uneven(blocks_at, ctx.options, ctx.cluster, num_blocks,
                               cuttable=ctx.per_sample_cuts[np.asarray(ctx.chain)])
    if num_blocks <= 16:  # small chains: simulate every candidate, refine every config
        candidates = _merged(search(blocks_at, ctx.options, ctx.cluster, num_blocks), uneven)
        simulated, candidate_of = _simulate_fitting(ctx, candidates)
        return _refine_best(ctx, simulated, candidate_of, None)
    # The pruned search returns the full list cut after its num_simulated-th candidate with one
    # stage per rank group; if fewer than num_simulated of them fit, the full list is needed.
    candidates = search(blocks_at, ctx.options, ctx.cluster, num_blocks, num_best=num_simulated)
    simulated, candidate_of = _simulate_fitting(ctx, _merged(candidates, uneven), num_simulated)
    if len(simulated) < num_simulated and sum(c.config.virtual_stages == 1 for c in candidates) >= num_simulated:
        candidates = search(blocks_at, ctx.options, ctx.cluster, num_blocks)
        simulated, candidate_of = _simulate_fitting(ctx, _merged(candidates, uneven), num_simulated)
    return _refine_best(ctx, simulated, candidate_of, NUM_REFINED)


def _merged(uniform: list[Candidate], uneven: list[Candidate]) -> list[Candidate]:
    """Both searches' candidates, by estimate (ties broken by the search's fixed key)."""
    return sorted([*uniform, *uneven], key=sort_key) if uneven else uniform


def _simulate_fitting(ctx: PlanningContext, candidates: Sequence[Candidate], limit: int | None = None):
    """Plans of the first ``limit`` candidates that fit (all: None), and the candidate of each plan.

    Candidates whose rank groups hold several stages passed the search's per-stage memory check
    only; the exact check can reject them, so keep going until ``limit`` plans fit."""
    simulated, candidate_of = [], {}
    for candidate in candidates:
        p = plan_from_candidate(ctx, candidate)
        if p is not None:
            simulated.append(p)
            candidate_of[id(p)] = candidate
            if limit is not None and len(simulated) >= limit:
                break
    return simulated, candidate_of


def _refine_best(ctx: PlanningContext, simulated: list[Plan], candidate_of: dict, num_refined: int | None):
    """Refine the best simulated plan of each of the best ``num_refined`` configs (None: all within
    REFINE_WITHIN of the best plan's step); the best result."""
    if not simulated:
        return None
    simulated.sort(key=_plan_key)
    best_per_config: dict = {}
    for p in simulated:  # the best simulated plan of each config, best configs first
        best_per_config.setdefault(candidate_of[id(p)].config, p)
    to_refine = list(best_per_config.values())[:num_refined]
    if num_refined is None:
        to_refine = [p for p in to_refine if p.predicted_step_s <= simulated[0].predicted_step_s * REFINE_WITHIN]
    seeds = _BaselineSeeds(ctx)
    refined = []
    for p in to_refine:
        best = refine(ctx, candidate_of[id(p)], p)
        refined.append(min([best, *seeds.refined(candidate_of[id(p)].config, best)], key=_plan_key))
    return min(refined, key=_plan_key)


class _BaselineSeeds:
    """The baselines' splits under a config as extra starting points of the refinement.

    The DP's split and the hill-climb from it can end a few blocks away from a better split that a
    simple rule finds (equal FLOPs on Llama-7B). A baseline split (under ``same_config``) that beats
    the config's refined plan is refined too, from its boundaries snapped to the chain's blocks, so
    the plan is never slower than a baseline's split under its config (``baseline_plans``).
    """

    def __init__(self, ctx: PlanningContext):
        self.ctx, self.splits = ctx, _baseline_splits(ctx)

    def refined(self, config: Config, to_beat: Plan) -> list[Plan]:
        same = same_config(config)
        found = []
        for boundaries in self.splits(same).values():
            if boundaries is None:
                continue
            seed = _fit_with_recompute(self.ctx, same, boundaries, "partita", mode=same.recompute_mode,
                                       step_to_beat=to_beat.predicted_step_s)
            if seed is not None and _plan_key(seed) < _plan_key(to_beat):
                start = Candidate(same, _nearest_blocks(self.ctx.chain, boundaries), (), 0.0)
                found.append(refine(self.ctx, start, seed))
        return found


def _nearest_blocks(chain: Sequence[int], node_boundaries: Sequence[int]) -> tuple[int, ...]:
    """Block boundaries nearest to ``node_boundaries`` (first 0, last K, strictly increasing)."""
    positions = np.asarray(chain)
    num_blocks, num_stages = len(positions) - 1, len(node_boundaries) - 1
    blocks = [0]
    for s, node in enumerate(node_boundaries[1:-1], start=1):
        low, high = blocks[-1] + 1, num_blocks - (num_stages - s)
        b = int(np.clip(np.searchsorted(positions, node), low, high))
        if b - 1 >= low and abs(positions[b - 1] - node) <= abs(positions[b] - node):
            b -= 1
        blocks.append(b)
    blocks.append(num_blocks)
    return tuple(blocks)


def _neighbours(boundaries: list[int]) -> list[list[int]]:
    """Splits one move away: one inner boundary by 1 or 2 blocks, or a whole stage shifted by 1."""
    found = []
    inner = range(1, len(boundaries) - 1)
    moves = [((s,), d) for s in inner for d in (-2, -1, 1, 2)]
    moves += [((s, s + 1), d) for s in inner if s + 1 < len(boundaries) - 1 for d in (-1, 1)]
    for positions, delta in moves:
        moved = list(boundaries)
        for s in positions:
            moved[s] += delta
        if all(a < b for a, b in zip(moved, moved[1:])):
            found.append(moved)
    return found


def _plan_key(p: Plan) -> tuple:
    return (round(p.predicted_step_s, 12), p.num_devices, p.boundaries)


def refine(ctx: PlanningContext, candidate: Candidate, start: Plan, *, max_rounds: int = 20) -> Plan:
    """Hill-climb on the simulated step: move a stage boundary by one or two blocks (or shift a
    whole stage) while that makes the step shorter. The DP optimises a closed-form estimate; this fixes what the
    estimate misses (transfers, all-reduce tails, the schedule's real order)."""
    config, best = candidate.config, start
    boundaries = list(candidate.boundaries)
    quick_bound = _split_bound(ctx, config)
    # Splits tried in earlier rounds: None when they did not fit or could not beat the step of then,
    # which is never shorter than any later step to beat (steps only improve).
    tried: dict[tuple[int, ...], Plan | None] = {}
    for _ in range(max_rounds):
        step = None  # the best neighbour of this round (steepest descent: the order of trying them is free)
        ranked = []
        for moved in _neighbours(boundaries):
            nodes = block_to_node_boundaries(ctx.chain, moved)
            ranked.append((quick_bound(nodes), moved, nodes))
        ranked.sort(key=lambda item: (item[0], item[1]))  # most promising first: the step to beat drops fast
        for bound, moved, nodes in ranked:
            if _cannot_beat(bound, (step[0] if step else best).predicted_step_s):
                break  # does not fit or cannot be faster, nor can any later one
            if tuple(moved) not in tried:
                tried[tuple(moved)] = _fit_with_recompute(ctx, config, nodes, "partita", mode=config.recompute_mode,
                                                          step_to_beat=(step[0] if step else best).predicted_step_s)
            trial = tried[tuple(moved)]
            if trial is not None and _plan_key(trial) < _plan_key(step[0] if step else best):
                step = (trial, moved)
        if step is None:
            return best
        best, boundaries = step
    return best


def _split_bound(ctx: PlanningContext, config) -> Callable[[Sequence[int]], float]:
    """``bound(node_boundaries)``: a step no plan of ``config`` with that split beats (inf: it does not fit).

    Cheap next to building the plan: prefix sums for the stage times, and with one stage per rank
    group the memory of each stage range (remembered: neighbouring splits share most stages),
    which decides, as ``_fit_with_recompute`` does, the stages that recompute and whether it fits.
    Otherwise stages recompute only when the config or the options say so (never fewer than the plan).
    """
    tables = stage_tables(ctx.costs_at, config)
    prefix = {}  # id(table) -> (forward, forward + backward) prefix sums
    for t in tables:
        if id(t) not in prefix:
            prefix[id(t)] = (np.concatenate([[0.0], np.cumsum(np.asarray(t.forward_s, dtype=np.float64))]),
                             np.concatenate([[0.0], np.cumsum(np.asarray(t.forward_s) + np.asarray(t.backward_s))]))
    forward = [prefix[id(t)][0] for t in tables]
    compute = [prefix[id(t)][1] for t in tables]
    mode = ctx.options.recompute if config.recompute_mode is None else config.recompute_mode
    limit, options = ctx.options.memory_limit_bytes, ctx.options
    in_flight = [microbatches_in_flight(config.schedule, config.num_microbatches, config.num_rank_groups, g,
                                        config.virtual_stages) for g in range(config.num_rank_groups)]

    @functools.lru_cache(maxsize=None)
    def fits(start: int, stop: int, stage: int, recompute: bool) -> bool:
        return device_memory(tables[stage], [(start, stop)], in_flight=in_flight[stage], optimizer=options.optimizer,
                             recompute=recompute, mixed_precision=options.mixed_precision,
                             num_replicas=config.replicas_of(stage),
                             num_microbatches=config.num_microbatches).total_bytes <= limit

    def bound(nodes: Sequence[int]) -> float:
        stages = [(nodes[s], nodes[s + 1]) for s in range(config.num_stages)]
        if mode is not None or config.virtual_stages != 1:
            recompute = [bool(mode)] * config.num_stages
        else:
            recompute = [not fits(a, b, s, False) for s, (a, b) in enumerate(stages)]
            if any(r and not fits(a, b, s, True) for s, ((a, b), r) in enumerate(zip(stages, recompute))):
                return float("inf")
        return _step_lower_bound_s(config, [compute[s][b] - compute[s][a] + (forward[s][b] - forward[s][a] if r else 0.0)
                                            for s, ((a, b), r) in enumerate(zip(stages, recompute))])

    return bound


def _step_lower_bound_s(config, compute_s: Sequence[float]) -> float:
    """A bound below the simulated step, from each stage's F + B seconds per micro-batch.

    Every rank group runs its actions one at a time, so the step is at least the busiest group's
    m (F + B). With one stage per group (GPipe, 1F1B) group g's first action is a forward, which
    waits for that micro-batch's forwards on groups 0 .. g-1, and its last a backward, after which
    that micro-batch's backwards on groups g-1 .. 0 still run: step >= sum_{k<g} (F_k + B_k) + m (F_g + B_g).
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
    return m * max(loads)


def plan_from_candidate(ctx: PlanningContext, candidate: Candidate, method: str = "partita") -> Plan | None:
    """Build, check memory exactly (rank groups with several stages) and simulate one candidate."""
    config = candidate.config
    node_boundaries = block_to_node_boundaries(ctx.chain, candidate.boundaries)
    return finish_plan(ctx, config, node_boundaries, candidate.recompute, method)


def finish_plan(ctx: PlanningContext, config, node_boundaries, recompute, method: str) -> Plan | None:
    if not _routable(ctx, config, node_boundaries):
        return None
    p = _draft_plan(ctx, config, node_boundaries, recompute, method)
    return _simulated(ctx, p) if fits(p, ctx.options.memory_limit_bytes) else None


def _draft_plan(ctx: PlanningContext, config, node_boundaries, recompute, method: str) -> Plan:
    """The Plan with predicted stage times and memory, its step not yet simulated."""
    import partita

    return build_plan(ctx.graph, ctx.costs_at, config, node_boundaries, recompute, ctx.options,
                      cluster_dict=ctx.cluster.to_dict(), method=method, resolved_options=ctx.resolved,
                      versions=(partita.__version__, torch.__version__))


def _simulated(ctx: PlanningContext, p: Plan) -> Plan:
    result = simulate(p, ctx.costs_at, ctx.cluster, keep_timeline=False)  # only the step and bubble are kept
    return p.__class__(**{**p.__dict__, "predicted_step_s": result.step_s,
                          "predicted_bubble_fraction": result.bubble_fraction})


def infeasible_error(ctx: PlanningContext) -> InfeasiblePlanError:
    """Say the smallest device count (same device) and the smallest memory per device that fit.

    Both are found by planning again (doubling, then bisection), so the numbers are ones with
    which ``partita.plan`` succeeds; they are also attributes of the error (``min_devices``,
    ``min_memory_bytes``; None when not found within 128x).
    """
    from partita.report.format import fmt_bytes

    n = ctx.cluster.num_devices
    min_devices = _smallest_fitting(lambda d: _fits_with(ctx, devices=d), n, _valid_device_count(ctx.cluster))
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
    if any(recompute_allowed(s) for s in ctx.options.schedules):
        fixes.append("or a smaller global batch, recompute=True, or a lighter optimizer")
    else:  # ZBV never recomputes
        fixes.append("or a smaller global batch, a lighter optimizer, or schedule '1f1b' or "
                     "'interleaved1f1b' with recompute=True")
    err = InfeasiblePlanError(
        f"no plan fits {n} device(s) with {fmt_bytes(ctx.options.memory_limit_bytes)} usable each "
        f"({ctx.graph.num_parameters:,} parameters, optimizer {ctx.options.optimizer.value}): " + ", ".join(fixes))
    err.min_devices, err.min_memory_bytes = min_devices, min_memory
    return err


def _fits_with(ctx: PlanningContext, *, devices: int | None = None, memory: int | None = None) -> bool:
    cluster, options = ctx.cluster, ctx.options
    if devices is not None:
        cluster = Cluster(**{**_cluster_fields(cluster), "num_devices": devices})
        options = _with(options, num_devices=devices)
    if memory is not None:
        options = _with(options, memory_limit_bytes=memory)
    trial = PlanningContext(ctx.graph, cluster, options, ctx.costs_at, ctx.chain, ctx.resolved)
    return best_plan(trial, num_simulated=4) is not None


def _valid_device_count(cluster: Cluster):
    """Round a device count up to one the cluster can have (whole nodes beyond one node)."""
    def valid(count: int) -> int:
        per_node = cluster.devices_per_node
        return count if count <= per_node else -(-count // per_node) * per_node
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


def _schedules(schedules, schedule) -> tuple[Schedule, ...]:
    if schedule is not None:
        return (Schedule.parse(schedule),)
    if schedules is None:
        return tuple(Schedule)
    chosen = tuple(Schedule.parse(s) for s in schedules)
    if not chosen:
        raise InputError("schedules is empty: give at least one of " + ", ".join(s.value for s in Schedule))
    return chosen


def _check_recompute(chosen: tuple[Schedule, ...], recompute: bool | None) -> None:
    """Refuse recompute=True when every allowed schedule is one that must not recompute (ZBV)."""
    if recompute and not any(recompute_allowed(s) for s in chosen):
        names = ", ".join(repr(s.value) for s in chosen)
        raise InputError(
            f"schedule {names} with recompute=True is not supported: under ZBV (torch's "
            "ScheduleZBVZeroBubble) a recomputed stage keeps its recomputed activations alive between the "
            "input-gradient and the weight-gradient pass, so its memory cannot be predicted (it would exceed "
            "the plan by 40-60%); use schedule '1f1b' or 'interleaved1f1b' with recompute=True, or 'zbv' "
            "with recompute=False (or unpinned)")


def _cost_source(costs: str, graph: OpGraph, cluster: Cluster) -> str:
    if costs not in ("auto", "measured", "analytic"):
        raise InputError(f"costs={costs!r}: use 'auto', 'measured' or 'analytic'")
    on_meta = any(p.device.type == "meta" for p in graph.graph_module.parameters())
    local = cluster.device.name == "cpu"
    if costs == "measured" and (on_meta or not local):
        why = "the model is on the meta device" if on_meta else f"the target device {cluster.device.name!r} is not this machine's"
        raise InputError(f"costs='measured' is impossible: {why}; use costs='analytic'")
    if costs == "auto":
        return "measured" if local and not on_meta else "analytic"
    return costs


def _costs_provider(graph: OpGraph, cluster: Cluster, source: str, inputs, cache_dir) -> Callable[[int], CostTable]:
    """Cost tables per micro-batch size, compute times slowed by ``cluster.compute_slowdown``
    (ranks that share one host's memory system run slower together than a solo profile says)."""
    from partita.cost.contention import contended

    if source == "analytic":
        from partita.cost.analytic import analytic_costs

        return functools.lru_cache(maxsize=None)(
            lambda b: contended(analytic_costs(graph, cluster.device, b), cluster.compute_slowdown))
    from partita.cost.profiler import profile

    return functools.lru_cache(maxsize=None)(
        lambda b: contended(profile(graph, inputs, microbatch_size=b, cache_dir=cache_dir), cluster.compute_slowdown))


def _reference_microbatch(graph: OpGraph, global_batch_size: int, num_devices: int) -> int:
    return max(1, min(graph.batch_size, global_batch_size // num_devices or 1))


def _check_positive(**values) -> None:
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{name} must be a positive integer, got {value!r}")


def baseline_plans(ctx: PlanningContext, like: Plan) -> dict[str, Plan | None]:
    """Each baseline's split under ``like``'s configuration (None: it does not fit or cannot split).

    Recomputation is switched on only for the stages that do not fit without it, and never under
    ZBV (see partita.plan.search). ``best_plan`` starts its refinement from these same splits, so
    no baseline's split is faster than partita's plan under partita's configuration."""
    splits = _baseline_splits(ctx)
    config = same_config(like)
    return {method: None if boundaries is None else
            _fit_with_recompute(ctx, config, boundaries, method, mode=config.recompute_mode)
            for method, boundaries in splits(config).items()}


def same_config(like: Plan | Config) -> Config:
    """The configuration of ``like`` (a plan or a search config) under which baselines are compared:
    its rank groups, replicas, schedule, virtual stages and micro-batches; recomputation per stage,
    as needed (off under ZBV)."""
    if isinstance(like, Plan):
        counts = tuple(s.num_replicas for s in like.stages)
        like = Config(replicas=min(counts), num_rank_groups=like.num_rank_groups,
                      schedule=like.schedule, virtual_stages=like.num_stages // like.num_rank_groups,
                      num_microbatches=like.num_microbatches, microbatch_size=like.microbatch_size,
                      recompute_mode=None, stage_replicas=() if like.uniform_replicas else counts)
    return dataclasses.replace(like, recompute_mode=None if recompute_allowed(like.schedule) else False)


def _baseline_splits(ctx: PlanningContext) -> Callable[[Config], dict[str, list[int] | None]]:
    """``splits(config)``: each baseline's node boundaries for the config's number of stages (None:
    cannot split). Under an uneven config the baselines cut only where every crossing tensor splits
    by sample (``PlanningContext.per_sample_cuts``), as partita's own uneven plans do."""
    from partita.plan.baselines import BASELINES, baseline_boundaries
    from partita.plan.chain import legal_cuts

    legal = legal_cuts(ctx.graph)

    @functools.lru_cache(maxsize=None)
    def splits_of(num_stages: int, by_sample: bool) -> dict[str, list[int] | None]:
        allowed = legal & ctx.per_sample_cuts if by_sample else legal
        return {method: baseline_boundaries(method, ctx.graph, allowed, num_stages) for method in BASELINES}

    return lambda config: splits_of(config.num_stages, bool(config.stage_replicas))


def _fit_with_recompute(ctx: PlanningContext, config, boundaries: list[int], method: str,
                        mode: bool | None = None, *, step_to_beat: float | None = None) -> Plan | None:
    """Recompute only the stages that do not fit without it (a pinned or config-wide mode is kept).

    With ``step_to_beat``, also None (without simulating) when ``_step_lower_bound_s`` shows that
    the plan cannot be faster than that.
    """
    if not _routable(ctx, config, boundaries):
        return None
    pinned = ctx.options.recompute if mode is None else mode
    limit = ctx.options.memory_limit_bytes
    recompute = [bool(pinned)] * config.num_stages
    draft = _draft_plan(ctx, config, boundaries, recompute, method)
    if not fits(draft, limit):
        if pinned is not None:
            return None
        recompute = [s.memory_bytes > limit or recompute[s.index] for s in draft.stages]
        if step_to_beat is not None and _cannot_beat(_draft_lower_bound_s(config, draft, recompute), step_to_beat):
            return None
        draft = _draft_plan(ctx, config, boundaries, recompute, method)
        if not fits(draft, limit):
            return None
    final = [s.recompute for s in draft.stages]
    if step_to_beat is not None and _cannot_beat(_draft_lower_bound_s(config, draft, final), step_to_beat):
        return None
    return _simulated(ctx, draft)


def _routable(ctx: PlanningContext, config, node_boundaries: Sequence[int]) -> bool:
    """Whether every cut between stages with different replica counts splits by sample (the
    runtime cannot route a merged batch dim such as ``(B*T, H)`` between them)."""
    if not config.stage_replicas:
        return True
    counts = config.stage_replicas
    return all(counts[k] == counts[k + 1] or ctx.per_sample_cuts[node_boundaries[k + 1]]
               for k in range(len(counts) - 1))


def _draft_lower_bound_s(config, draft: Plan, recompute: Sequence[bool]) -> float:
    """``_step_lower_bound_s`` of ``draft`` with ``recompute`` (a rank group recomputes all its
    stages when any of them does, as the simulator counts it)."""
    recomputes = {s.rank_group for s in draft.stages if recompute[s.index]}
    return _step_lower_bound_s(config, [s.forward_s + s.backward_s - (s.forward_s if s.recompute else 0.0)
                                        + (s.forward_s if s.rank_group in recomputes else 0.0) for s in draft.stages])


def _cannot_beat(lower_bound_s: float, step_s: float) -> bool:
    """Whether a plan whose step is at least ``lower_bound_s`` surely simulates slower than ``step_s``
    (with a margin for rounding: plans compare by their step rounded to 1e-12 s)."""
    return lower_bound_s > step_s * (1 + 1e-9) + 2e-12
