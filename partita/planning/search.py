"""The joint search: rank groups x replicas x micro-batches x schedule x stage split x recompute.

Glossary
--------
config      one choice of (replicas r, rank groups G, schedule, virtual stages v, micro-batches
            m, recompute mode); each rank group runs v stages, so the chain is split into G*v.
candidate   a config plus a split of the block chain into stages and per-stage recompute.
recompute   a level per stage (``Recompute``: none, selective, full). With one stage per rank
            group each stage takes the least level with which it fits (mode None), its time
            including what that level recomputes; with several, one level for all (each searched).

ZBV never recomputes: under torch's ScheduleZBVZeroBubble a checkpointed stage keeps its
recomputed activations alive from the input-gradient to the weight-gradient pass, so the memory
model (recomputation keeps only the stage inputs) would under-predict it (bench/e2e_memory.py
measures by how much). ``enumerate_configs`` yields no ZBV config with recomputation.

Driver: for every config allowed by the options, build the stage-cost matrices (time, with
``inf`` where the stage does not fit in memory) from the block costs at the config's micro-batch
size, let :mod:`partita.planning.partition` propose splits (one per candidate bottleneck, and with
several stages per rank group also the most even split under each; every split for small chains
with several stages per rank group, see EXHAUSTIVE_SPLITS), estimate
each with a closed form (``estimate_step``; L_g: a rank group's time per micro-batch, plus the
step's tail, ``step_tail_s``: the gradient all-reduce and optimizer step after the last backward),
and keep the best few; then the caller simulates them on the real schedule (moving the splits
whose rank groups, several stages each, overfill: :mod:`partita.planning.group_fit`).

The options and the configs they allow are :mod:`partita.planning.configs`. Configs here give
every rank group the same number of replicas; :mod:`partita.planning.uneven`
searches stages with their own counts (``Config.stage_replicas``) and reuses ``StageCosts``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from partita.cost.memory import memory_from_totals, microbatches_in_flight
from partita.cost.recompute import extra_backward_s
from partita.planning.chain import BlockCosts
from partita.planning.configs import Candidate, Config, SearchOptions, enumerate_configs
from partita.planning.partition import candidate_partitions, covers, min_bottleneck
from partita.planning.stage_costs import StageCosts, rank_groups_span_nodes
from partita.types import RECOMPUTE_LEVELS, Recompute, Schedule, Sharding

# Chains with at most this many blocks try every bottleneck value (exact for the estimate).
EXHAUSTIVE_BLOCKS = 16
# On such chains, configs with several stages per rank group whose number of splits is at most
# EXHAUSTIVE_SPLITS try every split, and keep the best SPLITS_KEPT whose estimate is within
# SPLIT_MARGIN of the best: the per-stage DP neither sees a rank group's load (the sum of its
# stages) nor its memory (its stages together), and with few micro-batches the estimate's order
# of close splits is not the simulator's.
EXHAUSTIVE_SPLITS = 512
SPLIT_MARGIN = 0.10
SPLITS_KEPT = 32
# Bytes of matrices the StageCosts a planning run remembers may hold (``SearchCache``): each holds
# (K+1)^2 matrices per sharding level, recomputation level and micro-batch count in flight, 2 MB
# each at K = 514 blocks, and a 1T model on 64 interleaved rank groups at max_blocks=256 made
# hundreds of them (beyond 24 GB). The least recently used are dropped and rebuilt when asked again.
STAGE_COSTS_BUDGET_BYTES = 1 << 30


# ----------------------------------------------------------------------------- driver


class SearchCache:
    """What the searches of one planning run share (one ``blocks_at``, options and cluster):
    ``StageCosts`` by what they depend on (``stage_costs``), and each config's candidates
    (``best_plan`` may search twice: pruned, then in full)."""

    def __init__(self, budget_bytes: int | None = None) -> None:
        self._stage_costs: dict[tuple, tuple[BlockCosts, StageCosts]] = {}  # least recently used first
        self._memo: dict[tuple, tuple[BlockCosts, float | bool]] = {}  # bottleneck floors, may_fit answers
        self.candidates: dict[Config, list[Candidate]] = {}
        self.budget_bytes = STAGE_COSTS_BUDGET_BYTES if budget_bytes is None else budget_bytes

    def stage_costs(self, blocks: BlockCosts, config: Config, options: SearchOptions, cluster) -> StageCosts:
        """The StageCosts of ``config``, shared with every config of the same micro-batch size,
        replicas, micro-batches, recompute mode and whether a rank group spans nodes: all that
        ``StageCosts`` depends on, since ``cost_at`` takes the stage's position from the caller."""
        key = (
            config.microbatch_size,
            config.replicas,
            config.num_microbatches,
            config.recompute_mode,
            rank_groups_span_nodes(config, cluster),
        )
        made = self._stage_costs.pop(key, None)
        if made is None or made[0] is not blocks:
            self._trim()
            made = (blocks, StageCosts(blocks, config, options, cluster))
        self._stage_costs[key] = made  # now the most recently used
        return made[1]

    def _trim(self) -> None:
        """Drop the least recently used StageCosts until the rest hold at most ``budget_bytes`` of
        matrices (one is rebuilt alike when asked for again: only planning time changes)."""
        held = [made[1].nbytes() for made in self._stage_costs.values()]
        total = sum(held)
        for key, nbytes in zip(list(self._stage_costs), held):
            if total <= self.budget_bytes:
                break
            del self._stage_costs[key]
            total -= nbytes

    def bottleneck_floor(self, blocks: BlockCosts, num_stages: int) -> float:
        """The smallest max compute (F + B per micro-batch) over the splits of the chain into
        ``num_stages`` stages: no stage of any config costs less than its compute, so no split of
        any config at this micro-batch size has a smaller bottleneck (remembered per size and depth)."""
        key = ("bottleneck floor", id(blocks), num_stages)
        made = self._memo.get(key)
        if made is None or made[0] is not blocks:
            ranges = blocks.stage_totals
            compute = np.where(ranges["valid"], ranges["compute_s"], np.inf)
            value = min_bottleneck(lambda s: compute, blocks.num_blocks, num_stages, ranges["work_prefix_s"])
            made = self._memo[key] = (blocks, value)
        return made[1]

    def may_fit(self, blocks: BlockCosts, config: Config, options: SearchOptions) -> bool:
        """``_may_fit``, remembered by what it depends on (configs differ mostly in schedule and m)."""
        sharded = config.replicas > 1 and options.sharding is not Sharding.REPLICATE
        key = ("may fit", config.microbatch_size, config.num_rank_groups, config.replicas if sharded else 1)
        made = self._memo.get(key)
        if made is None or made[0] is not blocks:
            made = self._memo[key] = (blocks, _may_fit(blocks, config, options))
        return made[1]


