"""Tensor parallelism at run time: split the stages' weights over a group, rewrite their graphs.

Stage ``k`` of degree ``t_k`` (``StagePlan.tensor_parallel``) runs every replica on a group of
``t_k`` consecutive ranks of one node (``StagePlan.replica_ranks``). The ranks with index ``i`` in
their groups see a plan of their own (``local_plan``: each stage's ranks of index ``i mod t_k``),
which trains as a plan without tensor parallelism -- pipelines, replicas, sharding, loss
scaling -- and the groups meet only inside the stages:

* ``stage_analyses`` finds the layout of every stage's graph at its degree
  (``partita.capturing.tensor_parallel``); a weight several stages read (tied embeddings) is split
  only where all of them split it alike, at one degree;
* ``shard_parameters`` gives each stage this rank's part of every split weight (a new Parameter,
  before the optimizer and FSDP2 see it);
* ``rewrite_stage`` (``tensor_parallel_rewrite.py``, after the loss rewriting of loss_scaling.py)
  inserts the collectives of ``tensor_parallel_ops`` into the stage graph and divides the size
  arguments of the views.

Explicit collectives, not DTensor: the stage graphs stay plain tensors, so FSDP2, the
pipelines, recomputation and bf16 autocast work on them unchanged, and a fused QKV projection
(one weight holding query, key and value) splits by heads, which no DTensor placement expresses.
Boundary tensors between stages are whole (replicated in the group), and so are their gradients:
each rank of a group sends its copy along its own pipeline (under sequence parallelism, see below,
a token-split one crosses in part). Where the stages on both sides of a
boundary have different degrees (stages on device types of their own, a mixed cluster's plan;
partita's executor runs them), the receiving rank of index ``i`` takes the tensor from the sending
rank of index ``i mod t_k`` and sends its gradient back to the sending ranks of the indices ``j``
with ``j mod t_{k+1} = i`` (``partita.runtime.uneven``).

Sequence parallelism (``StagePlan.sequence_parallel``; ``partita.capturing.sequence_parallel``) also
splits the regions between them by token: row-parallel outputs are reduce-scattered, the inputs of
column-parallel matmuls all-gathered, and a stage takes its part of a received value the whole
graph splits, and gathers whole what it sends -- except between two stages of one degree that
both split the value alike, which exchange each rank's tokens (``boundary_parts``). The weights
broadcast over the tokens (norms' weights and biases, row-parallel biases) get each rank's tokens'
part of their gradient, summed over the group once per step (``partial_gradients``,
``GradientSync.sum_over``), not after every micro-batch. Checkpoints and ``gather_state_dict`` hold whole tensors
under the original names (``gather_full``), so any plan, or the plain model, loads them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from partita.capturing.sequence_parallel import TokenSplit, analyze_sequence, whole_graph_splits
from partita.capturing.tensor_parallel import TensorParallelAnalysis, analyze
from partita.errors import InputError
from partita.runtime.stages import StageModule, boundary_tensor, contiguous_grad
from partita.types import OpGraph, Plan
from partita.types.tensor_parallel import ParamShard

__all__ = [
    "TensorParallel",
    "gather_full",
    "local_part",
    "local_plan",
    "process_group",
    "shard_parameters",
    "spanning_degrees",
    "stage_analyses",
    "stage_degrees",
]

_GROUPS: dict[int, dist.ProcessGroup] = {}  # key (an int in the FX graphs) -> group


@dataclass(frozen=True, eq=False)
class TensorParallel:
    """This rank's tensor-parallel group: ``degree`` ranks, this one ``index``-th; ``analyses``:
    stage index -> the layout of that stage's graph, for every stage of a degree above 1 (each at
    its own, ``degrees``; with its ``sequence`` analysis when ``sequence_parallel``); ``parts_sent``:
    the boundary values that travel in part (``boundary_parts``)."""

    degree: int
    index: int
    group: dist.ProcessGroup | None
    analyses: Mapping[int, TensorParallelAnalysis]
    sequence_parallel: bool = False
    degrees: Mapping[int, int] | None = None  # stage index -> its degree; None: ``degree`` for every stage
    parts_sent: Mapping[tuple[int, str], TokenSplit] = field(default_factory=dict)

    @property
    def key(self) -> int:
        """The group as FX graphs name it (an int: a ProcessGroup has no source form); ``process_group``
        gives it back."""
        _GROUPS[id(self.group)] = self.group
        return id(self.group)

    def shards(self) -> dict[str, ParamShard]:
        """Canonical name -> how it is split, over every stage of this rank's degree (a weight read by
        stages of different degrees is whole in all of them)."""
        return {
            name: s
            for k, a in self.analyses.items()
            if self.degree_of(k) == self.degree
            for name, s in a.layout.params.items()
        }

    def degree_of(self, stage: int) -> int:
        return self.degree if self.degrees is None else self.degrees[stage]

    def sent_in_part(self, stage: int) -> dict[str, TokenSplit]:
        """Value name -> token split, of what stage ``stage`` sends to the next in part."""
        return {name: split for (k, name), split in self.parts_sent.items() if k == stage}

    def boundary_shapes(self, stage: int, names: Sequence[str], tensors: Sequence[Any], *, sent: bool) -> tuple:
        """``tensors`` (the boundary values ``names`` of ``stage`` at their whole shapes: what it
        receives, or with ``sent`` what it sends) as they travel: the parts of those sent in part
        (empty tensors of the part's shape, same dtype, device and ``requires_grad``)."""
        parts = self.sent_in_part(stage if sent else stage - 1)
        out = []
        for name, t in zip(names, tensors):
            split = parts.get(name)
            if split is not None:
                shape = list(t.shape)
                shape[split.dim] //= self.degree_of(stage)
                t = torch.empty(shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)
            out.append(t)
        return tuple(out)


def process_group(key: int) -> dist.ProcessGroup:
    """The group of a ``TensorParallel.key`` (how the rewritten stage graphs find theirs)."""
    return _GROUPS[key]


def local_plan(plan: Plan, index: int) -> Plan:
    """The plan the ranks of tensor-parallel index ``index`` see: each stage's ranks of index
    ``index mod`` its degree, degree 1. With one degree for every stage these views partition the
    ranks; where degrees differ, a rank of index 1 in a group of 2 sees a stage of degree 1 whole,
    as index 0 does (``partita.runtime.uneven`` sends such a stage's tensors to both)."""
    stages = tuple(
        dataclasses.replace(
            s,
            ranks=s.ranks[index % s.tensor_parallel :: s.tensor_parallel],
            tensor_parallel=1,
            sequence_parallel=False,
        )
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)


# ----------------------------------------------------------------------------- layouts


def stage_analyses(
    graph: OpGraph, stages: Sequence[StageModule], degree: int | Mapping[int, int], sequence_parallel: bool = False
) -> dict[int, TensorParallelAnalysis]:
    """The layout of every stage's graph at its degree (``degree``: one for all, or stage index ->
    degree; stages of degree 1 are not analysed, their weights stay whole); a weight read by
    several stages is split only when every one of them splits it the same way at the same degree
    (their gradients are summed shard by shard). With ``sequence_parallel`` each analysis has its
    ``sequence`` one, the received values that the whole graph splits by token taken in part at
    the stage's start."""
    degrees = {s.spec.index: degree if isinstance(degree, int) else degree[s.spec.index] for s in stages}
    split = [s for s in stages if degrees[s.spec.index] > 1]
    whole: set[str] = set()
    while True:
        found = {s.spec.index: _analyze_stage(graph, s, degrees[s.spec.index], whole) for s in split}
        ways: dict[str, set] = {}
        for stage in stages:
            k = stage.spec.index
            layout = found[k].layout if k in found else None
            for name in stage.spec.param_names:
                shard = layout.params.get(name) if layout is not None else None
                ways.setdefault(name, set()).add(None if shard is None else (degrees[k], shard))
        disagree = {name for name, w in ways.items() if len(w) > 1} - whole
        if not disagree:
            break
        whole |= disagree
    if sequence_parallel:
        splits = {t: whole_graph_splits(graph, t) for t in sorted({degrees[s.spec.index] for s in split})}
        for stage in split:
            k = stage.spec.index
            found[k].sequence = _sequence_of_stage(stage, found[k], splits[degrees[k]])
    return found


def boundary_parts(
    all_stages: Sequence[StageModule], analyses: Mapping[int, TensorParallelAnalysis], degrees: Mapping[int, int]
) -> dict[tuple[int, str], TokenSplit]:
    """(sending stage, value name) -> token split, of the boundary values that travel in part: where
    stages ``k`` and ``k + 1`` run sequence parallelism at one degree, ``k`` holds the value split by
    token (it would gather it whole to send it) and ``k + 1`` takes the same part of it at its start
    (it would slice it again). Each rank then sends and receives its own tokens, as Megatron-LM does:
    the transfer and the received tensor that the stage keeps shrink by the degree, and neither the
    gather nor the slice runs. Any other boundary value travels whole, in particular between stages of
    different degrees (``partita.runtime.uneven`` sends one rank's copy to several)."""
    by_index = {s.spec.index: s for s in all_stages}
    found: dict[tuple[int, str], TokenSplit] = {}
    for k, stage in sorted(by_index.items()):
        after = by_index.get(k + 1)
        here, there = analyses.get(k), analyses.get(k + 1)
        if after is None or here is None or there is None or here.sequence is None or there.sequence is None:
            continue
        if degrees[k] != degrees[k + 1]:
            continue
        output = next(n for n in stage.graph_module.graph.nodes if n.op == "output")
        sent = [node.name for node in output.args[0]]  # the boundary_tensor wrapper of each output
        for name, node_name in zip(stage.spec.output_names, sent):
            mine, theirs = here.sequence.whole_gathers.get(node_name), there.sequence.sources.get(name)
            if mine is not None and theirs is not None and (mine.dim, mine.inner) == (theirs.dim, theirs.inner):
                found[(k, name)] = theirs
    return found


def _sequence_of_stage(stage: StageModule, analysis: TensorParallelAnalysis, splits: Mapping[str, TokenSplit]):
    """The sequence-parallel analysis of one stage's graph (its received values split as ``splits``)."""
    gm = stage.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    params = {node.name: name for node, name in zip(placeholders, stage.spec.param_names)}
    received = {name: splits[name] for name in stage.spec.input_names if name in splits}
    return analyze_sequence(gm.graph, analysis, params=params, inputs=received)


def _analyze_stage(graph: OpGraph, stage: StageModule, degree: int, whole: set[str]) -> TensorParallelAnalysis:
    gm = stage.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = list(stage.spec.param_names)
    params = {node.name: name for node, name in zip(placeholders, names)}
    for node, name in zip(placeholders, names):  # parameter placeholders carry no value: give them their shape
        if "val" not in node.meta:
            info = graph.parameters[name]
            node.meta["val"] = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device="meta")
    for node in gm.graph.nodes:
        if node.op == "call_function" and "val" not in node.meta and node.target in (contiguous_grad, boundary_tensor):
            source = node.args[0]
            if isinstance(source, torch.fx.Node) and "val" in source.meta:
                node.meta["val"] = source.meta["val"]
    return analyze(gm.graph, degree, params=params, replicated=whole & set(names))


