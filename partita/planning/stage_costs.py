"""Time and memory of every possible stage of one config, as (K+1, K+1) matrices over the chain's
blocks (``StageCosts``): what :mod:`partita.planning.search` partitions, and what
:mod:`partita.planning.uneven` and :mod:`partita.planning.hetero_search` reuse.

A stage with several replicas takes, at each size, the fastest sharding level (and gradient
accumulation, ``partita.planning.sharding.accumulations``) that fits; recomputation only where
no level fits without it. The search module's docstring gives the rules per config.
"""

from __future__ import annotations

import numpy as np

from partita.cost.comm import p2p_time_s
from partita.cost.memory import MemoryByInFlight, microbatches_in_flight
from partita.cost.recompute import extra_backward_s
from partita.planning.chain import BlockCosts
from partita.planning.configs import Config, SearchOptions
from partita.planning.partition import stage_reach
from partita.planning.sharding import accumulations, levels, step_overhead_s
from partita.types import RECOMPUTE_LEVELS, Accumulation, Recompute, Sharding

__all__ = ["StageCosts", "rank_groups_span_nodes"]


class StageCosts:
    """Time and memory of every possible stage ``[j, i)`` of one config, as (K+1, K+1) matrices.

    A stage with several replicas takes, at each size, the fastest sharding level that fits
    (``partita.planning.sharding``; recomputing only when no level fits without it, and then the
    least recomputation level with which one fits): its time is its compute, plus what that
    recomputation adds to its backward, plus what that sharding level's step overhead exceeds
    replicate's, spread over the m micro-batches (never less than its compute, which the search's
    lower bounds rely on)."""

    def __init__(self, blocks: BlockCosts, config: Config, options: SearchOptions, cluster):
        self.config, self.options = config, options
        ranges = blocks.stage_totals  # config-independent: shared by every config at this size
        forward, backward = ranges["forward_s"], ranges["backward_s"]
        self.forward, self.backward = forward, backward
        self.compute, self.valid = ranges["compute_s"], ranges["valid"]
        # seconds each recomputation level adds to a stage's backward per micro-batch
        self.extra = {level: extra_backward_s(level, forward, ranges["selective_recompute_s"]) for level in Recompute}
        self.unshared = ranges["valid"] & ~blocks.tied_matrix  # stages that may shard
        self.totals = {name: ranges[name] for name in _TOTALS}
        # Activation and gradient of the stage's output cross to the next stage once each.
        self.send = np.array([2 * p2p_time_s(float(c), cluster, same_node=True) for c in blocks.cut_bytes])
        self.levels = levels(options.sharding, config.replicas)
        self._spans = rank_groups_span_nodes(config, cluster)
        # Seconds per step replicate's gradient all-reduce (what the last backward does not hide) and
        # the optimizer step add to each stage, once per step: the step's tail (``step_tail_s``), and
        # the base of the other levels' penalties.
        self.tail = self._overhead(Sharding.REPLICATE, cluster)
        self.penalty = self._level_penalties(cluster)
        self._cache: dict[tuple[float, Recompute, Sharding], np.ndarray] = {}
        self._memory: dict[tuple[Recompute, Sharding, Accumulation], MemoryByInFlight] = {}
        self._costs: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        self._reach: dict[float, int] = {}

    def _overhead(self, level: Sharding, cluster, accumulation: Accumulation = Accumulation.WHOLE) -> np.ndarray:
        """``step_overhead_s`` of every stage range under ``level`` and ``accumulation``."""
        c, o = self.config, self.options
        return step_overhead_s(
            level,
            accumulation=accumulation,
            trainable_bytes=self.totals["trainable_bytes"],
            forward_s=self.forward,
            backward_s=self.backward,
            num_microbatches=c.num_microbatches,
            num_replicas=c.replicas,
            precision=o.precision,
            optimizer=o.optimizer,
            cluster=cluster,
            spans_nodes=self._spans,
            segments=self.totals["segments"],
        )

    def _level_penalties(self, cluster) -> dict[tuple[Sharding, Accumulation], np.ndarray]:
        """Per level and accumulation, seconds per micro-batch its step overhead exceeds
        replicate's (>= 0): what sharding adds to every micro-batch of the stage (replicate's own
        is the step's tail)."""
        m = self.config.num_microbatches
        penalty = {(Sharding.REPLICATE, Accumulation.WHOLE): np.zeros_like(self.forward)}
        for level, accumulation in self._variants():
            if level is not Sharding.REPLICATE:
                overhead = self._overhead(level, cluster, accumulation)
                penalty[level, accumulation] = np.maximum(0.0, overhead - self.tail) / m
        return penalty

    def _variants(self) -> list[tuple[Sharding, Accumulation]]:
        """The (level, accumulation) pairs a stage of this config may take."""
        c = self.config
        return [(lv, acc) for lv in self.levels for acc in accumulations(lv, c.replicas, c.num_microbatches)]

    def nbytes(self) -> int:
        """Bytes of the matrices this StageCosts made (those of its BlockCosts are shared)."""
        arrays = [*self.extra.values(), *self.penalty.values(), self.tail, *self._cache.values()]
        arrays += [a for pair in self._costs.values() for a in pair]
        made = sum(a.nbytes for a in arrays if isinstance(a, np.ndarray))
        return made + sum(memory.nbytes() for memory in self._memory.values())

    def fits(
        self,
        in_flight: float,
        recompute: Recompute,
        level: Sharding = Sharding.REPLICATE,
        accumulation: Accumulation = Accumulation.WHOLE,
    ) -> np.ndarray:
        key = (in_flight, recompute, level, accumulation)
        if key not in self._cache:
            memory = self._memory.get((recompute, level, accumulation))
            if memory is None:
                memory = self._memory[recompute, level, accumulation] = MemoryByInFlight(
                    **self.totals,
                    optimizer=self.options.optimizer,
                    recompute=recompute,
                    precision=self.options.precision,
                    sharding=level,
                    num_replicas=self.config.replicas,
                    num_microbatches=self.config.num_microbatches,
                    accumulation=accumulation,
                )
            self._cache[key] = memory.total_bytes(in_flight) <= self.options.memory_limit_bytes
        return self._cache[key]

    def stage_cost(self, stage: int) -> tuple[np.ndarray, np.ndarray]:
        """(time matrix with inf where infeasible, matrix of the recomputation level chosen, as its
        ``Recompute.order``) for stage ``stage``."""
        c = self.config
        return self.cost_at(
            microbatches_in_flight(
                c.schedule, c.num_microbatches, c.num_rank_groups, c.rank_group_of(stage), c.virtual_stages
            )
        )

    def cost_at(self, in_flight: float) -> tuple[np.ndarray, np.ndarray]:
        """``stage_cost`` of a stage that keeps ``in_flight`` micro-batches' activations: all that
        depends on the stage's position (remembered: stages at the same depth share it). Only the
        config's replicas, micro-batches and recompute mode enter, so configs that differ in
        schedule or depth alone may share one StageCosts (``partita.planning.uneven`` does).

        Without recomputation the time is the fastest fitting sharding level's; recomputation only
        where no level fits without it: the least recomputation level with which one fits (then
        again the fastest fitting sharding level), its recomputed seconds added. A config's own
        recomputation mode is the one level tried."""
        if in_flight not in self._costs:
            mode = self.config.recompute_mode
            time = np.full(self.valid.shape, np.inf)
            chosen = np.zeros(self.valid.shape, dtype=np.int8)
            for recompute in RECOMPUTE_LEVELS if mode is None else (mode,):
                fastest = self._fastest(in_flight, recompute) + self.extra[recompute]
                take = ~np.isfinite(time) & np.isfinite(fastest)
                time, chosen = np.where(take, fastest, time), np.where(take, recompute.order, chosen)
            self._costs[in_flight] = (time, chosen)
            self._reach[in_flight] = stage_reach(time)
        return self._costs[in_flight]

    def extra_s(self, chosen: np.ndarray) -> np.ndarray:
        """Seconds recomputation adds to each stage [j, i), at the levels of ``chosen`` (``cost_at``'s
        second matrix)."""
        return np.choose(chosen, [self.extra[level] for level in RECOMPUTE_LEVELS])

    def reach_at(self, in_flight: float) -> int:
        """The most blocks a stage that fits with ``in_flight`` micro-batches spans (``stage_reach``)."""
        if in_flight not in self._reach:
            self.cost_at(in_flight)
        return self._reach[in_flight]

    def _fastest(self, in_flight: float, recompute: Recompute) -> np.ndarray:
        """Compute + the smallest penalty over the levels that fit (inf where none does). A stage
        that shares a tied weight with another stage only replicates (``BlockCosts.tied_matrix``),
        under a pinned level too (as ``partita.planning.build`` places it; ``partita.plan`` refuses a
        plan where the pin then shards no stage). Before, a pin other than replicate left such a
        stage no level: a tied GPT on several stages had no plan, and the error blamed memory."""
        best = np.full(self.valid.shape, np.inf)
        for level, accumulation in self._variants():
            ok = self.fits(in_flight, recompute, level, accumulation)
            ok &= self.valid if level is Sharding.REPLICATE else self.unshared
            best = np.where(ok, np.minimum(best, self.compute + self.penalty[level, accumulation]), best)
        if Sharding.REPLICATE not in self.levels:  # a pinned level: the stages that cannot take it replicate
            ok = self.fits(in_flight, recompute, Sharding.REPLICATE) & self.valid & ~self.unshared
            best = np.where(ok, np.minimum(best, self.compute), best)
        return best


def rank_groups_span_nodes(config: Config, cluster) -> bool:
    """Whether some rank group of ``config`` (group g: units [g r, (g + 1) r), nodes of
    ``devices_per_node`` units) crosses a node: ``partita.cost.comm.spans_nodes`` of every group
    at once, in the search's units."""
    per_node, r = cluster.devices_per_node, config.replicas
    return any(g * r // per_node != ((g + 1) * r - 1) // per_node for g in range(config.num_rank_groups))


# The memory totals of ``BlockCosts.stage_totals`` that ``memory_from_totals`` takes.
_TOTALS = (
    "param_bytes",
    "trainable_bytes",
    "activation_bytes",
    "saved_bytes",
    "stage_input_bytes",
    "boundary_bytes",
    "largest_output_bytes",
    "largest_param_bytes",
    "first_grad_bytes",
    "foreach_step",
    "segments",
)
