"""Turn a search candidate (or a baseline's split) into a Plan: node ranges, ranks, predictions."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from partita.cost.comm import spans_nodes
from partita.cost.memory import DeviceMemory, device_memory, microbatches_in_flight
from partita.cost.partial_recompute import recomputed_seconds, whole_block_count
from partita.cost.recompute import extra_backward_s
from partita.cost.segment_memory import segment_totals
from partita.errors import InputError
from partita.planning.configs import Config, SearchOptions
from partita.planning.sharding import accumulations, levels, step_overhead_s
from partita.types import Accumulation, Cluster, CostTable, OpGraph, Plan, Recompute, Sharding, StagePlan
from partita.types.segments import whole_blocks


def stage_ranks(config: Config, tensor_parallel: int = 1) -> list[tuple[int, ...]]:
    """Ranks of each rank group: consecutive blocks, group g after groups 0 .. g-1 (uniform:
    [g*r*t, (g+1)*r*t) with t = ``tensor_parallel``), so a group's replicas and neighbouring
    groups sit in the same node whenever the node is large enough. Uneven configs have one stage
    per rank group."""
    return consecutive_ranks([config.replicas_of(g) for g in range(config.num_rank_groups)], tensor_parallel)


def consecutive_ranks(counts: Sequence[int], tensor_parallel: int | Sequence[int] = 1) -> list[tuple[int, ...]]:
    """Ranks of rank groups with ``counts[g]`` replicas of ``tensor_parallel`` devices each (one
    degree, or one per rank group): consecutive, group g after groups 0 .. g-1, replica-major
    (``StagePlan.ranks``: each replica's tensor-parallel group is consecutive ranks)."""
    degrees = [tensor_parallel] * len(counts) if isinstance(tensor_parallel, int) else list(tensor_parallel)
    widths = [r * t for r, t in zip(counts, degrees)]
    starts = [sum(widths[:g]) for g in range(len(counts))]
    return [tuple(range(start, start + w)) for start, w in zip(starts, widths)]


def stage_tables(costs: CostTable | Callable[[int], CostTable], config: Config) -> list[CostTable]:
    """The CostTable of each stage at its replicas' micro-batch size (``Config.microbatch_size_of``).

    ``costs`` is a function micro-batch size -> CostTable, or one CostTable when every stage runs
    at ``config.microbatch_size`` (uniform configs)."""
    if isinstance(costs, CostTable):
        if config.stage_replicas:
            raise InputError(
                "an uneven config runs its stages at different micro-batch sizes: pass a function "
                "microbatch_size -> CostTable, not one CostTable"
            )
        return [costs] * config.num_stages
    by_size = {size: costs(size) for size in sorted({config.microbatch_size_of(s) for s in range(config.num_stages)})}
    return [by_size[config.microbatch_size_of(s)] for s in range(config.num_stages)]


class BuildMemo:
    """Per-range results that the plans of one planning run share: the refinement builds
    thousands of splits that differ from each other in a stage or two, and each build asks for
    the parameters of every stage range and the memory of every rank group. A table is known by
    its identity (the run's ``costs_at`` keeps its tables alive); each entry keeps its table, so a
    table made anew is never taken for another one that happened to have its id. One memo serves
    one cluster and options object (``PlanningContext.build_memo``: one per context, which keeps
    both alive)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[CostTable, Any]] = {}
        self._layouts: dict[tuple, tuple] = {}

    def get(self, table: CostTable, key: tuple, make: Callable[..., Any], *args: Any) -> Any:
        """``make(*args)``, remembered under ``table`` and ``key``."""
        full = (id(table), *key)
        entry = self._entries.get(full)
        if entry is None or entry[0] is not table:
            entry = self._entries[full] = (table, make(*args))
        return entry[1]

    def device_memory(
        self,
        table: CostTable,
        ranges,
        *,
        in_flight,
        recompute: Recompute,
        level: Sharding,
        replicas: int,
        num_microbatches: int,
        options,
        accumulation: Accumulation = Accumulation.WHOLE,
    ) -> DeviceMemory:
        """``device_memory`` of a rank group's node ``ranges`` (a tuple of (start, stop)) at
        ``level`` and ``accumulation``, remembered: the refinement's bounds and the plans it builds
        ask for the same ranges."""
        key = ("memory", ranges, in_flight, recompute, level, accumulation, replicas, num_microbatches, id(options))
        return self.get(
            table,
            key,
            lambda: device_memory(
                table,
                ranges,
                in_flight=in_flight,
                optimizer=options.optimizer,
                recompute=recompute,
                precision=options.precision,
                sharding=level,
                num_replicas=replicas,
                num_microbatches=num_microbatches,
                accumulation=accumulation,
            ),
        )

    def held(self, table: CostTable, start: int, stop: int) -> list[int]:
        """``table.params_in_range(start, stop)``, remembered."""
        return self.get(table, ("held", start, stop), table.params_in_range, start, stop)

    def layout(self, config: Config, options: SearchOptions, cluster: Cluster | None) -> tuple:
        """(ranks per rank group, and per rank group (micro-batches in flight, replicas, whether it
        spans nodes)) of ``config``, remembered."""
        key = (config, id(options), cluster is None)
        if key not in self._layouts:
            groups = stage_ranks(config, options.tensor_parallel)
            per_group = tuple(
                (
                    microbatches_in_flight(
                        config.schedule, config.num_microbatches, config.num_rank_groups, g, config.virtual_stages
                    ),
                    config.replicas_of(g),
                    cluster is not None and spans_nodes(groups[g], cluster),
                )
                for g in range(config.num_rank_groups)
            )
            self._layouts[key] = (groups, per_group)
        return self._layouts[key]


def rank_group_memory(
    tables: Sequence[CostTable],
    config: Config,
    options: SearchOptions,
    ranges_by_group: Mapping[int, list],
    recompute_by_group: Mapping[int, Recompute],
    cluster: Cluster | None = None,
    memo: BuildMemo | None = None,
) -> dict[int, GroupMemory]:
    """Exact predicted memory per rank group (all of the group's virtual stages together) and the
    group's sharding level: the fastest level that fits (``partita.planning.sharding``; ties: the
    least sharded), or, when none fits, the one that needs the least memory. ``tables[s]``: stage
    s's CostTable (``stage_tables``); a rank group's stages share one size. Without ``cluster``
    (no comm model) the least sharded level that fits. ``memo``: results shared with other plans
    of the same run (``BuildMemo``)."""
    memo = BuildMemo() if memo is None else memo
    result = {}
    groups, per_group = memo.layout(config, options, cluster)
    shared = groups_sharing_parameters(tables, ranges_by_group, memo)
    m = config.num_microbatches
    for g, ranges in ranges_by_group.items():
        in_flight, replicas, spans = per_group[g]
        ranges, recompute = tuple(ranges), recompute_by_group[g]
        allowed = group_levels(options, replicas, shares_parameters=g in shared)
        key = ("group", ranges, in_flight, recompute, replicas, m, allowed, spans, len(groups[g]), id(options))
        result[g] = memo.get(
            tables[g],
            key + (cluster is None,),
            _group_level,
            _Group(tables[g], ranges, in_flight, recompute, replicas),
            config,
            options,
            allowed,
            cluster,
            groups[g],
            memo,
        )
    return result


def group_levels(options: SearchOptions, replicas: int, *, shares_parameters: bool) -> tuple[Sharding, ...]:
    """The sharding levels a rank group of ``replicas`` may take: replicate only when a stage of it
    shares a trainable parameter with another stage (``groups_sharing_parameters``)."""
    return (Sharding.REPLICATE,) if shares_parameters else tuple(levels(options.sharding, replicas))


class GroupMemory(NamedTuple):
    """``rank_group_memory``'s answer for one rank group: its memory, its sharding level, and the
    memory's total and breakdown (computed once: every stage of the group shows them), and how its
    sharded stages accumulate gradients."""

    memory: DeviceMemory
    level: Sharding
    total_bytes: int
    breakdown: Any
    accumulation: Accumulation = Accumulation.WHOLE


class _Group(NamedTuple):
    """One rank group of a plan, as its memory sees it."""

    table: CostTable
    ranges: tuple[tuple[int, int], ...]
    in_flight: float
    recompute: Recompute
    replicas: int


def _group_level(group: _Group, config: Config, options: SearchOptions, allowed, cluster, ranks, memo: BuildMemo):
    """``rank_group_memory`` of one rank group (``GroupMemory``), its level among the ``allowed``
    ones, each with each accumulation it may take (``accumulations``: the one that moves less first)."""
    m = config.num_microbatches
    memory = {
        (level, acc): memo.device_memory(
            group.table,
            group.ranges,
            in_flight=group.in_flight,
            recompute=group.recompute,
            level=level,
            replicas=group.replicas,
            num_microbatches=m,
            options=options,
            accumulation=acc,
        )
        for level in allowed
        for acc in accumulations(level, group.replicas, m)
    }
    fitting = [choice for choice, mem in memory.items() if mem.total_bytes <= options.memory_limit_bytes]
    if not fitting:
        choice = min(memory, key=lambda c: memory[c].total_bytes)  # dict order: least sharded first on ties
    elif cluster is None or len(fitting) == 1:
        choice = fitting[0]
    else:
        cost = {c: _group_overhead_s(*c, group.table, group.ranges, config, options, cluster, ranks) for c in fitting}
        choice = min(fitting, key=lambda c: cost[c])  # min keeps the first (least sharded) of equals
    mem = memory[choice]
    return GroupMemory(mem, choice[0], int(mem.total_bytes), mem.breakdown(), choice[1])


def groups_sharing_parameters(
    tables: Sequence[CostTable], ranges_by_group: Mapping[int, list], memo: BuildMemo
) -> set[int]:
    """Rank groups with a stage that reads a trainable parameter another stage reads too (tied
    weights across stages): they replicate, as the runtime shards no parameter two stages share
    (partita/runtime/sharding.py). Only a parameter that several nodes read can be tied."""
    readers: dict[int, set[tuple[int, int]]] = {}
    held_by: dict[int, list[int]] = {}  # rank group -> the parameters of its stages that several nodes read
    for g, ranges in ranges_by_group.items():
        for start, stop in ranges:
            shared = memo.get(tables[g], ("read twice", start, stop), _read_twice, tables[g], start, stop, memo)
            held_by.setdefault(g, []).extend(shared)
            for p in shared:
                readers.setdefault(p, set()).add((start, stop))
    tied = {p for p, stages in readers.items() if len(stages) > 1}
    return {g for g, held in held_by.items() if any(p in tied for p in held)}


def _read_twice(table: CostTable, start: int, stop: int, memo: BuildMemo) -> list[int]:
    """The trainable parameters that nodes [start, stop) read and that nodes at two or more
    positions read."""
    candidates = memo.get(table, ("read twice",), _parameters_read_twice, table)
    if not candidates:
        return []
    owners, uses = table._flat_param_uses
    inside = (uses >= start) & (uses < stop)
    return [p for p in candidates if inside[owners == p].any()]


def _parameters_read_twice(table: CostTable) -> list[int]:
    trainable = np.asarray(table.param_trainable, dtype=bool)
    return [p for p, uses in enumerate(table.param_uses) if trainable[p] and len(np.unique(np.asarray(uses))) > 1]


def _group_overhead_s(
    level: Sharding,
    accumulation: Accumulation,
    table: CostTable,
    ranges,
    config: Config,
    options: SearchOptions,
    cluster: Cluster,
    ranks,
) -> float:
    """Seconds per step ``level`` and ``accumulation`` add to the compute of a rank group's stages
    (``step_overhead_s``; ``ranks``: the group's devices, ``options.tensor_parallel`` to a replica)."""
    total = 0.0
    trainable = np.asarray(table.param_trainable, dtype=bool)
    for start, stop in ranges:
        total += float(
            step_overhead_s(
                level,
                accumulation=accumulation,
                trainable_bytes=(
                    held := sum(int(table.param_bytes[p]) for p in table.params_in_range(start, stop) if trainable[p])
                ),
                segments=segment_totals(table, start, stop, held),
                forward_s=float(table.forward_s[start:stop].sum()),
                backward_s=float(table.backward_s[start:stop].sum()),
                num_microbatches=config.num_microbatches,
                num_replicas=len(ranks) // options.tensor_parallel,
                precision=options.precision,
                optimizer=options.optimizer,
                cluster=cluster,
                spans_nodes=spans_nodes(ranks, cluster),
            )
        )
    return total


def group_ranges(
    config: Config, node_boundaries: Sequence[int], recompute: Sequence[Recompute]
) -> tuple[dict[int, list], dict[int, Recompute]]:
    """Per rank group, its stages' node ranges (in stage order) and its recomputation level (the
    most any of its stages takes: the group runs all its stages at it): what
    ``rank_group_memory`` takes."""
    ranges_by_group: dict[int, list] = {}
    recompute_by_group: dict[int, Recompute] = {}
    for s in range(config.num_stages):
        g = config.rank_group_of(s)
        ranges_by_group.setdefault(g, []).append((node_boundaries[s], node_boundaries[s + 1]))
        recompute_by_group[g] = Recompute.most([recompute_by_group.get(g, Recompute.NONE), recompute[s]])
    return ranges_by_group, recompute_by_group


def build_plan(
    graph: OpGraph,
    costs: CostTable | Callable[[int], CostTable],
    config: Config,
    node_boundaries: Sequence[int],
    recompute: Sequence[Recompute],
    options: SearchOptions,
    *,
    cluster: Cluster,
    method: str,
    resolved_options: Mapping[str, Any],
    versions: tuple[str, str],
    memo: BuildMemo | None = None,
) -> Plan:
    """A Plan with predicted per-stage times and memory (the step time is filled in by simulation).

    ``costs``: see ``stage_tables``; at ``options.tensor_parallel`` t > 1 the costs of one device of
    a group of t, and ``config`` counts groups (``partita.planning.tensor_parallel``).
    ``memo``: per-range results shared with the other plans of the run (``BuildMemo``)."""
    memo = BuildMemo() if memo is None else memo
    groups, per_group = memo.layout(config, options, cluster)
    tables = stage_tables(costs, config)
    recompute = [Recompute.parse(level) for level in recompute]  # a bool: full / none
    ranges_by_group, recompute_by_group = group_ranges(config, node_boundaries, recompute)
    memory = rank_group_memory(tables, config, options, ranges_by_group, recompute_by_group, cluster, memo)
    partial = {
        g: fewest_recomputed_blocks(
            tables[g], ranges[0], recompute_by_group[g], memory[g], per_group[g][:2], config, options, memo
        )
        for g, ranges in ranges_by_group.items()
        if len(ranges) == 1
    }
    stages = []
    for s in range(config.num_stages):
        start, stop = int(node_boundaries[s]), int(node_boundaries[s + 1])
        g = config.rank_group_of(s)
        costs = tables[s]
        forward, backward, selective, param_bytes, modules = memo.get(
            costs, ("stage", start, stop), _stage_sums, graph, costs, start, stop, memo
        )
        level = recompute_by_group[g]
        extra = extra_backward_s(level, forward, selective)
        blocks_recomputed, group_memory = None, memory[g]
        if partial.get(g) is not None:
            blocks_recomputed, group_memory, extra = partial[g]
        stages.append(
            StagePlan(
                index=s,
                start=start,
                stop=stop,
                first_node=graph.nodes[start].name,
                last_node=graph.nodes[stop - 1].name,
                module_range=modules,
                ranks=groups[g],
                rank_group=g,
                recompute=level,
                forward_s=float(forward),
                backward_s=float(backward + extra),
                memory_bytes=group_memory.total_bytes,
                param_bytes=param_bytes,
                cut_bytes=int(costs.cut_bytes[stop]) if stop < graph.num_nodes else 0,
                sharding=memory[g].level,
                blocks=whole_blocks(graph, start, stop),
                accumulation=memory[g].accumulation,
                memory_breakdown=group_memory.breakdown,
                recompute_blocks=blocks_recomputed,
                tensor_parallel=options.tensor_parallel,
                sequence_parallel=options.sequence_parallel,
            )
        )
    return Plan(
        graph_fingerprint=graph.fingerprint,
        cluster=cluster,
        stages=tuple(stages),
        schedule=config.schedule,
        global_batch_size=options.global_batch_size,
        num_microbatches=config.num_microbatches,
        microbatch_size=config.microbatch_size,
        total_compute_s=total_compute_s(costs, config, options.global_batch_size),
        options=dict(resolved_options),
        method=method,
        cost_source=costs.source,
        precision=options.precision,
        compile=options.compile,
        partita_version=versions[0],
        torch_version=versions[1],
    )


def fewest_recomputed_blocks(
    table: CostTable,
    node_range,
    level: Recompute,
    group: GroupMemory,
    in_flight_and_replicas: tuple[float, int],
    config: Config,
    options: SearchOptions,
    memo: BuildMemo,
) -> tuple[int, GroupMemory, float] | None:
    """For a rank group of one recomputing stage: the fewest of its whole blocks that need recompute
    (its first ones, ``StagePlan.recompute_blocks``; every other tensor kept) for it to fit, with its
    memory then and the seconds that recomputation adds to its backward; None where recomputing
    every segment is what fits (or the stage holds no whole block, or recomputes nothing), and where
    the level is pinned (``PlanOptions.recompute``: every block recomputes, as asked)."""
    start, stop = node_range
    held = whole_block_count(table, start, stop)
    if level is Recompute.NONE or held < 2 or config.recompute_mode is not None or options.recompute is not None:
        return None
    key = ("partial", start, stop, level, group.level, group.accumulation, in_flight_and_replicas)
    key += (config.num_microbatches, id(options))
    args = (table, node_range, level, group, *in_flight_and_replicas, config.num_microbatches, options, held)
    return memo.get(table, key, _fewest_blocks, *args)


def _fewest_blocks(table, node_range, level, group: GroupMemory, in_flight, replicas, num_microbatches, options, held):
    start, stop = node_range
    for n in range(1, held):
        memory = device_memory(
            table,
            [node_range],
            in_flight=in_flight,
            optimizer=options.optimizer,
            recompute=level,
            precision=options.precision,
            sharding=group.level,
            num_replicas=replicas,
            num_microbatches=num_microbatches,
            accumulation=group.accumulation,
            recompute_blocks=n,
        )
        if memory.total_bytes <= options.memory_limit_bytes:
            found = GroupMemory(memory, group.level, int(memory.total_bytes), memory.breakdown(), group.accumulation)
            return n, found, float(extra_backward_s(level, *recomputed_seconds(table, start, stop, n)))
    return None


def _stage_sums(graph: OpGraph, table: CostTable, start: int, stop: int, memo: BuildMemo) -> tuple:
    """(forward, backward and selectively recomputed seconds as numpy sums, parameter bytes, module
    range) of nodes [start, stop)."""
    held = memo.held(table, start, stop)
    return (
        table.forward_s[start:stop].sum(),
        table.backward_s[start:stop].sum(),
        table.selective_recompute_s[start:stop].sum(),
        int(sum(table.param_bytes[p] for p in held)),
        module_range(graph, start, stop),
    )


def total_compute_s(costs: CostTable | Callable[[int], CostTable], config: Config, global_batch_size: int) -> float:
    """Forward + backward seconds of all of a step's samples on one device, at the plan's
    micro-batch size (the ideal step is this divided by the number of devices)."""
    table = costs if isinstance(costs, CostTable) else costs(config.microbatch_size)
    per_microbatch = float(table.forward_s.sum() + table.backward_s.sum())
    return per_microbatch * global_batch_size / config.microbatch_size


def fits(plan: Plan, memory_limit_bytes: int) -> bool:
    return all(s.memory_bytes <= memory_limit_bytes for s in plan.stages)


def module_range(graph: OpGraph, start: int, stop: int) -> str:
    """'first module .. last module' of the nodes in [start, stop), skipping root-level glue."""
    paths = [n.module_path for n in graph.nodes[start:stop] if n.module_path]
    if not paths:
        return "(root)"
    return paths[0] if paths[0] == paths[-1] else f"{paths[0]} .. {paths[-1]}"


def block_to_node_boundaries(chain: Sequence[int], block_boundaries: Sequence[int]) -> list[int]:
    return [int(chain[b]) for b in block_boundaries]


CostsAt = Callable[[int], CostTable]