def search_config(
    blocks: BlockCosts, config: Config, options: SearchOptions, cluster, cache: SearchCache | None = None
) -> list[Candidate]:
    """The best few candidates of one config by the closed-form estimate (``cache``: StageCosts
    shared with other configs, and the result remembered)."""
    if cache is None:
        cache = SearchCache()
    elif config in cache.candidates:
        return cache.candidates[config]
    costs = cache.stage_costs(blocks, config, options, cluster)
    in_flight = [
        microbatches_in_flight(
            config.schedule,
            config.num_microbatches,
            config.num_rank_groups,
            config.rank_group_of(s),
            config.virtual_stages,
        )
        for s in range(config.num_stages)
    ]
    per_stage = [costs.cost_at(f) for f in in_flight]
    reach = [costs.reach_at(f) for f in in_flight]
    cache.candidates[config] = _best_splits(blocks, config, options, costs, per_stage, reach)
    return cache.candidates[config]


def _best_splits(
    blocks: BlockCosts, config: Config, options: SearchOptions, costs: StageCosts, per_stage, reach: list[int]
):
    """``search_config``'s candidates from each stage's (time, recompute) matrices and reaches."""
    stage_time = lambda s: per_stage[s][0]  # noqa: E731 - the DP's StageCost
    k, num_stages = blocks.num_blocks, config.num_stages
    if not covers(reach, k):
        return []  # some stage fits nowhere, or the stages together cannot span the chain
    exhaustive = k <= EXHAUSTIVE_BLOCKS
    every_split = exhaustive and config.virtual_stages > 1 and math.comb(k - 1, num_stages - 1) <= EXHAUSTIVE_SPLITS
    if every_split:
        splits = ([0, *inner, k] for inner in itertools.combinations(range(1, k), num_stages - 1))
    else:
        work = blocks.stage_totals["work_prefix_s"]  # every stage costs at least its compute: the banded DPs
        splits = candidate_partitions(
            stage_time, k, num_stages, exhaustive=exhaustive, work=work, reach=reach, even=config.virtual_stages > 1
        )
    found = []
    for boundaries in splits:
        times = [float(per_stage[s][0][boundaries[s], boundaries[s + 1]]) for s in range(num_stages)]
        if not np.isfinite(sum(times)):
            continue  # only the exhaustive enumeration proposes splits with a stage that does not fit
        recompute = tuple(
            RECOMPUTE_LEVELS[int(per_stage[s][1][boundaries[s], boundaries[s + 1]])] for s in range(num_stages)
        )
        sends = sum(float(costs.send[b]) for b in boundaries[1:-1])
        tail = step_tail_s(config, *_tails_and_backwards(costs, boundaries))
        estimate = estimate_step(config, times) + sends + tail
        found.append(Candidate(config, tuple(boundaries), recompute, estimate, tail))
    key = lambda c: (c.estimate_s, c.boundaries)  # noqa: E731
    if every_split:
        found = heapq.nsmallest(SPLITS_KEPT, found, key=key)
        return [c for c in found if c.estimate_s <= found[0].estimate_s * (1 + SPLIT_MARGIN)]
    keep = len(found) if exhaustive else options.candidates_per_config
    return heapq.nsmallest(keep, found, key=key)


