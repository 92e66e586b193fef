"""Wrap a rank's stage modules for torch.distributed.pipelining and build the plan's schedule.

Glossary
--------
local stage   a stage of the plan that this rank runs: one for GPipe and 1F1B, several for
              Interleaved1F1B (stages g, g + G, ...) and two for ZBV (g and 2G - 1 - g).
root inputs   the flat graph inputs (``flatten_inputs``) a stage reads directly. Every rank
              receives the whole batch, so they never travel by P2P: this rank's replica slice
              of them is passed to ``schedule.step`` as keyword arguments named ``input_<j>``
              (``j``: position in the flat graph inputs). The schedule cuts keyword arguments into
              micro-batches along each input's batch dim (``root_chunk_spec``) and passes
              micro-batch ``i``'s to EVERY local stage's forward for micro-batch ``i``, in all four
              schedules; each ``StageRunner`` picks the inputs its stage reads. The micro-batch
              index travels with the call, so nothing here depends on the order a schedule runs
              forwards in (ZBV interleaves two stages' forwards).
metadata      ``PipelineStage`` gets static ``input_args``/``output_args`` (torch's dynamic
              mode runs stages on ``torch.empty`` inputs and breaks on relayed integer labels).
              ``stage_metadata`` finds them by running all stages once on one micro-batch.
split backward  ZBV runs each backward as an input-gradient pass, then a weight pass that
              torch restricts to parameters whose path meets a received input, each at one node;
              a stage with other parameters (T5's decoder embedding reads only labels) or with a
              weight used at several depths (a layer applied twice) runs its whole backward in
              the first pass instead (``_split_backward_complete``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from partita.capturing.recompute import keeps_dispatched
from partita.runtime.precision import FP32, Compute
from partita.runtime.stage_modes import full_shard_stages, sharded_accumulation_stages, whole_backward_stages
from partita.runtime.stages import StageModule
from partita.types import OpGraph, Plan, Recompute, Schedule

__all__ = [
    "StageMetadata",
    "backward_switches",
    "StageRunner",
    "build_schedule",
    "make_pipeline_stages",
    "rng_and_buffers_restored",
    "root_chunk_spec",
    "root_key",
    "selective_policy",
    "stage_metadata",
]


def root_key(j: int) -> str:
    """Keyword under which flat graph input ``j`` is passed to ``schedule.step`` and the runners."""
    return f"input_{j}"


def selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective recomputation's op policy (``partita.capturing.recompute``, the one the cost model
    counts): keep the outputs of the ops it names (matmuls, attention), recompute the rest."""
    name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
    return CheckpointPolicy.MUST_SAVE if keeps_dispatched(name) else CheckpointPolicy.PREFER_RECOMPUTE


