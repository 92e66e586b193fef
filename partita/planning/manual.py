"""Plans written by hand: the user (or a test) chooses the cuts, the schedule and the mesh.

A manual plan is a Plan like any other (``method="manual"``): the runtime cannot tell it from
a searched one. It carries no predictions (times and memory are 0), only what the runtime needs::

    plan = manual_plan(graph, [0, 80, graph.num_nodes], schedule="1f1b", num_rank_groups=2,
                       replicas=2, num_microbatches=4, global_batch_size=16)

Stage ``k`` runs on rank group ``stage_rank_groups(schedule, G, S)[k]`` (the placement torch's
schedules use: ``k % G``, or the V shape for ZBV); rank group ``g`` holds ranks
``[g * replicas, (g + 1) * replicas)`` as in ``partita.planning.build.stage_ranks``.

With ``tensor_parallel=t`` every replica is a tensor-parallel group of ``t`` consecutive ranks
(``StagePlan.ranks`` replica-major), so rank group ``g`` holds ranks
``[g * replicas * t, (g + 1) * replicas * t)``; the groups must not span nodes of ``cluster``.

Uneven plans give each rank group its own replica count, ``replicas=(2, 1)``: GPipe or 1F1B only
(one stage per rank group). Rank group ``g``'s ranks follow those of the groups before it
(``[r_0 + ... + r_{g-1}, r_0 + ... + r_g)``), and each micro-batch of ``B / m`` samples is split
evenly over a stage's replicas (see ``partita.runtime.uneven``)::

    plan = manual_plan(graph, [0, 80, graph.num_nodes], schedule="1f1b", num_rank_groups=2,
                       replicas=(2, 1), num_microbatches=2, global_batch_size=8)   # ranks (0, 1), (2,)

``replica_samples`` gives a rank group's replicas unequal shares of each micro-batch instead (a
fast and a slow device: ``replica_samples=[(3, 1), None]`` runs samples 0-2 of every micro-batch
of 4 on rank 0 and sample 3 on rank 1); the loss weighs each share by its samples, so training
stays exact (``partita.runtime.loss_scaling``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from partita.checks import positive_int
from partita.errors import InputError
from partita.planning.build import consecutive_ranks, module_range
from partita.planning.tensor_parallel import check_degree
from partita.types import Accumulation, OpGraph, Plan, Precision, Recompute, Schedule, Sharding, StagePlan
from partita.types.cluster import Cluster
from partita.types.schedule_orders import UNEVEN_SCHEDULES, check_schedule, stage_rank_groups
from partita.types.segments import whole_blocks
from partita.types.whole_batch import check_coupled_batch_size, check_whole_batch

__all__ = ["manual_plan"]


def manual_plan(
    graph: OpGraph,
    boundaries: Sequence[int],
    *,
    schedule: Schedule | str,
    num_rank_groups: int,
    num_microbatches: int,
    global_batch_size: int,
    replicas: int | Sequence[int] = 1,
    recompute: Recompute | str | bool | Sequence[Recompute | str | bool] = Recompute.NONE,
    cluster: Cluster | Mapping[str, Any] | None = None,
    precision: Precision | str = Precision.FP32,
    sharding: Sharding | str | Sequence[Sharding | str] = Sharding.REPLICATE,
    tensor_parallel: int | Sequence[int] = 1,
    sequence_parallel: bool = False,
    replica_samples: Sequence[Sequence[int] | None] | None = None,
    accumulation: Accumulation | str = Accumulation.WHOLE,
    recompute_blocks: int | None = None,
    compile: bool = False,
) -> Plan:
    """A Plan with stages ``[boundaries[k], boundaries[k + 1])`` of ``graph.nodes``.

    Args:
        boundaries: node positions, strictly increasing from 0 to ``graph.num_nodes``.
        schedule: a ``Schedule`` or its name ("gpipe", "1f1b", "interleaved1f1b", "zbv").
        num_rank_groups: pipeline depth G; ``len(boundaries) - 1`` stages are placed on them.
        replicas: data-parallel replicas of every stage, or one count per rank group (uneven
            plans: GPipe and 1F1B only).
        num_microbatches: micro-batches per step (every replica of a stage runs each of them).
        global_batch_size: samples per step over all replicas; must be a multiple of
            ``num_microbatches * r`` for every replica count ``r`` split evenly.
        recompute: the recomputation level ("none", "selective", "full"; True / False: full / none),
            for all stages or one per stage.
        cluster: the machines (a Cluster, or its ``to_dict()``); default: as many CPU ranks as the plan uses, on one node.
        precision: "fp32" or "bf16" (``Plan.precision``).
        sharding: a ``Sharding`` level for all stages or one per stage; a stage with one replica
            must replicate.
        tensor_parallel: devices per replica, splitting its matmuls (``StagePlan.tensor_parallel``),
            for every rank group or one per rank group (stages on device types of their own:
            GPipe and 1F1B only, one stage per rank group); the default cluster then has
            ``replicas x tensor_parallel`` CPU ranks per rank group.
        sequence_parallel: the tensor-parallel groups also split, by token, the regions they leave
            whole (``Plan.sequence_parallel``; needs a degree above 1, and applies to the stages
            that have one).
        replica_samples: per rank group, the samples of each micro-batch that each of its
            replicas runs (``StagePlan.replica_samples``; at least one each, summing to
            ``global_batch_size / num_microbatches``), or None for an even split. Unequal shares
            run under GPipe and 1F1B, one stage per rank group.
        accumulation: how the sharded stages accumulate gradients over the micro-batches
            (``Accumulation``: "whole", or "sharded": reduce-scattered in every backward); needs a
            sharded stage when "sharded".
        recompute_blocks: the recomputing stages recompute only their first that many whole blocks
            and keep every tensor of the rest (``StagePlan.recompute_blocks``); None: every segment.
        compile: every block runs through ``torch.compile``, compiled once per distinct block
            (``Plan.compile``).

    Raises InputError when the split, the schedule or the batch do not fit together.
    """
    schedule = Schedule.parse(schedule)
    cuts = _check_cuts(boundaries, graph.num_nodes)
    num_stages = len(cuts) - 1
    for name, value in (
        ("num_rank_groups", num_rank_groups),
        ("num_microbatches", num_microbatches),
        ("global_batch_size", global_batch_size),
    ):
        positive_int(value, name)
    check_schedule(schedule, num_microbatches, num_rank_groups, num_stages)
    counts = _replica_counts(replicas, schedule, num_rank_groups)
    degrees = _degrees(tensor_parallel, schedule, num_rank_groups, num_stages)
    t = max(degrees)
    shares = _replica_shares(replica_samples, counts, global_batch_size, num_microbatches)
    if any(shares) and (schedule not in UNEVEN_SCHEDULES or num_stages != num_rank_groups):
        raise InputError(
            f"replica_samples={[None if s is None else list(s) for s in shares]} gives replicas unequal shares, "
            "which run under schedule gpipe or 1f1b with one stage per rank group only "
            f"(got {schedule.value}, {num_stages} stages on {num_rank_groups} rank groups): "
            "change those, or leave replica_samples out"
        )
    for r in sorted({r for r, s in zip(counts, shares) if s is None}):
        if global_batch_size % (num_microbatches * r):
            raise InputError(
                f"global_batch_size={global_batch_size} is not a multiple of num_microbatches x replicas = "
                f"{num_microbatches} x {r}: every micro-batch must split evenly over every stage's replicas; "
                f"use a global batch that is a multiple of {num_microbatches * r}"
            )
    flags = _recompute_flags(recompute, num_stages)
    precision = Precision.parse(precision)
    check_coupled_batch_size(graph, global_batch_size)  # a batch taken from the wrong dim?
    check_whole_batch(graph, num_microbatches, counts)  # a loss that couples samples needs the whole batch
    for name, flag in (("sequence_parallel", sequence_parallel), ("compile", compile)):
        if not isinstance(flag, bool):
            raise InputError(f"{name} must be True or False, got {flag!r}")
    if sequence_parallel and t == 1:
        raise InputError(
            "sequence_parallel=True splits the regions a tensor-parallel group leaves whole, but tensor_parallel "
            "is 1: give tensor_parallel=2 or more, or sequence_parallel=False"
        )
    groups = stage_rank_groups(schedule, num_rank_groups, num_stages)
    ranks = consecutive_ranks(counts, degrees)
    levels = _sharding_levels(sharding, [counts[g] for g in groups])
    accumulation = _accumulation(accumulation, levels)
    stages = tuple(
        dataclasses.replace(
            _stage(graph, k, cuts[k], cuts[k + 1], groups[k], ranks[groups[k]], flags[k]),
            sharding=levels[k],
            blocks=whole_blocks(graph, cuts[k], cuts[k + 1]),
            accumulation=Accumulation.WHOLE if levels[k] is Sharding.REPLICATE else accumulation,
            recompute_blocks=_recompute_blocks(recompute_blocks, graph, k, cuts, flags[k]),
            tensor_parallel=degrees[groups[k]],
            sequence_parallel=sequence_parallel and degrees[groups[k]] > 1,
            replica_samples=shares[groups[k]],
        )
        for k in range(num_stages)
    )
    if cluster is None:
        n = sum(r * d for r, d in zip(counts, degrees))
        cluster = Cluster(device="cpu", num_devices=n, devices_per_node=n)
    elif not isinstance(cluster, Cluster):
        cluster = Cluster.from_dict(cluster)
    if len(set(degrees)) == 1 and t > 1:
        check_degree(t, cluster)
    elif t > 1:
        _check_groups_in_nodes(degrees, ranks, cluster)
    return Plan(
        graph_fingerprint=graph.fingerprint,
        cluster=cluster,
        stages=stages,
        schedule=schedule,
        global_batch_size=global_batch_size,
        num_microbatches=num_microbatches,
        microbatch_size=max(max(s) for s in shares if s)
        if any(shares)
        else global_batch_size // (num_microbatches * min(counts)),
        options={
            "boundaries": list(cuts),
            "num_rank_groups": num_rank_groups,
            "replicas": replicas if isinstance(replicas, int) else list(counts),
            "recompute": [level.value for level in flags],
            "precision": precision.value,
            "sharding": [level.value for level in levels],
            "tensor_parallel": degrees[0] if len(set(degrees)) == 1 else list(degrees),
            "sequence_parallel": sequence_parallel,
            **({"replica_samples": [None if s is None else list(s) for s in shares]} if any(shares) else {}),
            **({"accumulation": accumulation.value} if accumulation is not Accumulation.WHOLE else {}),
            **({"compile": True} if compile else {}),
        },
        method="manual",
        cost_source="none",
        precision=precision,
        compile=compile,
        partita_version=_version(),
        torch_version=_torch_version(),
    )


def _degrees(
    tensor_parallel: int | Sequence[int], schedule: Schedule, num_rank_groups: int, num_stages: int
) -> tuple[int, ...]:
    """The tensor-parallel degree of each rank group; InputError naming the value when the runtime
    cannot run it (degrees that differ run on partita's executor: GPipe or 1F1B, one stage per
    rank group)."""
    if isinstance(tensor_parallel, int) and not isinstance(tensor_parallel, bool):
        return (positive_int(tensor_parallel, "tensor_parallel"),) * num_rank_groups
    if isinstance(tensor_parallel, (str, bytes)) or not isinstance(tensor_parallel, Sequence):
        raise InputError(
            f"tensor_parallel must be an int or a sequence of one int per rank group, got {tensor_parallel!r}"
        )
    degrees = tuple(positive_int(d, "tensor_parallel") for d in tensor_parallel)
    if len(degrees) != num_rank_groups:
        raise InputError(
            f"tensor_parallel={list(degrees)} has {len(degrees)} entries for {num_rank_groups} rank groups: "
            "give one degree per rank group, or one int for all"
        )
    if len(set(degrees)) > 1 and (schedule not in UNEVEN_SCHEDULES or num_stages != num_rank_groups):
        raise InputError(
            f"tensor_parallel={list(degrees)} differs between rank groups, which runs under schedule gpipe or 1f1b "
            f"with one stage per rank group only (got {schedule.value}, {num_stages} stages on {num_rank_groups} "
            "rank groups): change those, or give every rank group the same degree"
        )
    return degrees


def _check_groups_in_nodes(degrees: Sequence[int], ranks: Sequence[tuple[int, ...]], cluster: Cluster) -> None:
    """Where degrees differ: each a power of two, and every tensor-parallel group in one node."""
    for g, (d, group_ranks) in enumerate(zip(degrees, ranks)):
        if d & (d - 1):
            raise InputError(
                f"tensor_parallel={d} (rank group {g}) is not a power of two: the split rules divide heads, features "
                "and vocabularies in halves; use 1, 2, 4 or 8"
            )
        for j in range(0, len(group_ranks), d):
            block = group_ranks[j : j + d]
            if block[-1] >= cluster.num_devices or len({cluster.rank_to_node(r) for r in block}) > 1:
                raise InputError(
                    f"rank group {g}'s tensor-parallel group on ranks {list(block)} does not lie in one node of the "
                    f"cluster ({cluster.num_devices} devices, {cluster.devices_per_node} per node): a group "
                    "all-reduces activations in every layer; change the degrees or the cluster"
                )


def _replica_counts(replicas: int | Sequence[int], schedule: Schedule, num_rank_groups: int) -> tuple[int, ...]:
    """Replicas of each rank group; InputError naming the value when the runtime cannot run it."""
    if isinstance(replicas, int) and not isinstance(replicas, bool):
        positive_int(replicas, "replicas")
        return (replicas,) * num_rank_groups
    if isinstance(replicas, (str, bytes)) or not isinstance(replicas, Sequence):
        raise InputError(f"replicas must be an int or a sequence of one int per rank group, got {replicas!r}")
    counts = tuple(replicas)
    if len(counts) != num_rank_groups:
        raise InputError(
            f"replicas={list(counts)} has {len(counts)} entries for {num_rank_groups} rank groups: "
            "give one replica count per rank group, or one int for all"
        )
    for count in counts:
        positive_int(count, "replicas")
    if len(set(counts)) > 1 and schedule not in UNEVEN_SCHEDULES:
        raise InputError(
            f"replicas={list(counts)} differ between rank groups, which {schedule.value} cannot run "
            "(a rank group holds several stages): use schedule gpipe or 1f1b, or the same count for "
            "every rank group"
        )
    return counts


def _replica_shares(
    replica_samples: Sequence[Sequence[int] | None] | None, counts: Sequence[int], batch: int, num_microbatches: int
) -> tuple[tuple[int, ...] | None, ...]:
    """Each rank group's unequal shares, or None (an even split: not given, or equal shares);
    InputError naming the entry that does not split the micro-batch over the group's replicas."""
    if replica_samples is None:
        return (None,) * len(counts)
    if isinstance(replica_samples, (str, bytes)) or not isinstance(replica_samples, Sequence):
        raise InputError(f"replica_samples must be a sequence of one entry per rank group, got {replica_samples!r}")
    if len(replica_samples) != len(counts):
        raise InputError(
            f"replica_samples has {len(replica_samples)} entries for {len(counts)} rank groups: give one per rank "
            "group (None for an even split)"
        )
    if batch % num_microbatches:
        raise InputError(
            f"global_batch_size={batch} is not a multiple of num_microbatches={num_microbatches}: every micro-batch "
            "must hold as many samples"
        )
    microbatch = batch // num_microbatches
    found = []
    for g, (given, r) in enumerate(zip(replica_samples, counts)):
        if given is None:
            found.append(None)
            continue
        shares = tuple(given) if isinstance(given, Sequence) and not isinstance(given, (str, bytes)) else None
        ok = shares is not None and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in shares)
        if not ok or len(shares) != r or sum(shares) != microbatch:
            raise InputError(
                f"replica_samples[{g}] is {given!r}: rank group {g} has {r} replicas, so give {r} ints >= 1 summing "
                f"to the micro-batch of {microbatch} samples (global_batch_size / num_microbatches), or None"
            )
        found.append(None if len(set(shares)) == 1 else shares)
    return tuple(found)