def estimate_step(config: Config, stage_times: Sequence[float]) -> float:
    """Closed-form step: ``(m - 1)·max_g L_g + sum_g L_g`` with one stage per rank group (exact
    for GPipe/1F1B without communication); with ``v`` stages per group the fill and drain
    shrink to ``(G - 1)·max_g L_g / v`` after the ``m`` rounds of the busiest group."""
    loads = _per_rank_group(config, stage_times)
    m, v, g = config.num_microbatches, config.virtual_stages, config.num_rank_groups
    if v == 1:
        return float((m - 1) * loads.max() + loads.sum())
    return float(m * loads.max() + (g - 1) * loads.max() / v)


def step_tail_s(config: Config, tails: Sequence[float], backwards: Sequence[float]) -> float:
    """What the step adds after the last backward: each rank group's replicate overhead (exposed
    gradient all-reduce and optimizer step, ``StageCosts.tail`` of its stages: ``tails``) runs once
    its own last backward is done. With one stage per group (GPipe, 1F1B) stage s finishes that
    backward the backwards of stages 0..s-1 (``backwards``, per micro-batch) before stage 0, which
    ends the drain; with v stages per group every group works until near the end, so each group's
    whole tail shows. The largest of these is the tail."""
    if config.virtual_stages == 1:
        return pipeline_tail_s(tails, backwards)
    return float(_per_rank_group(config, tails).max())


def _per_rank_group(config: Config, per_stage: Sequence[float]) -> np.ndarray:
    """The sum of ``per_stage`` over each rank group's stages."""
    sums = np.zeros(config.num_rank_groups)
    for s, value in enumerate(per_stage):
        sums[config.rank_group_of(s)] += value
    return sums


def pipeline_tail_s(tails: Sequence[float], backwards: Sequence[float]) -> float:
    """``step_tail_s`` of a pipeline with one stage per rank group: ``max_s (tail_s - sum_{j<s} B_j)``."""
    ahead = np.concatenate(([0.0], np.cumsum(backwards[:-1])))
    return float(max(0.0, np.max(np.asarray(tails) - ahead)))


def _tails_and_backwards(costs: StageCosts, boundaries: Sequence[int]) -> tuple[list[float], list[float]]:
    pairs = list(zip(boundaries[:-1], boundaries[1:]))
    return [float(costs.tail[j, i]) for j, i in pairs], [float(costs.backward[j, i]) for j, i in pairs]


