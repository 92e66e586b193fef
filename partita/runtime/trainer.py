"""partita.Trainer: train an unmodified model as a Plan says, on torch.distributed.

Run one process per device under torchrun (a plan for one device also runs in a plain
``python script.py``); every process builds the same model, plan and trainer, and feeds every
step the SAME global batch::

    model = build_model()                                # same weights on every rank (seeded)
    plan = partita.plan(model, kwargs=batch, cluster=cluster, global_batch_size=64)   # one plan per job
    trainer = partita.Trainer(model, plan, kwargs=batch, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    for batch in batches:
        loss = trainer.step(**batch)                     # target= too, when captured with loss_fn

The constructor reads as its set-up steps: the graph (``graph_for_plan``), the process groups
(``process_groups``), this rank's stages, placed, split and sharded (``stage_set``), the optimizer
and scheduler (``optimizer_setup``), the step programs (``programs``), the gradient sync
(``gradient_sync``) and the checkpointer (``checkpoint``). ``trainer.plan`` is the job's plan;
``trainer.local_plan`` the part this rank runs (with tensor parallelism: its index's).

Layouts (process_groups.py): a uniform plan (every stage on ``dp`` replicas) runs on a pp x dp
DeviceMesh with torch.distributed.pipelining; an uneven plan (stage ``k`` on its own ``r_k``
replicas, or replicas taking unequal sample shares, GPipe or 1F1B) runs on partita's executor
(uneven.py), which routes slices of each micro-batch between replicas many-to-many.

What happens in a step (see pipeline.py, uneven.py and gradient_sync.py for why each part is exact):
1. the batch is flattened into graph inputs. Uniform: this rank keeps its replica's slice along
   each input's batch dim (replica ``rank % dp`` takes samples ``[replica * B/dp, (replica+1) * B/dp)``)
   and the schedule cuts it into micro-batches. Uneven: micro-batch ``i`` is samples
   ``[i*b, (i+1)*b)``, ``b = B/m``, and replica ``j`` of stage ``k`` runs its slice of ``n_j``
   samples after those of replicas ``0 .. j-1`` (``n_j = b/r_k``, or the plan's
   ``StagePlan.replica_samples``);
2. the schedule runs this rank's stages over ``num_microbatches`` micro-batches; graph inputs
   reach each stage directly, boundary tensors by P2P;
3. under sequence parallelism the norms' weight gradients, each rank's of its tokens, are summed
   over the tensor-parallel group (once per step, ``GradientSync.sum_over``); then
   gradients are summed over every rank holding a parameter (replicas, tied copies) and scaled
   once (``LossScaling.grad_scale``, loss_scaling.py): by ``1 / (num_microbatches * r)``, ``r``
   being the last stage's replica count (``dp`` when uniform), when the loss is a mean over
   equally many elements per micro-batch; by 1 when the stages were rewritten to compute each
   micro-batch's part of the full-batch loss (a mean over a data-dependent count). Replicas with
   unequal shares weigh their slice's loss by their samples (loss_scaling.py);
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
distinct shape, without re-planning; a sharded stage's variant runs through the same FSDP2
module (sharding.py). A longer batch is refused (the memory fit holds up to the captured sizes),
and so is one of another dtype or of shapes the model cannot be captured at, naming its inputs.
``evaluate`` runs the model captured in eval mode the same way, forwards only.

Precision and sharding (``Plan.precision``, ``StagePlan.sharding``): bf16 plans run every stage
under autocast with fp32 master weights and send activations in bf16 (precision.py); a stage
sharded over its replicas runs as an FSDP2 module, ZeRO-2-like or ZeRO-3 (sharding.py). Both are
exact in the same sense as above: fp32 sharding equals unsplit training up to summation order,
bf16 equals the unsplit model under the same autocast policy up to bf16 rounding.

Tensor parallelism (``StagePlan.tensor_parallel = t``): each replica of a stage is a group of ``t``
ranks that split its matmuls, embedding and LM head + loss (tensor_parallel.py); the ranks of one
index in their groups run ``local_plan`` (``trainer.local_plan``; ``trainer.plan`` is the whole
one) and meet only inside the stages. Stages of a mixed cluster's plan may have degrees of their
own (partita's executor routes their boundaries). Exact as above: loss and parameters equal
unsplit training.

Gradient accumulation (``accumulation_steps=K``): a step takes ``K * plan.global_batch_size``
samples, runs K pipeline rounds of ``plan.global_batch_size`` each, gradients accumulating, and
steps the optimizer once: the same update as unsplit training on all the samples (the loss's
global counts are taken over all of them).

One plan per job: at start, every rank compares a digest of what it will execute of its plan with
the others' and all raise PlanFileError if they differ (``partita.plan`` in a torchrun job, and
``shared_plan``, make the plan on rank 0 only and share it).
With ``collective_timeout_s``, a wait on a hung rank ends in CollectiveTimeoutError naming the
step, the waiting rank and the ranks that have not reached the step (progress.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.checks import positive_int
from partita.errors import InputError, NumericsError, PartitaError
from partita.runtime.batch_values import check_batch_dtypes, check_batch_values
from partita.runtime.checkpoint import Checkpointer, StepCount
from partita.runtime.gradient_sync import GradientSync, local_tensor
from partita.runtime.graph_for_plan import CaptureInputs, graph_for_plan
from partita.runtime.layout import check_layout, stage_shares
from partita.runtime.materialize import on_meta
from partita.runtime.numerics import (
    NonFinitePolicy,
    count_nonfinite,
    describe,
    gather_findings,
    gradient_findings,
    loss_findings,
)
from partita.runtime.optimizer_setup import OptimizerFactory, SchedulerFactory, make_optimizer, make_scheduler
from partita.runtime.pipeline import rng_and_buffers_restored
from partita.runtime.precision import Compute
from partita.runtime.process_groups import Topology, start_topology, timeout_of
from partita.runtime.programs import StepPrograms
from partita.runtime.progress import Progress, is_timeout
from partita.runtime.sharding import gathered, sharded_names
from partita.runtime.stage_set import StageSet, place_stages
from partita.runtime.stage_set import holders as holders_of
from partita.runtime.stages import StageModule, batch_of, flatten_inputs, narrow_batch
from partita.runtime.state_dict import gather_state_dict
from partita.runtime.step_program import StepProgram
from partita.runtime.tensor_parallel import local_plan, tensor_parallel_sync
from partita.types import OpGraph, Plan
from partita.types.whole_batch import batch_dims_words, check_whole_batch

__all__ = ["Trainer"]


class Trainer:
    """Pipelined, replicated, sharded, tensor-parallel training of ``model`` as ``plan`` says
    (one process per device).

    Args:
        model: the unmodified model, with the same weights on every rank. Its parameters are
            trained in place (stage modules hold the model's own Parameter objects), except those
            of stages the plan shards or splits: FSDP2 and tensor parallelism replace them
            (``gather_state_dict`` and checkpoints give the trained weights).
        plan: a Plan made for this model's graph (``partita.plan``, ``partita.manual_plan``,
            ``partita.Plan.load``): uniform, or uneven (GPipe/1F1B, any replica count and sample
            shares per stage).
        optimizer: ``params -> Optimizer``; each rank builds one over the parameters of its stages.
        args, kwargs, loss_fn, target, batch_dims: example inputs, exactly as ``partita.capture``
            and ``partita.plan`` take them: the trainer captures the graph the plan was made for
            from them. Or ``graph=``: the graph itself (then none of these).
        lr_scheduler: ``optimizer -> LRScheduler``, stepped after every optimizer step.
        max_grad_norm: clip gradients by their global 2-norm over all stages and ranks.
        on_nonfinite: when a micro-batch's loss or a gradient holds NaN or inf, ``"raise"``
            NumericsError on every rank (naming the stage and micro-batch or the parameters), or
            ``"skip"`` the update with a RuntimeWarning and return the non-finite loss. Either
            way the weights, optimizer state and LR scheduler are left as they were.
        init_from: a seed checkpoint (``partita.save_seed``) to take the initial weights from.
            Required for a model built on the ``meta`` device: each rank then allocates only what
            its stages read (see materialize.py), so no rank needs memory for the whole model.
            With a real model, the held tensors are overwritten.
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
        example_inputs: deprecated: ``(args, kwargs, target)``; use the keywords above.

    A rank whose stages hold no trainable parameter (a frozen or parameter-free stage) builds its
    optimizer over one empty parameter group (``optimizer([{"params": []}])``), so that schedulers
    and checkpoints work alike on every rank; its optimizer steps change nothing.

    Attributes: ``graph``, ``plan`` (the job's), ``local_plan`` (what this rank's index runs),
    ``topology`` (rank, replica, mesh, groups), ``stages`` (this rank's StageModules), ``params``,
    ``optimizer``, ``lr_scheduler``, ``loss_scaling`` (how the loss is normalised over the global
    batch), ``tensor_parallel``, ``seed``, ``num_steps`` (steps taken, skipped ones included),
    ``num_skipped_steps``, ``last_grad_norm``, ``accumulation_steps``.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: Plan,
        *,
        optimizer: OptimizerFactory,
        args: tuple = (),
        kwargs: Mapping[str, Any] | None = None,
        loss_fn: Callable | None = None,
        target: Any = None,
        batch_dims: Mapping[Any, int | None] | None = None,
        graph: OpGraph | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        max_grad_norm: float | None = None,
        on_nonfinite: NonFinitePolicy | str = NonFinitePolicy.RAISE,
        init_from: str | None = None,
        seed: int | None = None,
        collective_timeout_s: float | None = None,
        accumulation_steps: int = 1,
        example_inputs: tuple | None = None,
    ):
        self._check_arguments(model, plan, max_grad_norm, seed, init_from, collective_timeout_s)
        self.model, self.plan, self.max_grad_norm = model, plan, max_grad_norm
        self.accumulation_steps = positive_int(accumulation_steps, "accumulation_steps")
        self.seed = seed if seed is not None else torch.initial_seed()
        self.collective_timeout_s = collective_timeout_s
        self.on_nonfinite = NonFinitePolicy.parse(on_nonfinite)
        inputs = CaptureInputs.of(args, kwargs, loss_fn, target, batch_dims, example_inputs)
        self.graph = graph_for_plan(model, plan, graph, inputs)
        check_whole_batch(self.graph, plan.num_microbatches, [s.num_replicas for s in plan.stages])
        self.topology: Topology = start_topology(plan, collective_timeout_s)
        self.local_plan = local_plan(plan, self.topology.tp_index) if plan.tensor_parallel > 1 else plan
        self.compute = Compute(plan.precision, self.topology.device.type)  # fp32, or bf16 autocast (precision.py)
        self._stages: StageSet = place_stages(
            model, self.graph, self.local_plan, self.topology, self.compute, init_from, job_plan=plan
        )
        self.optimizer = make_optimizer(optimizer, self._stages)
        self.lr_scheduler = make_scheduler(lr_scheduler, self.optimizer)
        self._programs = StepPrograms(
            self.graph, self._stages, self.topology, accumulation_steps=self.accumulation_steps, compute=self.compute
        )
        self.loss_scaling = self._programs.planned.loss_scaling
        self.grad_sync = self._gradient_sync()
        self._count = StepCount()
        self._checkpointer = Checkpointer(
            self._stages,
            self.optimizer,
            self.lr_scheduler,
            self._count,
            job_plan=plan,
            graph_fingerprint=self.graph.fingerprint,
        )
        self._progress = Progress(
            self.topology.rank, self.topology.world_size, enabled=collective_timeout_s is not None
        )
        self.last_grad_norm: float | None = None
        self._warned_loss = False
        if inputs.given:
            self._programs.prebuild(flatten_inputs(self.graph, inputs.args, dict(inputs.kwargs), inputs.target))

    # ------------------------------------------------------------------ what the trainer holds

    @property
    def stages(self) -> list[StageModule]:
        """This rank's stage modules."""
        return self._stages.stages

    @property
    def params(self) -> dict[str, nn.Parameter]:
        """This rank's trainable parameters by canonical name, each once."""
        return self._stages.params

    @property
    def tensor_parallel(self):
        """This rank's tensor-parallel group and layouts (``runtime.tensor_parallel.TensorParallel``), or None."""
        return self._stages.tensor_parallel

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken, skipped ones (``on_nonfinite="skip"``) included; restored by ``load_checkpoint``."""
        return self._count.num_steps

    @property
    def num_skipped_steps(self) -> int:
        return self._count.num_skipped_steps

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
            with self._step_rng(), self.compute.step_context():  # one bf16 copy of each weight per step
                losses = self._run_rounds(program, flat)
            if program.partial_gradients:
                doing = "the all-reduce of sequence-parallel norms' gradients over their tensor-parallel group"
                self.grad_sync.sum_over(program.partial_gradients, program.tensor_parallel.group)
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
                e, step=step, doing=doing, stages=self._stages.describe(), timeout_s=self.collective_timeout_s
            ) from e
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self._count.num_steps += 1
        return loss

    def evaluate(self, *args: Any, **kwargs: Any) -> float:
        """The loss of this batch with the model in eval mode (dropout off, batch norm from its
        running statistics), the same on every rank; nothing changes: weights, gradients,
        optimizer, buffers, RNG streams and ``num_steps`` are left as they were.

        Called like ``step``, with a batch of as many samples. The model is captured once more in
        eval mode (per input shape) and run forward through the plan's pipeline (variants.py).
        """
        program, flat = self._prepare(args, kwargs, "evaluate", training=False)
        runners = self._stages.runners
        with torch.no_grad(), rng_and_buffers_restored(program.stages, self.topology.device), gathered(runners):
            losses = self._run_rounds(program, flat, forward_only=True)
        local = torch.zeros(1, dtype=torch.float32, device=self.topology.device)
        if losses and self.topology.tp_index == 0:  # this rank runs the last stage (once per replica)
            local[0] = program.loss_scaling.reported_loss(losses)
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=self.topology.world_group)
        return float(local.item())

    # ------------------------------------------------------------------ state

    def gather_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0: the full state dict (parameters and persistent buffers, CPU tensors) with
        the keys of ``model.state_dict()`` (tied names included), so that the unsplit model
        loads it directly. Other ranks return None. Collective: call it on every rank."""
        return gather_state_dict(self._stages)

    def held_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers, by canonical name: the tensors
        training updates (on GPUs, ``.to()`` gave the stages their own buffer objects)."""
        return self._stages.held_state()

    def save_checkpoint(self, path: str, *, extra_state: dict | None = None) -> None:
        """Write a DCP checkpoint keyed by the model's parameter names (see checkpoint.py), with the
        caller's ``extra_state`` (a small picklable dict, the same on every rank) when given.
        Collective: every rank, the same path on a filesystem they share."""
        self._checkpointer.save(path, extra_state=extra_state)

    def load_checkpoint(self, path: str, *, verify: bool = True) -> dict:
        """Load a checkpoint written under any plan into this trainer (model, optimizer, scheduler,
        step, RNG); returns its ``extra_state`` ({} when it has none). ``verify``: check the files
        against the checkpoint's manifest first."""
        return self._checkpointer.load(path, verify=verify)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check_arguments(
        model: nn.Module,
        plan: Plan,
        max_grad_norm: float | None,
        seed: int | None,
        init_from: str | None,
        collective_timeout_s: float | None,
    ) -> None:
        """InputError for arguments the constructor cannot take, before any process group or capture."""
        if not isinstance(plan, Plan):
            raise InputError(f"plan must be a partita.Plan, got {type(plan).__name__}: load one with partita.Plan.load")
        check_layout(plan)  # before any process group or capture
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InputError(f"seed must be a non-negative int or None, got {seed!r}")
        timeout_of(collective_timeout_s)
        if init_from is None and on_meta(model):
            raise InputError(
                "the model is on the meta device (no weights): pass init_from=<seed checkpoint>, written by "
                "partita.save_seed(model, path) from the model built with real weights"
            )

    def _gradient_sync(self) -> GradientSync:
        stages, top = self._stages, self.topology
        trainable = {name: h for name, h in stages.holders.items() if name in stages.trainable_names()}
        return GradientSync(
            stages.params,
            trainable,
            top.rank,
            self.loss_scaling.grad_scale,
            timeout=top.timeout,
            world_group=top.world_group,
            sharded=sharded_names(self.local_plan, stages.all_stages) & set(trainable),
            **tensor_parallel_sync(self.plan, stages.tensor_parallel, stages.all_stages, holders_of),
        )

    def _prepare(self, args: tuple, kwargs: dict, where: str, *, training: bool) -> tuple[StepProgram, list]:
        """The batch's flat inputs, checked (size, ids and labels), the program for its shapes, and
        its global values (the loss's counts over the whole batch) filled in."""
        kwargs = dict(kwargs)
        target = kwargs.pop("target", None) if self.graph.has_loss_fn else None
        flat = flatten_inputs(self.graph, args, kwargs, target)
        self._check_batch(flat)
        check_batch_dtypes(self.graph, flat, where)
        program = self._programs.for_batch(flat, args, kwargs, target, where, training=training)
        check_batch_values(program.graph, flat, where, program.index_uses)  # before any stage fails on them
        program.loss_scaling.update(flat)  # global counts of the step, from the whole batch
        return program, flat

    def _run_rounds(self, program: StepProgram, flat: list, *, forward_only: bool = False) -> list[torch.Tensor]:
        """``accumulation_steps`` pipeline rounds over consecutive ``plan.global_batch_size`` samples
        of the batch (gradients accumulate in ``.grad``); the last stage's micro-batch losses."""
        size = self.plan.global_batch_size
        losses: list[torch.Tensor] = []
        for k in range(self.accumulation_steps):
            local = self._local_batch(
                flat if self.accumulation_steps == 1 else narrow_batch(self.graph, flat, k * size, size)
            )
            self._programs.build(program, local)
            losses += program.run(local, forward_only=forward_only)
        return losses

    def _local_batch(self, flat: list) -> list:
        """What this rank runs of one round's ``plan.global_batch_size`` samples, on its device: its
        replica's slice (uniform), or all of them (uneven: the executor slices each micro-batch itself)."""
        top = self.topology
        if top.uniform:
            per_replica = self.plan.global_batch_size // top.replicas
            flat = narrow_batch(self.graph, flat, top.replica * per_replica, per_replica)
        return [x.to(top.device) if isinstance(x, torch.Tensor) else x for x in flat]

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
                f"the batch has {batch} samples along {batch_dims_words(self.graph)} (where capture put the "
                f"batch) but the trainer takes {expected} (the plan's global batch {self.plan.global_batch_size}"
                f"{rounds}): pass the whole batch on every rank, or, if the samples lie along another dim (a "
                "sequence-first input), capture and plan with batch_dims= naming it"
            )
        return batch

    def _global_loss(self, program: StepProgram, losses: list[torch.Tensor]) -> tuple[float, int]:
        """The full-batch loss (the last stage's ranks' parts of it, ``LossScaling.reported_loss``) and
        the number of non-finite micro-batch losses and gradients over all ranks: one all-reduce, the
        same answer on every rank."""
        top = self.topology
        local = torch.zeros(2, dtype=torch.float32, device=top.device)  # (loss part, non-finite count)
        if losses and top.tp_index == 0:  # this rank runs the last stage (once per replica)
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
        local = gradient_findings(self.params, self._stages.stages_of(), top.rank)
        if losses and top.tp_index == 0:  # once per replica of the last stage
            last = self.local_plan.num_stages - 1
            samples = [self._loss_samples(i) for i in range(len(losses))]
            local = loss_findings(losses, stage_index=last, replica=top.replica, rank=top.rank, samples=samples) + local
        findings = gather_findings(local, group=top.world_group)
        message = describe(
            findings,
            step=step,
            replicas=self.local_plan.stages[-1].num_replicas,  # the same on every rank
            policy=self.on_nonfinite,
        )
        if self.on_nonfinite is NonFinitePolicy.RAISE:
            raise NumericsError(message, step=step, findings=tuple(findings))
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.optimizer.zero_grad(set_to_none=True)
        self._count.num_steps += 1
        self._count.num_skipped_steps += 1
        return loss

    def _loss_samples(self, index: int) -> tuple[int, int]:
        """(first sample in the batch, number of samples) of this last-stage rank's ``index``-th
        micro-batch loss (micro-batches of every accumulation round, in order)."""
        top, plan = self.topology, self.local_plan
        samples = self._programs.microbatch_samples
        rounds, microbatch = divmod(index, plan.num_microbatches)
        first = rounds * plan.global_batch_size
        if top.uniform:
            per_replica = plan.global_batch_size // top.replicas
            return first + top.replica * per_replica + microbatch * samples, samples
        microbatch_samples = plan.global_batch_size // plan.num_microbatches
        shares = stage_shares(plan.stages[-1], microbatch_samples)
        return first + microbatch * microbatch_samples + sum(shares[: top.replica]), samples
