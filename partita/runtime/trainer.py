"""partita.Trainer: train an unmodified model as a Plan says, on torch.distributed.

Run one process per device under torchrun; every process builds the same model, plan and
trainer, and feeds every step the SAME global batch::

    model = build_model()                                # same weights on every rank (seeded)
    plan = partita.Plan.load("plan.json")
    trainer = partita.Trainer(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4),
                              example_inputs=(args, kwargs, target))
    for args, kwargs, target in batches:
        loss = trainer.step(*args, target=target, **kwargs)    # target= only with loss_fn

Layouts (data_parallel.py): a uniform plan (every stage on ``dp`` replicas) runs on a pp x dp
DeviceMesh with torch.distributed.pipelining; an uneven plan (stage ``k`` on its own ``r_k``
replicas, GPipe or 1F1B) runs on partita's executor (uneven.py), which routes slices of each
micro-batch between replicas many-to-many.

What happens in a step (see pipeline.py, uneven.py and data_parallel.py for why each part is exact):
1. the batch is flattened into graph inputs. Uniform: this rank keeps its replica's slice along
   each input's batch dim (replica ``rank % dp`` takes samples ``[replica * B/dp, (replica+1) * B/dp)``)
   and the schedule cuts it into micro-batches. Uneven: micro-batch ``i`` is samples
   ``[i*b, (i+1)*b)``, ``b = B/m``, and replica ``j`` of stage ``k`` runs its slice
   ``[i*b + j*b/r_k, i*b + (j+1)*b/r_k)``;
2. the schedule runs this rank's stages over ``num_microbatches`` micro-batches; graph inputs
   reach each stage directly, boundary tensors by P2P;
3. gradients are summed over every rank holding a parameter (replicas, tied copies) and scaled
   once (``LossScaling.grad_scale``, loss_scaling.py): by ``1 / (num_microbatches * r)``, ``r``
   being the last stage's replica count (``dp`` when uniform), when the loss is a mean over
   equally many elements per micro-batch; by 1 when the stages were rewritten to compute each
   micro-batch's part of the full-batch loss (a mean over a data-dependent count);
4. the loss (the full-batch loss, from the last stage's micro-batch losses) is all-reduced so every rank
   returns it, and with it the number of non-finite micro-batch losses and gradients (numerics.py):
   if any, every rank raises NumericsError (or skips the update, ``on_nonfinite="skip"``) before
   the optimizer touches a weight;
5. gradients are clipped by the global norm, and the optimizer steps.

Exactness: loss and parameters match the unsplit model trained on the full batch (fp32, up to
summation order). A loss that is a mean over a data-dependent count -- cross-entropy or NLL with
``ignore_index`` (padded or masked labels), a masked mean ``sum(x * mask) / mask.sum()`` -- is
found on the captured graph (partita.capturing.normalizer) and computed as each micro-batch's sum
divided by the count over the WHOLE global batch (every rank is given the global batch, so each
computes the count itself, once per step, before the first forward). A loss partita cannot
analyse trains as micro-batch means averaged, with a warning at the first step naming the node.
BatchNorm normalises over each micro-batch slice a rank runs (as under DDP without SyncBatchNorm),
and its running statistics and ``num_batches_tracked`` advance once per slice, not once per step.

Randomness (dropout): every step, each rank draws from a generator seeded from (``seed``, its
pipeline position, its replica, the step number), so replicas draw different masks and a run
with the same seed repeats itself; the global RNG state the user sees is left untouched.

Batches of other shapes: a plan is made at the example's shapes, the longest the job will see. A
batch padded to a shorter length (or bucketed) runs the model captured again at its shapes, split
at the matching nodes into the same stages and reading the same tensors (variants.py): once per
distinct shape, without re-planning. A longer batch is refused (the memory fit holds up to the
captured sizes). ``evaluate`` runs the model captured in eval mode the same way, forwards only.

Precision and sharding (``Plan.precision``, ``StagePlan.sharding``): bf16 plans run every stage
under autocast with fp32 master weights and send activations in bf16 (precision.py); a stage
sharded over its replicas runs as an FSDP2 module, ZeRO-2-like or ZeRO-3 (sharding.py). Both are
exact in the same sense as above: fp32 sharding equals unsplit training up to summation order,
bf16 equals the unsplit model under the same autocast policy up to bf16 rounding.

Tensor parallelism (``Plan.tensor_parallel = t``): each replica of a stage is a group of ``t``
ranks that split its matmuls, embedding and LM head + loss (tensor_parallel.py); the ranks of one
index in their groups run ``local_plan`` (``trainer.plan``; ``trainer.full_plan`` is the whole
one) and meet only inside the stages. Exact as above: loss and parameters equal unsplit training.

Gradient accumulation (``accumulation_steps=K``): a step takes ``K * plan.global_batch_size``
samples, runs K pipeline rounds of ``plan.global_batch_size`` each, gradients accumulating, and
steps the optimizer once: the same update as unsplit training on all the samples (the loss's
global counts are taken over all of them).

One plan per job: at start, every rank compares a digest of its plan with the others' and all
raise PlanFileError if they differ (``shared_plan`` makes the plan on rank 0 only and shares it).
With ``collective_timeout_s``, a wait on a hung rank ends in CollectiveTimeoutError naming the
step, the waiting rank and the ranks that have not reached the step (progress.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.capturing import canonical_names
from partita.checks import positive_int
from partita.errors import InputError, NumericsError, PartitaError
from partita.planning.context import check_whole_batch
from partita.runtime.batch_values import check_batch_values
from partita.runtime.checkpoint import load_checkpoint, save_checkpoint
from partita.runtime.data_parallel import (
    GradientSync,
    Topology,
    local_tensor,
    unique_parameters,
)
from partita.runtime.job import shared_plan, start_topology
from partita.runtime.materialize import materialize, on_meta, retarget_device
from partita.runtime.numerics import (
    NonFinitePolicy,
    count_nonfinite,
    describe,
    gather_findings,
    gradient_findings,
    loss_findings,
)
from partita.runtime.pipeline import rng_and_buffers_restored, stage_metadata
from partita.runtime.precision import Compute
from partita.runtime.progress import Progress, is_timeout
from partita.runtime.sharding import check_sharding, gathered_for, sharded_names, sharded_runners, sharded_stages
from partita.runtime.stages import StageModule, flatten_inputs, narrow_batch, split_graph
from partita.runtime.state_dict import gather_state_dict
from partita.runtime.step_program import StepProgram
from partita.runtime.tensor_parallel import local_plan, start_tensor_parallel, tensor_parallel_sync, whole_tensors
from partita.runtime.trainer_setup import (
    batch_of,
    check_scheduler,
    example_triple,
    holders,
    meta_microbatch,
    resolve_graph,
    state_names,
)
from partita.runtime.uneven import check_uneven_boundaries
from partita.runtime.variants import captured_shapes, check_within_plan, input_shapes, variant_stages
from partita.types import OpGraph, Plan

__all__ = ["Trainer", "shared_plan"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Trainer:
    """Pipelined, replicated training of ``model`` as ``plan`` says (one process per device).

    Args:
        model: the unmodified model, with the same weights on every rank. Its parameters are
            trained in place (stage modules hold the model's own Parameter objects), except those
            of stages the plan shards: FSDP2 replaces them by DTensor shards (``gather_state_dict``
            and checkpoints give the trained weights).
        plan: a Plan made for this model's graph: uniform (same replica count for every stage), or
            uneven (GPipe/1F1B, one stage per rank group, any replica count per stage).
        optimizer: ``params -> Optimizer``; each rank builds one over the parameters of its stages.
        lr_scheduler: ``optimizer -> LRScheduler``, stepped after every optimizer step.
        max_grad_norm: clip gradients by their global 2-norm over all stages and ranks.
        on_nonfinite: when a micro-batch's loss or a gradient holds NaN or inf, ``"raise"``
            NumericsError on every rank (naming the stage and micro-batch or the parameters), or
            ``"skip"`` the update with a RuntimeWarning and return the non-finite loss. Either
            way the weights, optimizer state and LR scheduler are left as they were.
        graph: the OpGraph the plan was made for; or ``example_inputs=(args, kwargs, target)``
            (and ``loss_fn``) to capture it here, as ``partita.capture`` did for the plan.
        init_from: a seed checkpoint (``partita.runtime.materialize.save_seed``) to take the
            initial weights from. Required for a model built on the ``meta`` device: each rank
            then allocates only what its stages read (see materialize.py), so no rank needs
            memory for the whole model. With a real model, the held tensors are overwritten.
        seed: the seed of the randomness inside the model (dropout): each rank's generator is
            seeded per step from (seed, pipeline position, replica, step), so replicas draw
            different masks and runs with the same seed are identical. None: ``torch.initial_seed()``
            (the last ``torch.manual_seed``).
        accumulation_steps: pipeline rounds per optimizer step; each step is then given
            ``accumulation_steps * plan.global_batch_size`` samples.
        collective_timeout_s: how long a collective or a transfer between stages may wait before
            CollectiveTimeoutError (naming the step, this rank and the ranks that have not reached
            the step); also the timeout of the process group when the trainer initialises it.
            None: torch's default (30 min on gloo, 10 min on NCCL).

    A rank whose stages hold no trainable parameter (a frozen or parameter-free stage) builds its
    optimizer over one empty parameter group (``optimizer([{"params": []}])``), so that schedulers
    and checkpoints work alike on every rank; its optimizer steps change nothing.

    Attributes: ``graph``, ``plan``, ``topology`` (rank, replica, mesh, groups), ``stages`` (this rank's
    StageModules), ``optimizer``, ``lr_scheduler``, ``loss_scaling`` (how the loss is normalised over
    the global batch), ``seed``, ``num_steps`` (steps taken, skipped ones included),
    ``num_skipped_steps``, ``last_grad_norm``, ``accumulation_steps``.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        optimizer: OptimizerFactory,
        lr_scheduler: SchedulerFactory | None = None,
        max_grad_norm: float | None = None,
        graph: OpGraph | None = None,
        example_inputs: tuple | None = None,
        loss_fn: Callable | None = None,
        on_nonfinite: NonFinitePolicy | str = NonFinitePolicy.RAISE,
        init_from: str | None = None,
        seed: int | None = None,
        collective_timeout_s: float | None = None,
        accumulation_steps: int = 1,
    ):
        if not isinstance(plan, Plan):
            raise InputError(f"plan must be a partita.Plan, got {type(plan).__name__}: load one with partita.Plan.load")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InputError(f"seed must be a non-negative int or None, got {seed!r}")
        self.model, self.plan, self.max_grad_norm = model, plan, max_grad_norm
        self.accumulation_steps = positive_int(accumulation_steps, "accumulation_steps")
        self.seed = seed if seed is not None else torch.initial_seed()
        self.collective_timeout_s = collective_timeout_s
        self.on_nonfinite = NonFinitePolicy.parse(on_nonfinite)
        if init_from is None and on_meta(model):
            raise InputError(
                "the model is on the meta device (no weights): pass init_from=<seed checkpoint>, "
                "written by partita.runtime.materialize.save_seed(model) from the model built with "
                "real weights"
            )
        self.graph = resolve_graph(model, plan, graph, example_inputs, loss_fn)
        check_whole_batch(self.graph, plan.num_microbatches, [s.num_replicas for s in plan.stages])
        self._state_names = state_names(model)
        self.topology: Topology = start_topology(plan, collective_timeout_s)
        self.full_plan = plan
        if plan.tensor_parallel > 1:  # the ranks of this tensor-parallel index run a plan of their own
            self.plan = plan = local_plan(plan, self.topology.tp_index)
        self.compute = Compute(plan.precision, self.topology.device.type)  # fp32, or bf16 autocast (precision.py)
        self._progress = Progress(
            self.topology.rank, self.topology.world_size, enabled=collective_timeout_s is not None
        )
        self._all_stages = split_graph(self.graph, plan.boundaries)
        if not plan.uniform_replicas:
            check_uneven_boundaries(self.graph, plan, self._all_stages)
        self._captured_shapes = captured_shapes(self.graph)
        # Samples per micro-batch that this rank's stages run (uniform: plan.microbatch_size).
        self._samples = plan.global_batch_size // (plan.num_microbatches * self.topology.replicas)
        group = self.topology.rank_group
        self.stages: list[StageModule] = [s for s in self._all_stages if plan.stages[s.spec.index].rank_group == group]
        self._metadata: list | None = None
        built_on_meta = on_meta(model)  # then the weights materialized here are partita's own
        if built_on_meta:
            # Static pipeline metadata from shapes alone, while every stage is still on meta.
            self._metadata = stage_metadata(
                self._all_stages, meta_microbatch(self.graph, self._samples), torch.device("cpu"), self.compute
            )
            materialize(
                model,
                [*self._all_stages, self.graph.graph_module],
                self._local_names(),
                self.topology.device,
                init_from,
            )
            for stage in self._all_stages:  # ops captured on meta create their tensors on meta
                retarget_device(stage.graph_module, self.topology.device)
        else:
            if self.topology.device.type != "cpu":
                model.to(self.topology.device)
                for stage in self._all_stages:
                    stage.to(self.topology.device)
            if init_from is not None:
                materialize(
                    model,
                    [*self._all_stages, self.graph.graph_module],
                    self._local_names(),
                    self.topology.device,
                    init_from,
                )
        check_sharding(plan, self._all_stages)
        # before the optimizer and FSDP2: this rank's parts of the weights tensor parallelism splits
        self.tensor_parallel = start_tensor_parallel(
            self.graph, self.topology, self._all_stages, self.stages, release_whole=built_on_meta
        )
        # before the optimizer: FSDP2 makes new (DTensor) parameters
        self._runners = sharded_runners(plan, self.stages, self.topology, self.compute)
        self._holders = holders(plan, self._all_stages)
        self.params = unique_parameters(self.stages)
        self._stages_of = {
            name: tuple(s.spec.index for s in self.stages if name in s.spec.param_names) for name in self.params
        }
        self.optimizer = self._make_optimizer(optimizer)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        check_scheduler(self.lr_scheduler)
        # Rewrites the stages that compute a loss normalised by a data-dependent count (loss_scaling.py).
        planned = StepProgram(
            self.graph,
            plan,
            self.topology,
            self._all_stages,
            accumulation_steps=self.accumulation_steps,
            runners=self._runners,
            compute=self.compute,
            tensor_parallel=self.tensor_parallel,
        )
        self._programs: dict[tuple, StepProgram] = {(True, self._captured_shapes): planned}
        self.loss_scaling = planned.loss_scaling
        trainable = {name: h for name, h in self._holders.items() if name in self._trainable_names()}
        top = self.topology
        self.grad_sync = GradientSync(
            self.params,
            trainable,
            top.rank,
            self.loss_scaling.grad_scale,
            timeout=top.timeout,
            world_group=top.world_group,
            sharded=sharded_names(plan, self._all_stages) & set(trainable),
            **tensor_parallel_sync(self.full_plan, self.tensor_parallel, self._all_stages, holders),
        )
        self.num_steps = 0
        self.num_skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._warned_loss = False
        if example_inputs is not None:
            flat = flatten_inputs(self.graph, *example_triple(example_inputs))
            if batch_of(self.graph, flat) >= self._samples:
                planned.build(narrow_batch(self.graph, flat, 0, self._samples), self._metadata)

    # ------------------------------------------------------------------ training

    def step(self, *args: Any, **kwargs: Any) -> float:
        """One optimizer step on the global batch; returns its mean loss (the same on every rank).

        Call it exactly like the model: ``trainer.step(*args, **kwargs)``. When the graph was
        captured with a ``loss_fn``, the keyword ``target=`` is the loss target (not a model
        input). Every rank must pass the same batch of ``plan.global_batch_size *
        accumulation_steps`` samples; its non-batch dims (sequence length) may be smaller than
        the captured ones, never larger.

        Raises NumericsError (on every rank, before the optimizer step) when a loss or gradient
        is not finite, unless the trainer was built with ``on_nonfinite="skip"``.
        """
        step = self.num_steps + 1
        self._progress.mark(step)
        program, flat = self._prepare(args, kwargs, f"step {step}", training=True)
        self._warn_about_loss(program)
        self.optimizer.zero_grad(set_to_none=True)
        self.grad_sync.scale = program.loss_scaling.grad_scale
        doing = "the pipeline's transfers between stages"
        try:
            with self._step_rng():
                losses = self._run_rounds(program, flat)
            doing = "the all-reduce of gradients over their holders"
            self.grad_sync.reduce_and_scale()
            doing = "the all-reduce of the loss"
            loss, num_nonfinite = self._global_loss(program, losses)
            if num_nonfinite:
                doing = "gathering the non-finite values"
                return self._nonfinite_step(loss, losses)
            if self.max_grad_norm is not None:
                doing = "the all-reduce of the gradient norm"
                self.last_grad_norm = float(self.grad_sync.clip(self.max_grad_norm))
        except (RuntimeError, TimeoutError) as e:
            if isinstance(e, PartitaError) or not is_timeout(e):
                raise
            raise self._progress.timeout_error(
                e, step=step, doing=doing, stages=self._stages_text(), timeout_s=self.collective_timeout_s
            ) from e
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.num_steps += 1
        return loss

    def evaluate(self, *args: Any, **kwargs: Any) -> float:
        """The loss of this batch with the model in eval mode (dropout off, batch norm from its
        running statistics), the same on every rank; nothing changes: weights, gradients,
        optimizer, buffers, RNG streams and ``num_steps`` are left as they were.

        Called like ``step``, with a batch of as many samples. The model is captured once more in
        eval mode (per input shape) and run forward through the plan's pipeline (variants.py).
        """
        program, flat = self._prepare(args, kwargs, "evaluate", training=False)
        gathered = gathered_for(program.all_stages, self._runners, self._all_stages)
        with torch.no_grad(), rng_and_buffers_restored(program.stages, self.topology.device), gathered:
            losses = self._run_rounds(program, flat, forward_only=True)
        local = torch.zeros(1, dtype=torch.float32, device=self.topology.device)
        if losses:  # this rank runs the last stage
            local[0] = program.loss_scaling.reported_loss(losses)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.topology.world_group)
        return float(local.item())

    def gather_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0: the full state dict (parameters and persistent buffers, CPU tensors) with
        the keys of ``model.state_dict()`` (tied names included), so that the unsplit model
        loads it directly. Other ranks return None. Collective: call it on every rank."""
        return gather_state_dict(self)

    def held_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers, by canonical name: the tensors
        training updates (on GPUs, ``.to()`` gave the stages their own buffer objects)."""
        held: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
                if name in self._state_names:  # leaves out export's lifted constants, non-persistent buffers
                    held.setdefault(name, t)
        return whole_tensors(held, self.tensor_parallel)

    def save_checkpoint(self, path: str) -> None:
        """Write a DCP checkpoint keyed by the model's parameter names (see checkpoint.py)."""
        save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written under any plan into this trainer (model, optimizer, scheduler, step, RNG)."""
        load_checkpoint(self, path)

    # ------------------------------------------------------------------ internals

    def _prepare(self, args: tuple, kwargs: dict, where: str, *, training: bool) -> tuple[StepProgram, list]:
        """The batch's flat inputs, checked (size, ids and labels), the program for its shapes, and
        its global values (the loss's counts over the whole batch) filled in."""
        kwargs = dict(kwargs)
        target = kwargs.pop("target", None) if self.graph.has_loss_fn else None
        flat = flatten_inputs(self.graph, args, kwargs, target)
        self._check_batch(flat)
        program = self._program_for(flat, args, kwargs, target, training=training)
        check_batch_values(program.graph, flat, where, program.index_uses)  # before any stage fails on them
        program.loss_scaling.update(flat)  # global counts of the step, from the whole batch
        return program, flat

    def _program_for(self, flat: list, args: tuple, kwargs: dict, target: Any, *, training: bool) -> StepProgram:
        """The program for this batch's shapes and mode: the planned graph's, or a variant captured
        now (once per shape and mode, variants.py)."""
        shapes = input_shapes(self.graph, flat)
        key = (training, shapes)
        if key not in self._programs:
            self._programs[key] = self._variant(shapes, args, kwargs, target, training=training)
        return self._programs[key]

    def _variant(self, shapes: tuple, args: tuple, kwargs: dict, target: Any, *, training: bool) -> StepProgram:
        check_within_plan(self.graph, shapes)
        if training and sharded_stages(self.plan):  # FSDP2 reduces the gradients of its own forwards only
            raise InputError(
                f"stages {sorted(sharded_stages(self.plan))} are sharded (FSDP2), and sharded stages train at the "
                f"planned shapes {[list(s) for s in self._captured_shapes if s is not None]} (batch dim left out) "
                f"only; got {[list(s) for s in shapes if s is not None]}: pad the batches to the planned shapes, or "
                "plan with sharding='replicate'"
            )
        if self._metadata is not None:  # the model is on meta: nothing to capture again from
            planned = [list(s) for s in self._captured_shapes if s is not None]
            raise InputError(
                "evaluate() is not available for a model built on the meta device (init_from=): it captures the "
                "model again in eval mode, which needs its weights; build the model with weights to evaluate"
                if not training
                else f"the model was built on the meta device (init_from=), so every batch must have the planned "
                f"shapes {planned} (batch dim left out), got {[list(s) for s in shapes if s is not None]}: pad the "
                "batches to the planned shapes, or build the model with weights"
            )
        call, device = (args, kwargs, target), self.topology.device
        graph, stages = variant_stages(self.graph, self.plan, self._all_stages, call, training, device)
        return StepProgram(
            graph,
            self.plan,
            self.topology,
            stages,
            accumulation_steps=self.accumulation_steps,
            compute=self.compute,
            tensor_parallel=self.tensor_parallel,
        )

    def _run_rounds(self, program: StepProgram, flat: list, *, forward_only: bool = False) -> list[torch.Tensor]:
        """``accumulation_steps`` pipeline rounds over consecutive ``plan.global_batch_size`` samples
        of the batch (gradients accumulate in ``.grad``); the last stage's micro-batch losses."""
        size = self.plan.global_batch_size
        losses: list[torch.Tensor] = []
        for k in range(self.accumulation_steps):
            local = self._local_batch(
                flat if self.accumulation_steps == 1 else narrow_batch(self.graph, flat, k * size, size)
            )
            self._build(program, local)
            losses += program.run(local, forward_only=forward_only)
        return losses

    def _build(self, program: StepProgram, local: list) -> None:
        """The program's pipeline, at its first use, from one micro-batch of ``local`` (autograd on)."""
        if program.built:
            return
        planned = program is self._programs[(True, self._captured_shapes)]
        with torch.enable_grad():
            program.build(narrow_batch(self.graph, local, 0, self._samples), self._metadata if planned else None)

    def _local_batch(self, flat: list) -> list:
        """What this rank runs of one round's ``plan.global_batch_size`` samples, on its device: its
        replica's slice (uniform), or all of them (uneven: the executor slices each micro-batch itself)."""
        top = self.topology
        if top.uniform:
            per_replica = self.plan.global_batch_size // top.replicas
            flat = narrow_batch(self.graph, flat, top.replica * per_replica, per_replica)
        return [x.to(top.device) if isinstance(x, torch.Tensor) else x for x in flat]

    def _make_optimizer(self, factory: OptimizerFactory) -> torch.optim.Optimizer:
        """The user's optimizer over this rank's parameters; one empty parameter group when its
        stages hold none (torch refuses an empty parameter list)."""
        if self.params:
            return factory(list(self.params.values()))
        try:
            return factory([{"params": []}])
        except Exception as e:  # noqa: BLE001 - the factory is user code; say what was asked of it
            raise InputError(
                f"rank {self.topology.rank} runs {self._stages_text()}, which hold no trainable parameter (frozen "
                "or parameter-free), so the trainer built its optimizer over one empty parameter group, "
                f"optimizer([{{'params': []}}]), and the optimizer factory failed on it ({type(e).__name__}: {e}): "
                "let the factory accept a list of parameter groups (e.g. lambda params: torch.optim.AdamW(params, "
                "lr=3e-4)), or re-plan so that every stage holds a trainable parameter"
            ) from e

    def _stages_text(self) -> str:
        indices = [s.spec.index for s in self.stages]
        return f"stage{'s' if len(indices) != 1 else ''} {', '.join(map(str, indices))}"

    @contextlib.contextmanager
    def _step_rng(self) -> Iterator[None]:
        """This rank's randomness for the current step (dropout masks): a generator seeded from
        (seed, pipeline position, replica, step), inside a fork of the RNG state, so replicas draw
        different masks, a run with the same seed repeats itself (checkpoint resumes too: the step
        number is restored), and the caller's RNG stream is not disturbed."""
        top = self.topology
        devices = [top.device] if top.device.type == "cuda" else []
        key = f"partita/{self.seed}/{top.rank_group}/{top.replica}/{self.num_steps}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            if devices:
                torch.cuda.manual_seed(seed)  # this rank's device (init_topology made it current)
            yield

    def _warn_about_loss(self, program: StepProgram) -> None:
        """Once, at the first step, on rank 0: the loss could not be normalised over the global batch."""
        if program.loss_scaling.warning is not None and not self._warned_loss and self.topology.rank == 0:
            warnings.warn(program.loss_scaling.warning, RuntimeWarning, stacklevel=3)
        self._warned_loss = True

    def _check_batch(self, flat: list) -> int:
        """The batch size; InputError unless it is the plan's global batch (times ``accumulation_steps``)."""
        batch = batch_of(self.graph, flat)
        expected = self.plan.global_batch_size * self.accumulation_steps
        if batch != expected:
            rounds = f" x {self.accumulation_steps} accumulation steps" if self.accumulation_steps > 1 else ""
            raise InputError(
                f"the batch has {batch} samples but the trainer takes {expected} (the plan's global batch "
                f"{self.plan.global_batch_size}{rounds}): pass the whole batch on every rank"
            )
        return batch

    def _global_loss(self, program: StepProgram, losses: list[torch.Tensor]) -> tuple[float, int]:
        """The full-batch loss (the last stage's ranks' parts of it, ``LossScaling.reported_loss``) and
        the number of non-finite micro-batch losses and gradients over all ranks: one all-reduce, the
        same answer on every rank."""
        top = self.topology
        local = torch.zeros(2, dtype=torch.float32, device=top.device)  # (loss part, non-finite count)
        if losses:  # this rank runs the last stage
            local[0] = program.loss_scaling.reported_loss(losses)
        grads = [local_tensor(p.grad) for p in self.params.values() if p.grad is not None]
        local[1] = count_nonfinite(losses, top.device) + count_nonfinite(grads, top.device)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=top.world_group)
        loss, count = local.tolist()
        return loss, int(count)

    def _nonfinite_step(self, loss: float, losses: list[torch.Tensor]) -> float:
        """On every rank: gather what was non-finite, then raise NumericsError, or warn and count the
        step as taken without an update (``on_nonfinite="skip"``). The optimizer never steps here."""
        top, step = self.topology, self.num_steps + 1
        local = gradient_findings(self.params, self._stages_of, top.rank)
        if losses:
            last = self.plan.num_stages - 1
            samples = [self._loss_samples(i) for i in range(len(losses))]
            local = loss_findings(losses, stage_index=last, replica=top.replica, rank=top.rank, samples=samples) + local
        findings = gather_findings(local, group=top.world_group)
        message = describe(
            findings,
            step=step,
            replicas=self.plan.stages[-1].num_replicas,  # the same on every rank
            policy=self.on_nonfinite,
        )
        if self.on_nonfinite is NonFinitePolicy.RAISE:
            raise NumericsError(message, step=step, findings=tuple(findings))
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.optimizer.zero_grad(set_to_none=True)
        self.num_steps += 1
        self.num_skipped_steps += 1
        return loss

    def _loss_samples(self, index: int) -> tuple[int, int]:
        """(first sample in the batch, number of samples) of this last-stage rank's ``index``-th
        micro-batch loss (micro-batches of every accumulation round, in order)."""
        top, plan = self.topology, self.plan
        rounds, microbatch = divmod(index, plan.num_microbatches)
        first = rounds * plan.global_batch_size
        if top.uniform:
            per_replica = plan.global_batch_size // top.replicas
            return first + top.replica * per_replica + microbatch * self._samples, self._samples
        microbatch_samples = plan.global_batch_size // plan.num_microbatches
        return first + microbatch * microbatch_samples + top.replica * self._samples, self._samples

    def _local_names(self) -> set[str]:
        """Canonical names of what this rank must hold: its stages' tensors, and the model's
        parameters and buffers that no stage reads (checkpoints and state dicts include them)."""
        read_anywhere = {name for s in self._all_stages for name in s.spec.param_names}
        model_names = set(canonical_names(self.model).values())
        return {name for s in self.stages for name in s.spec.param_names} | (model_names - read_anywhere)

    def _trainable_names(self) -> set[str]:
        return {name for s in self._all_stages for name, p in s.named_parameters() if p.requires_grad}

    def _owner(self, name: str) -> int:
        return min(self._holders[name])