def search(
    blocks_at: Callable[[int], BlockCosts],
    options: SearchOptions,
    cluster,
    num_blocks: int,
    *,
    num_best: int | None = None,
    cache: SearchCache | None = None,
    step_to_beat: float = float("inf"),
) -> list[Candidate]:
    """All configs' best candidates, sorted by estimate (ties broken by a fixed key).

    Configs whose parameters and optimizer state alone cannot fit (even spread evenly over the
    rank groups) are skipped. With ``num_best``, the search is pruned (branch and bound) and
    returns only the candidates whose estimate is at most ``bound``, the ``num_best``-th smallest
    estimate of a candidate with one stage per rank group (v = 1: its plan's exact memory check
    normally agrees with the search's), or all when there are fewer such candidates: configs are visited
    from the smallest lower bound on their estimate, and once the bound is known a config whose
    lower bound exceeds it is skipped. The result equals the full list cut at ``bound``.
    ``cache`` (``SearchCache``): what an earlier search of the same run found, reused.
    ``step_to_beat``: the step of a plan found elsewhere (another tensor-parallel degree): configs
    whose lower bound exceeds it cannot beat that plan, and are skipped; so are the candidates whose
    estimate less its tail (``Candidate.tail_s``) exceeds it, for ZB-V less the fill and drain
    that its weight-gradient passes fill as well (``rounds_s``) among the configs searched.
    """
    cache = SearchCache() if cache is None else cache
    configs = [
        c for c in enumerate_configs(options, num_blocks) if cache.may_fit(blocks_at(c.microbatch_size), c, options)
    ]
    if num_best is not None:
        configs.sort(key=lambda c: _estimate_lower_bound(blocks_at(c.microbatch_size), c))
    found: list[Candidate] = []
    best_v1: list[float] = []  # max-heap (negated) of the num_best smallest v = 1 estimates
    bound = float("inf")
    for config in configs:
        blocks = blocks_at(config.microbatch_size)
        if _estimate_lower_bound(blocks, config) > min(bound, step_to_beat):
            break  # configs are sorted by this lower bound: every later one is pruned too
        if config.virtual_stages == 1 and _split_lower_bound(blocks, config, cache) > min(bound, step_to_beat):
            continue  # none of its candidates would be kept: each estimate (less its tail) exceeds the bound
        candidates = search_config(blocks_at(config.microbatch_size), config, options, cluster, cache)
        found.extend(candidates)
        if num_best is not None and config.virtual_stages == 1:
            for c in candidates:
                heapq.heappush(best_v1, -c.estimate_s)
                if len(best_v1) > num_best:
                    heapq.heappop(best_v1)
            if len(best_v1) == num_best:
                bound = -best_v1[0]
    # Against another plan's simulated step, without the tail: the closed form overestimates it
    # where several stages share a rank group (every group's whole tail counted), and a candidate
    # estimated a little above a step found at another degree may still simulate below it.
    found = [c for c in found if c.estimate_s <= bound and rounds_s(c) <= step_to_beat]
    found.sort(key=sort_key)
    return found


def _may_fit(blocks: BlockCosts, config: Config, options: SearchOptions) -> bool:
    """False when the parameters, gradients and optimizer state of the whole model, spread evenly
    over the rank groups (and sharded as far as the options allow, nothing gathered), exceed the
    memory limit: the fullest rank group holds at least that."""
    k = blocks.num_blocks
    sharded = config.replicas > 1 and options.sharding is not Sharding.REPLICATE
    params, trainable = int(blocks.param_bytes_matrix[0, k]), int(blocks.trainable_bytes_matrix[0, k])
    spread = spread_state_bytes(
        params, trainable, config.num_rank_groups, config.replicas, sharded, options, foreach_step=blocks.foreach_step
    )
    return spread <= options.memory_limit_bytes


def spread_state_bytes(
    param_bytes: int,
    trainable_bytes: int,
    num_rank_groups: int,
    replicas: int,
    sharded: bool,
    options: SearchOptions,
    *,
    foreach_step: bool,
) -> int:
    """``_may_fit``'s memory: the whole model's parameters, gradients and optimizer state spread
    evenly over ``num_rank_groups`` groups of ``replicas`` (``sharded``: state sharded over them,
    nothing gathered), with no activations; ``foreach_step``: ``BlockCosts.foreach_step`` (a
    foreach step's temporaries are a share of the state as well)."""
    g = num_rank_groups
    memory = memory_from_totals(
        param_bytes=param_bytes // g,
        trainable_bytes=trainable_bytes // g,
        activation_bytes=0,
        stage_input_bytes=0,
        boundary_bytes=0,
        largest_output_bytes=0,
        in_flight=0,
        optimizer=options.optimizer,
        recompute=Recompute.NONE,
        precision=options.precision,
        # the least memory any allowed level needs: nothing gathered, state sharded where allowed
        sharding=Sharding.FULL_SHARD if sharded else Sharding.REPLICATE,
        num_replicas=replicas if sharded else 1,
        gathered_trainable_bytes=0,
        foreach_step=foreach_step,
    )
    return int(memory.total_bytes)


def _estimate_lower_bound(blocks: BlockCosts, config: Config) -> float:
    """A bound no candidate of ``config`` beats: with W the compute of the whole chain per
    micro-batch, plus what the config's recomputation mode adds to every stage (``StageCosts``:
    a fixed mode recomputes in every stage; None, the least level per stage, adds at least
    nothing), every rank-group load L_g >= its stages' share of W, so max L_g >= W / G and sum
    L_g >= W: one stage per group, (m - 1) max L_g + sum L_g >= (m - 1) W / G + W; v stages,
    m max L_g + (G - 1) max L_g / v >= (m + (G - 1) / v) W / G (``estimate_step``; a hair
    lower, for rounding)."""
    total = float(blocks.forward_s.sum() + blocks.backward_s.sum())
    if config.recompute_mode is not None:
        mode = config.recompute_mode
        total += float(extra_backward_s(mode, blocks.forward_s.sum(), blocks.selective_recompute_s.sum()))
    m, g, v = config.num_microbatches, config.num_rank_groups, config.virtual_stages
    if v == 1:
        return ((m - 1) * total / g + total) * (1 - 1e-9)
    return (m + (g - 1) / v) * total / g * (1 - 1e-9)