def _stage(
    graph: OpGraph, k: int, start: int, stop: int, group: int, ranks: tuple[int, ...], recompute: Recompute
) -> StagePlan:
    held = {p for node in graph.nodes[start:stop] for p in node.params}
    return StagePlan(
        index=k,
        start=start,
        stop=stop,
        first_node=graph.nodes[start].name,
        last_node=graph.nodes[stop - 1].name,
        module_range=module_range(graph, start, stop),
        ranks=ranks,
        rank_group=group,
        recompute=recompute,
        forward_s=0.0,
        backward_s=0.0,
        memory_bytes=0,
        param_bytes=sum(graph.parameters[p].num_bytes for p in held if not graph.parameters[p].is_buffer),
        cut_bytes=0,
    )


def _check_cuts(boundaries: Sequence[int], num_nodes: int) -> tuple[int, ...]:
    cuts = tuple(boundaries)
    ok = (
        len(cuts) >= 2
        and all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
        and cuts[0] == 0
        and cuts[-1] == num_nodes
        and all(a < b for a, b in zip(cuts, cuts[1:]))
    )
    if not ok:
        raise InputError(
            f"boundaries={list(cuts)} are not cut positions: give strictly increasing ints from 0 to "
            f"num_nodes={num_nodes}, e.g. [0, {num_nodes // 2}, {num_nodes}]"
        )
    return cuts


