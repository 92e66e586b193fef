"""What the search may choose (``SearchOptions``) and the configs it tries (``Config``, ``Candidate``).

``SearchOptions`` is a ``PlanOptions`` resolved against one cluster and global batch
(``SearchOptions.from_plan_options``, the one place that derives it), plus the knobs only the
search has; ``enumerate_configs`` lists every config those options allow, in a fixed order.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from partita.checks import positive_int
from partita.errors import InputError
from partita.planning.options import PlanOptions, recompute_allowed
from partita.types import RECOMPUTE_LEVELS, OptimizerKind, Precision, Recompute, Schedule, Sharding
from partita.types.schedule_orders import check_schedule


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """What the search may choose; a non-None value pins that choice. Made from the user's
    ``PlanOptions`` by ``from_plan_options`` (the fields down to ``sharding`` are PlanOptions',
    resolved: no defaults of their own); the fields after them are the search's own knobs."""

    num_devices: int  # units to place: devices, or with tensor_parallel t > 1 groups of t devices
    global_batch_size: int
    memory_limit_bytes: int  # usable per device
    schedules: tuple[Schedule, ...]
    num_stages: int | None  # rank groups (pipeline depth in devices)
    replicas: int | None  # replicas per rank group (each of tensor_parallel devices)
    uniform_replicas: bool  # False: also search uneven replica counts (partita.planning.uneven)
    num_microbatches: int | None
    recompute: Recompute | None
    optimizer: OptimizerKind
    precision: Precision
    sharding: Sharding | None  # None: each stage's level is searched
    compile: bool = False  # blocks compiled, and costed so (``partita.planning.options.resolve_compile``)
    # stages per rank group of interleaved 1F1B (torch's ScheduleInterleaved1F1B runs any count):
    # 3 against 2 shrinks the fill and drain ((G - 1) / v of a group's load) and the first group's
    # activations in flight (about 4G/3 micro-batches of its share, not 3G/2:
    # partita.cost.memory.microbatches_in_flight), for more sends between stages. 5: Megatron's
    # 530B GPT (105 layers) on 21 groups of 5 one-layer stages, 37.96 s against 39.48 s for its
    # best plan of 35 groups x 3 (bench/scale_prediction.py); 4 and 6-8 found no faster plan for
    # any row of that bench and took 1T's search from 25 to 30-32 s
    interleaved_virtual_stages: tuple[int, ...] = (2, 3, 5)
    # the tensor-parallel degree of the costs searched (partita.planning.tensor_parallel): the
    # search places groups of this many devices, as if each were one device
    tensor_parallel: int = 1
    sequence_parallel: bool = False  # whether those costs split the groups' whole regions by token too
    # False: replica counts that divide the units (every unit used when the depth allows); True:
    # only those that divide the batch but not the units (G r < N, some units idle), searched as
    # a context of their own (``partita.planning.api``), so they never displace the first kind
    idle_units: bool = False
    max_microbatch_choices: int = 6
    candidates_per_config: int = 3
    # True: a plan of partita's own must honour a pinned sharding level other than replicate (some
    # stage has it; ``plan_builder.honours_pins``); False, only to tell why none does
    # (``partita.planning.api``): the fastest plans may all hold tied weights on every stage
    sharding_must_apply: bool = True

    def __post_init__(self) -> None:
        if self.recompute is not None:  # a bool pins full / none
            object.__setattr__(self, "recompute", Recompute.parse(self.recompute))

    @classmethod
    def from_plan_options(
        cls,
        options: PlanOptions,
        *,
        num_devices: int,
        global_batch_size: int,
        memory_limit_bytes: int,
        precision: Precision,
        compile: bool = False,
        **knobs: Any,
    ) -> SearchOptions:
        """The search's options for ``options`` (validated by PlanOptions) on ``num_devices`` units
        of ``memory_limit_bytes`` each, at ``global_batch_size``; ``precision``: the one the plan
        computes in (``partita.planning.options.resolve_precision``); ``compile``: whether its blocks are
        compiled (``resolve_compile``); ``knobs``: the search's own
        fields. Unpinned ``uniform_replicas`` becomes True when the replicas are pinned (one count
        for every stage), else False (uneven counts searched where the search can)."""
        uniform = options.uniform_replicas
        return cls(
            num_devices=positive_int(num_devices, "num_devices"),
            global_batch_size=positive_int(global_batch_size, "global_batch_size"),
            memory_limit_bytes=memory_limit_bytes,
            schedules=options.schedules,
            num_stages=options.num_stages,
            replicas=options.replicas,
            uniform_replicas=options.replicas is not None if uniform is None else uniform,
            num_microbatches=options.num_microbatches,
            recompute=options.recompute,
            optimizer=options.optimizer,
            precision=Precision.parse(precision),
            sharding=options.sharding,
            compile=compile,
            **knobs,
        )