def rounds_s(candidate: Candidate) -> float:
    """What ``search`` holds against a step found elsewhere: the estimate less its tail, and for
    ZB-V less interleaved 1F1B's fill and drain too, ``m / (m + (G - 1) / v)`` of it. ZB-V fills
    those with its weight-gradient passes (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR
    2024: a bubble of about ``(G - 1)(F + B - 2W)``, near none when a backward splits evenly into
    input and weight gradients), which the closed form does not model: 145B's best ZB-V candidate
    (bench/_megatron.py, TP 4, 21 groups, m = 128) was estimated at 17.12 s and simulated at
    16.15 s, and was dropped against another degree's plan simulated at 16.39 s. Configs are still
    skipped by their estimate's bound (``_estimate_lower_bound``): a ZB-V one that it skips may
    have such a candidate, but lowering that bound for ZB-V had 175B's search (bench/plan_time.py)
    try twice the configs."""
    rounds, config = candidate.estimate_s - candidate.tail_s, candidate.config
    if config.schedule is Schedule.ZBV:
        m = config.num_microbatches
        rounds *= m / (m + (config.num_rank_groups - 1) / config.virtual_stages)
    return rounds


def _split_lower_bound(blocks: BlockCosts, config: Config, cache: SearchCache) -> float:
    """``_estimate_lower_bound`` of a config with one stage per rank group, with the chain's
    granularity: its busiest stage costs at least the smallest compute bottleneck of a split into
    G stages (``SearchCache.bottleneck_floor``), so its estimate is at least (m - 1) B_G + T."""
    total = float(blocks.forward_s.sum() + blocks.backward_s.sum())
    floor = cache.bottleneck_floor(blocks, config.num_rank_groups)
    return ((config.num_microbatches - 1) * floor + total) * (1 - 1e-9)


def sort_key(c: Candidate) -> tuple:
    cfg = c.config
    return (
        c.estimate_s,
        cfg.num_rank_groups,
        cfg.replicas,
        cfg.stage_replicas,
        cfg.schedule.value,
        cfg.virtual_stages,
        cfg.num_microbatches,
        -1 if cfg.recompute_mode is None else cfg.recompute_mode.order,
        c.boundaries,
    )


def config_step_floor(
    blocks: BlockCosts, config: Config, options: SearchOptions, cluster, *, block_splits: bool = True
) -> float:
    """A step that no plan of ``config`` simulates below, refined ones included: every rank group
    computes m L_g (``partita.planning.plan_builder.step_lower_bound_s``), so the step is at least m
    times the busiest group's load. With one stage per group and ``block_splits`` (splits at
    block boundaries, as the search and the refinement make them) that is at least m times the
    smallest bottleneck of any split, each stage recomputing where nothing fits without (the
    bottleneck DP on those loads); otherwise (several stages per group, or any split of the
    nodes) at least m times the whole chain's load over the groups, with what every stage
    recomputes when all stages recompute. A hair lower, for rounding. 0 for uneven configs."""
    if config.stage_replicas:
        return 0.0
    m, g, v = config.num_microbatches, config.num_rank_groups, config.virtual_stages
    mode = options.recompute if config.recompute_mode is None else config.recompute_mode
    total = float(blocks.forward_s.sum() + blocks.backward_s.sum())
    if v > 1 or not block_splits or g > blocks.num_blocks:
        again = (
            0.0 if mode is None else extra_backward_s(mode, blocks.forward_s.sum(), blocks.selective_recompute_s.sum())
        )
        return m * (total + float(again)) / g * (1 - 1e-9)
    costs = StageCosts(blocks, config, options, cluster)
    work = []
    for stage in range(g):
        time, chosen = costs.cost_at(microbatches_in_flight(config.schedule, m, g, stage, 1))
        work.append(np.where(np.isfinite(time), costs.compute + costs.extra_s(chosen), np.inf))
    floor = min_bottleneck(lambda s: work[s], blocks.num_blocks, g, blocks.stage_totals["work_prefix_s"])
    return m * max(floor, total / g) * (1 - 1e-9)