class StageRunner(nn.Module):
    """The module PipelineStage runs: ``forward(*received, **root_inputs)`` -> the stage's outputs.

    ``recompute`` (a ``Recompute`` level) wraps the stage in non-reentrant activation checkpointing:
    full keeps only the stage's inputs between forward and backward and recomputes the rest in
    backward; selective also keeps the outputs of the ops ``selective_policy`` keeps
    (``create_selective_checkpoint_contexts``), so backward recomputes only the others. The RNG
    state is restored for the recomputation (checkpoint's default), so dropout draws the same masks.
    A stage cut into segments (``partita.runtime.segments``: one per whole block it holds) is
    checkpointed segment by segment instead (``recompute_blocks``: only its first that many whole
    blocks' segments, ``StagePlan.recompute_blocks``), and, when this runner is an FSDP2 root, runs
    each block through its own FSDP2 unit. ``of`` builds the runner a stage of a plan takes.

    ``fresh_outputs`` returns copies of the boundary tensors. Zero-bubble schedules detach a
    stage's outputs in place after the input-gradient pass; when autograd saved such a tensor
    for the stage's own backward (softmax, tanh and exp save their result: a GPT-2 cut right
    after an attention softmax sends it), the weight-gradient pass then fails with "Trying to
    use a saved tensor that has been detached in-place".
    """

    def __init__(
        self,
        stage: StageModule,
        recompute: Recompute | bool,
        fresh_outputs: bool = False,
        compute: Compute = FP32,
        recompute_blocks: int | None = None,
    ):
        super().__init__()
        self.stage = stage
        self.recompute = Recompute.parse(recompute)
        self.recompute_blocks = recompute_blocks
        self.fresh_outputs = fresh_outputs and not stage.spec.is_last
        self.compute = compute
        # A variant of ``stage`` (the graph captured at other shapes, holding its tensors) to run in
        # its place: set by ``runtime.sharding.standing_in`` while a variant's step runs through the
        # FSDP2 module that wraps this runner. Kept out of the module tree, which FSDP2 manages.
        self.__dict__["stand_in"] = None

    @classmethod
    def of(cls, stage: StageModule, plan: Plan, compute: Compute = FP32) -> StageRunner:
        """The runner of ``stage`` as ``plan`` runs it: its recomputation (level and blocks), and
        fresh outputs under the zero-bubble schedule."""
        stage_plan = plan.stages[stage.spec.index]
        return cls(
            stage,
            stage_plan.recompute,
            fresh_outputs=plan.schedule is Schedule.ZBV,
            compute=compute,
            recompute_blocks=stage_plan.recompute_blocks,
        )

    def forward(self, *received: torch.Tensor, **root_inputs: Any) -> Any:
        stage = self.stand_in or self.stage
        inputs = (*received, *(root_inputs[root_key(j)] for j in stage.graph_input_indices))
        segmented = stage.__dict__.get("segmented")
        # checkpoint's recomputation restores the autocast state too
        with self.compute.context(recomputes=self.recompute is not Recompute.NONE):
            if segmented is not None:  # by block: each segment checkpointed, each block unit gathered on its own
                units = stage if isinstance(self, FSDPModule) else None  # FSDP2's hooks run inside its root's forward
                out = segmented.run(
                    stage.state_tensors,
                    inputs,
                    recompute=self.recompute,
                    recompute_blocks=self.recompute_blocks,
                    units=units,
                    context_fn=_SELECTIVE_CONTEXTS,
                )
            elif self.recompute is Recompute.FULL:
                out = checkpoint(stage, *inputs, use_reentrant=False)
            elif self.recompute is Recompute.SELECTIVE:
                out = checkpoint(stage, *inputs, use_reentrant=False, context_fn=_SELECTIVE_CONTEXTS)
            else:
                out = stage(*inputs)
        if stage.spec.is_last:
            return out
        out = tuple(self.compute.boundary(t) for t in out)
        return tuple(t.clone() for t in out) if self.fresh_outputs else out


_SELECTIVE_CONTEXTS = functools.partial(create_selective_checkpoint_contexts, selective_policy)


def root_chunk_spec(graph: OpGraph, indices: Sequence[int]) -> dict[str, Any]:
    """How ``schedule.step`` cuts each root input into micro-batches: along its batch dim, or
    replicated (inputs without a batch dim, non-tensor inputs). Keys in ``indices`` order, the
    order the keyword arguments must be given in (torch zips the two flattened dicts)."""
    spec: dict[str, Any] = {}
    for j in indices:
        info = graph.inputs[j].tensor
        spec[root_key(j)] = (
            TensorChunkSpec(info.batch_dim) if info is not None and info.batch_dim is not None else _Replicate()
        )
    return spec


@dataclass(frozen=True)
class StageMetadata:
    """What PipelineStage needs to know of one stage before it runs."""

    input_args: tuple[torch.Tensor, ...]  # received boundary tensors (shapes, dtypes, requires_grad)
    output_args: tuple[torch.Tensor, ...]  # sent boundary tensors, or the 0-dim loss on the last stage
    split_backward_complete: bool  # torch's input/weight backward split reaches every parameter


