"""The search over a mixed cluster: stages placed on device groups, with unequal sample shares.

Glossary
--------
kind        what runs one stage (``StageKind``): how many replicas on each device group
            (``counts[g]``; a replica is a tensor-parallel group of ``run.degree_of(g)`` devices) and
            how many samples of each micro-batch one replica of each group runs (``samples[g]``);
            ``sum_g counts[g] * samples[g] = b``, the micro-batch. A kind on two groups gives the
            faster type's replicas more samples, so that no replica waits; its groups have one
            degree (a run that gives the groups degrees of their own has kinds of one group each).
config      (schedule, micro-batches m, one kind per stage, recompute mode): ``MixedConfig``.
            GPipe or 1F1B, one stage per rank group (partita's executor runs them,
            ``partita.runtime.uneven``).
candidate   a config plus a split of the block chain into its stages (``MixedCandidate``).

A kind's stage time (``KindCosts``): each device group's ``StageCosts`` (``partita.planning.stage_costs``:
compute at its samples, sharding penalties, memory fit at its own memory limit) at the kind's
total replica count, and the slowest of them: ``T[kind][j, i] = max_g T_g(samples[g])[j, i]``,
``inf`` where any group's replica does not fit. Recomputation is one level per stage (the
runtime runs all its replicas alike): the least of none, selective and full at which every
group's replica fits, as the uniform search chooses it (``partita.planning.search``).

Ranks follow the device groups (``Cluster.assign_ranks``): each group's devices in order, stage
after stage. The job numbers the devices it starts densely, so a plan uses the cluster's first
devices: every device of each group before the last group it uses, whose trailing devices (and
every later group) may stay idle.

Partita's runtime runs every layout searched here (``partita.runtime.layout``): unequal sample
shares (each slice's loss weighted by its samples, ``partita.runtime.loss_scaling``), and stages
whose ranks follow the device groups in any order of the stages (the second group's stages first).

Sample shares (``balanced_shares``): per vector of replica counts, the few splits of the
micro-batch whose slowest replica is fastest by the groups' time per sample (``SHARES_KEPT``,
``SMALL_SHARES_KEPT``), and the even split (for memory: the fast type's larger share may not fit).
``MixedRun.every_share`` tries every split instead (the brute-force oracle's space): on small
clusters with large micro-batches that is several times the work (the zoo MLP on 2 H100 + 4 V100
at batch 32, the whole ``plan_mixed``: 39 s against 9 s here), for the same plans on the oracle's instances
(tests/unit/test_hetero_search.py).

Configs: on small clusters and chains (``SMALL_DEVICES``, ``EXHAUSTIVE_BLOCKS``) every tuple of kinds
(up to ``MAX_KIND_TUPLES`` per shape); otherwise two families whose shapes scale to thousands of
devices:

- mixed data parallelism: every stage the same kind, each group's devices spread evenly over
  the stages, the shares balanced on the whole chain's time per sample (``balanced_shares``);
- type blocks: a pipeline whose first stages run on one group and the rest on the next (either
  order), each group's stages with equal replica counts (and equal shares).

Each config's stage split comes from the per-stage bottleneck DPs of ``partita.planning.partition``
on its stages' time matrices; a cut between stages whose replicas hold different samples must
split by sample (``MixedRun.cuttable``). The step is estimated as the uniform search does:
``(m - 1) max_p t_p + sum_p t_p`` plus the sends (``estimate_mixed_step``) and the step's tail
(the exposed gradient all-reduce and optimizer step, ``pipeline_tail_s``); the best candidates are
simulated (``partita.planning.hetero``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from partita.cost.memory import microbatches_in_flight
from partita.planning.configs import Config, divisors, microbatch_counts, schedule_accepts
from partita.planning.device_groups import MixedRun
from partita.planning.partition import candidate_partitions
from partita.planning.search import EXHAUSTIVE_BLOCKS, pipeline_tail_s
from partita.planning.stage_costs import StageCosts
from partita.types import RECOMPUTE_LEVELS, Recompute, Schedule
from partita.types.schedule_orders import UNEVEN_SCHEDULES

__all__ = [
    "KindCosts",
    "MixedCandidate",
    "MixedConfig",
    "StageKind",
    "balanced_shares",
    "enumerate_mixed_configs",
    "estimate_mixed_step",
    "search_mixed",
]

MIXED_SCHEDULES = UNEVEN_SCHEDULES  # run by partita.runtime.uneven (module docstring)
MAX_STAGES = 8
# Clusters of at most this many devices (on chains of at most EXHAUSTIVE_BLOCKS blocks) try every
# tuple of kinds, with every share, up to MAX_KIND_TUPLES per (schedule, stages, micro-batches).
SMALL_DEVICES = 16
MAX_KIND_TUPLES = 4096
# Sample shares tried per count vector (the best balanced first), besides the even split: in the
# families of larger clusters, and in every tuple of kinds on small ones (where more shares multiply
# the tuples; on the oracle instances of tests/unit/test_hetero_search.py one finds every optimum).
SHARES_KEPT = 2
SMALL_SHARES_KEPT = 1


@dataclass(frozen=True)
class StageKind:
    """Replicas of a stage on each device group (``counts``) and samples of each micro-batch one
    replica of each group runs (``samples``, 0 where the count is 0)."""

    counts: tuple[int, ...]
    samples: tuple[int, ...]

    @property
    def num_replicas(self) -> int:
        return sum(self.counts)

    @property
    def groups(self) -> tuple[int, ...]:
        """The device groups the stage runs on."""
        return tuple(g for g, c in enumerate(self.counts) if c)

    @property
    def shares(self) -> tuple[int, ...]:
        """Samples of each replica, in replica (rank) order: group by group."""
        return tuple(n for c, n in zip(self.counts, self.samples) for _ in range(c))


@dataclass(frozen=True)
class MixedConfig:
    schedule: Schedule
    num_microbatches: int
    kinds: tuple[StageKind, ...]  # one per stage, stage p on rank group p
    recompute_mode: Recompute | None  # None: per stage, the least level that fits; a level: every stage

    @property
    def num_stages(self) -> int:
        return len(self.kinds)

    def devices_of_group(self, group: int) -> int:
        return sum(k.counts[group] for k in self.kinds)


@dataclass(frozen=True)
class MixedCandidate:
    config: MixedConfig
    boundaries: tuple[int, ...]  # block positions, first 0, last K
    recompute: tuple[Recompute, ...]  # per stage
    estimate_s: float


# ----------------------------------------------------------------------------- stage costs


class KindCosts:
    """Stage time matrices of kinds at one micro-batch count and recompute mode: each group's
    ``StageCosts`` combined (module docstring), remembered per kind and activations in flight."""

    def __init__(self, run: MixedRun, num_microbatches: int, mode: Recompute | None):
        self.run, self.m, self.mode = run, num_microbatches, mode
        self._stage_costs: dict[tuple, StageCosts] = {}
        self._costs: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self._send: dict[StageKind, np.ndarray] = {}
        self._tail: dict[StageKind, tuple[np.ndarray, np.ndarray]] = {}

    def stage_costs(self, group: int, samples: int, replicas: int, mixed: bool, mode: Recompute | None) -> StageCosts:
        """Group ``group``'s StageCosts at ``samples`` per replica and ``replicas`` replicas in all
        (``mixed``: the stage spans groups, so its collectives run over the mixed cluster's slowest links)."""
        key = (group, samples, replicas, mixed, mode)
        if key not in self._stage_costs:
            ctx = self.run.contexts[group]
            config = Config(replicas, 1, Schedule.GPIPE, 1, self.m, samples, mode)  # see StageCosts.cost_at
            cluster = self.run.search_cluster if mixed else ctx.search_cluster
            self._stage_costs[key] = StageCosts(self.run.blocks_at(group, samples), config, ctx.options, cluster)
        return self._stage_costs[key]

    def cost(self, kind: StageKind, in_flight: float) -> tuple[np.ndarray, np.ndarray]:
        """(seconds per micro-batch with inf where a replica does not fit, the recomputation level
        chosen as its ``Recompute.order``) of every block range as a stage of ``kind`` keeping
        ``in_flight`` micro-batches' activations: the least level at which every group fits."""
        key = (kind, in_flight)
        if key in self._costs:
            return self._costs[key]
        mixed = len(kind.groups) > 1
        time, chosen = None, None
        for mode in [self.mode] if self.mode is not None else RECOMPUTE_LEVELS:
            per_group = [
                self.stage_costs(g, kind.samples[g], kind.num_replicas, mixed, mode).cost_at(in_flight)[0]
                for g in kind.groups
            ]
            at_level = np.maximum.reduce(per_group)
            if time is None:
                time, chosen = at_level, np.full(at_level.shape, mode.order, dtype=np.int8)
            else:  # a level only where the levels before it do not fit
                take = ~np.isfinite(time) & np.isfinite(at_level)
                time, chosen = np.where(take, at_level, time), np.where(take, mode.order, chosen)
        self._costs[key] = (time, chosen)
        return self._costs[key]

    def tail(self, kind: StageKind) -> tuple[np.ndarray, np.ndarray]:
        """(the step's tail of every block range as a stage of ``kind``: its slowest group's
        replicate overhead, ``StageCosts.tail``; that group's backward seconds per micro-batch,
        which the stages after it take before it, ``pipeline_tail_s``)."""
        if kind not in self._tail:
            mixed = len(kind.groups) > 1
            per_group = [self.stage_costs(g, kind.samples[g], kind.num_replicas, mixed, self.mode) for g in kind.groups]
            self._tail[kind] = (
                np.maximum.reduce([c.tail for c in per_group]),
                np.maximum.reduce([c.backward for c in per_group]),
            )
        return self._tail[kind]

    def send(self, kind: StageKind) -> np.ndarray:
        """Seconds to send a stage of ``kind``'s output at each block boundary (and its gradient
        back): its slowest group's replica's."""
        if kind not in self._send:
            mixed = len(kind.groups) > 1
            sends = [
                self.stage_costs(g, kind.samples[g], kind.num_replicas, mixed, self.mode).send for g in kind.groups
            ]
            self._send[kind] = np.maximum.reduce(sends)
        return self._send[kind]


# ----------------------------------------------------------------------------- kinds


def balanced_shares(run: MixedRun, counts: Sequence[int], microbatch: int, limit: int | None) -> list[tuple[int, ...]]:
    """Sample vectors (per group, 0 where ``counts`` is 0) that split ``microbatch`` samples over the
    replicas, at least one each: all of them with ``limit`` None, else the ``limit`` whose slowest
    replica is fastest by the groups' time per sample (``MixedRun.seconds_per_sample``), best first,
    and then the even split (every replica as many samples) where there is one."""
    groups = [g for g, c in enumerate(counts) if c]
    reference = max(2, microbatch // max(1, sum(counts)))
    lines = {g: run.seconds_per_sample(g, reference) for g in groups} if limit is not None else {}
    found: list[tuple[float, tuple[int, ...]]] = []

    def extend(i: int, left: int, chosen: list[int]) -> None:
        g = groups[i]
        if i == len(groups) - 1:
            if left % counts[g] == 0 and left // counts[g] >= 1:
                samples = [0] * len(counts)
                for h, n in zip(groups, [*chosen, left // counts[g]]):
                    samples[h] = n
                slowest = max((lines[h][0] + lines[h][1] * samples[h] for h in groups), default=0.0) if lines else 0.0
                found.append((slowest, tuple(samples)))
            return
        later = sum(counts[h] for h in groups[i + 1 :])  # every later replica needs a sample
        for n in range(1, (left - later) // counts[g] + 1):
            extend(i + 1, left - counts[g] * n, [*chosen, n])

    if groups:
        extend(0, microbatch, [])
    found.sort(key=lambda item: (item[0], item[1]))
    if limit is None:
        return [samples for _, samples in found]
    kept = [samples for _, samples in found[:limit]]
    even = [samples for _, samples in found[limit:] if len({n for n in samples if n}) == 1]
    return kept + even


def _one_degree(run: MixedRun, counts: Sequence[int]) -> bool:
    """Whether the groups of ``counts`` share one tensor-parallel degree (a stage's replicas do:
    ``MixedRun.degrees``)."""
    return len({run.degree_of(g) for g, c in enumerate(counts) if c}) <= 1


def _all_kinds(run: MixedRun, microbatch: int, one_replica: bool) -> list[StageKind]:
    """Every kind of a micro-batch of ``microbatch`` samples on the cluster (small clusters)."""
    limits = [c.num_devices for c in run.search_cluster.group_clusters]
    kinds = []
    for counts in itertools.product(*(range(n + 1) for n in limits)):
        total = sum(counts)
        if total == 0 or total > microbatch or (one_replica and total > 1) or not _one_degree(run, counts):
            continue
        limit = None if run.every_share else SMALL_SHARES_KEPT
        kinds.extend(StageKind(counts, s) for s in balanced_shares(run, counts, microbatch, limit))
    return kinds


def _uses_devices(run: MixedRun, kinds: Sequence[StageKind]) -> bool:
    """Whether the devices used are the cluster's first ones (module docstring): no group holds more
    than it has, and every group before the last one used is used whole."""
    sizes = [c.num_devices for c in run.search_cluster.group_clusters]
    used = [sum(k.counts[g] for k in kinds) for g in range(len(sizes))]
    last = max((g for g, u in enumerate(used) if u), default=0)
    return all(u <= n for u, n in zip(used, sizes)) and all(used[g] == sizes[g] for g in range(last))


def _every_tuple(
    run: MixedRun, num_stages: int, microbatch: int, one_replica: bool
) -> list[tuple[StageKind, ...]] | None:
    """Every kind tuple of ``num_stages`` stages that uses the devices as ``_uses_devices`` says;
    None when there are more than MAX_KIND_TUPLES."""
    kinds = _all_kinds(run, microbatch, one_replica)
    limits = [c.num_devices for c in run.search_cluster.group_clusters]
    found: list[tuple[StageKind, ...]] = []

    def extend(prefix: tuple[StageKind, ...], left: list[int]) -> bool:
        if len(prefix) == num_stages:
            if _uses_devices(run, prefix):
                found.append(prefix)
            return len(found) <= MAX_KIND_TUPLES
        for kind in kinds:
            if all(c <= n for c, n in zip(kind.counts, left)):
                if not extend((*prefix, kind), [n - c for n, c in zip(left, kind.counts)]):
                    return False
        return True

    return found if extend((), limits) else None


def _family_tuples(
    run: MixedRun, num_stages: int, microbatch: int, one_replica: bool
) -> Iterator[tuple[StageKind, ...]]:
    """Mixed data parallelism and type blocks (module docstring) of ``num_stages`` stages."""
    sizes = [c.num_devices for c in run.search_cluster.group_clusters]
    num_groups, last = len(sizes), len(sizes) - 1
    # mixed data parallelism: each group's devices spread evenly over the stages
    if all(n % num_stages == 0 for n in sizes[:-1]):
        counts = tuple(n // num_stages for n in sizes[:-1]) + (sizes[-1] // num_stages,)
        if sum(counts) and not (one_replica and sum(counts) > 1) and _one_degree(run, counts):
            for samples in balanced_shares(run, counts, microbatch, SHARES_KEPT):
                yield (StageKind(counts, samples),) * num_stages
    # type blocks: group g runs stages_per_group[g] consecutive stages, in either order of the groups
    for order in itertools.permutations(range(num_groups)):
        for split in _splits_of(num_stages, num_groups, last, order):
            blocks = []
            for g in order:
                if split[g] == 0:
                    continue
                replicas = _block_replicas(sizes[g], split[g], microbatch, exact=g != last, one_replica=one_replica)
                if replicas is None:
                    break
                counts = tuple(replicas if h == g else 0 for h in range(num_groups))
                samples = tuple(microbatch // replicas if h == g else 0 for h in range(num_groups))
                blocks.extend([StageKind(counts, samples)] * split[g])
            else:
                if len({k.counts for k in blocks}) > 1 or num_groups == 1:
                    yield tuple(blocks)


def _splits_of(num_stages: int, num_groups: int, last: int, order: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Stages per group (indexed by group): each group but the last gets at least one; the order's
    first group at least one too (a leading empty block is another order's split)."""
    for split in itertools.product(range(num_stages + 1), repeat=num_groups):
        if sum(split) == num_stages and all(split[g] >= 1 for g in range(num_groups) if g != last):
            if split[order[0]] >= 1:
                yield split


def _block_replicas(devices: int, stages: int, microbatch: int, *, exact: bool, one_replica: bool) -> int | None:
    """Replicas per stage of a type block of ``stages`` stages on ``devices`` devices: all of them
    when ``exact`` (they must divide evenly), else the most that fit; each count divides the micro-batch."""
    if exact:
        r = devices // stages
        ok = devices % stages == 0 and microbatch % r == 0 and not (one_replica and r > 1)
        return r if ok else None
    counts = [r for r in divisors(microbatch) if r * stages <= devices and (r == 1 or not one_replica)]
    return max(counts) if counts else None


def enumerate_mixed_configs(run: MixedRun, options) -> Iterator[MixedConfig]:
    """Every config of the mixed search (module docstring), in a fixed order. ``options``: the
    first group's SearchOptions (schedules, pinned depth, micro-batches, recompute)."""
    batch, num_blocks = run.global_batch_size, run.num_blocks
    one_replica = run.graph.couples_samples is not None  # a loss over the whole batch: no split of it
    small = run.search_cluster.num_devices <= SMALL_DEVICES and num_blocks <= EXHAUSTIVE_BLOCKS
    schedules = [s for s in MIXED_SCHEDULES if s in options.schedules]
    depths = [options.num_stages] if options.num_stages is not None else range(1, min(MAX_STAGES, num_blocks) + 1)
    modes = [options.recompute] if options.recompute is not None else [None]
    for schedule in schedules:
        for s in depths:
            if s > num_blocks:
                continue
            for m in [1] if one_replica else microbatch_counts(options, batch, s):
                if not schedule_accepts(schedule, m, s, s) or (schedule is Schedule.ONE_F_ONE_B and s == 1 and m == 1):
                    continue
                tuples = _every_tuple(run, s, batch // m, one_replica) if small else None
                if tuples is None:
                    tuples = list(dict.fromkeys(_family_tuples(run, s, batch // m, one_replica)))
                for kinds in tuples:
                    if _uses_devices(run, kinds):
                        for mode in modes:
                            yield MixedConfig(schedule, m, kinds, mode)


# ----------------------------------------------------------------------------- splits


def estimate_mixed_step(num_microbatches: int, stage_times: Sequence[float]) -> float:
    """``(m - 1) max_p t_p + sum_p t_p``: GPipe/1F1B with one stage per rank group, no communication."""
    return (num_microbatches - 1) * max(stage_times) + sum(stage_times)


def search_config(run: MixedRun, config: MixedConfig, costs: KindCosts, keep: int | None) -> list[MixedCandidate]:
    """The best ``keep`` candidates of one config by estimate (None: every split the DPs propose)."""
    s, m, k = config.num_stages, config.num_microbatches, run.num_blocks
    per_stage = [
        costs.cost(kind, microbatches_in_flight(config.schedule, m, s, p, 1)) for p, kind in enumerate(config.kinds)
    ]
    times = [t for t, _ in per_stage]
    for p in range(s - 1):  # different samples on both sides: the cut must split by sample
        if config.kinds[p].shares != config.kinds[p + 1].shares:
            times[p] = np.where(run.cuttable[None, :], times[p], np.inf)
    found = []
    for boundaries in candidate_partitions(lambda p: times[p], k, s, exhaustive=k <= EXHAUSTIVE_BLOCKS):
        stage_s = [float(times[p][boundaries[p], boundaries[p + 1]]) for p in range(s)]
        if not np.isfinite(sum(stage_s)):
            continue
        recompute = tuple(RECOMPUTE_LEVELS[int(per_stage[p][1][boundaries[p], boundaries[p + 1]])] for p in range(s))
        sends = sum(
            _copies(run, config.kinds[p], config.kinds[p + 1]) * float(costs.send(config.kinds[p])[boundaries[p + 1]])
            for p in range(s - 1)
        )
        ranges = [(boundaries[p], boundaries[p + 1]) for p in range(s)]
        tails = [costs.tail(kind) for kind in config.kinds]  # (tail, backward) matrices per stage
        tail = pipeline_tail_s(
            [float(t[j, i]) for (t, _), (j, i) in zip(tails, ranges)],
            [float(b[j, i]) for (_, b), (j, i) in zip(tails, ranges)],
        )
        estimate = estimate_mixed_step(m, stage_s) + sends + tail
        found.append(MixedCandidate(config, tuple(boundaries), recompute, estimate))
    key = lambda c: (c.estimate_s, c.boundaries)  # noqa: E731
    return sorted(found, key=key) if keep is None else heapq.nsmallest(keep, found, key=key)


def _copies(run: MixedRun, sender: StageKind, receiver: StageKind) -> int:
    """Copies of a boundary tensor (or its gradient) a rank sends between stages of two degrees: their
    ratio (``partita.planning.hetero_simulate``'s sends count them alike)."""
    degrees = (run.degree_of(sender.groups[0]), run.degree_of(receiver.groups[0]))
    return max(degrees) // min(degrees)


def search_mixed(run: MixedRun, options, *, keep_per_config: int = 3) -> list[MixedCandidate]:
    """Every config's best candidates, sorted by estimate (ties: a fixed key). On small chains
    (EXHAUSTIVE_BLOCKS) every split the DPs propose is kept."""
    exhaustive = run.num_blocks <= EXHAUSTIVE_BLOCKS
    costs: dict[tuple[int, Recompute | None], KindCosts] = {}
    found: list[MixedCandidate] = []
    for config in enumerate_mixed_configs(run, options):
        key = (config.num_microbatches, config.recompute_mode)
        if key not in costs:
            costs[key] = KindCosts(run, *key)
        found.extend(search_config(run, config, costs[key], None if exhaustive else keep_per_config))
    found.sort(key=mixed_sort_key)
    return found


def mixed_sort_key(c: MixedCandidate) -> tuple:
    cfg = c.config
    return (
        c.estimate_s,
        cfg.num_stages,
        cfg.schedule.value,
        cfg.num_microbatches,
        tuple((k.counts, k.samples) for k in cfg.kinds),
        str(cfg.recompute_mode),
        c.boundaries,
    )
