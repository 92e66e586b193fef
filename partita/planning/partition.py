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
(the "enumerate the bottleneck" trick of Alpa), the smallest ``sum`` under it; the bounds of one
chain run side by side (one array operation per stage for all of them). Each (kernel, driver,
backtrack) is written out separately.

Banded DPs. Given ``work`` (prefix sums P with ``cost[k][j, i] >= P[i] - P[j]``: a stage costs at
least its compute), a stage under a bound ``t`` spans at most ``w(t) = max_j (#blocks i - j with
P[i] - P[j] <= t)`` blocks, so the minimum over j runs over ``i - w .. i - 1`` only: ``S K w``
work instead of ``S K^2`` (w is about K / S for a balanced split, one or two blocks on deep
pipelines). The candidates are the same values in the same order of j, so the results (ties:
the smallest j) equal the full DP's. The bottleneck DP has no bound to start from: it runs under
a guess ``U`` (stages costing more are left out), which is exact when its answer is finite (the
optimum is then at most U, and no stage of the optimal split costs more), and doubles U until
then (the full DP once the band spans the chain).

Reach. Memory bounds a stage too: ``reach[k]``, the most blocks a finite entry of ``cost[k]``
spans (``stage_reach``), caps every band at ``max_k reach[k]`` with the same results, since the
entries outside are inf. A split needs ``sum_k reach[k] >= K`` (each stage covers at most its
reach): a config whose stages cannot cover the chain is answered without a DP. The bottleneck DP
with the band of the widest reach and no limit is exact in one pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

StageCost = Callable[[int], np.ndarray]  # stage index k -> (K+1, K+1) cost matrix

# Bounds per pass of min_sums_under: a (bounds, w, K+1) array per stage stays small.
_BOUNDS_PER_PASS = 64
# Elements of the (bounds, j, i) candidates one pass of _sum_step holds.
_SUM_STEP_ELEMENTS = 1 << 20
# Relative slack on the band widths: P's differences and the cost matrices' sums round apart.
_BAND_SLACK = 1e-6
# The band pays for its gathering when it is at most this share of the chain.
_BAND_SHARE = 0.25
RELAXATIONS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35)  # of the smallest bottleneck, on long chains


# ----------------------------------------------------------------------------- kernels


