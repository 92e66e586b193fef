"""Dynamic programs that split a chain of K blocks into S contiguous stages.

Both work on stage-cost matrices: ``cost[k][j, i]`` is the time of stage ``k`` if it runs
blocks ``j .. i-1`` (``inf`` where the stage would not fit in memory, or ``j >= i``).

Recurrences (the stage-partition DP of Alpa, Zheng et al. OSDI 2022, Eq. 2, without its
device-mesh axis; RaNNC's stage DP has the same shape):

    bottleneck:  B[0][0] = 0,  B[k][i] = min_j max(B[k-1][j], cost[k-1][j, i])
    sum under a bound t_max:
                 F[0][0] = 0,  F[k][i] = min_j F[k-1][j] + cost[k-1][j, i]   where cost <= t_max

The pipeline step of GPipe/1F1B is about ``(m - 1) * max_s t_s + sum_s t_s``: the bottleneck DP
finds the smallest achievable ``max``, and the bounded-sum DP, run for each candidate ``t_max``
(the "enumerate the bottleneck" trick of Alpa), the smallest ``sum`` under it. Each (kernel,
driver, backtrack) is written out separately.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

StageCost = Callable[[int], np.ndarray]  # stage index k -> (K+1, K+1) cost matrix


# ----------------------------------------------------------------------------- kernels


def _bottleneck_step(previous: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer of the bottleneck DP: (B[k][i], argmin j) from B[k-1] and cost[k-1]."""
    candidates = np.maximum(previous[:, None], cost)  # (j, i)
    best = np.argmin(candidates, axis=0)
    return candidates[best, np.arange(cost.shape[1])], best


def _sum_step(previous: np.ndarray, cost: np.ndarray, t_max: float) -> tuple[np.ndarray, np.ndarray]:
    """One layer of the bounded-sum DP: (F[k][i], argmin j) from F[k-1] and cost[k-1]."""
    bounded = np.where(cost <= t_max, cost, np.inf)
    candidates = previous[:, None] + bounded
    best = np.argmin(candidates, axis=0)
    return candidates[best, np.arange(cost.shape[1])], best


# ----------------------------------------------------------------------------- drivers


def min_bottleneck(stage_cost: StageCost, num_blocks: int, num_stages: int) -> float:
    """Smallest possible max stage time over all splits into ``num_stages`` stages (inf: none fits)."""
    value = np.full(num_blocks + 1, np.inf)
    value[0] = 0.0
    for k in range(num_stages):
        value, _ = _bottleneck_step(value, stage_cost(k))
    return float(value[num_blocks])


def min_sum_under(stage_cost: StageCost, num_blocks: int, num_stages: int, t_max: float) -> list[int] | None:
    """Boundaries (block positions, first 0, last K) minimising the sum of stage times with
    every stage at most ``t_max``; None when no split satisfies the bound."""
    value = np.full(num_blocks + 1, np.inf)
    value[0] = 0.0
    choices = []
    for k in range(num_stages):
        value, best = _sum_step(value, stage_cost(k), t_max)
        choices.append(best)
    if not np.isfinite(value[num_blocks]):
        return None
    return _backtrack(choices, num_blocks)


def _backtrack(choices: Sequence[np.ndarray], num_blocks: int) -> list[int]:
    boundaries = [num_blocks]
    for best in reversed(choices):
        boundaries.append(int(best[boundaries[-1]]))
    boundaries.reverse()
    assert boundaries[0] == 0, boundaries
    return boundaries


def bottleneck_candidates(stage_cost: StageCost, num_blocks: int, num_stages: int, *, exhaustive: bool) -> list[float]:
    """The t_max values to try: every distinct feasible stage time at or above the optimal
    bottleneck when ``exhaustive`` (small chains), else the bottleneck and a few relaxations."""
    floor = min_bottleneck(stage_cost, num_blocks, num_stages)
    if not np.isfinite(floor):
        return []
    if not exhaustive:
        return [floor * (1 + eps) for eps in (0.0, 0.02, 0.05, 0.1, 0.2, 0.35)]
    values = set()
    for k in range(num_stages):
        c = stage_cost(k)
        values.update(float(v) for v in c[np.isfinite(c) & (c >= floor)].ravel())
    return sorted(values)


def candidate_partitions(
    stage_cost: StageCost, num_blocks: int, num_stages: int, *, exhaustive: bool
) -> list[list[int]]:
    """Distinct optimal-sum splits, one per candidate bottleneck, in order of increasing bound."""
    seen: set[tuple[int, ...]] = set()
    result = []
    for t_max in bottleneck_candidates(stage_cost, num_blocks, num_stages, exhaustive=exhaustive):
        boundaries = min_sum_under(stage_cost, num_blocks, num_stages, t_max * (1 + 1e-12))
        if boundaries is not None and tuple(boundaries) not in seen:
            seen.add(tuple(boundaries))
            result.append(boundaries)
    return result