def stage_metadata(
    stages: Sequence[StageModule],
    flat_microbatch: Sequence[Any],
    device: torch.device,
    compute: Compute = FP32,
    run: Callable[[StageModule, Sequence[Any], Sequence[Any]], Any] | None = None,
) -> list[StageMetadata]:
    """The metadata of every stage of the plan, from one real micro-batch.

    All stages run in sequence, with autograd on (``requires_grad`` of each boundary tensor is
    part of the metadata: a float tensor that does not depend on a parameter gets no gradient).
    The RNG state and every buffer are restored afterwards, so training continues exactly as if
    this run had not happened (BatchNorm statistics, dropout streams). Stage outputs are detached
    between stages, so only one stage's activations are alive at a time. Stages run in ``compute``'s
    precision, and record the dtypes their runners send (precision.py). ``run(stage, received,
    graph_inputs)`` runs one stage where calling it does not do (stages that exchange parts of
    their boundary values: ``partita.runtime.tensor_parallel_rewrite.run_whole``).
    """
    metadata = []
    received: tuple[torch.Tensor, ...] = ()
    with rng_and_buffers_restored(stages, device):
        for stage in stages:
            with compute.context():
                graph_inputs = stage.graph_inputs(flat_microbatch)
                out = stage(*received, *graph_inputs) if run is None else run(stage, received, graph_inputs)
            outputs = (out,) if stage.spec.is_last else tuple(compute.boundary(t) for t in out)
            complete = _split_backward_complete(stage, received, outputs)
            outputs = tuple(_detached(t) for t in outputs)
            metadata.append(StageMetadata(received, outputs, complete))
            received = outputs
    return metadata


def _split_backward_complete(
    stage: StageModule, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]
) -> bool:
    """Whether zero-bubble schedules' split backward computes every weight gradient of the stage.

    torch's input-gradient pass (``stage_backward_input``) keeps, for the later weight pass, the
    gradients at the nodes where a parameter's path meets a path from a received input. A
    parameter with a path to the outputs that meets no such node (T5's decoder embedding reads
    only the labels; its relative position bias, sent on to the next stage, only positions)
    would silently lose that part of its gradient; a parameter whose path meets the inputs' at
    several nodes (weights reused at several depths) makes torch's weight pass walk a freed graph.
    Such a stage runs its whole backward at once. The walk uses torch's own graph helpers, so the
    answer is torch's.
    """
    from torch.distributed.pipelining import _backward as tb

    if stage.spec.is_first:  # torch runs the first stage's whole backward in its weight pass
        return True
    out_fns = {tb._get_grad_fn_or_grad_acc(t) for t in outputs if t.requires_grad} - {None}
    in_fns = [fn for fn in (tb._get_grad_fn_or_grad_acc(t) for t in inputs if t.requires_grad) if fn is not None]
    reverse = tb.construct_reverse_graph(list(out_fns))
    from_inputs, _ = tb.reverse_closure(in_fns, set(), reverse)
    for p in stage.parameters():
        if p.requires_grad:
            # Nodes downstream of p, stopping where a path from the inputs joins (those are covered).
            downstream, joins = tb.reverse_closure([tb._get_grad_fn_or_grad_acc(p)], from_inputs, reverse)
            if downstream & out_fns:
                return False
            # A weight that joins the inputs' path at several nodes (one layer's weights applied at
            # several depths of the stage): torch's weight pass walks from every join with the
            # graph freed after the first walk, and fails ("backward through the graph a second time").
            if len(joins) > 1:
                return False
    return True


def make_pipeline_stages(
    stages: Sequence[StageModule],
    plan: Plan,
    metadata: Sequence[tuple],
    device: torch.device,
    pp_group: Any,
    runners: Mapping[int, nn.Module] | None = None,
    compute: Compute = FP32,
) -> list[PipelineStage]:
    """One PipelineStage per local stage (``stages``) of ``plan``, with static metadata; ``runners``
    by stage index are used as they are (sharded ones, sharding.py), the other stages get their
    ``StageRunner.of``. Some stages run their whole backward in the input-gradient pass of a
    split-backward schedule (``stage_modes.whole_backward_stages`` says which and why); the fully
    sharded ones, and those that reduce-scatter every backward, take their ``backward_switches``."""
    whole_backward, full_shard = whole_backward_stages(plan), full_shard_stages(plan)
    sharded_accumulation = sharded_accumulation_stages(plan)
    result = []
    for stage in stages:
        meta = metadata[stage.spec.index]
        runner = (runners or {}).get(stage.spec.index) or StageRunner.of(stage, plan, compute)
        # A dw_builder makes the input-gradient pass a full backward, and the weight pass a no-op.
        split = meta.split_backward_complete and stage.spec.index not in whole_backward
        whole = None if split else _no_weight_pass
        result.append(
            _PartitaStage(
                runner,
                stage_index=stage.spec.index,
                num_stages=stage.spec.num_stages,
                device=device,
                input_args=meta.input_args,
                output_args=meta.output_args,
                group=pp_group,
                dw_builder=whole,
                full_shard=stage.spec.index in full_shard,
                sharded_accumulation=stage.spec.index in sharded_accumulation,
            )
        )
    return result