# ----------------------------------------------------------------------------- parameters


def local_part(tensor: torch.Tensor, shard: ParamShard, index: int, degree: int) -> torch.Tensor:
    """Part ``index`` of ``degree`` of ``tensor`` as ``shard`` splits it (a new contiguous tensor)."""
    d, k = shard.dim, shard.blocks
    if shard.whole:  # does not divide: parts rounded up, the last one padded with zeros
        size = -(-shard.whole // degree)
        pad = [0, 0] * (tensor.dim() - 1 - d) + [0, size * degree - shard.whole]
        return (
            torch.nn.functional.pad(tensor, pad)
            .narrow(d, index * size, size)
            .clone(memory_format=torch.contiguous_format)
        )
    per_block = tensor.shape[d] // k
    size = per_block // degree
    blocks = tensor.unflatten(d, (k, per_block))
    return blocks.narrow(d + 1, index * size, size).flatten(d, d + 1).clone(memory_format=torch.contiguous_format)


def whole_from_parts(parts: Sequence[torch.Tensor], shard: ParamShard) -> torch.Tensor:
    """The inverse of ``local_part`` over all the group's parts, in index order."""
    d, k = shard.dim, shard.blocks
    if shard.whole:
        return torch.cat(list(parts), dim=d).narrow(d, 0, shard.whole)
    split = [p.unflatten(d, (k, p.shape[d] // k)) for p in parts]
    return torch.cat(split, dim=d + 1).flatten(d, d + 1)


def gather_full(tensor: torch.Tensor, shard: ParamShard, tp: TensorParallel) -> torch.Tensor:
    """The whole tensor from every rank's part (collective over the group); a sharded stage's
    DTensor part is first gathered over its replicas."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    parts = [torch.empty_like(tensor) for _ in range(tp.degree)]
    dist.all_gather(parts, tensor.detach().contiguous(), group=tp.group)
    return whole_from_parts(parts, shard)


def shard_parameters(stages: Sequence[StageModule], tp: TensorParallel, *, release_whole: bool = False) -> None:
    """Give every stage this rank's part of each weight its layout splits: one new Parameter per
    weight, shared by the stages that read it. ``release_whole``: the whole weights are partita's
    own (allocated from a seed checkpoint for a model built on meta): their storage is freed once
    the parts are made, so that a rank holds its parts alone (training updates the parts,
    checkpoints gather them whole). Each keeps its shape, as a zero-stride view of one element, so
    that the model can still be captured again (evaluation at other shapes)."""
    made: dict[str, torch.Tensor] = {}
    whole: list[torch.Tensor] = []
    for stage in stages:
        layout = tp.analyses[stage.spec.index].layout
        tensors = stage.state_tensors()
        local = {}
        for name, shard in layout.params.items():
            if name not in made:
                t = tensors[name]
                part = local_part(t.detach(), shard, tp.index, tp.degree)
                made[name] = nn.Parameter(part, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else part
                whole.append(t)
            local[name] = made[name]
        stage.rebind(local)
    for t in whole if release_whole else ():
        t.data = t.new_zeros(()).expand(t.shape)


# ----------------------------------------------------------------------------- the trainer's part


def start_tensor_parallel(
    graph: OpGraph,
    topology: Any,
    all_stages: Sequence[StageModule],
    own: Sequence[StageModule],
    job: Plan,
    *,
    release_whole: bool = False,
) -> TensorParallel | None:
    """This rank's TensorParallel (None when its stages have degree 1), with its stages' weights
    split (``release_whole``: as ``shard_parameters`` takes it); ``job``: the whole plan (every
    stage's degree)."""
    if topology.tensor_parallel == 1:
        return None
    degree, sequence = topology.tensor_parallel, topology.sequence_parallel
    degrees = stage_degrees(job)
    analyses = stage_analyses(graph, all_stages, degrees, sequence)
    parts = boundary_parts(all_stages, analyses, degrees) if sequence else {}
    tp = TensorParallel(degree, topology.tp_index, topology.tp_group, analyses, sequence, degrees, parts)
    shard_parameters(own, tp, release_whole=release_whole)
    return tp


def stage_degrees(plan: Plan) -> dict[int, int]:
    """Stage index -> its tensor-parallel degree."""
    return {s.index: s.tensor_parallel for s in plan.stages}


def program_layouts(tp: TensorParallel, graph: OpGraph, all_stages: Sequence[StageModule]) -> TensorParallel:
    """The TensorParallel of a program's stages (the planned graph after its loss rewriting, or a
    variant captured at other shapes), which must split the weights as the planned stages do."""
    degrees = tp.degrees if tp.degrees is not None else tp.degree
    found = stage_analyses(graph, all_stages, degrees, tp.sequence_parallel)
    ours = tp.shards()
    theirs = dataclasses.replace(tp, analyses=found).shards()
    if theirs != ours:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
        raise InputError(
            f"the graph captured at these shapes splits its weights differently over the tensor-parallel group "
            f"than the planned one ({differ} ...): pad the batches to the planned shapes, or plan with "
            "tensor_parallel=1"
        )
    parts = {}
    if tp.sequence_parallel:
        parts = boundary_parts(all_stages, found, {s.spec.index: tp.degree_of(s.spec.index) for s in all_stages})
    return dataclasses.replace(tp, analyses=found, parts_sent=parts)


def spanning_degrees(full: Plan, stages: Sequence[StageModule]) -> dict[str, tuple[int, ...]]:
    """The weights read by stages of different degrees (whole in all of them: ``stage_analyses``),
    each with every rank holding it. Each replica's gradient is on all ranks of its group alike, so
    the sum over holders takes it from the ranks of index 0 only (``GradientSync``)."""
    degrees: dict[str, set[int]] = {}
    ranks: dict[str, set[int]] = {}
    for stage in stages:
        planned = full.stages[stage.spec.index]
        for name in stage.spec.param_names:
            degrees.setdefault(name, set()).add(planned.tensor_parallel)
            ranks.setdefault(name, set()).update(planned.ranks)
    return {name: tuple(sorted(ranks[name])) for name, d in degrees.items() if len(d) > 1}


def holder_sets(
    full: Plan, holders_of: Any, stages: Sequence[StageModule], spanning: Mapping[str, tuple[int, ...]]
) -> list[tuple[int, ...]]:
    """The sets of ranks that sum a gradient, over every tensor-parallel index, in one order: each
    index's holders of a weight (``local_plan``), and all holders of a weight of ``spanning``."""
    sets: set[tuple[int, ...]] = {h for h in spanning.values() if len(h) > 1}
    for i in range(full.tensor_parallel):
        held = holders_of(local_plan(full, i), stages)
        sets |= {tuple(h) for name, h in held.items() if len(h) > 1 and name not in spanning}
    return sorted(sets)


def tensor_parallel_sync(
    full: Plan, tp: TensorParallel | None, all_stages: Sequence[StageModule], holders_of: Any
) -> dict[str, Any]:
    """GradientSync's tensor-parallel arguments: every index's holder sets (all ranks create the
    same groups, whatever their own degree), the weights whose holders span degrees, this rank's
    index and its split parameters (each index's part counts in the norm)."""
    if full.tensor_parallel == 1:
        return {}
    spanning = spanning_degrees(full, all_stages)
    return {
        "group_sets": holder_sets(full, holders_of, all_stages, spanning),
        "spanning": spanning,
        "tp_index": 0 if tp is None else tp.index,
        "tp_split": set() if tp is None else set(tp.shards()),
    }


def whole_tensors(held: Mapping[str, torch.Tensor], tp: TensorParallel | None) -> dict[str, torch.Tensor]:
    """``held`` with every tensor-parallel part gathered whole (collective over the group, in name
    order); a sharded stage's DTensor is first gathered over its replicas."""
    if tp is None:
        return dict(held)
    shards = tp.shards()
    return {name: gather_full(t, shards[name], tp) if name in shards else t for name, t in sorted(held.items())}
