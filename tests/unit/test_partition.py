"""The stage DPs with and without their shortcuts (bands, reach) give the same answers."""

import itertools

import numpy as np
import pytest

from partita.planning.partition import candidate_partitions, covers, min_bottleneck, min_sums_under, stage_reach


def _instance(seed: int, num_blocks: int, num_stages: int):
    """Stage costs of random blocks (each stage at least its compute), memory-limited: stage k
    fits at most ``widths[k]`` blocks, and a few ranges do not fit at all."""
    rng = np.random.default_rng(seed)
    work = np.concatenate([[0.0], np.cumsum(rng.uniform(0.5, 2.0, num_blocks))])
    narrow = seed % 2 == 0  # stages of at most a quarter of the chain: the banded DPs run
    widths = rng.integers(2, num_blocks // 4 + 1, num_stages) if narrow else rng.integers(1, num_blocks + 1, num_stages)
    j, i = np.meshgrid(np.arange(num_blocks + 1), np.arange(num_blocks + 1), indexing="ij")
    costs = []
    for k in range(num_stages):
        cost = (work[i] - work[j]) * rng.uniform(1.0, 1.3, (num_blocks + 1,) * 2)
        cost[(i <= j) | (i - j > widths[k]) | (rng.random(cost.shape) < 0.05)] = np.inf
        costs.append(cost)
    return costs, work


def _brute_bottleneck(costs, num_blocks):
    best = np.inf
    for inner in itertools.combinations(range(1, num_blocks), len(costs) - 1):
        b = [0, *inner, num_blocks]
        best = min(best, max(costs[k][b[k], b[k + 1]] for k in range(len(costs))))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_reach_and_bands_change_no_answer(seed):
    num_blocks, num_stages = 16, 6 + seed % 4 // 2 if seed % 2 == 0 else 2 + seed % 4
    costs, work = _instance(seed, num_blocks, num_stages)
    stage_cost = lambda k: costs[k]  # noqa: E731
    reach = [stage_reach(c) for c in costs]
    expected = _brute_bottleneck(costs, num_blocks)
    assert min_bottleneck(stage_cost, num_blocks, num_stages) == expected
    assert min_bottleneck(stage_cost, num_blocks, num_stages, work, reach) == expected
    assert covers(reach, num_blocks) or expected == np.inf
    if np.isfinite(expected):
        bounds = [expected * (1 + eps) for eps in (1e-12, 0.1, 0.5)]
        plain = min_sums_under(stage_cost, num_blocks, num_stages, bounds)
        assert min_sums_under(stage_cost, num_blocks, num_stages, bounds, work, reach) == plain
    found = candidate_partitions(stage_cost, num_blocks, num_stages, exhaustive=False, work=work, reach=reach)
    assert found == candidate_partitions(stage_cost, num_blocks, num_stages, exhaustive=False)


def test_stage_reach_counts_the_widest_finite_stage():
    cost = np.full((5, 5), np.inf)
    cost[0, 1] = cost[1, 4] = 1.0
    assert stage_reach(cost) == 3
    assert stage_reach(np.full((5, 5), np.inf)) == 0


def test_stages_that_cannot_span_the_chain_are_answered_without_a_dp():
    assert not covers([2, 2, 2], 7)  # three stages of at most two blocks each cover six
    assert covers([2, 2, 3], 7)
    assert not covers([0, 7], 7)  # a stage that fits nowhere


# odd seeds: stages up to the whole chain; seed 27 has no split that fits
@pytest.mark.parametrize("seed", [s for s in range(1, 42, 2) if s != 27])
def test_squares_give_the_most_even_split_under_each_bound(seed):
    """``squares=True``: under each bound, a split with the least sum of squared stage times
    (brute force), with and without the bands; ``even`` adds the one under the smallest bound to
    the candidates."""
    num_blocks, num_stages = 14, 3 + seed % 3
    costs, work = _instance(seed, num_blocks, num_stages)
    stage_cost = lambda k: costs[k]  # noqa: E731
    reach = [stage_reach(c) for c in costs]
    floor = min_bottleneck(stage_cost, num_blocks, num_stages, work, reach)
    assert np.isfinite(floor)
    bounds = [floor * (1 + eps) for eps in (1e-12, 0.2, 1.0)]
    found = min_sums_under(stage_cost, num_blocks, num_stages, bounds, squares=True)
    assert min_sums_under(stage_cost, num_blocks, num_stages, bounds, work, reach, squares=True) == found
    for bound, split in zip(bounds, found):
        best = np.inf
        for inner in itertools.combinations(range(1, num_blocks), num_stages - 1):
            b = [0, *inner, num_blocks]
            times = [costs[k][b[k], b[k + 1]] for k in range(num_stages)]
            if max(times) <= bound:
                best = min(best, sum(t * t for t in times))
        times = [costs[k][split[k], split[k + 1]] for k in range(num_stages)]
        assert max(times) <= bound and sum(t * t for t in times) == pytest.approx(best, rel=1e-12)
    plain = candidate_partitions(stage_cost, num_blocks, num_stages, exhaustive=False, work=work, reach=reach)
    even = candidate_partitions(stage_cost, num_blocks, num_stages, exhaustive=False, work=work, reach=reach, even=True)
    assert even[: len(plain)] == plain and found[0] in even  # the most even split under the smallest bound


def test_squares_split_uniform_blocks_evenly():
    """On equal blocks the sum DP's ties may leave stages of 4, 4, 2, 2 blocks under a relaxed
    bound; the squares give 3, 3, 3, 3 under every bound."""
    num_blocks = 12
    j, i = np.meshgrid(np.arange(num_blocks + 1), np.arange(num_blocks + 1), indexing="ij")
    cost = np.where(i > j, (i - j).astype(float), np.inf)
    splits = min_sums_under(lambda k: cost, num_blocks, 4, [3.0, 4.0, 6.0], squares=True)
    assert splits == [[0, 3, 6, 9, 12]] * 3