def backward_switches(
    runner: nn.Module, *, last: bool, full_shard: bool, sharded_accumulation: bool = False, is_last: bool = False
) -> None:
    """FSDP2's switches for one micro-batch's backward of a sharded stage's ``runner`` (each of its
    units, recursively): gradients reduce-scattered unit by unit as each one's backward ends on the
    step's ``last`` backward (before it, they accumulate unreduced), or on every backward under
    ``sharded_accumulation`` (``Accumulation.SHARDED``: FSDP2 sums them into the shards); a
    ``full_shard`` stage's units resharded after every backward, so that one block's weights are
    gathered at a time in backward too (a ZeRO-2 stage keeps them gathered until the last).
    ``is_last``: FSDP2's root finishes the step itself at the end of this backward (else
    ``perform_reduce_grad`` does)."""
    runner.set_is_last_backward(is_last)
    runner.set_reshard_after_backward(last or full_shard)
    runner.set_requires_gradient_sync(last or sharded_accumulation)


class _PartitaStage(PipelineStage):
    """torch's PipelineStage, with partita's FSDP2 switches for a sharded stage (``backward_switches``)
    in place of torch's, which keep every unit gathered and every gradient unreduced until the end
    of the step: here the last backward reduce-scatters each block's gradients as its backward ends,
    and a fully sharded stage gathers one block at a time in backward too."""

    def __init__(self, *args: Any, full_shard: bool = False, sharded_accumulation: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.full_shard, self.sharded_accumulation = full_shard, sharded_accumulation

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        backward_switches(
            self.submod,
            last=last_backward,
            full_shard=self.full_shard,
            sharded_accumulation=self.sharded_accumulation,
        )
        if backward_type == "full":
            grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
            return grads, None
        if backward_type == "input":
            return stage_backward_input(
                bwd_kwargs["stage_output"],
                bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"],
                self.submod.parameters(),
            )
        return stage_backward_weight(self.submod.parameters(), bwd_kwargs["param_groups"]), None


def _no_weight_pass() -> Callable[[], None]:
    return lambda: None


def build_schedule(
    schedule: Schedule, pipeline_stages: list[PipelineStage], num_microbatches: int, chunk_spec: dict[str, Any]
) -> Any:
    """The torch schedule for the plan. Gradients are left unscaled (``scale_grads=False``):
    ``GradientSync`` divides each unique parameter once (a tied parameter in two local stages
    would be divided twice by torch)."""
    common = dict(n_microbatches=num_microbatches, loss_fn=stage_loss, kwargs_chunk_spec=chunk_spec, scale_grads=False)
    if schedule is Schedule.GPIPE:
        return ScheduleGPipe(pipeline_stages[0], **common)
    if schedule is Schedule.ONE_F_ONE_B:
        return Schedule1F1B(pipeline_stages[0], **common)
    if schedule is Schedule.INTERLEAVED_1F1B:
        return ScheduleInterleaved1F1B(pipeline_stages, **common)
    if schedule is Schedule.ZBV:
        return ScheduleZBVZeroBubble(pipeline_stages, **common)
    raise AssertionError(f"unhandled schedule {schedule}")


def stage_loss(output: torch.Tensor, target: Any) -> torch.Tensor:
    """The schedule's loss function: the last stage already returns the 0-dim loss (the
    micro-batch's mean, or its part of the full-batch loss when loss_scaling.py rewrote the
    stage); ``target`` is a dummy the schedule insists on."""
    return output


def _detached(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.requires_grad)


@contextlib.contextmanager
def rng_and_buffers_restored(stages: Sequence[StageModule], device: torch.device) -> Iterator[None]:
    """Run the body in a fork of the RNG state, and put every buffer of ``stages`` back afterwards."""
    buffers = {id(b): b for stage in stages for b in stage.buffers()}
    saved = {key: b.detach().clone() for key, b in buffers.items()}
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for key, b in buffers.items():
                b.copy_(saved[key])
