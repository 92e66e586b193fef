"""Stages with different replica counts: the stage DP with a device axis.

A uniform config gives every rank group the same number of devices; an uneven one gives stage
``p`` its own ``r_p`` replicas (``Config.stage_replicas``), so a stage that costs more (GPT's
vocabulary projection, a CNN's early high-resolution layers) can run its share of every
micro-batch on more devices, and device counts that are no product ``pp x dp`` of a good
pipeline (6, 7, 10 ...) are used whole. Uneven configs have one stage per rank group and run
GPipe or 1F1B; each micro-batch of ``b = B / m`` samples is split evenly over a stage's
replicas, so ``r_p`` divides ``b`` and stage ``p`` runs ``b / r_p`` samples per replica.

Recurrence (Alpa's stage DP, Zheng et al. OSDI 2022, Eq. 2, with its device axis; RaNNC's DP
allocates devices per stage the same way), for one (schedule, S, m)::

    F[0][0][0] = 0
    F[p][i][d] = min over j < i, r in R of  F[p-1][j][d - r] (+) T[p-1][r][j, i]

``T[p][r][j, i]``: seconds per micro-batch of blocks ``j .. i-1`` as stage ``p`` with ``r``
replicas, at ``b / r`` samples (recomputing when only that fits; ``inf`` when nothing fits;
``partita.planning.search.StageCosts``). ``(+)`` is ``max`` for the bottleneck pass and ``+`` under
a bound ``t_max`` for the sum pass; ``d <= N`` devices are used. As in the uniform search, the
step ``(m - 1) max_p t_p + sum_p t_p`` (plus sends) is minimised by enumerating the bottleneck:
for each candidate ``t_max`` the sum pass gives the best split and replica counts under it.

Cost: ``S (K+1)^2 (N+1) |R|`` per pass. Long chains are searched on at most
``MAX_DP_BLOCKS`` of their block boundaries (the refinement then moves boundaries on the whole
chain). Up to ``MAX_DEVICES`` devices every shape with at most ``MAX_STAGES`` stages is searched.
Beyond, enumerating the shapes costs too much, so the DP searches the shapes of the best
simulated uniform plans (``seed_shapes``: their schedule, depth, micro-batch count and
recompute mode), each with the replica counts within a factor ``NEAR_SEED`` of the seed's, and
only where one pass's work ``S (K'+1)^2 (N+1) |R|`` stays under ``MAX_SEEDED_WORK``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from partita.cost.memory import microbatches_in_flight
from partita.planning.chain import BlockCosts
from partita.planning.configs import Candidate, Config, SearchOptions, divisors, microbatch_counts, schedule_accepts
from partita.planning.partition import candidate_partitions
from partita.planning.search import EXHAUSTIVE_BLOCKS, estimate_step, step_tail_s
from partita.planning.stage_costs import StageCosts
from partita.types import RECOMPUTE_LEVELS, Recompute, Schedule
from partita.types.schedule_orders import UNEVEN_SCHEDULES

MAX_DEVICES = 64
MAX_STAGES = 8
MAX_DP_BLOCKS = 32
# Short chains (EXHAUSTIVE_BLOCKS) try every replica vector when a shape has at most this many.
MAX_ENUMERATED_VECTORS = 256
# Relaxations of the smallest bottleneck tried on chains longer than EXHAUSTIVE_BLOCKS.
BOTTLENECK_RELAXATIONS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35)

# Beyond MAX_DEVICES: how many of the best simulated uniform plans' shapes are searched again with
# uneven counts, the replica counts kept (a factor of the seed's count either way), and the most work
# (array elements of one DP pass) a seeded shape may take.
NUM_SEED_SHAPES = 4
NEAR_SEED = 4
MAX_SEEDED_WORK = 60_000_000

# (schedule, stages, micro-batches, recompute mode) of an uneven search.
ShapeKey = tuple[Schedule, int, int, Recompute | None]


class _Shape:
    """One (schedule, S stages, m micro-batches, recompute mode): the replica choices and the
    time of every stage range at every replica count."""

    def __init__(
        self,
        stage_costs: Callable[[int, int, Recompute | None], StageCosts],
        options: SearchOptions,
        schedule: Schedule,
        num_stages: int,
        num_microbatches: int,
        recompute_mode: Recompute | None,
        positions: np.ndarray,
        replica_counts: list[int],
    ):
        b = options.global_batch_size // num_microbatches
        self.num_stages, self.num_microbatches, self.schedule = num_stages, num_microbatches, schedule
        self.recompute_mode, self.samples, self.positions = recompute_mode, b, positions
        self.replica_counts = replica_counts
        self.time: dict[int, list[np.ndarray]] = {}  # r -> per stage p: (K'+1, K'+1) seconds (inf: no fit)
        self.recompute: dict[int, list[np.ndarray]] = {}  # r -> per stage p: the level's order (``cost_at``)
        self.send: dict[int, np.ndarray] = {}  # r -> seconds to send each boundary's tensors (and gradients)
        self.tail: dict[int, np.ndarray] = {}  # r -> replicate's step overhead of each range (``StageCosts.tail``)
        self.backward: np.ndarray = np.empty(0)  # backward seconds per micro-batch of each range
        sub = np.ix_(positions, positions)
        for r in self.replica_counts:
            costs = stage_costs(r, num_microbatches, recompute_mode)
            per_stage = [
                costs.cost_at(microbatches_in_flight(schedule, num_microbatches, num_stages, p, 1))
                for p in range(num_stages)
            ]
            self.time[r] = [t[sub] for t, _ in per_stage]
            self.recompute[r] = [u[sub] for _, u in per_stage]
            self.send[r] = costs.send[positions]
            self.tail[r], self.backward = costs.tail[sub], costs.backward[sub]

    def config(self, replicas: tuple[int, ...]) -> Config:
        fewest = min(replicas)
        return Config(
            fewest,
            self.num_stages,
            self.schedule,
            1,
            self.num_microbatches,
            self.samples // fewest,
            self.recompute_mode,
            stage_replicas=replicas,
        )


def enumerate_shapes(options: SearchOptions, num_blocks: int) -> Iterator[tuple[Schedule, int, int, Recompute | None]]:
    """(schedule, stages, micro-batches, recompute mode) of every uneven search the options allow."""
    n, batch = options.num_devices, options.global_batch_size
    schedules = [s for s in UNEVEN_SCHEDULES if s in options.schedules]
    if options.num_stages is not None:
        stage_counts = [options.num_stages] if 2 <= options.num_stages <= n else []
    else:
        stage_counts = list(range(2, min(n, num_blocks, MAX_STAGES) + 1))
    modes = [options.recompute] if options.recompute is not None else [None]
    for schedule in schedules:
        for s in stage_counts:
            if s > num_blocks:
                continue
            for m in microbatch_counts(options, batch, s):
                if schedule_accepts(schedule, m, s, s):
                    for mode in modes:
                        yield schedule, s, m, mode


def search_uneven(
    blocks_at: Callable[[int], BlockCosts],
    options: SearchOptions,
    cluster,
    num_blocks: int,
    *,
    cuttable: np.ndarray | None = None,
    seeds: Sequence[tuple[ShapeKey, int]] | None = None,
) -> list[Candidate]:
    """Candidates of every uneven shape whose replica counts are not all equal (the uniform
    search covers those), best estimates first within each shape. ``cuttable[b]``: whether block
    boundary ``b`` may separate different replica counts (``chain.per_sample_cuts``; None: all);
    the DP cuts only there. ``seeds`` (``seed_shapes``): search only those shapes, each at the
    replica counts near its seed's count, and only those whose DP work stays under
    MAX_SEEDED_WORK; None: every shape ``enumerate_shapes`` gives, at every count."""
    allowed = np.flatnonzero(np.ones(num_blocks + 1, bool) if cuttable is None else np.asarray(cuttable, bool))
    allowed = np.union1d(allowed, [0, num_blocks])
    positions = _dp_positions(allowed)
    exhaustive = num_blocks <= EXHAUSTIVE_BLOCKS
    found: list[Candidate] = []
    seen: set = set()
    shared: dict[tuple, StageCosts] = {}

    def stage_costs(r: int, m: int, mode: Recompute | None) -> StageCosts:
        """The stage costs at r replicas, m micro-batches: shared by every schedule and depth."""
        if (r, m, mode) not in shared:
            samples = options.global_batch_size // (m * r)
            config = Config(r, 1, Schedule.GPIPE, 1, m, samples, mode)  # schedule and depth: see StageCosts.cost_at
            shared[r, m, mode] = StageCosts(blocks_at(samples), config, options, cluster)
        return shared[r, m, mode]

    if seeds is None:
        shapes = [(key, None) for key in enumerate_shapes(options, num_blocks)]
    else:
        shapes = [(key, near) for key, near in seeds if key[1] < len(positions)]
    for (schedule, s, m, mode), near in shapes:
        counts = _replica_counts(options, m, near)
        if len(counts) < 2:
            continue  # one replica count only: every split is uniform
        if near is not None and s * len(positions) ** 2 * (options.num_devices + 1) * len(counts) > MAX_SEEDED_WORK:
            continue
        shape = _Shape(stage_costs, options, schedule, s, m, mode, positions, counts)
        for boundaries, replicas in _splits(shape, options.num_devices, exhaustive=exhaustive):
            if len(set(replicas)) == 1:
                continue
            full = tuple(int(positions[b]) for b in boundaries)
            key = (schedule, s, m, mode, full, replicas)
            if key in seen:
                continue
            seen.add(key)
            found.append(_candidate(shape, boundaries, full, replicas))
    return found


def seed_shapes(candidates: Sequence[Candidate], limit: int = NUM_SEED_SHAPES) -> list[tuple[ShapeKey, int]]:
    """The shapes of the first ``limit`` distinct uniform configs among ``candidates`` (best first)
    that an uneven config can have (two or more stages, one per rank group, GPipe or 1F1B), each
    with its replica count: ``search_uneven``'s seeds beyond MAX_DEVICES."""
    found: dict[ShapeKey, int] = {}
    for c in candidates:
        config = c.config
        if config.stage_replicas or config.virtual_stages != 1 or config.schedule not in UNEVEN_SCHEDULES:
            continue
        if config.num_stages < 2:
            continue  # one stage has one count
        key = (config.schedule, config.num_stages, config.num_microbatches, config.recompute_mode)
        found.setdefault(key, config.replicas)
        if len(found) >= limit:
            break
    return list(found.items())


