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
from partita.errors import InputError, NumericsError, PartitaError
from partita.planning.context import check_whole_batch
from partita.runtime.batch_values import check_batch_values, index_uses
from partita.runtime.checkpoint import load_checkpoint, save_checkpoint
from partita.runtime.data_parallel import (
    GradientSync,
    Topology,
    unique_parameters,
)
from partita.runtime.job import shared_plan, start_topology
from partita.runtime.loss_scaling import LossScaling
from partita.runtime.materialize import materialize, on_meta, retarget_device
from partita.runtime.numerics import (
    NonFinitePolicy,
    count_nonfinite,
    describe,
    gather_findings,
    gradient_findings,
    loss_findings,
)
from partita.runtime.pipeline import build_schedule, make_pipeline_stages, root_chunk_spec, root_key, stage_metadata
from partita.runtime.progress import Progress, is_timeout
from partita.runtime.stages import StageModule, flatten_inputs, narrow_batch, split_graph
from partita.runtime.trainer_setup import (
    batch_of,
    check_scheduler,
    example_triple,
    holders,
    meta_microbatch,
    resolve_graph,
    shape_without_batch,
    state_names,
)
from partita.runtime.uneven import UnevenExecutor, check_uneven_boundaries
from partita.types import OpGraph, Plan

__all__ = ["Trainer", "shared_plan"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Trainer:
    """Pipelined, replicated training of ``model`` as ``plan`` says (one process per device).

    Args:
        model: the unmodified model, with the same weights on every rank. Its parameters are
            trained in place (stage modules hold the model's own Parameter objects).
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
    ``num_skipped_steps``, ``last_grad_norm``.
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
    ):
        if not isinstance(plan, Plan):
            raise InputError(f"plan must be a partita.Plan, got {type(plan).__name__}: load one with partita.Plan.load")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InputError(f"seed must be a non-negative int or None, got {seed!r}")
        self.model, self.plan, self.max_grad_norm = model, plan, max_grad_norm
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
        self._progress = Progress(
            self.topology.rank, self.topology.world_size, enabled=collective_timeout_s is not None
        )
        self._all_stages = split_graph(self.graph, plan.boundaries)
        if not plan.uniform_replicas:
            check_uneven_boundaries(self.graph, plan, self._all_stages)
        # Samples per micro-batch that this rank's stages run (uniform: plan.microbatch_size).
        self._samples = plan.global_batch_size // (plan.num_microbatches * self.topology.replicas)
        group = self.topology.rank_group
        self.stages: list[StageModule] = [s for s in self._all_stages if plan.stages[s.spec.index].rank_group == group]
        self._metadata: list | None = None
        if on_meta(model):
            # Static pipeline metadata from shapes alone, while every stage is still on meta.
            self._metadata = stage_metadata(
                self._all_stages, meta_microbatch(self.graph, self._samples), torch.device("cpu")
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
        self._holders = holders(plan, self._all_stages)
        self.params = unique_parameters(self.stages)
        self._stages_of = {
            name: tuple(s.spec.index for s in self.stages if name in s.spec.param_names) for name in self.params
        }
        self.optimizer = self._make_optimizer(optimizer)
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        check_scheduler(self.lr_scheduler)
        # Rewrites the stages that compute a loss normalised by a data-dependent count (loss_scaling.py).
        self._index_uses = index_uses(self.graph)
        self.loss_scaling = LossScaling(self.graph, plan, self._all_stages, self.stages, self.topology.device)
        trainable = {name: h for name, h in self._holders.items() if name in self._trainable_names()}
        top = self.topology
        self.grad_sync = GradientSync(
            self.params,
            trainable,
            top.rank,
            self.loss_scaling.grad_scale,
            timeout=top.timeout,
            world_group=top.world_group,
        )
        self.num_steps = 0
        self.num_skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._warned_loss = False
        self._root_indices = sorted({j for s in self.stages for j in s.graph_input_indices})
        self._schedule: Any = None  # uniform plans: the torch schedule
        self._executor: UnevenExecutor | None = None  # uneven plans
        self._input_shapes: list | None = None
        if example_inputs is not None:
            flat = flatten_inputs(self.graph, *example_triple(example_inputs))
            if batch_of(self.graph, flat) >= self._samples:
                self._build_pipeline(narrow_batch(self.graph, flat, 0, self._samples))

    # ------------------------------------------------------------------ training

    def step(self, *args: Any, **kwargs: Any) -> float:
        """One optimizer step on the global batch; returns its mean loss (the same on every rank).

        Call it exactly like the model: ``trainer.step(*args, **kwargs)``. When the graph was
        captured with a ``loss_fn``, the keyword ``target=`` is the loss target (not a model
        input). Every rank must pass the same batch of ``plan.global_batch_size`` samples.

        Raises NumericsError (on every rank, before the optimizer step) when a loss or gradient
        is not finite, unless the trainer was built with ``on_nonfinite="skip"``.
        """
        step = self.num_steps + 1
        self._progress.mark(step)
        target = kwargs.pop("target", None) if self.graph.has_loss_fn else None
        flat = flatten_inputs(self.graph, args, kwargs, target)
        check_batch_values(self.graph, flat, f"step {step}", self._index_uses)  # before any stage fails on them
        local = self._local_batch(flat)
        self.loss_scaling.update(flat)  # global counts of the step, from the whole global batch
        if self._schedule is None and self._executor is None:
            self._build_pipeline(narrow_batch(self.graph, local, 0, self._samples))
        self._check_shapes(local)
        self._warn_about_loss()
        self.optimizer.zero_grad(set_to_none=True)
        doing = "the pipeline's transfers between stages"
        try:
            with self._step_rng():
                losses = self._run_microbatches(local)
            doing = "the all-reduce of gradients over their holders"
            self.grad_sync.reduce_and_scale()
            doing = "the all-reduce of the loss"
            loss, num_nonfinite = self._global_loss(losses)
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

    def gather_state_dict(self) -> dict[str, torch.Tensor] | None:
        """On rank 0: the full state dict (parameters and persistent buffers, CPU tensors) with
        the keys of ``model.state_dict()`` (tied names included), so that the unsplit model
        loads it directly. Other ranks return None. Collective: call it on every rank.

        Each tensor comes from the first rank holding it; tensors no stage reads (unused by
        the loss) come from rank 0's model, which never changes them.
        """
        rank = self.topology.rank
        local = {name: t.detach().cpu().clone() for name, t in self.held_state().items() if self._owner(name) == rank}
        gathered: list | None = [None] * self.topology.world_size if rank == 0 else None
        dist.gather_object(local, gathered, dst=0)
        if rank != 0:
            return None
        merged = {name: t for part in gathered for name, t in part.items()}
        canonical = canonical_names(self.model)
        result = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            name = canonical[id(t)]
            result[key] = merged[name] if name in merged else t.detach().cpu().clone()
        return result

    def held_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers, by canonical name: the tensors
        training updates (on GPUs, ``.to()`` gave the stages their own buffer objects)."""
        held: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
                if name in self._state_names:  # leaves out export's lifted constants, non-persistent buffers
                    held.setdefault(name, t)
        return held

    def save_checkpoint(self, path: str) -> None:
        """Write a DCP checkpoint keyed by the model's parameter names (see checkpoint.py)."""
        save_checkpoint(self, path)

    def load_checkpoint(self, path: str) -> None:
        """Load a checkpoint written under any plan into this trainer (model, optimizer, scheduler, step, RNG)."""
        load_checkpoint(self, path)

    # ------------------------------------------------------------------ internals

    def _local_batch(self, flat: list) -> list:
        """What this rank runs, on its device: its replica's slice of the global batch (uniform),
        or the whole global batch (uneven: the executor slices each micro-batch itself)."""
        batch = self._check_batch(flat)
        top = self.topology
        if top.uniform:
            per_replica = batch // top.replicas
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

    def _warn_about_loss(self) -> None:
        """Once, at the first step, on rank 0: the loss could not be normalised over the global batch."""
        if self.loss_scaling.warning is not None and not self._warned_loss and self.topology.rank == 0:
            warnings.warn(self.loss_scaling.warning, RuntimeWarning, stacklevel=3)
        self._warned_loss = True

    def _run_microbatches(self, local: list) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch; the last stage's micro-batch losses ([] elsewhere)."""
        if self._executor is not None:
            return self._executor.step(local)
        losses: list[torch.Tensor] = []
        roots = {root_key(j): local[j] for j in self._root_indices}
        self._schedule.step(target=self._dummy_target, losses=losses, return_outputs=False, **roots)
        return losses

    def _build_pipeline(self, flat_microbatch: list) -> None:
        """Static metadata from one micro-batch of this rank's size (``_samples``), then the plan's
        torch schedule (uniform) or the uneven executor for this rank's one stage."""
        plan, top = self.plan, self.topology
        flat_microbatch = [x.to(top.device) if isinstance(x, torch.Tensor) else x for x in flat_microbatch]
        metadata = self._metadata or stage_metadata(self._all_stages, flat_microbatch, top.device)
        self._input_shapes = [shape_without_batch(self.graph, j, x) for j, x in enumerate(flat_microbatch)]
        if not top.uniform:
            stage = self.stages[0]  # uneven plans run one stage per rank group
            self._executor = UnevenExecutor(
                self.graph, plan, stage, top.replica, metadata[stage.spec.index], top.device, group=top.world_group
            )
            return
        recompute = [plan.stages[s.spec.index].recompute for s in self.stages]
        pipeline_stages = make_pipeline_stages(
            self.stages, recompute, metadata, plan.schedule, top.device, top.pp_group
        )
        chunks = root_chunk_spec(self.graph, self._root_indices)
        self._schedule = build_schedule(plan.schedule, pipeline_stages, plan.num_microbatches, chunks)
        # The schedule cuts `target` into micro-batches and hands them to the loss function,
        # which ignores them: the last stage computes the loss itself.
        self._dummy_target = torch.zeros(plan.num_microbatches, device=top.device)

    def _check_batch(self, flat: list) -> int:
        """The batch size; InputError unless it is the plan's global batch."""
        batch = batch_of(self.graph, flat)
        if batch != self.plan.global_batch_size:
            raise InputError(
                f"the batch has {batch} samples but the plan's global batch is "
                f"{self.plan.global_batch_size}: pass the whole global batch on every rank"
            )
        return batch

    def _check_shapes(self, flat: list) -> None:
        """Static pipeline metadata fixes every non-batch dim (sequence length, image size)."""
        shapes = [shape_without_batch(self.graph, j, x) for j, x in enumerate(flat)]
        if shapes != self._input_shapes:
            raise InputError(
                f"input shapes (batch dim left out) {shapes} differ from the first step's "
                f"{self._input_shapes}: the pipeline's boundary tensors have static shapes; pad "
                "every batch to the same sequence length"
            )

    def _global_loss(self, losses: list[torch.Tensor]) -> tuple[float, int]:
        """The full-batch loss (the last stage's ranks' parts of it, ``LossScaling.reported_loss``) and
        the number of non-finite micro-batch losses and gradients over all ranks: one all-reduce, the
        same answer on every rank."""
        top = self.topology
        local = torch.zeros(2, dtype=torch.float32, device=top.device)  # (loss part, non-finite count)
        if losses:  # this rank runs the last stage
            local[0] = self.loss_scaling.reported_loss(losses)
        grads = [p.grad for p in self.params.values() if p.grad is not None]
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

    def _loss_samples(self, microbatch: int) -> tuple[int, int]:
        """(first global sample, number of samples) of this last-stage rank's loss for ``microbatch``."""
        top, plan = self.topology, self.plan
        if top.uniform:
            return top.replica * (plan.global_batch_size // top.replicas) + microbatch * self._samples, self._samples
        microbatch_samples = plan.global_batch_size // plan.num_microbatches
        return microbatch * microbatch_samples + top.replica * self._samples, self._samples

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