def _bottleneck_step(previous: np.ndarray, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer of the bottleneck DP: (B[k][i], argmin j) from B[k-1] and cost[k-1]."""
    candidates = np.maximum(previous[:, None], cost)  # (j, i)
    best = np.argmin(candidates, axis=0)
    return candidates[best, np.arange(cost.shape[1])], best


def _sum_step(previous: np.ndarray, cost: np.ndarray, t_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer of the bounded-sum DP for several bounds: (F[k][i], argmin j) per bound, each
    (T, K+1), from F[k-1] (T, K+1), cost[k-1] (K+1, K+1) and the bounds t_max (T,); the bounds
    side by side, a few at a time (``_SUM_STEP_ELEMENTS``)."""
    value, best = np.empty_like(previous), np.empty(previous.shape, dtype=np.int64)
    per_pass = max(1, _SUM_STEP_ELEMENTS // cost.size)
    for first in range(0, len(t_max), per_pass):
        rows = slice(first, first + per_pass)
        bounded = np.where(cost[None] <= t_max[rows, None, None], cost[None], np.inf)  # (t, j, i)
        candidates = previous[rows, :, None] + bounded
        best[rows] = np.argmin(candidates, axis=1)  # the first minimum, the smallest j
        value[rows] = candidates.min(axis=1)
    return value, best


class _Band:
    """The entries ``cost[i - d, i]`` of a cost matrix for d = w .. 1 (rows: j ascending), inf
    where i - d < 0; ``rows[d_row, i]`` is that j (0 where negative)."""

    def __init__(self, cost: np.ndarray, width: int):
        self.rows, flat, outside, self.first_start = _band_indices(cost.shape[0], width)
        self.values = cost.ravel().take(flat)
        self.values[outside] = np.inf


@functools.lru_cache(maxsize=1024)
def _band_indices(size: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(rows j, flat indices j * size + i, where i - d < 0, j of row 0) of ``_Band`` for (size, size) matrices."""
    columns = np.arange(size)
    starts = columns[None, :] - np.arange(width, 0, -1)[:, None]  # (w, K+1): j = i - d
    rows = np.maximum(starts, 0)
    return rows, rows * size + columns[None, :], starts < 0, columns - width


def _band_sum_step(previous: np.ndarray, band: _Band, t_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``_sum_step`` on the band: the same candidates in the same order of j."""
    bounded = np.where(band.values[None] <= t_max[:, None, None], band.values[None], np.inf)  # (T, w, i)
    candidates = previous[:, band.rows] + bounded
    row = np.argmin(candidates, axis=1)  # (T, i): the first minimum, the smallest j
    return candidates.min(axis=1), band.first_start[None, :] + row


def _band_bottleneck_step(previous: np.ndarray, band: _Band, limit: float) -> np.ndarray:
    """One layer of the bottleneck DP on the band, stages costing more than ``limit`` left out."""
    values = np.where(band.values <= limit, band.values, np.inf)
    return np.maximum(previous[band.rows], values).min(axis=0)


# ----------------------------------------------------------------------------- drivers


def band_width(work: np.ndarray, t_max: float) -> int:
    """Blocks a stage under ``t_max`` spans at most, from the non-decreasing prefix sums ``work``
    (module docstring), with a little slack for rounding: a wider band gives the same answer."""
    k = len(work) - 1
    if not np.isfinite(t_max):
        return k
    limit = t_max * (1 + _BAND_SLACK) + _BAND_SLACK * abs(float(work[-1]))
    reach = np.searchsorted(work, work + limit, side="right") - 1  # the last i with P[i] - P[j] <= limit
    return int(min(k, max(1, int((reach - np.arange(k + 1)).max()))))


def stage_reach(cost: np.ndarray) -> int:
    """The most blocks a finite entry ``cost[j, i]`` spans (``i - j``; 0: none is finite)."""
    starts, stops = np.nonzero(np.isfinite(cost))
    return int((stops - starts).max()) if len(starts) else 0


def covers(reach: Sequence[int] | None, num_blocks: int) -> bool:
    """Whether stages of these reaches can split the chain at all (module docstring: Reach)."""
    return reach is None or (min(reach) > 0 and sum(reach) >= num_blocks)


def min_bottleneck(
    stage_cost: StageCost,
    num_blocks: int,
    num_stages: int,
    work: np.ndarray | None = None,
    reach: Sequence[int] | None = None,
) -> float:
    """Smallest possible max stage time over all splits into ``num_stages`` stages (inf: none fits).
    ``reach``: per stage, ``stage_reach`` of its cost matrix (module docstring)."""
    if not covers(reach, num_blocks):
        return float("inf")
    widest = num_blocks if reach is None else min(num_blocks, max(reach))
    guess = 2 * (float(work[-1]) / num_stages + float(np.diff(work).max())) if work is not None else 0.0
    if guess > 0:
        while (width := band_width(work, guess)) < widest and width <= _BAND_SHARE * num_blocks:
            value = _banded_bottleneck(stage_cost, num_blocks, num_stages, width, guess)
            if np.isfinite(value):
                return value
            guess *= 2
    if widest <= _BAND_SHARE * num_blocks:  # every finite stage lies in this band: exact without a limit
        return _banded_bottleneck(stage_cost, num_blocks, num_stages, widest, float("inf"))
    value = np.full(num_blocks + 1, np.inf)
    value[0] = 0.0
    for k in range(num_stages):
        value, _ = _bottleneck_step(value, stage_cost(k))
    return float(value[num_blocks])


def _banded_bottleneck(stage_cost: StageCost, num_blocks: int, num_stages: int, width: int, limit: float) -> float:
    value = np.full(num_blocks + 1, np.inf)
    value[0] = 0.0
    bands: dict[int, _Band] = {}  # stages that share a cost matrix share its band
    for k in range(num_stages):
        cost = stage_cost(k)
        band = bands.setdefault(id(cost), _Band(cost, width))
        value = _band_bottleneck_step(value, band, limit)
    return float(value[num_blocks])


def min_sum_under(stage_cost: StageCost, num_blocks: int, num_stages: int, t_max: float) -> list[int] | None:
    """Boundaries (block positions, first 0, last K) minimising the sum of stage times with
    every stage at most ``t_max``; None when no split satisfies the bound."""
    return min_sums_under(stage_cost, num_blocks, num_stages, [t_max])[0]


def min_sums_under(
    stage_cost: StageCost,
    num_blocks: int,
    num_stages: int,
    t_maxes: Sequence[float],
    work: np.ndarray | None = None,
    reach: Sequence[int] | None = None,
    *,
    squares: bool = False,
) -> list[list[int] | None]:
    """``min_sum_under`` for each bound of ``t_maxes``, the bounds of one pass side by side, on
    the band of the largest bound when ``work`` is given, and at most the widest ``reach``
    (module docstring). ``squares``: minimise the sum of the squared stage times instead, the
    most even split under each bound (stages that share a cost matrix share its square)."""
    if not covers(reach, num_blocks):
        return [None] * len(t_maxes)
    result: list[list[int] | None] = []
    costs = [stage_cost(k) for k in range(num_stages)]
    if squares:
        squared: dict[int, np.ndarray] = {}
        costs = [squared.setdefault(id(c), np.square(c)) for c in costs]
    widest = num_blocks if reach is None else min(num_blocks, max(reach))
    for first in range(0, len(t_maxes), _BOUNDS_PER_PASS):
        unsquared = np.asarray(t_maxes[first : first + _BOUNDS_PER_PASS], dtype=np.float64)
        width = min(widest, band_width(work, float(unsquared.max()))) if work is not None else widest
        bounds = np.square(unsquared) if squares else unsquared
        bands: dict[int, _Band] = {}
        value = np.full((len(bounds), num_blocks + 1), np.inf)
        value[:, 0] = 0.0
        choices = []
        for cost in costs:
            if width <= _BAND_SHARE * num_blocks:
                value, best = _band_sum_step(value, bands.setdefault(id(cost), _Band(cost, width)), bounds)
            else:
                value, best = _sum_step(value, cost, bounds)
            choices.append(best)
        for t in range(len(bounds)):
            if np.isfinite(value[t, num_blocks]):
                result.append(_backtrack([best[t] for best in choices], num_blocks))
            else:
                result.append(None)
    return result


def _backtrack(choices: Sequence[np.ndarray], num_blocks: int) -> list[int]:
    boundaries = [num_blocks]
    for best in reversed(choices):
        boundaries.append(int(best[boundaries[-1]]))
    boundaries.reverse()
    assert boundaries[0] == 0, boundaries
    return boundaries


def bottleneck_candidates(
    stage_cost: StageCost,
    num_blocks: int,
    num_stages: int,
    *,
    exhaustive: bool,
    work: np.ndarray | None = None,
    reach: Sequence[int] | None = None,
) -> list[float]:
    """The t_max values to try: every distinct feasible stage time at or above the optimal
    bottleneck when ``exhaustive`` (small chains), else the bottleneck and a few relaxations."""
    floor = min_bottleneck(stage_cost, num_blocks, num_stages, work, reach)
    if not np.isfinite(floor):
        return []
    if not exhaustive:
        return [floor * (1 + eps) for eps in RELAXATIONS]
    values = set()
    for k in range(num_stages):
        c = stage_cost(k)
        values.update(float(v) for v in c[np.isfinite(c) & (c >= floor)].ravel())
    return sorted(values)


def candidate_partitions(
    stage_cost: StageCost,
    num_blocks: int,
    num_stages: int,
    *,
    exhaustive: bool,
    work: np.ndarray | None = None,
    reach: Sequence[int] | None = None,
    even: bool = False,
) -> list[list[int]]:
    """Distinct optimal-sum splits, one per candidate bottleneck, in order of increasing bound.
    ``work``: prefix sums below every stage's cost; ``reach``: per stage, the most blocks a finite
    entry of its cost spans (module docstring: the banded DPs, Reach). ``even``: also, after
    them, the most even split under the smallest bound (least sum of squared stage times): where
    several stages share a device (interleaved 1F1B, ZB-V) its load is their sum, which the sum
    DP leaves to its ties (it may keep many stages at the bound and make others tiny). Under
    every bound it found the same plans for bench/plan_time.py's rows and plan_quality.py's
    Llama-7B ZB-V row, and the DPs took 1.5 s of 175B's search (profiled) instead of 1.2 s."""
    seen: set[tuple[int, ...]] = set()
    result = []
    floors = bottleneck_candidates(stage_cost, num_blocks, num_stages, exhaustive=exhaustive, work=work, reach=reach)
    bounds = [t * (1 + 1e-12) for t in floors]
    splits = min_sums_under(stage_cost, num_blocks, num_stages, bounds, work, reach)
    if even:
        splits += min_sums_under(stage_cost, num_blocks, num_stages, bounds[:1], work, reach, squares=True)
    for boundaries in splits:
        if boundaries is not None and tuple(boundaries) not in seen:
            seen.add(tuple(boundaries))
            result.append(boundaries)
    return result
