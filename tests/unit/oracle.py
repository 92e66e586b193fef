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
from partita.types import RECOMPUTE_LEVELS, Plan, Recompute

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
        for s, ok in enumerate(stage_fits(config, nodes, [level] * config.num_stages)):
            if ok and chosen[s] is None:
                chosen[s] = level
    return [Recompute.FULL if level is None else level for level in chosen]  # full: fits in no way