def _sharding_levels(sharding: Any, replicas: Sequence[int]) -> tuple[Sharding, ...]:
    """One level per stage (``replicas[k]``: stage k's replica count); InputError for a level other
    than replicate on a stage with one replica (nothing to shard over)."""
    if isinstance(sharding, (str, Sharding)):
        chosen = (Sharding.parse(sharding),) * len(replicas)
    else:
        chosen = tuple(Sharding.parse(level) for level in sharding)
        if len(chosen) != len(replicas):
            raise InputError(
                f"sharding has {len(chosen)} entries for {len(replicas)} stages: give one per stage or one level"
            )
    for k, (level, r) in enumerate(zip(chosen, replicas)):
        if level is not Sharding.REPLICATE and r == 1:
            raise InputError(
                f"stage {k} has one replica, so sharding={level.value!r} has nothing to shard over: use "
                "'replicate' for it, or give its rank group several replicas"
            )
    return chosen


def _recompute_blocks(count: Any, graph: OpGraph, k: int, cuts: Sequence[int], level: Recompute) -> int | None:
    """Stage k's ``recompute_blocks``: ``count`` where it recomputes, else None; InputError for a
    count that is not a positive int, or above the whole blocks the stage holds."""
    if count is None or level is Recompute.NONE:
        return None
    held = whole_blocks(graph, cuts[k], cuts[k + 1])
    if type(count) is not int or not 1 <= count <= held:
        raise InputError(
            f"recompute_blocks={count!r}, but stage {k} (nodes {cuts[k]}..{cuts[k + 1]}) holds {held} whole block(s): "
            f"give an int from 1 to {held}, or None to recompute every segment"
        )
    return count


def _accumulation(accumulation: Any, levels: Sequence[Sharding]) -> Accumulation:
    """The parsed ``accumulation``; InputError for "sharded" where no stage is sharded."""
    chosen = Accumulation.parse(accumulation)
    if chosen is Accumulation.SHARDED and all(level is Sharding.REPLICATE for level in levels):
        raise InputError(
            "accumulation='sharded' reduce-scatters a sharded stage's gradients in every backward, but no stage "
            "is sharded (every sharding is 'replicate'): give sharding='full_shard' or "
            "'shard_grads_and_optimizer' with several replicas, or leave accumulation out"
        )
    return chosen


def _recompute_flags(recompute: Any, num_stages: int) -> tuple[Recompute, ...]:
    if isinstance(recompute, (bool, str, Recompute)):
        return (Recompute.parse(recompute),) * num_stages
    flags = tuple(Recompute.parse(r) for r in recompute)
    if len(flags) != num_stages:
        raise InputError(f"recompute has {len(flags)} entries for {num_stages} stages: give one per stage or one level")
    return flags


def _version() -> str:
    import partita

    return partita.__version__


def _torch_version() -> str:
    import torch

    return torch.__version__
