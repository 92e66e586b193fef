"""Brute force over every split of the block chain: the search tests' oracle (planning_instances.oracle).

It tries every config the options allow (with ``uniform_replicas=False`` also every vector of
per-stage replica counts of every uneven shape, ``partita.planning.uneven``) and every way to cut
the chain into the config's number of stages; each stage recomputes at the least level with which it fits
(recomputation only adds time, the more the more it recomputes, so this choice is optimal per stage). Each
candidate is simulated on its schedule; the shortest step that fits wins.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from partita.planning.configs import Config, SearchOptions, enumerate_configs
from partita.planning.uneven import enumerate_shapes
from partita.types import RECOMPUTE_LEVELS, Plan, Recompute, Schedule

# (config, node boundaries, recompute per stage, method) -> simulated Plan, or None if it does not fit
Evaluate = Callable[[Config, list, list, str], "Plan | None"]


def all_splits(num_blocks: int, num_stages: int) -> Iterator[list[int]]:
    for inner in itertools.combinations(range(1, num_blocks), num_stages - 1):
        yield [0, *inner, num_blocks]


def brute_force(options: SearchOptions, chain: list[int], evaluate: Evaluate, stage_fits: Callable) -> Plan | None:
    """The best plan over every config and split. ``stage_fits(config, boundaries, recompute)``
    returns per-stage fit flags (``recompute``: a level per stage) used to decide recomputation."""
    best: Plan | None = None
    num_blocks = len(chain) - 1
    for config in all_configs(options, num_blocks):
        for split in all_splits(num_blocks, config.num_stages):
            nodes = [chain[b] for b in split]
            recompute = _recompute_needed(config, nodes, stage_fits)
            if recompute is None:
                continue
            p = evaluate(config, nodes, recompute, "oracle")
            if p is not None and (best is None or p.predicted_step_s < best.predicted_step_s):
                best = p
    return best


def all_configs(options: SearchOptions, num_blocks: int) -> Iterator[Config]:
    """The uniform configs, then (``uniform_replicas=False``) every uneven one: each replica vector
    over the stages whose counts divide the micro-batch, are not all equal and use at most N devices."""
    yield from enumerate_configs(options, num_blocks)
    if options.uniform_replicas:
        return
    for schedule, num_stages, m, mode in enumerate_shapes(options, num_blocks):
        samples = options.global_batch_size // m
        counts = [r for r in range(1, options.num_devices + 1) if samples % r == 0]
        for replicas in itertools.product(counts, repeat=num_stages):
            if len(set(replicas)) > 1 and sum(replicas) <= options.num_devices:
                fewest = min(replicas)
                yield Config(fewest, num_stages, schedule, 1, m, samples // fewest, mode, stage_replicas=replicas)


def _recompute_needed(config: Config, nodes: list[int], stage_fits: Callable) -> list[Recompute]:
    if config.recompute_mode is not None:
        return [config.recompute_mode] * config.num_stages
    chosen: list[Recompute | None] = [None] * config.num_stages
    for level in RECOMPUTE_LEVELS:
        if all(c is not None for c in chosen):
            break  # every stage has its least level: the costlier ones change nothing
        for s, ok in enumerate(stage_fits(config, nodes, [level] * config.num_stages)):
            if ok and chosen[s] is None:
                chosen[s] = level
    return [Recompute.FULL if level is None else level for level in chosen]  # full: fits in no way


# ----------------------------------------------------------------------------- mixed clusters


def brute_force_mixed(run, schedules, recompute_pinned, evaluate) -> Plan | None:
    """The best plan over a mixed cluster (``partita.planning.hetero_search``'s space, enumerated
    here on its own): GPipe and 1F1B, every depth and micro-batch count, every stage's replicas on
    each device group with every split of the micro-batch over them (each replica at least one
    sample, a group's replicas alike), every tuple of those that uses the cluster's first devices
    (the job numbers them densely), and every split of the chain whose cuts between stages with
    different sample slices split by sample (a replica: a tensor-parallel group of its device group's
    degree, ``MixedRun.degree_of``; a stage's replicas of one degree).
    ``evaluate(config, boundaries, recompute)`` returns
    the simulated plan or None (does not fit); each stage at the least recomputation level (none,
    selective, full) at which it fits.
    Every such layout runs on partita's runtime (unequal shares, the second group's stages first)."""
    from partita.planning.chain import per_sample_cuts
    from partita.planning.hetero_search import MixedConfig
    from partita.types.schedule_orders import check_schedule

    units = run.search_cluster  # devices, or tensor-parallel groups at the run's degree
    sizes = [c.num_devices for c in units.group_clusters]
    batch, num_blocks = run.global_batch_size, run.num_blocks
    cuttable = per_sample_cuts(run.graph)
    best = None
    for schedule in [s for s in (Schedule.GPIPE, Schedule.ONE_F_ONE_B) if s in schedules]:
        for num_stages in range(1, num_blocks + 1):
            for m in [d for d in range(1, batch + 1) if batch % d == 0]:
                try:
                    check_schedule(schedule, m, num_stages, num_stages)
                except Exception:  # noqa: BLE001 - torch's schedule refuses these counts
                    continue
                if schedule is Schedule.ONE_F_ONE_B and num_stages == 1 and m == 1:
                    continue  # runs as GPipe does
                # a stage's replicas share one tensor-parallel degree (a run may give each group its own)
                kinds = [k for k in _every_kind(sizes, batch // m) if len({run.degree_of(g) for g in k.groups}) <= 1]
                for kinds_tuple in itertools.product(kinds, repeat=num_stages):
                    if not _dense_prefix(units, sizes, kinds_tuple):
                        continue
                    for mode in [recompute_pinned] if recompute_pinned is not None else [None]:
                        config = MixedConfig(schedule, m, kinds_tuple, mode)
                        for split in all_splits(num_blocks, num_stages):
                            if not all(
                                kinds_tuple[p].shares == kinds_tuple[p + 1].shares or cuttable[run.chain[split[p + 1]]]
                                for p in range(num_stages - 1)
                            ):
                                continue
                            p = evaluate(config, split)
                            if p is not None and (best is None or p.predicted_step_s < best.predicted_step_s):
                                best = p
    return best


def _every_kind(sizes: list[int], microbatch: int) -> list:
    from partita.planning.hetero_search import StageKind

    found = []
    for counts in itertools.product(*(range(n + 1) for n in sizes)):
        if sum(counts) == 0:
            continue
        options = [range(1, microbatch + 1) if c else [0] for c in counts]
        for samples in itertools.product(*options):
            if sum(c * n for c, n in zip(counts, samples)) == microbatch:
                found.append(StageKind(tuple(counts), tuple(samples)))
    return found


def _dense_prefix(cluster, sizes: list[int], kinds) -> bool:
    used = [sum(k.counts[g] for k in kinds) for g in range(len(sizes))]
    if any(u > n for u, n in zip(used, sizes)):
        return False
    ranks = sorted(r for stage in cluster.assign_ranks([k.counts for k in kinds]) for r in stage)
    return ranks == list(range(len(ranks)))