@dataclass(frozen=True)
class Config:
    replicas: int  # replicas per rank group; with stage_replicas, the fewest of them
    num_rank_groups: int
    schedule: Schedule
    virtual_stages: int
    num_microbatches: int
    microbatch_size: int  # samples per micro-batch per replica (with stage_replicas: of a stage with the fewest)
    recompute_mode: Recompute | None  # None: per stage, the least level that fits; a level: every stage
    # Uneven configs (partita.planning.uneven): the replicas of each stage, one stage per rank group;
    # empty when every rank group has ``replicas`` devices.
    stage_replicas: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.recompute_mode is not None and not isinstance(self.recompute_mode, Recompute):
            object.__setattr__(self, "recompute_mode", Recompute.parse(self.recompute_mode))  # a bool: full / none

    @property
    def num_stages(self) -> int:
        return self.num_rank_groups * self.virtual_stages

    @property
    def num_devices(self) -> int:
        return sum(self.stage_replicas) if self.stage_replicas else self.replicas * self.num_rank_groups

    def replicas_of(self, stage: int) -> int:
        return self.stage_replicas[stage] if self.stage_replicas else self.replicas

    def microbatch_size_of(self, stage: int) -> int:
        """Samples per micro-batch of each replica of ``stage``: the micro-batch split over its replicas."""
        return self.microbatch_size * self.replicas // self.replicas_of(stage)

    def rank_group_of(self, stage: int) -> int:
        g = self.num_rank_groups
        if self.schedule is Schedule.ZBV:
            return stage if stage < g else 2 * g - 1 - stage
        return stage % g


@dataclass(frozen=True)
class Candidate:
    config: Config
    boundaries: tuple[int, ...]  # block positions, first 0, last K
    recompute: tuple[Recompute, ...]  # per stage
    estimate_s: float
    tail_s: float = 0.0  # the part of estimate_s after the last backward (``search.step_tail_s``)


# ----------------------------------------------------------------------------- configs


def enumerate_configs(options: SearchOptions, num_blocks: int) -> Iterator[Config]:
    """Every config the options allow, in a fixed order (deterministic results). A replica count
    divides the global batch, and the units unless ``options.idle_units``: then ``G`` rank groups
    of ``r`` use ``G r < N`` units, e.g. a batch of 1,536 on 1,000 devices in groups of 24 or 12,
    which no count dividing 1,000 and 1,536 (at most 8) gives. A pinned sharding level other than
    replicate leaves out one replica per rank group (nothing to shard: the pin would be dropped)."""
    n, batch = options.num_devices, options.global_batch_size
    if options.replicas is not None:
        counts = [] if options.idle_units else [options.replicas]  # pinned: any count, searched once
    else:
        counts = [r for r in divisors(batch) if (n % r != 0) == options.idle_units]
        if options.sharding not in (None, Sharding.REPLICATE):  # a pinned level needs replicas to shard over
            counts = [r for r in counts if r > 1]
    for r in counts:
        if batch % r or r > n:
            continue
        groups = range(1, n // r + 1) if options.num_stages is None else [options.num_stages]
        for g in groups:
            if g * r > n:
                continue
            for schedule, v in _schedules(options, g):
                if g * v > num_blocks:
                    continue
                for m in microbatch_counts(options, batch // r, g):
                    if not schedule_accepts(schedule, m, g, g * v) or _same_as_gpipe(options, schedule, g, m):
                        continue
                    for mode in _recompute_modes(options, schedule, v):
                        yield Config(r, g, schedule, v, m, batch // (r * m), mode)


def _schedules(options: SearchOptions, num_groups: int) -> Iterator[tuple[Schedule, int]]:
    for schedule in options.schedules:
        if schedule.one_stage_per_rank_group:
            yield schedule, 1
        elif num_groups > 1:
            vs = options.interleaved_virtual_stages if schedule is Schedule.INTERLEAVED_1F1B else (2,)
            for v in vs:
                yield schedule, v


def _same_as_gpipe(options: SearchOptions, schedule: Schedule, num_groups: int, m: int) -> bool:
    """1F1B on one rank group with one micro-batch runs as GPipe does: searched once, as GPipe. With
    more micro-batches it is gradient accumulation (one micro-batch in flight, GPipe keeps all m)."""
    return schedule is Schedule.ONE_F_ONE_B and num_groups == 1 and m == 1 and Schedule.GPIPE in options.schedules


def microbatch_counts(options: SearchOptions, samples: int, num_groups: int) -> list[int]:
    """The micro-batch counts searched for ``samples`` per replica over ``num_groups`` rank groups:
    the pinned count if it divides them, else their divisors, at most ``max_microbatch_choices``
    of them (the schedule's own rules are checked afterwards)."""
    if options.num_microbatches is not None:
        return [options.num_microbatches] if samples % options.num_microbatches == 0 else []
    counts = list(divisors(samples))
    if len(counts) > options.max_microbatch_choices:
        # Prefer m around a few times the pipeline depth (small bubble, not too small micro-batches).
        target = 4 * num_groups
        counts = sorted(counts, key=lambda m: (abs(np.log(m / target)), m))[: options.max_microbatch_choices]
        counts.sort()
    return counts


@functools.lru_cache(maxsize=4096)
def schedule_accepts(schedule: Schedule, m: int, num_groups: int, num_stages: int) -> bool:
    """Whether torch's schedule runs this (e.g. 1F1B needs m >= stages); remembered, since the
    search asks for the same shapes at every replica count."""
    try:
        check_schedule(schedule, m, num_groups, num_stages)
    except InputError:
        return False
    return True


def _recompute_modes(options: SearchOptions, schedule: Schedule, virtual_stages: int) -> list[Recompute | None]:
    if not recompute_allowed(schedule):
        return [] if options.recompute not in (None, Recompute.NONE) else [Recompute.NONE]
    if options.recompute is not None:
        return [options.recompute]
    return [None] if virtual_stages == 1 else list(RECOMPUTE_LEVELS)


@functools.lru_cache(maxsize=1024)
def divisors(n: int) -> tuple[int, ...]:
    return tuple(d for d in range(1, n + 1) if n % d == 0)
