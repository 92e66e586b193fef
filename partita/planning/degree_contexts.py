"""The planning contexts of the tensor-parallel degrees searched (``degree_contexts``).

A degree above 1 searches the degree-1 context's graph on its group cluster, with one device's
costs of a group and the chain without the boundaries inside a split region
(``partita.planning.tensor_parallel`` has the model; ``with_layout`` makes its context).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from partita.cost.tensor_parallel import tensor_parallel_costs
from partita.errors import InputError
from partita.planning.context import PlanningContext
from partita.planning.tensor_parallel import candidate_degrees, find_layout, split_crossings
from partita.types.tensor_parallel import TensorParallelLayout

__all__ = ["degree_contexts", "with_layout"]


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