def _replica_counts(options: SearchOptions, num_microbatches: int, near: int | None) -> list[int]:
    """The replica counts a stage may have: those that divide the micro-batch and fit the devices;
    with a seed's count ``near``, only those within a factor NEAR_SEED of it."""
    counts = [r for r in divisors(options.global_batch_size // num_microbatches) if r <= options.num_devices]
    if near is None:
        return counts
    return [r for r in counts if near <= r * NEAR_SEED and r <= near * NEAR_SEED]


def _dp_positions(allowed: np.ndarray) -> np.ndarray:
    """Block boundaries the DP cuts at: the ``allowed`` ones (sorted, first 0, last K), or
    MAX_DP_BLOCKS + 1 of them evenly spread."""
    if len(allowed) <= MAX_DP_BLOCKS + 1:
        return allowed
    return allowed[np.unique(np.round(np.linspace(0, len(allowed) - 1, MAX_DP_BLOCKS + 1)).astype(int))]


def _candidate(shape: _Shape, boundaries: list[int], full: tuple[int, ...], replicas: tuple[int, ...]) -> Candidate:
    times, recompute = [], []
    for p, r in enumerate(replicas):
        a, b = boundaries[p], boundaries[p + 1]
        times.append(float(shape.time[r][p][a, b]))
        recompute.append(RECOMPUTE_LEVELS[int(shape.recompute[r][p][a, b])])
    sends = sum(float(shape.send[replicas[p]][boundaries[p + 1]]) for p in range(shape.num_stages - 1))
    ranges = [(boundaries[p], boundaries[p + 1]) for p in range(shape.num_stages)]
    tails = [float(shape.tail[r][a, b]) for r, (a, b) in zip(replicas, ranges)]
    tail = step_tail_s(shape.config(replicas), tails, [float(shape.backward[a, b]) for a, b in ranges])
    config = shape.config(replicas)
    return Candidate(config, full, tuple(recompute), estimate_step(config, times) + sends + tail, tail)


# ----------------------------------------------------------------------------- DP


def _splits(shape: _Shape, num_devices: int, *, exhaustive: bool) -> Iterator[tuple[list[int], tuple[int, ...]]]:
    """(boundaries on the DP positions, replicas per stage) minimising the sum of stage times
    under each candidate bottleneck.

    The DP's sums leave out the gradient all-reduce (once per step, longer for more replicas of
    more parameters) and the optimizer step, which a candidate's estimate adds only afterwards (the
    step's tail, ``step_tail_s``): on short chains with few replica vectors, every vector gets its
    own splits (the per-stage DP of ``partition``), so the simulator ranks them all; otherwise the
    device-axis DP proposes one vector per bottleneck."""
    vectors = _replica_vectors(shape, num_devices) if exhaustive else None
    if vectors is not None and len(vectors) <= MAX_ENUMERATED_VECTORS:
        for replicas in vectors:
            stage_time = lambda p, replicas=replicas: shape.time[replicas[p]][p]  # noqa: E731 - the DP's StageCost
            for boundaries in candidate_partitions(
                stage_time, len(shape.positions) - 1, shape.num_stages, exhaustive=True
            ):
                yield boundaries, replicas
        return
    floor = _min_bottleneck(shape, num_devices)
    if not np.isfinite(floor):
        return
    for t_max in [floor * (1 + eps) for eps in BOTTLENECK_RELAXATIONS]:
        yield from _min_sum_under(shape, num_devices, t_max * (1 + 1e-12))


def _replica_vectors(shape: _Shape, num_devices: int) -> list[tuple[int, ...]] | None:
    """Every vector of replica counts (not all equal) using at most ``num_devices``; None when
    there are more than MAX_ENUMERATED_VECTORS."""
    found: list[tuple[int, ...]] = []

    def extend(prefix: tuple[int, ...], left: int) -> bool:
        if len(prefix) == shape.num_stages:
            if len(set(prefix)) > 1:
                found.append(prefix)
            return len(found) <= MAX_ENUMERATED_VECTORS
        need = shape.num_stages - len(prefix) - 1  # at least one device for each later stage
        return all(extend((*prefix, r), left - r) for r in shape.replica_counts if r <= left - need)

    return found if extend((), num_devices) else None


def _min_bottleneck(shape: _Shape, num_devices: int) -> float:
    value = _initial(shape, num_devices)
    for p in range(shape.num_stages):
        value, _, _ = _device_step(value, {r: shape.time[r][p] for r in shape.replica_counts}, np.maximum)
    return float(value[-1].min())


def _min_sum_under(shape: _Shape, num_devices: int, t_max: float) -> Iterator[tuple[list[int], tuple[int, ...]]]:
    value = _initial(shape, num_devices)
    choices = []
    for p in range(shape.num_stages):
        bounded = {r: np.where(shape.time[r][p] <= t_max, shape.time[r][p], np.inf) for r in shape.replica_counts}
        value, best_j, best_r = _device_step(value, bounded, np.add)
        choices.append((best_j, best_r))
    last = value[-1]
    d = int(np.argmin(last))
    if np.isfinite(last[d]):
        yield _backtrack(choices, len(value) - 1, d)


def _initial(shape: _Shape, num_devices: int) -> np.ndarray:
    """F[0]: (K'+1, N+1), 0 at no blocks and no devices, inf elsewhere."""
    k = len(next(iter(shape.time.values()))[0]) - 1
    value = np.full((k + 1, num_devices + 1), np.inf)
    value[0, 0] = 0.0
    return value


def _device_step(
    previous: np.ndarray, cost_by_replicas: dict[int, np.ndarray], combine: Callable
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One layer of the DP: F[p][i][d] = min_{j, r} combine(F[p-1][j][d - r], cost[r][j, i]).

    Returns (F[p], argmin j, argmin r), each (K+1, N+1); r = 0 where nothing is reachable."""
    k1, n1 = previous.shape
    value = np.full((k1, n1), np.inf)
    best_j = np.zeros((k1, n1), dtype=np.int64)
    best_r = np.zeros((k1, n1), dtype=np.int64)
    for r, cost in cost_by_replicas.items():
        if r >= n1:
            continue
        candidates = combine(previous[:, None, : n1 - r], cost[:, :, None])  # (j, i, d) -> devices d + r
        j = np.argmin(candidates, axis=0)  # (i, d)
        reached = np.take_along_axis(candidates, j[None], axis=0)[0]
        better = reached < value[:, r:]
        value[:, r:] = np.where(better, reached, value[:, r:])
        best_j[:, r:] = np.where(better, j, best_j[:, r:])
        best_r[:, r:] = np.where(better, r, best_r[:, r:])
    return value, best_j, best_r


def _backtrack(choices, num_blocks: int, devices: int) -> tuple[list[int], tuple[int, ...]]:
    boundaries, replicas = [num_blocks], []
    i, d = num_blocks, devices
    for best_j, best_r in reversed(choices):
        j, r = int(best_j[i, d]), int(best_r[i, d])
        boundaries.append(j)
        replicas.append(r)
        i, d = j, d - r
    assert i == 0 and d == 0, (i, d)
    return boundaries[::-1], tuple(replicas[::-1])
