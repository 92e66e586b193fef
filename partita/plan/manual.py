"""Plans written by hand: the user (or a test) chooses the cuts, the schedule and the mesh.

A manual plan is a Plan like any other (``method="manual"``): the runtime cannot tell it from
a searched one. It carries no predictions (times and memory are 0), only what the runtime needs::

    plan = manual_plan(graph, [0, 80, graph.num_nodes], schedule="1f1b", num_rank_groups=2,
                       replicas=2, num_microbatches=4, global_batch_size=16)

Stage ``k`` runs on rank group ``stage_rank_groups(schedule, G, S)[k]`` (the placement torch's
schedules use: ``k % G``, or the V shape for ZBV); rank group ``g`` holds ranks
``[g * replicas, (g + 1) * replicas)`` as in ``partita.plan.build.stage_ranks``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from partita.errors import InputError
from partita.plan.build import module_range
from partita.plan.schedules import check_schedule, stage_rank_groups
from partita.types import OpGraph, Plan, Schedule, StagePlan

__all__ = ["manual_plan"]


def manual_plan(
    graph: OpGraph,
    boundaries: Sequence[int],
    *,
    schedule: Schedule | str,
    num_rank_groups: int,
    num_microbatches: int,
    global_batch_size: int,
    replicas: int = 1,
    recompute: bool | Sequence[bool] = False,
    cluster: Mapping[str, Any] | None = None,
) -> Plan:
    """A Plan with stages ``[boundaries[k], boundaries[k + 1])`` of ``graph.nodes``.

    Args:
        boundaries: node positions, strictly increasing from 0 to ``graph.num_nodes``.
        schedule: a ``Schedule`` or its name ("gpipe", "1f1b", "interleaved1f1b", "zbv").
        num_rank_groups: pipeline depth G; ``len(boundaries) - 1`` stages are placed on them.
        replicas: data-parallel replicas of every stage (uniform plans only).
        num_microbatches: micro-batches per replica per step.
        global_batch_size: samples per step over all replicas; must be a multiple of
            ``num_microbatches * replicas``.
        recompute: activation recomputation, for all stages or per stage.
        cluster: ``Cluster.to_dict()`` of the machines; default: ``G * replicas`` CPU ranks on one node.

    Raises InputError when the split, the schedule or the batch do not fit together.
    """
    schedule = Schedule.parse(schedule)
    cuts = _check_cuts(boundaries, graph.num_nodes)
    num_stages = len(cuts) - 1
    _check_counts(num_rank_groups=num_rank_groups, replicas=replicas, num_microbatches=num_microbatches,
                  global_batch_size=global_batch_size)
    check_schedule(schedule, num_microbatches, num_rank_groups, num_stages)
    if global_batch_size % (num_microbatches * replicas):
        raise InputError(
            f"global_batch_size={global_batch_size} is not a multiple of num_microbatches x replicas = "
            f"{num_microbatches} x {replicas}: every micro-batch of every replica must have the same size"
        )
    flags = _recompute_flags(recompute, num_stages)
    groups = stage_rank_groups(schedule, num_rank_groups, num_stages)
    stages = tuple(
        _stage(graph, k, cuts[k], cuts[k + 1], groups[k], replicas, flags[k]) for k in range(num_stages)
    )
    if cluster is None:
        from partita.cost.cluster import Cluster

        n = num_rank_groups * replicas
        cluster = Cluster(device="cpu", num_devices=n, devices_per_node=n).to_dict()
    return Plan(
        graph_fingerprint=graph.fingerprint, cluster=dict(cluster), stages=stages, schedule=schedule,
        global_batch_size=global_batch_size, num_microbatches=num_microbatches,
        microbatch_size=global_batch_size // (num_microbatches * replicas),
        options={"boundaries": list(cuts), "num_rank_groups": num_rank_groups, "replicas": replicas,
                 "recompute": list(flags)},
        method="manual", cost_source="none", partita_version=_version(), torch_version=_torch_version(),
    )


def _stage(graph: OpGraph, k: int, start: int, stop: int, group: int, replicas: int, recompute: bool) -> StagePlan:
    held = {p for node in graph.nodes[start:stop] for p in node.params}
    return StagePlan(
        index=k, start=start, stop=stop, first_node=graph.nodes[start].name, last_node=graph.nodes[stop - 1].name,
        module_range=module_range(graph, start, stop), ranks=tuple(range(group * replicas, (group + 1) * replicas)),
        rank_group=group, recompute=recompute, forward_s=0.0, backward_s=0.0, memory_bytes=0,
        param_bytes=sum(graph.parameters[p].num_bytes for p in held if not graph.parameters[p].is_buffer),
        cut_bytes=0,
    )


def _check_cuts(boundaries: Sequence[int], num_nodes: int) -> tuple[int, ...]:
    cuts = tuple(boundaries)
    ok = (len(cuts) >= 2 and all(isinstance(c, int) and not isinstance(c, bool) for c in cuts)
          and cuts[0] == 0 and cuts[-1] == num_nodes and all(a < b for a, b in zip(cuts, cuts[1:])))
    if not ok:
        raise InputError(f"boundaries={list(cuts)} are not cut positions: give strictly increasing ints from 0 to "
                         f"num_nodes={num_nodes}, e.g. [0, {num_nodes // 2}, {num_nodes}]")
    return cuts


def _check_counts(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{name} must be an int >= 1, got {value!r}")


def _recompute_flags(recompute: bool | Sequence[bool], num_stages: int) -> tuple[bool, ...]:
    if isinstance(recompute, bool):
        return (recompute,) * num_stages
    flags = tuple(bool(r) for r in recompute)
    if len(flags) != num_stages:
        raise InputError(f"recompute has {len(flags)} entries for {num_stages} stages: give one per stage or a bool")
    return flags


def _version() -> str:
    import partita

    return partita.__version__


def _torch_version() -> str:
    import torch

    return torch.__version__
