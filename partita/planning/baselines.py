"""The splits other tools make, as Plans, for side-by-side comparison.

- ``uniform``: equal numbers of repeated layers per stage (torchtitan's default split; the
  layers before the first and after the last go with the first and last stage).
- ``parameters``: equal parameter bytes per stage (DeepSpeed PipelineModule's
  ``partition_method="parameters"``).
- ``equal_flops``: equal forward FLOPs per stage.

These only choose the stage boundaries: the rest of the configuration (rank groups,
replicas, micro-batches, schedule) is the one they are compared against, and recomputation is
switched on for a stage only when it would not fit otherwise. Boundaries snap to the chain's
legal cut positions.

- ``fsdp``: what most users run instead of a pipeline: plain data parallelism over every device
  with FSDP2's full sharding (one stage, ``full_shard``, no tensor parallelism), the fewest micro-batches (gradient
  accumulation steps, 1F1B order) that fit, recomputing only if nothing fits without.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from partita.planning.chain import layer_boundaries
from partita.planning.context import PlanningContext, fit_with_recompute
from partita.planning.options import recompute_allowed
from partita.planning.search import Config, divisors
from partita.types import OpGraph, Plan, Recompute, Schedule, Sharding

BASELINES = ("uniform", "parameters", "equal_flops")  # splits under the plan's configuration
FSDP = "fsdp"  # a configuration of its own: one stage on every device, full_shard


def baseline_boundaries(method: str, graph: OpGraph, legal: np.ndarray, num_stages: int) -> list[int] | None:
    """Node-position boundaries (first 0, last num_nodes) of ``method`` for ``num_stages`` stages;
    None when the method cannot make that many non-empty stages."""
    n = graph.num_nodes
    if method == "uniform":
        starts = layer_boundaries(graph)
        if len(starts) < num_stages:
            return None
        # Stage s starts at layer round(s * L / S); stage 0 also takes everything before layer 0.
        picks = [starts[(s * len(starts)) // num_stages] for s in range(1, num_stages)]
        return _snap([0, *picks, n], legal)
    if method == "parameters":
        weights = _first_use_param_bytes(graph)
    elif method == "equal_flops":
        weights = np.array([node.flops for node in graph.nodes], dtype=np.float64)
    else:
        raise ValueError(f"unknown baseline {method!r}: use one of {', '.join(BASELINES)}")
    return _balanced_cuts(weights, legal, num_stages)


def _first_use_param_bytes(graph: OpGraph) -> np.ndarray:
    """Each parameter's bytes at the first node that reads it (as DeepSpeed counts a layer's parameters)."""
    weights = np.zeros(graph.num_nodes)
    seen: set[str] = set()
    for node in graph.nodes:
        for name in node.params:
            if name not in seen:
                seen.add(name)
                weights[node.index] += graph.parameters[name].num_bytes
    return weights


def _balanced_cuts(weights: np.ndarray, legal: np.ndarray, num_stages: int) -> list[int] | None:
    """Legal cuts nearest to where the cumulative weight crosses s/S of the total."""
    n = len(weights)
    cumulative = np.concatenate([[0.0], np.cumsum(weights)])
    total = cumulative[-1] or 1.0
    legal_positions = np.flatnonzero(legal[: n + 1])
    cuts = [0]
    for s in range(1, num_stages):
        goal = total * s / num_stages
        options = legal_positions[(legal_positions > cuts[-1]) & (legal_positions < n)]
        if len(options) == 0:
            return None
        cuts.append(int(options[np.argmin(np.abs(cumulative[options] - goal))]))
    cuts.append(n)
    return cuts if all(a < b for a, b in zip(cuts, cuts[1:])) else None


def _snap(cuts: list[int], legal: np.ndarray) -> list[int] | None:
    """Move each inner cut to the nearest legal position after the previous cut."""
    n = cuts[-1]
    legal_positions = np.flatnonzero(legal[: n + 1])
    snapped = [0]
    for c in cuts[1:-1]:
        options = legal_positions[(legal_positions > snapped[-1]) & (legal_positions < n)]
        if len(options) == 0:
            return None
        snapped.append(int(options[np.argmin(np.abs(options - c))]))
    snapped.append(n)
    return snapped if all(a < b for a, b in zip(snapped, snapped[1:])) else None


def baseline_plans(ctx: PlanningContext, like: Plan) -> dict[str, Plan | None]:
    """Each baseline's split under ``like``'s configuration (None: it does not fit or cannot split;
    ``baseline_outcomes`` also says which).

    Recomputation is switched on only for the stages that do not fit without it, and never under
    ZBV (see partita.planning.search). ``best_plan`` starts its refinement from these same splits, so
    no baseline's split is faster than partita's plan under partita's configuration. The ``fsdp``
    baseline, a configuration of its own, is ``fsdp_plan``'s."""
    return baseline_outcomes(ctx, like, fsdp=False)[0]


