"""A mixed candidate as a Plan: ranks by device group, sample shares, memory per device type.

Each stage's replicas run on the devices ``Cluster.assign_ranks`` gives its kind's counts (times
its group's tensor-parallel degree ``t``: a replica is ``t`` consecutive ranks of one node); a stage
whose replicas take unequal shares records them (``StagePlan.replica_samples``). Its memory is
checked on every device group it runs on, at that group's share and memory limit; its sharding
level is one for all its replicas (one FSDP2 unit): the fastest level that fits on every group
(ties: the least sharded), or replicate for a stage that shares a weight with another stage
(the runtime shards no tied weight). A stage's recorded times and memory are its slowest and
fullest group's; ``memory_bytes_by_group`` holds each group's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import partita
from partita.cost.comm import spans_nodes
from partita.cost.memory import DeviceMemory, microbatches_in_flight
from partita.cost.recompute import extra_backward_s
from partita.cost.segment_memory import segment_totals
from partita.planning.build import BuildMemo, module_range
from partita.planning.device_groups import MixedRun
from partita.planning.hetero_search import MixedCandidate, MixedConfig, StageKind
from partita.planning.sharding import accumulations, levels, step_overhead_s
from partita.types import RECOMPUTE_LEVELS, Accumulation, CostTable, Plan, Recompute, Sharding, StagePlan
from partita.types.segments import whole_blocks

__all__ = ["fitting_mixed_draft", "mixed_draft", "mixed_total_compute_s"]


def mixed_draft(
    run: MixedRun, candidate: MixedCandidate, recompute: Sequence[Recompute], method: str = "partita"
) -> Plan:
    """The Plan of ``candidate`` with ``recompute`` per stage, its step not yet simulated."""
    config = candidate.config
    nodes = [int(run.chain[b]) for b in candidate.boundaries]
    # a replica is t consecutive ranks of one node, t its group's degree (``MixedRun.search_cluster``)
    ranks = run.cluster.assign_ranks([[c * run.degree_of(g) for g, c in enumerate(k.counts)] for k in config.kinds])
    tied = _tied_stages(run, config, nodes)
    stages = tuple(
        _stage(run, config, p, nodes, ranks[p], Recompute.parse(recompute[p]), p in tied)
        for p in range(config.num_stages)
    )
    return Plan(
        graph_fingerprint=run.graph.fingerprint,
        cluster=run.cluster,
        stages=stages,
        schedule=config.schedule,
        global_batch_size=run.global_batch_size,
        num_microbatches=config.num_microbatches,
        microbatch_size=_microbatch_size(config, run.global_batch_size),
        options=dict(run.resolved),
        method=method,
        total_compute_s=mixed_total_compute_s(run, config),
        cost_source=run.costs_at(0, 1).source,
        precision=run.contexts[0].options.precision,
        compile=run.contexts[0].options.compile,
        partita_version=partita.__version__,
        torch_version=torch.__version__,
    )


def fitting_mixed_draft(run: MixedRun, candidate: MixedCandidate, method: str = "partita") -> Plan | None:
    """``mixed_draft`` that fits every device's memory: with the candidate's recomputation, else
    (recomputation not pinned) each stage that does not fit at the next level up, until all fit
    or a stage recomputes fully and still does not; None when nothing fits."""
    recompute = list(candidate.recompute)
    draft = mixed_draft(run, candidate, recompute, method)
    while not fits_mixed(run, draft):
        if candidate.config.recompute_mode is not None:
            return None
        raised = [
            r if _stage_fits(run, s) or r is Recompute.FULL else RECOMPUTE_LEVELS[r.order + 1]
            for r, s in zip(recompute, draft.stages)
        ]
        if raised == recompute:
            return None
        recompute = raised
        draft = mixed_draft(run, candidate, recompute, method)
    return draft


def fits_mixed(run: MixedRun, plan: Plan) -> bool:
    return all(_stage_fits(run, s) for s in plan.stages)


def _stage_fits(run: MixedRun, stage: StagePlan) -> bool:
    limits = [ctx.options.memory_limit_bytes for ctx in run.contexts]
    return all(used <= limit for used, limit in zip(stage.memory_bytes_by_group, limits))


def mixed_total_compute_s(run: MixedRun, config: MixedConfig) -> float:
    """Forward + backward seconds of a whole step's samples on one device of the plan's devices taken
    together: its devices / their summed speed (samples per second, each type at its share), so that
    ``total_compute_s / num_devices`` is the ideal step over every device the plan uses, each at its
    own speed (the report's efficiency). Under tensor parallelism, each device at degree 1."""
    batch = run.global_batch_size
    speed, devices = 0.0, 0
    for g in range(run.num_groups):
        count = config.devices_of_group(g) * run.degree_of(g)
        if not count:
            continue
        size = max(k.samples[g] for k in config.kinds if k.counts[g])
        table = run.base.costs_at(g, size)
        speed += count * size / float(table.forward_s.sum() + table.backward_s.sum())
        devices += count
    return devices * batch / speed


def _microbatch_size(config: MixedConfig, batch: int) -> int:
    """The plan's microbatch_size: with unequal shares the largest share, else the samples per replica
    of a stage with the fewest replicas (``Plan.microbatch_size``)."""
    if all(len(set(k.shares)) == 1 for k in config.kinds):
        return batch // config.num_microbatches // min(k.num_replicas for k in config.kinds)
    return max(max(k.shares) for k in config.kinds)


def _stage(
    run: MixedRun,
    config: MixedConfig,
    p: int,
    nodes: Sequence[int],
    ranks: tuple[int, ...],
    recompute: Recompute,
    tied: bool,
) -> StagePlan:
    kind, start, stop = config.kinds[p], nodes[p], nodes[p + 1]
    in_flight = microbatches_in_flight(config.schedule, config.num_microbatches, config.num_stages, p, 1)
    tables = {g: run.costs_at(g, kind.samples[g]) for g in kind.groups}
    (level, accumulation), memory = _level_and_memory(
        run, config, kind, tables, (start, stop), in_flight, recompute, tied, ranks
    )
    by_group = tuple(int(memory[g].total_bytes) if g in memory else 0 for g in range(run.num_groups))
    fullest = max(kind.groups, key=lambda g: (memory[g].total_bytes, -g))
    slowest = max(kind.groups, key=lambda g: (_compute_s(tables[g], start, stop), -g))
    table = tables[slowest]
    forward = float(table.forward_s[start:stop].sum())
    selective = float(table.selective_recompute_s[start:stop].sum())
    backward = float(table.backward_s[start:stop].sum()) + float(extra_backward_s(recompute, forward, selective))
    graph = run.graph
    return StagePlan(
        index=p,
        start=start,
        stop=stop,
        first_node=graph.nodes[start].name,
        last_node=graph.nodes[stop - 1].name,
        module_range=module_range(graph, start, stop),
        ranks=ranks,
        rank_group=p,
        recompute=recompute,
        forward_s=forward,
        backward_s=backward,
        memory_bytes=int(memory[fullest].total_bytes),
        param_bytes=int(sum(int(table.param_bytes[q]) for q in table.params_in_range(start, stop))),
        cut_bytes=int(tables[max(kind.groups, key=lambda g: kind.samples[g])].cut_bytes[stop])
        if stop < graph.num_nodes
        else 0,
        sharding=level,
        accumulation=accumulation,
        blocks=whole_blocks(graph, start, stop),
        memory_breakdown=memory[fullest].breakdown(),
        replica_samples=None if len(set(kind.shares)) == 1 else kind.shares,
        memory_bytes_by_group=by_group,
        tensor_parallel=run.degree_of(kind.groups[0]),
        sequence_parallel=run.sequence_parallel and run.degree_of(kind.groups[0]) > 1,
    )


def _compute_s(table: CostTable, start: int, stop: int) -> float:
    return float(table.forward_s[start:stop].sum() + table.backward_s[start:stop].sum())


def _level_and_memory(
    run: MixedRun,
    config: MixedConfig,
    kind: StageKind,
    tables: dict[int, CostTable],
    node_range: tuple[int, int],
    in_flight: float,
    recompute: Recompute,
    tied: bool,
    ranks: tuple[int, ...],
) -> tuple[tuple[Sharding, Accumulation], dict[int, DeviceMemory]]:
    """The stage's sharding level and gradient accumulation (module docstring; ``accumulations``)
    and each of its groups' memory with them."""
    options = run.contexts[0].options
    allowed = (Sharding.REPLICATE,) if tied else levels(options.sharding, kind.num_replicas)
    m = config.num_microbatches
    choices = [(lv, acc) for lv in allowed for acc in accumulations(lv, kind.num_replicas, m)]
    memo = _memo(run)
    memory = {
        (level, acc): {
            g: memo.device_memory(
                tables[g],
                (node_range,),
                in_flight=in_flight,
                recompute=recompute,
                level=level,
                replicas=kind.num_replicas,
                num_microbatches=m,
                options=run.contexts[g].options,
                accumulation=acc,
            )
            for g in kind.groups
        }
        for level, acc in choices
    }
    fitting = [
        c
        for c in choices
        if all(memory[c][g].total_bytes <= run.contexts[g].options.memory_limit_bytes for g in kind.groups)
    ]
    if not fitting:
        choice = min(choices, key=lambda c: max(memory[c][g].total_bytes for g in kind.groups))
    elif len(fitting) == 1:
        choice = fitting[0]
    else:
        cost = {c: _overhead_s(run, config, kind, tables, node_range, c, ranks) for c in fitting}
        choice = min(fitting, key=lambda c: cost[c])  # the first (least sharded) of equals
    return choice, memory[choice]


def _overhead_s(
    run: MixedRun, config, kind: StageKind, tables, node_range, choice: tuple[Sharding, Accumulation], ranks
) -> float:
    """Seconds per step ``choice`` (level, accumulation) adds to the stage (``step_overhead_s``), its slowest group's, its
    collectives over the stage's links (the mixed cluster's when it spans groups)."""
    start, stop = node_range
    mixed = len(kind.groups) > 1
    worst = 0.0
    for g in kind.groups:
        table = tables[g]
        cluster = run.cluster if mixed else run.contexts[g].cluster
        local = ranks if mixed else tuple(r - run.cluster.group_first_ranks[g] for r in ranks)
        trainable = sum(
            int(table.param_bytes[q]) for q in table.params_in_range(start, stop) if table.param_trainable[q]
        )
        seconds = step_overhead_s(
            choice[0],
            accumulation=choice[1],
            trainable_bytes=trainable,
            segments=segment_totals(table, start, stop, trainable),
            forward_s=float(table.forward_s[start:stop].sum()),
            backward_s=float(table.backward_s[start:stop].sum()),
            num_microbatches=config.num_microbatches,
            num_replicas=kind.num_replicas,
            precision=run.contexts[g].options.precision,
            optimizer=run.contexts[g].options.optimizer,
            cluster=cluster,
            spans_nodes=spans_nodes(local, cluster),
        )
        worst = max(worst, float(seconds))
    return worst


def _tied_stages(run: MixedRun, config: MixedConfig, nodes: Sequence[int]) -> set[int]:
    """Stages that read a trainable parameter another stage reads too (tied weights): they replicate."""
    table = run.costs_at(0, 1)
    readers: dict[int, set[int]] = {}
    for p in range(config.num_stages):
        for q in _memo(run).held(table, nodes[p], nodes[p + 1]):
            if table.param_trainable[q]:
                readers.setdefault(int(q), set()).add(p)
    return {p for stages in readers.values() if len(stages) > 1 for p in stages}


def _memo(run: MixedRun) -> BuildMemo:
    """The run's BuildMemo (per-range memory and parameters, shared by its plans)."""
    return run.build_memo
