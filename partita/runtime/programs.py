"""The StepPrograms of one trainer: the planned graph's, and one per variant it has run since (a
batch padded to other shapes, evaluation in eval mode: partita.runtime.variants), each built at its
first use and kept."""

from __future__ import annotations

from typing import Any

import torch

from partita.errors import CaptureError, InputError
from partita.runtime.layout import replica_microbatch_samples
from partita.runtime.precision import Compute
from partita.runtime.process_groups import Topology
from partita.runtime.stage_set import StageSet
from partita.runtime.stages import batch_of, narrow_batch
from partita.runtime.step_program import StepProgram
from partita.runtime.variants import (
    Shapes,
    captured_shapes,
    check_within_plan,
    input_shapes,
    unsupported_shapes_message,
    variant_stages,
)
from partita.types import OpGraph

__all__ = ["StepPrograms"]


class StepPrograms:
    """Programs by (training, input shapes). ``planned`` is the plan's own graph's, in training
    mode; its ``loss_scaling`` is what the trainer reports."""

    def __init__(
        self, graph: OpGraph, stages: StageSet, topology: Topology, *, accumulation_steps: int, compute: Compute
    ):
        self.graph, self.stages, self.topology = graph, stages, topology
        self.accumulation_steps, self.compute = accumulation_steps, compute
        self.captured_shapes = captured_shapes(graph)
        # Rewrites the stages that compute a loss normalised by a data-dependent count (loss_scaling.py).
        self.planned = StepProgram(
            graph,
            stages.plan,
            topology,
            stages.all_stages,
            accumulation_steps=accumulation_steps,
            runners=stages.runners,
            compute=compute,
            tensor_parallel=stages.tensor_parallel,
            job_plan=stages.job_plan,
        )
        self._programs: dict[tuple[bool, Shapes], StepProgram] = {(True, self.captured_shapes): self.planned}
        # Samples per micro-batch that this rank's stages run (uniform: plan.microbatch_size; uneven:
        # this replica's share)
        self.microbatch_samples = replica_microbatch_samples(stages.plan, topology.rank_group, topology.replica)

    def __len__(self) -> int:
        return len(self._programs)

    def __iter__(self):
        """The (training, input shapes) keys of the programs built so far."""
        return iter(self._programs)

    def for_batch(
        self, flat: list, args: tuple, kwargs: dict, target: Any, where: str, *, training: bool
    ) -> StepProgram:
        """The program for this batch's shapes and mode: the planned graph's, or a variant captured
        now (once per shape and mode); InputError naming the batch's inputs when the model cannot be
        captured at its shapes."""
        key = (training, input_shapes(self.graph, flat))
        if key not in self._programs:
            try:
                self._programs[key] = self._variant(key[1], args, kwargs, target, training=training)
            except CaptureError as e:
                raise InputError(unsupported_shapes_message(self.graph, key[1], where, e)) from e
        return self._programs[key]

    def build(self, program: StepProgram, local: list) -> None:
        """The program's pipeline, at its first use, from one micro-batch of ``local`` (autograd on);
        the planned program of a model built on meta from the static shapes found there."""
        if program.built:
            return
        metadata = self.stages.metadata if program is self.planned else None
        with torch.enable_grad():
            program.build(narrow_batch(self.graph, local, 0, self.microbatch_samples), metadata)

    def prebuild(self, flat: list) -> None:
        """Build the planned pipeline from the example inputs now, when they hold a micro-batch."""
        if batch_of(self.graph, flat) >= self.microbatch_samples:
            self.planned.build(narrow_batch(self.graph, flat, 0, self.microbatch_samples), self.stages.metadata)

    def _variant(self, shapes: Shapes, args: tuple, kwargs: dict, target: Any, *, training: bool) -> StepProgram:
        check_within_plan(self.graph, shapes)
        plan = self.stages.plan
        planned = [list(s) for s in self.captured_shapes if s is not None]
        got = [list(s) for s in shapes if s is not None]
        if self.stages.metadata is not None:  # the model is on meta: nothing to capture again from
            raise InputError(
                "evaluate() is not available for a model built on the meta device (init_from=): it captures the "
                "model again in eval mode, which needs its weights; build the model with weights to evaluate"
                if not training
                else f"the model was built on the meta device (init_from=), so every batch must have the planned "
                f"shapes {planned} (batch dim left out), got {got}: pad the batches to the planned shapes, or "
                "build the model with weights"
            )
        call, device = (args, kwargs, target), self.topology.device
        graph, stages = variant_stages(self.graph, plan, self.stages.all_stages, call, training, device)
        return StepProgram(
            graph,
            plan,
            self.topology,
            stages,
            accumulation_steps=self.accumulation_steps,
            runners=self.stages.runners if training else None,  # sharded stages: FSDP2 runs the variant's too
            compute=self.compute,
            tensor_parallel=self.stages.tensor_parallel,
            job_plan=self.stages.job_plan,
        )
