"""A lower bound on every plan's memory per device: "nothing fits" answered without searching.

The search (``partita.planning.search``, ``uneven``) tries every split of the chain of blocks, replica
count, micro-batch count, schedule, recomputation and sharding level, and the exact memory model
(``partita.cost.memory``) rejects what does not fit. This module evaluates the same memory formula
with every saving the search has at once, so that its answer is below what any plan needs:

    micro-batch 1         activations, cut and output bytes of the tables at micro-batch 1; a replica
                          that runs n = B / r samples per step keeps at least the bytes of n samples
                          at its peak when no backward runs before it (m <= in flight, the only way
                          to keep the first gradients alone: GPipe, 1F1B drained), else one
                          micro-batch's (``_Scaled``);
    in flight             at least one micro-batch (every schedule's ``microbatches_in_flight``);
    recomputation         every level the options and schedules allow (ZBV never recomputes);
    sharding              every level the options allow at r replicas (one replica: replicate),
                          sharded levels with sharded gradient accumulation (the fewer gradients);
    replicas              every r that divides the global batch, up to the devices (groups);
    stages                any split into ranges of blocks: the smallest stage is one block.

Three tests, on ``units`` (devices, or tensor-parallel groups of ``t`` devices; ``PlanningContext``):

    block      every block fits a device as part of its cheapest stage: ``min_r min_{[j,i) ∋ k}
               M_r[j, i] <= L`` for each block k, with the first gradients at their smallest (any
               stage containing k, on any schedule, needs at least this);
    one stage per rank group (GPipe, 1F1B; uniform and uneven replicas): a cover of the chain by
               ranges that fit. Uniform: for an r dividing the batch, the fewest ranges with
               ``M_r <= L`` times r is at most the units. Uneven (up to ``uneven.MAX_DEVICES``): the
               fewest devices, each range taking the smallest r with which it fits
               (``D[i] = min_j D[j] + r_min[j, i] <= units``); beyond, the uneven search
               starts from the uniform search's plans (``uneven.seed_shapes``), so the uniform
               cover decides;
    several stages per rank group (interleaved 1F1B with v stages per group, ZB-V with 2; uniform):
               G rank groups hold vG ranges, one from each chunk of G consecutive ranges
               (interleaved: g, G + g, ..., (v - 1) G + g; ZB-V: g and 2G - 1 - g). A group needs
               at least the additive parts of its ranges (state of the parameters each range reads
               first, activations, boundaries, all gradients or a sharded level's share) plus the per-range maxima (gathered
               parameters, working memory, first gradients, optimizer temporaries) of any one of
               them (the group's maximum of each is at least that range's), so the groups'
               memories sum to at least the additive parts of all ranges plus the per-range maxima
               of the ranges of any one chunk; the backward and the optimizer-step peak are bounded
               apart (their larger one is at least either). With ``g`` those sums per range, any
               plan of G groups needs ``min over splits of g-sums <= G L``, for each chunk. The
               first and the last chunk are taken: DPs over the chain from its start and from its
               end (``half_sums``) give the least sums of c ranges with and without maxima for
               every c at once, so each G costs one minimum over where the chunk ends or starts
               (``groups_least``); a middle chunk would need a DP per G, and the chain's ends
               (embedding, head) hold its largest maxima.

``M_r[j, i]`` is ``memory_from_totals`` on the exact totals of range [j, i) at the settings above,
minimised over them. The bound never refuses what the search can find (tests/unit/test_memory_bound.py
checks it against the search); it may let through what the search then rejects (pipelines whose
depth leaves too many micro-batches in flight, tied weights that must replicate, ...).

Only analytic tables are bounded: measured activation bytes need not grow with the micro-batch
as the analytic ones do (``MemoryBound.applies``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from partita.cost.memory import ALLREDUCE_BUCKET_BYTES, memory_from_totals
from partita.planning.chain import block_costs
from partita.planning.options import recompute_allowed
from partita.planning.range_matrices import range_sums
from partita.planning.sharding import levels
from partita.planning.uneven import MAX_DEVICES as UNEVEN_MAX_DEVICES
from partita.types import RECOMPUTE_LEVELS, Accumulation, MemoryBreakdown, Precision, Recompute, Schedule, Sharding

__all__ = ["BlockNeed", "MemoryBound", "divisors"]

ONE_STAGE = tuple(s for s in Schedule if s.one_stage_per_rank_group)
SEVERAL_STAGES = tuple(s for s in Schedule if not s.one_stage_per_rank_group)
# Per tensor, the bytes of b samples may round below b times one sample's by a few bytes (floor
# and ceil divisions in partita.cost.table): this many bytes per node and sample are given up.
_ROUNDING_BYTES = 8
# Weights of the backward peak against the optimizer step's in the several-stage test.
PEAK_WEIGHTS = (1.0, 0.0)
# The range totals of ``BlockCosts.stage_totals`` that the bound's memory formula takes as they are
# (the first gradients are set apart: the bound also takes their smallest).
_RANGE_TOTALS = (
    "param_bytes",
    "trainable_bytes",
    "activation_bytes",
    "saved_bytes",
    "stage_input_bytes",
    "boundary_bytes",
    "largest_output_bytes",
    "largest_param_bytes",
    "foreach_step",
)
# What a bound computes from the cost tables alone (shared by bounds that differ in options only).
_TABLE_FIELDS = (
    "applies",
    "num_blocks",
    "valid",
    "per_sample_cut",
    "nodes",
    "totals",
    "per_sample_activation",
    "per_sample_saved",
    "first_grad",
    "least_first_grad",
    "own_trainable",
    "own_frozen",
    "segments",
)


@dataclass(frozen=True)
class BlockNeed:
    """The least memory a device holding ``block`` needs, and at which settings (the cheapest stage
    containing it: blocks ``[start, stop)`` of the chain with ``replicas`` replicas)."""

    block: int
    needed_bytes: int
    start: int
    stop: int
    replicas: int
    sharding: Sharding
    recompute: Recompute
    breakdown: MemoryBreakdown


def _memoized(method):
    """Remember a method's results on its instance (a bound lives as long as one planning run)."""

    @functools.wraps(method)
    def remembered(self, *args, **kwargs):
        memo = self.__dict__.setdefault("_memo", {})
        key = (method.__name__, args, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = method(self, *args, **kwargs)
        return memo[key]

    return remembered


class MemoryBound:
    """The bound of one planning context (one tensor-parallel degree): see the module docstring.

    ``graph``, ``chain`` (block boundaries in node positions), ``costs_at`` and ``options`` (a
    ``SearchOptions``: units, batch, limit, pins) are the context's. Per replica count the range
    matrices are computed once; ``may_fit`` then answers for any unit count and limit."""

    def __init__(self, graph, chain, costs_at, options, *, like: MemoryBound | None = None):
        """``like``: a bound of the same graph, chain and costs (other options), whose tables are reused."""
        self.graph, self.options, self.costs_at = graph, options, costs_at
        self.chain = np.asarray(chain, dtype=np.int64)
        if like is not None and like.costs_at is costs_at and np.array_equal(like.chain, self.chain):
            self.__dict__.update({name: like.__dict__[name] for name in _TABLE_FIELDS if name in like.__dict__})
            return
        self.applies = costs_at(1).source == "analytic"
        if not self.applies:
            return
        one, two = block_costs(costs_at(1), self.chain), costs_at(2)
        two_activation = np.add.reduceat(np.asarray(two.activation_bytes, dtype=np.int64), self.chain[:-1])
        two_saved = np.add.reduceat(np.asarray(two.saved_bytes, dtype=np.int64), self.chain[:-1])
        two_cut = np.asarray(two.cut_bytes, dtype=np.float64)[self.chain]
        k = one.num_blocks
        self.num_blocks = k
        j, i = np.meshgrid(np.arange(k + 1), np.arange(k + 1), indexing="ij")
        ranges = one.stage_totals  # the search's own range totals at micro-batch 1
        self.valid = ranges["valid"]
        cut1 = one.cut_bytes.astype(np.float64)
        self.per_sample_cut = np.maximum(0.0, two_cut - cut1)[j]
        self.nodes = (self.chain[i] - self.chain[j]).astype(np.float64)
        self.totals = {name: ranges[name] for name in _RANGE_TOTALS}
        self.per_sample_activation = range_sums(np.maximum(0, two_activation - one.activation_bytes))
        self.per_sample_saved = range_sums(np.maximum(0, two_saved - one.saved_bytes))
        self.first_grad = ranges["first_grad_bytes"]
        self.segments = ranges["segments"]  # per-block terms at micro-batch 1: below any size's
        nonzero = one.last_grad_bytes[one.last_grad_bytes > 0]
        self.least_first_grad = float(nonzero.min()) if len(nonzero) else 0.0
        self.own_trainable, self.own_frozen = _own_param_matrices(costs_at(1), self.chain)

    # ------------------------------------------------------------------ the choices searched

    @functools.cached_property
    def stages_per_group(self) -> tuple[int, ...]:
        """The stage counts per rank group of the several-stage schedules searched (ZB-V: 2;
        interleaved 1F1B: ``SearchOptions.interleaved_virtual_stages``), as ``configs._schedules``."""
        counts = set()
        for schedule in self.options.schedules:
            if schedule is Schedule.ZBV:
                counts.add(2)
            elif schedule is Schedule.INTERLEAVED_1F1B:
                counts.update(self.options.interleaved_virtual_stages)
        return tuple(sorted(counts))

    @functools.cached_property
    def recompute_modes(self) -> dict[bool, tuple[Recompute, ...]]:
        """Recomputation levels of one-stage (False) and several-stage (True) schedules."""
        pinned = self.options.recompute
        modes = {}
        for several, family in ((False, ONE_STAGE), (True, SEVERAL_STAGES)):
            allowed = [s for s in self.options.schedules if s in family]
            can = any(recompute_allowed(s) for s in allowed)
            if not allowed:
                modes[several] = ()
            elif pinned is not None:
                modes[several] = (pinned,) if can or pinned is Recompute.NONE else ()
            else:
                modes[several] = RECOMPUTE_LEVELS if can else (Recompute.NONE,)
        return modes

    def replica_counts(self, num_units: int) -> list[int]:
        """Replica counts the search may give a stage: dividing the batch (``enumerate_configs``)."""
        batch, pinned = self.options.global_batch_size, self.options.replicas
        if pinned is not None:
            return [pinned] if pinned <= num_units and batch % pinned == 0 else []
        return [r for r in divisors(batch) if r <= num_units]

    # ------------------------------------------------------------------ per replica count

    @_memoized
    def stage_memory(self, replicas: int, *, least_first_grad: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(M_r: the least bytes of a device holding range [j, i) as one stage of ``replicas``
        replicas, inf where j >= i; the index of the settings that give it, ``settings``).
        ``least_first_grad``: the first gradients at the chain's smallest (a bound for any stage
        containing the range)."""
        best = np.full(self.valid.shape, np.inf)
        which = np.zeros(self.valid.shape, dtype=np.int64)
        for index, setting in enumerate(self.settings(replicas)):
            total = self._memory(replicas, *setting, least_first_grad=least_first_grad).total_bytes
            better = total < best
            best, which = np.where(better, total, best), np.where(better, index, which)
        return np.where(self.valid, best, np.inf), which

    def settings(self, replicas: int) -> list[tuple[Sharding, Recompute, bool]]:
        """(level, recompute, drained) of every setting a stage of ``replicas`` replicas may take
        on a one-stage schedule; drained: no backward before the activation peak."""
        modes = self.recompute_modes[False] or self.recompute_modes[True]
        return [
            (level, rc, drained)
            for level in levels(self.options.sharding, replicas)
            for rc in modes
            for drained in (True, False)
        ]

    def _memory(self, r: int, level: Sharding, recompute: Recompute, drained: bool, *, least_first_grad: bool):
        n = self.options.global_batch_size // r
        samples = _Scaled(self, n)
        activation, stage_input, saved = (
            self.totals[k] for k in ("activation_bytes", "stage_input_bytes", "saved_bytes")
        )
        if drained:  # m <= in flight: m micro-batches of n / m samples are all in flight at the peak
            if recompute is Recompute.NONE:
                activation = samples.activation
            else:  # what each micro-batch keeps scales; one micro-batch's rebuilt tensors do not
                stage_input, saved = samples.stage_input, samples.saved
        first = np.full(self.valid.shape, self.least_first_grad) if least_first_grad else self.first_grad
        trainable = self.totals["trainable_bytes"]
        return memory_from_totals(
            **{**self.totals, "activation_bytes": activation, "stage_input_bytes": stage_input, "saved_bytes": saved},
            in_flight=1,
            optimizer=self.options.optimizer,
            recompute=recompute,
            precision=self.options.precision,
            sharding=level,
            num_replicas=r,
            num_microbatches=1 if drained else 2,
            first_grad_bytes=first,
            gathered_trainable_bytes=trainable if level is Sharding.FULL_SHARD else None,
            segments=self.segments,
            # the least gradients a sharded stage may hold (Accumulation: never more than whole's)
            accumulation=Accumulation.WHOLE if level is Sharding.REPLICATE else Accumulation.SHARDED,
        )

    @_memoized
    def group_share(self, replicas: int, weight: float, maxima: bool) -> np.ndarray:
        """g[j, i]: range [j, i)'s least share of a several-stage rank group's memory (module docstring):
        its additive parts, with its per-range maxima when ``maxima``; the backward peak weighted
        ``weight`` and the optimizer step's ``1 - weight`` (the larger of the two peaks is at least
        any such mean, which, unlike the larger, adds up over ranges)."""
        o, r = self.options, replicas
        k = o.optimizer.states_per_parameter
        own, frozen, held = self.own_trainable, self.own_frozen, self.totals["trainable_bytes"].astype(np.float64)
        samples = _Scaled(self, o.global_batch_size // r)
        half = 0.5 if o.precision is Precision.BF16 else 0.0
        use = 1.0 if maxima else 0.0
        best = np.full(self.valid.shape, np.inf)
        for level in levels(o.sharding, r):
            sharded = level is not Sharding.REPLICATE and r > 1
            full = sharded and level is Sharding.FULL_SHARD
            s = r if sharded else 1
            state = frozen + (0 if sharded else own) + k * own / s + (own / s if sharded else 0)
            # gathered in bf16 in bf16 plans (FSDP2's param_dtype), where autocast then casts nothing;
            # full_shard gathers a range's root unit and two blocks at a time (segment_memory)
            gathered_add = (1 - half) * own if sharded and not full else 0 * own
            copies_add = 0 * own if sharded else half * own
            bucket = np.minimum(held, ALLREDUCE_BUCKET_BYTES) if r > 1 and not sharded else 0 * own
            gathered_max = (1 - half) * self.segments.gathered if full else 0 * own
            fixed_max = gathered_max + bucket + 2 * self.totals["largest_output_bytes"]
            if not k:
                step = own / s
            elif self.totals["foreach_step"]:  # one state's worth (partita.cost.memory): it adds up
                step = 2 * own / s
            else:
                step = own / s + use * 2 * self.totals["largest_param_bytes"] / s
            by_block = self.segments
            for rc in self.recompute_modes[True]:
                for drained in (True, False):
                    # recomputing by block: each segment's input kept (at micro-batch 1, below any
                    # size's), one segment rebuilt at a time (a per-range maximum)
                    if rc is Recompute.FULL:
                        kept = by_block.kept_inputs + use * by_block.full_rebuilding
                    elif rc is Recompute.SELECTIVE:
                        saved = samples.saved if drained else self.totals["saved_bytes"]
                        kept = by_block.kept_inputs + saved + use * by_block.selective_rebuilding
                    else:
                        kept = samples.activation if drained else self.totals["activation_bytes"]
                    # sharded accumulation holds a 1/r share of the gradients (and one unit's: a maximum)
                    grads_add = 0 * own if drained else own / s
                    grads_max = np.where(held > 0, self.least_first_grad, 0.0) if drained else 0 * own
                    backward = gathered_add + copies_add + kept + self.totals["boundary_bytes"] + grads_add
                    backward = backward + use * (fixed_max + grads_max)
                    best = np.minimum(best, state + weight * backward + (1 - weight) * step)
        return np.where(self.valid, best, np.inf)

    def half_sums(self, replicas: int, weight: float, maxima: bool, from_end: bool, pieces: int) -> np.ndarray:
        """[c, i]: the least sum of ``group_share`` over c ranges covering blocks [0, i) (or, from the
        end, [i, K)), c = 0 .. pieces; inf where impossible. E_c[i] = min_j E_{c-1}[j] + g[j, i].
        Row c does not depend on how many rows follow: the rows are remembered and extended when
        more pieces are asked for (the bound asks for many depths per replica count)."""
        remembered = self.__dict__.setdefault("_half_sums", {})
        key = (replicas, weight, maxima, from_end)
        k = self.num_blocks
        rows = remembered.get(key)
        if rows is None:
            rows = np.full((1, k + 1), np.inf)
            rows[0, k if from_end else 0] = 0.0
        if len(rows) <= pieces:
            g = self.group_share(replicas, weight, maxima)
            done = len(rows)
            rows = np.concatenate([rows, np.full((pieces + 1 - done, k + 1), np.inf)])
            for c in range(done, min(pieces, k) + 1):  # c - 1 ranges cover c - 1 blocks at least: the rest is inf
                if from_end:
                    stop = k - c + 2
                    rows[c] = np.min(g[:, :stop] + rows[c - 1][None, :stop], axis=1)
                else:
                    rows[c] = np.min(rows[c - 1][c - 1 :, None] + g[c - 1 :], axis=0)
        remembered[key] = rows
        return rows[: pieces + 1]

    @_memoized
    def groups_least(self, replicas: int, most_groups: int, stages_per_group: int) -> np.ndarray:
        """[G]: the least total memory of G rank groups of ``replicas`` replicas holding v =
        ``stages_per_group`` stages each, G = 0 .. ``most_groups``. The chain splits into vG ranges,
        and each rank group holds one range of each chunk of G consecutive ones (interleaved: g, G +
        g, ...; ZB-V: g and 2G - 1 - g), so the groups' maxima sum to at least those of the first
        chunk's ranges, and to at least those of the last chunk's (the other ranges counted by
        their additive parts alone)."""
        counts, rest = np.arange(most_groups + 1), (stages_per_group - 1) * most_groups
        others = (stages_per_group - 1) * counts  # the ranges outside the chunk, for each G
        least = np.zeros(most_groups + 1)
        for weight in PEAK_WEIGHTS:
            sums = functools.partial(self.half_sums, replicas, weight)  # (maxima, from_end, pieces)
            first = sums(True, False, most_groups)[counts] + sums(False, True, rest)[others]
            last = sums(False, False, rest)[others] + sums(True, True, most_groups)[counts]
            least = np.maximum(least, np.maximum(first.min(axis=1), last.min(axis=1)))
        return least

    @_memoized
    def needs_at(self, replicas: int) -> np.ndarray:
        """Per block, the least bytes a device holding it needs in a stage of ``replicas`` replicas,
        on any schedule (the first gradients at their smallest)."""
        return _containing_min(self.stage_memory(replicas, least_first_grad=True)[0])

    def blocks_fit_at(self, replicas: int, limit: int) -> bool:
        """Whether every block can fit ``limit`` in a stage of ``replicas`` replicas (else no plan
        with that replica count fits: the stage holding the neediest block cannot)."""
        return float(self.needs_at(replicas).max(initial=0.0)) <= limit

    @_memoized
    def block_needs(self, num_units: int) -> tuple[float, ...]:
        """Per block, the least bytes a device holding it needs (over replica counts up to ``num_units``)."""
        needs = np.full(self.num_blocks, np.inf)
        for r in self.replica_counts(num_units):
            needs = np.minimum(needs, self.needs_at(r))
        return tuple(float(v) for v in needs)

    def largest_block_need(self, num_units: int) -> BlockNeed | None:
        """The block that needs the most (``block_needs``), with the settings of its least need."""
        needs = self.block_needs(num_units)
        if not needs or not np.isfinite(min(needs)):
            return None
        block = int(np.argmax(needs))
        for r in sorted(self.replica_counts(num_units), reverse=True):
            if self.needs_at(r)[block] <= needs[block]:
                return self._block_need(block, r, needs[block])
        raise AssertionError("the least need comes from some replica count")

    def _block_need(self, block: int, r: int, needed: float) -> BlockNeed:
        memory, which = self.stage_memory(r, least_first_grad=True)
        rows, cols = np.meshgrid(np.arange(block + 1), np.arange(block + 1, self.num_blocks + 1), indexing="ij")
        flat = np.argmin(memory[rows, cols])
        start, stop = int(rows.flat[flat]), int(cols.flat[flat])
        level, rc, drained = self.settings(r)[int(which[start, stop])]
        exact = self._memory(r, level, rc, drained, least_first_grad=True)
        pick = {name: getattr(exact, name) for name in exact.__dataclass_fields__}
        scalar = {
            name: (v if v is None or np.ndim(v) == 0 else int(np.asarray(v)[start, stop])) for name, v in pick.items()
        }
        breakdown = type(exact)(**scalar).breakdown()
        return BlockNeed(block, int(needed), start, stop, r, level if r > 1 else Sharding.REPLICATE, rc, breakdown)

    # ------------------------------------------------------------------ the tests

    def may_fit(self, num_units: int | None = None, limit_bytes: int | None = None) -> bool:
        """False only when no plan of the search fits ``num_units`` (default: the context's) devices
        or groups of ``limit_bytes`` (default: the context's limit) each."""
        if not self.applies:
            return True
        units = self.options.num_devices if num_units is None else num_units
        limit = self.options.memory_limit_bytes if limit_bytes is None else limit_bytes
        if max(self.block_needs(units), default=0.0) > limit:
            return False
        return self.fits_one_stage(units, limit) or self.fits_several_stages(units, limit)

    def fewest_units(self, limit: int, valid, most: int) -> int | None:
        """A count of units (at most ``most``) below which ``may_fit`` never holds at ``limit``: the
        least any of its tests asks for (None: none up to ``most``). ``valid(count, r)``: the smallest
        count >= ``count`` that the cluster can have and ``r`` divides (None: none)."""
        if not self.applies:
            return None
        wanted = []
        k = self.num_blocks
        for r in self.replica_counts(most):
            if self.recompute_modes[False] and self.blocks_fit_at(r, limit):
                ranges = self.fewest_ranges(r, limit)
                if np.isfinite(ranges):
                    wanted.append((int(ranges) * r, r))
            for v in self.stages_per_group if self.recompute_modes[True] else ():
                top = min(k // v, most // r)
                least = self.groups_least(r, top, v) if top >= 2 and self.blocks_fit_at(r, limit) else np.zeros(0)
                groups = [g for g in range(2, len(least)) if least[g] <= g * limit]
                if groups:
                    wanted.append((min(groups) * r, r))
        if not self.options.uniform_replicas and self.options.replicas is None:
            devices = self.fewest_uneven_units(min(most, UNEVEN_MAX_DEVICES), limit)
            if devices <= UNEVEN_MAX_DEVICES:
                wanted.append((int(devices), 1))
        step = (lambda r: 1) if self.options.replicas is not None else (lambda r: r)  # pinned: r need not divide
        counts = [c for want, r in wanted if (c := valid(want, step(r))) is not None and c <= most]
        return min(counts, default=None)

    def least_limit(self, num_units: int | None = None) -> int | None:
        """The least memory limit (to 0.1%) with which ``may_fit`` holds on ``num_units``."""
        if not self.applies:
            return None
        low = high = self.options.memory_limit_bytes
        for _ in range(64):
            if self.may_fit(num_units, high):
                break
            low, high = high, high * 2
        else:
            return None
        while high - low > max(1, high // 1000):
            mid = (low + high) // 2
            low, high = (low, mid) if self.may_fit(num_units, mid) else (mid, high)
        return high

    def fits_one_stage(self, units: int, limit: int) -> bool:
        if not self.recompute_modes[False]:
            return False
        pinned = self.options.num_stages
        for r in self.replica_counts(units):
            if not self.blocks_fit_at(r, limit):
                continue
            ranges = self.fewest_ranges(r, limit)
            if ranges * r <= units and (pinned is None or ranges <= pinned <= min(units // r, self.num_blocks)):
                return True
        if not self.options.uniform_replicas and units <= UNEVEN_MAX_DEVICES and self.options.replicas is None:
            return self.fewest_uneven_units(units, limit) <= units
        return False

    @_memoized
    def fewest_ranges(self, replicas: int, limit: int) -> float:
        """The fewest ranges of blocks that cover the chain, each fitting ``limit`` at ``replicas``."""
        fits = self.stage_memory(replicas)[0] <= limit
        count = np.full(self.num_blocks + 1, np.inf)
        count[0] = 0
        for i in range(1, self.num_blocks + 1):
            count[i] = np.min(np.where(fits[:i, i], count[:i], np.inf)) + 1
        return float(count[-1])

    def fewest_uneven_units(self, units: int, limit: int) -> float:
        """The fewest devices of a one-stage-per-group plan whose stages take their own replica counts."""
        least = np.full(self.valid.shape, np.inf)
        for r in sorted(self.replica_counts(units), reverse=True):
            least = np.where(self.stage_memory(r)[0] <= limit, r, least)
        devices = np.full(self.num_blocks + 1, np.inf)
        devices[0] = 0
        for i in range(1, self.num_blocks + 1):
            devices[i] = np.min(devices[:i] + least[:i, i])
        return float(devices[-1])

    def fits_several_stages(self, units: int, limit: int) -> bool:
        if not self.recompute_modes[True]:
            return False
        pinned = self.options.num_stages
        for v in self.stages_per_group:
            for r in self.replica_counts(units):
                most = min(units // r, self.num_blocks // v)
                groups = range(2, most + 1) if pinned is None else [pinned] if 2 <= pinned <= most else []
                if not groups or not self.blocks_fit_at(r, limit):
                    continue
                least = self.groups_least(r, most, v)
                if any(least[g] <= g * limit for g in groups):
                    return True
        return False


class _Scaled:
    """Lower bounds of a replica's bytes over n samples in m micro-batches (m b = n), all in flight:
    each tensor's bytes at b samples are at least b times one sample's (less rounding), and those
    that do not grow with the batch count once. From the tables at micro-batch 1 and 2."""

    def __init__(self, bound: MemoryBound, n: int):
        slack = _ROUNDING_BYTES * n * (bound.nodes + len(bound.graph.inputs) + 1)
        self.activation = np.maximum(
            bound.totals["activation_bytes"],
            bound.totals["activation_bytes"] + (n - 1) * bound.per_sample_activation - slack,
        )
        slack_cut = _ROUNDING_BYTES * n * (bound.graph.num_nodes + 1)
        self.stage_input = np.maximum(
            bound.totals["stage_input_bytes"],
            bound.totals["stage_input_bytes"] + (n - 1) * bound.per_sample_cut - slack_cut,
        )
        self.saved = np.maximum(
            bound.totals["saved_bytes"], bound.totals["saved_bytes"] + (n - 1) * bound.per_sample_saved - slack
        )


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _containing_min(matrix: np.ndarray) -> np.ndarray:
    """Per block k, the minimum of matrix[j, i] over ranges with j <= k < i."""
    down = np.minimum.accumulate(matrix, axis=0)  # [k, i] = min over j <= k
    k = matrix.shape[0] - 1
    right = np.minimum.accumulate(down[:, ::-1], axis=1)[:, ::-1]  # [k, i] = min over i' >= i
    return np.array([right[b, b + 1] for b in range(k)])


def _own_param_matrices(costs, chain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(trainable, frozen) bytes of the parameters and buffers first read in range [j, i): a range
    holds them, and disjoint ranges have disjoint such sets, so the bytes a rank group holds are at
    least the sum of its ranges' (a tied weight counts once, in the range of its first use)."""
    k = len(chain) - 1
    matrices = [np.zeros(k), np.zeros(k)]
    trainable = np.asarray(costs.param_trainable, dtype=bool)
    for p, uses in enumerate(costs.param_uses):
        if len(uses) == 0:
            continue
        first = int(np.searchsorted(chain, int(np.min(uses)), side="right")) - 1
        matrices[0 if trainable[p] else 1][first] += float(costs.param_bytes[p])
    return range_sums(matrices[0]), range_sums(matrices[1])
