"""One captured graph as this rank runs it: the plan's stages, the loss rewriting, the pipeline.

The Trainer keeps one StepProgram for the graph the plan was made for, and one per variant
(another sequence length, eval mode: partita.runtime.variants), all reading the same tensors.
A program's pipeline -- the torch schedule of a uniform plan, or partita's executor of an uneven
one -- is built at its first use, from one micro-batch of the shapes it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.runtime.batch_values import index_uses
from partita.runtime.loss_scaling import LossScaling
from partita.runtime.pipeline import (
    StageMetadata,
    build_schedule,
    make_pipeline_stages,
    root_chunk_spec,
    root_key,
    stage_metadata,
)
from partita.runtime.precision import FP32, Compute, align_norm_weights, drop_dtype_assertions
from partita.runtime.process_groups import Topology
from partita.runtime.segments import check_recompute_blocks, runs_by_block, segment_stage
from partita.runtime.sharding import gathered, standing_in
from partita.runtime.stage_modes import sharded_stages
from partita.runtime.stages import StageModule, narrow_batch
from partita.runtime.tensor_parallel import TensorParallel, program_layouts
from partita.runtime.tensor_parallel_rewrite import partial_gradients, rewrite_stage, run_whole
from partita.runtime.uneven import UnevenExecutor
from partita.types import OpGraph, Plan

__all__ = ["StepProgram"]


class StepProgram:
    """``graph`` split into the plan's stages (``all_stages``), this rank's ``stages``, their
    ``loss_scaling`` (over ``accumulation_steps`` pipeline rounds per step), ``index_uses``
    (the inputs read as ids or labels, checked every step) and, with tensor parallelism, the
    stages' layouts (this rank's stages rewritten to run on its group). ``plan`` is this rank's
    view of ``job_plan`` (``partita.runtime.tensor_parallel.local_plan``)."""

    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        topology: Topology,
        all_stages: list[StageModule],
        *,
        accumulation_steps: int,
        runners: dict[int, nn.Module] | None = None,
        compute: Compute = FP32,
        tensor_parallel: TensorParallel | None = None,
        job_plan: Plan | None = None,
    ):
        self.graph, self.plan, self.topology, self.all_stages = graph, plan, topology, all_stages
        self.job_plan = plan if job_plan is None else job_plan  # every rank's (``plan``: this rank's view)
        if compute.low is not None:
            drop_dtype_assertions(all_stages)
        group = topology.rank_group
        self.stages = [s for s in all_stages if plan.stages[s.spec.index].rank_group == group]
        if compute.low is not None:  # FSDP2 gathers these stages' weights in bf16 (precision.py)
            align_norm_weights([s for s in self.stages if s.spec.index in sharded_stages(plan)])
        self.index_uses = index_uses(graph)
        self.loss_scaling = LossScaling(
            graph,
            plan,
            all_stages,
            self.stages,
            topology.device,
            accumulation_steps=accumulation_steps,
            replica=topology.replica,
        )
        # after the loss rewriting: the vocab-parallel cross-entropy takes over its (sum) reduction
        self.tensor_parallel = None if tensor_parallel is None else program_layouts(tensor_parallel, graph, all_stages)
        # the gradients left as each rank's tokens' part, summed over its group once per step
        self.partial_gradients: frozenset[str] = frozenset()
        if self.tensor_parallel is not None:
            self.partial_gradients = partial_gradients(self.stages, self.tensor_parallel)
        for stage in self.stages if self.tensor_parallel is not None else ():
            rewrite_stage(stage, self.tensor_parallel, self.partial_gradients)
        for stage in self.stages:  # after every rewrite: the segments cut the graph as it runs
            stage_plan = plan.stages[stage.spec.index]
            check_recompute_blocks(stage_plan, graph)
            if runs_by_block(stage_plan, compiled=plan.compile):
                stage.__dict__["segmented"] = segment_stage(stage, graph, compiled=plan.compile)
        self.root_indices = sorted({j for s in self.stages for j in s.graph_input_indices})
        self._schedule: Any = None  # uniform plans: the torch schedule
        self._executor: UnevenExecutor | None = None  # uneven plans
        self._dummy_target: torch.Tensor | None = None
        self._metadata: list[StageMetadata] = []
        self.runners = runners or {}  # stage index -> the FSDP2 module that runs it (sharding.py)
        self.compute = compute

    @property
    def built(self) -> bool:
        return self._schedule is not None or self._executor is not None

    def build(self, flat_microbatch: Sequence[Any], metadata: list[StageMetadata] | None = None) -> None:
        """The pipeline, from one micro-batch of this rank's size (or the static ``metadata`` found
        on meta): the plan's torch schedule (uniform) or the uneven executor for this rank's stage."""
        plan, top = self.plan, self.topology
        flat_microbatch = [x.to(top.device) if isinstance(x, torch.Tensor) else x for x in flat_microbatch]
        if metadata is None:
            with gathered(self.runners):  # the stages read whole parameters, not shards
                run = self._run_whole if self.tensor_parallel is not None else None
                metadata = stage_metadata(self.all_stages, flat_microbatch, top.device, self.compute, run)
        metadata = self._metadata = self._as_sent(metadata)
        if not top.uniform:
            stage = self.stages[0]  # uneven plans run one stage per rank group
            self._executor = UnevenExecutor(
                self.graph,
                plan,
                stage,
                top.replica,
                metadata[stage.spec.index],
                top.device,
                group=top.world_group,
                compute=self.compute,
                runner=self.runners.get(stage.spec.index),
                job_plan=self.job_plan,
                tp_index=top.tp_index,
            )
            return
        pipeline_stages = make_pipeline_stages(
            self.stages,
            plan,
            metadata,
            top.device,
            top.pp_group,
            self.runners,
            self.compute,
        )
        chunks = root_chunk_spec(self.graph, self.root_indices)
        self._schedule = build_schedule(plan.schedule, pipeline_stages, plan.num_microbatches, chunks)
        # The schedule cuts `target` into micro-batches and hands them to the loss function,
        # which ignores them: the last stage computes the loss itself.
        self._dummy_target = torch.zeros(plan.num_microbatches, device=top.device)

    def _run_whole(self, stage: StageModule, received: Sequence[Any], graph_inputs: Sequence[Any]) -> Any:
        """A stage in ``stage_metadata``'s run: this rank's (rewritten, exchanging parts) on whole values."""
        if stage not in self.stages:
            return stage(*received, *graph_inputs)
        return run_whole(self.tensor_parallel, stage, received, graph_inputs)

    def _as_sent(self, metadata: list[StageMetadata]) -> list[StageMetadata]:
        """``metadata`` (whole boundary values) with the values that travel in part at their parts' shapes."""
        tp = self.tensor_parallel
        if tp is None or not tp.parts_sent:
            return metadata
        result = []
        for stage, meta in zip(self.all_stages, metadata):
            spec = stage.spec
            received = tp.boundary_shapes(spec.index, spec.input_names, meta.input_args, sent=False)
            sent = meta.output_args
            if not spec.is_last:
                sent = tp.boundary_shapes(spec.index, spec.output_names, meta.output_args, sent=True)
            result.append(dataclasses.replace(meta, input_args=received, output_args=sent))
        return result

    def run(self, local: list, *, forward_only: bool = False) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch of one pipeline round (``forward_only``: the
        forwards, under no_grad); the last stage's micro-batch losses ([] elsewhere)."""
        with standing_in(self.runners, self.stages):  # a variant's stages run through the FSDP2 modules
            if self._executor is not None:
                return self._executor.step(local, forward_only=forward_only)
            if forward_only:
                return self._forward_chain(local)
            losses: list[torch.Tensor] = []
            roots = {root_key(j): local[j] for j in self.root_indices}
            self._schedule.step(target=self._dummy_target, losses=losses, return_outputs=False, **roots)
            return losses

    def _forward_chain(self, local: list) -> list[torch.Tensor]:
        """Forwards of a uniform plan without a schedule: micro-batch by micro-batch, stage by stage
        in index order, boundary tensors sent to the next stage's rank of this pipeline. Every rank
        walks the same order, so any placement (looped, V) is served without a deadlock; there is
        no overlap between stages, which an evaluation can afford. (torch 2.13's ``schedule.eval``
        still runs the backward actions of the interleaved and ZBV schedules.)"""
        plan, top = self.plan, self.topology
        local_stages = {s.spec.index: s for s in self.stages}
        losses: list[torch.Tensor] = []
        samples = plan.global_batch_size // (top.replicas * plan.num_microbatches)
        for i in range(plan.num_microbatches):
            microbatch = narrow_batch(self.graph, local, i * samples, samples)
            carried: tuple[torch.Tensor, ...] = ()
            for k in range(plan.num_stages):
                stage = local_stages.get(k)
                if stage is None:
                    continue
                previous = plan.stages[k - 1].ranks[top.replica] if k > 0 else top.rank
                if previous != top.rank:  # this stage's input comes from another rank of the pipeline
                    carried = tuple(torch.empty_like(t) for t in self._metadata[k].input_args)
                    for t in carried:
                        dist.recv(t, src=previous, group=top.pp_group)
                with self.compute.context():
                    out = stage(*carried, *stage.graph_inputs(microbatch))
                if stage.spec.is_last:
                    losses.append(out.detach())
                    continue
                sent = self._metadata[k].output_args  # the dtypes the training pipeline sends (bf16 activations)
                carried = tuple(t.to(m.dtype).contiguous() for t, m in zip(out, sent))
                following = plan.stages[k + 1].ranks[top.replica]
                if following != top.rank:
                    for t in carried:
                        dist.send(t, dst=following, group=top.pp_group)
        return losses