def baseline_outcomes(
    ctx: PlanningContext, like: Plan, *, fsdp: bool = True
) -> tuple[dict[str, Plan | None], dict[str, str]]:
    """``baseline_plans`` (and with ``fsdp`` the ``fsdp`` baseline last), and why each baseline
    without a plan has none: it "cannot split into N stages" (too few layers or cut positions),
    or its split "does not fit" the memory."""
    splits = baseline_splits(ctx)
    config = same_config(like)
    plans: dict[str, Plan | None] = {}
    reasons: dict[str, str] = {}
    for method, boundaries in splits(config).items():
        if boundaries is None:
            plans[method], reasons[method] = None, _cannot_split(ctx, method, config)
            continue
        plans[method] = fit_with_recompute(ctx, config, boundaries, method, mode=config.recompute_mode)
        if plans[method] is None:
            reasons[method] = "does not fit" + (
                ""
                if recompute_allowed(config.schedule)
                else f" without recomputation, which {config.schedule.value} never uses"
            )
    if fsdp:
        plans[FSDP], why = fsdp_plan(ctx)
        if why:
            reasons[FSDP] = why
    return plans, reasons


def fsdp_plan(ctx: PlanningContext) -> tuple[Plan | None, str]:
    """The ``fsdp`` baseline (module docstring), or None and why there is none; without tensor
    parallelism at any degree of ``ctx`` (its degree-1 context)."""
    ctx = ctx.unsharded or ctx
    n, batch = ctx.options.num_devices, ctx.options.global_batch_size
    if n == 1:
        return None, "needs several devices to shard over"
    if batch % n:
        return None, f"the global batch of {batch} does not split over {n} devices"
    sharded = dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, sharding=Sharding.FULL_SHARD))
    boundaries = [0, ctx.graph.num_nodes]
    for m in divisors(batch // n):
        schedule = Schedule.GPIPE if m == 1 else Schedule.ONE_F_ONE_B
        config = Config(n, 1, schedule, 1, m, batch // (n * m), None)
        found = fit_with_recompute(sharded, config, boundaries, FSDP)
        if found is not None:
            return found, ""
    return None, "does not fit with any number of micro-batches"


def _cannot_split(ctx: PlanningContext, method: str, config: Config) -> str:
    n = config.num_stages
    if method == "uniform":
        layers = len(layer_boundaries(ctx.graph))
        if layers < n:
            return f"cannot split into {n} stages: the model has {layers} repeated layers"
    legal = ctx.legal_cuts
    if config.stage_replicas:
        legal = legal & ctx.per_sample_cuts
    inner = int(np.count_nonzero(legal[1 : ctx.graph.num_nodes]))
    return f"cannot split into {n} stages: its cuts make fewer non-empty stages ({inner} legal cut positions)"


def same_config(like: Plan | Config) -> Config:
    """The configuration of ``like`` (a plan or a search config) under which baselines are compared:
    its rank groups, replicas, schedule, virtual stages and micro-batches; recomputation per stage,
    as needed (off under ZBV)."""
    if isinstance(like, Plan):
        counts = tuple(s.num_replicas for s in like.stages)
        like = Config(
            replicas=min(counts),
            num_rank_groups=like.num_rank_groups,
            schedule=like.schedule,
            virtual_stages=like.num_stages // like.num_rank_groups,
            num_microbatches=like.num_microbatches,
            microbatch_size=like.microbatch_size,
            recompute_mode=None,
            stage_replicas=() if like.uniform_replicas else counts,
        )
    return dataclasses.replace(like, recompute_mode=None if recompute_allowed(like.schedule) else Recompute.NONE)


def baseline_splits(ctx: PlanningContext) -> Callable[[Config], dict[str, list[int] | None]]:
    """``splits(config)``: each baseline's node boundaries for the config's number of stages (None:
    cannot split). Under an uneven config the baselines cut only where every crossing tensor splits
    by sample (``PlanningContext.per_sample_cuts``), as partita's own uneven plans do; at a
    tensor-parallel degree above 1 never inside a split region (``PlanningContext.legal_cuts``)."""
    legal = ctx.legal_cuts

    @functools.cache
    def splits_of(num_stages: int, by_sample: bool) -> dict[str, list[int] | None]:
        allowed = legal & ctx.per_sample_cuts if by_sample else legal
        return {method: baseline_boundaries(method, ctx.graph, allowed, num_stages) for method in BASELINES}

    return lambda config: splits_of(config.num_stages, bool(config.stage_replicas))
