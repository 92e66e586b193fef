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
3. gradients are summed over every rank holding a parameter (replicas, tied copies) and divided
   once by ``num_microbatches * r``, ``r`` being the last stage's replica count (``dp`` when uniform);
4. the loss (mean over micro-batches and the last stage's replicas) is all-reduced so every rank returns it, and
   with it the number of non-finite micro-batch losses and gradients (numerics.py): if any, every
   rank raises NumericsError (or skips the update, ``on_nonfinite="skip"``) before the optimizer
   touches a weight;
5. gradients are clipped by the global norm, and the optimizer steps.

Exactness: loss and parameters match the unsplit model trained on the full batch (fp32, up to
summation order) when the model's loss is a mean over equally many elements in every
micro-batch (true for LM losses without ignored positions, and for classification). A loss that
averages over a data-dependent count (masked LM with ``-100`` labels at varying positions) is
averaged per micro-batch first, as in any gradient accumulation. BatchNorm normalises over each
micro-batch slice a rank runs (as under DDP without SyncBatchNorm), and its running statistics
and ``num_batches_tracked`` advance once per slice, not once per step.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from partita.capturing import canonical_names, capture
from partita.errors import InputError, NumericsError
from partita.runtime.checkpoint import load_checkpoint, save_checkpoint
from partita.runtime.data_parallel import GradientSync, Topology, init_topology, unique_parameters
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
from partita.runtime.stages import StageModule, flatten_inputs, narrow_batch, split_graph
from partita.runtime.uneven import UnevenExecutor, check_uneven_boundaries
from partita.types import OpGraph, Plan
from partita.types.plan_file import check_plan_matches_graph

__all__ = ["Trainer"]

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

    Attributes: ``graph``, ``plan``, ``topology`` (rank, replica, mesh, groups), ``stages`` (this rank's
    StageModules), ``optimizer``, ``lr_scheduler``, ``num_steps`` (steps taken, skipped ones included),
    ``num_skipped_steps``, ``last_grad_norm``.
    """

    def __init__(self, model: nn.Module, plan: Plan, *, optimizer: OptimizerFactory,
                 lr_scheduler: SchedulerFactory | None = None, max_grad_norm: float | None = None,
                 graph: OpGraph | None = None, example_inputs: tuple | None = None, loss_fn: Callable | None = None,
                 on_nonfinite: NonFinitePolicy | str = NonFinitePolicy.RAISE, init_from: str | None = None):
        if not isinstance(plan, Plan):
            raise InputError(f"plan must be a partita.Plan, got {type(plan).__name__}: load one with partita.Plan.load")
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise InputError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        self.model, self.plan, self.max_grad_norm = model, plan, max_grad_norm
        self.on_nonfinite = NonFinitePolicy.parse(on_nonfinite)
        if init_from is None and on_meta(model):
            raise InputError("the model is on the meta device (no weights): pass init_from=<seed checkpoint>, "
                             "written by partita.runtime.materialize.save_seed(model) from the model built with "
                             "real weights")
        self.graph = _resolve_graph(model, plan, graph, example_inputs, loss_fn)
        self._state_names = _state_names(model)
        self.topology: Topology = init_topology(plan)
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
            self._metadata = stage_metadata(self._all_stages, _meta_microbatch(self.graph, self._samples),
                                            torch.device("cpu"))
            materialize(model, [*self._all_stages, self.graph.graph_module], self._local_names(),
                        self.topology.device, init_from)
            for stage in self._all_stages:  # ops captured on meta create their tensors on meta
                retarget_device(stage.graph_module, self.topology.device)
        else:
            if self.topology.device.type != "cpu":
                model.to(self.topology.device)
                for stage in self._all_stages:
                    stage.to(self.topology.device)
            if init_from is not None:
                materialize(model, [*self._all_stages, self.graph.graph_module], self._local_names(),
                            self.topology.device, init_from)
        self._holders = _holders(plan, self._all_stages)
        self.params = unique_parameters(self.stages)
        self._stages_of = {name: tuple(s.spec.index for s in self.stages if name in s.spec.param_names)
                           for name in self.params}
        self.optimizer = optimizer(list(self.params.values()))
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        scale = 1.0 / (plan.num_microbatches * plan.stages[-1].num_replicas)  # see data_parallel.py
        trainable = {name: h for name, h in self._holders.items() if name in self._trainable_names()}
        self.grad_sync = GradientSync(self.params, trainable, self.topology.rank, scale)
        self.num_steps = 0
        self.num_skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._root_indices = sorted({j for s in self.stages for j in s.graph_input_indices})
        self._schedule: Any = None  # uniform plans: the torch schedule
        self._executor: UnevenExecutor | None = None  # uneven plans
        self._input_shapes: list | None = None
        if example_inputs is not None:
            flat = flatten_inputs(self.graph, *_example_triple(example_inputs))
            if _batch_of(self.graph, flat) >= self._samples:
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
        target = kwargs.pop("target", None) if self.graph.has_loss_fn else None
        local = self._local_batch(flatten_inputs(self.graph, args, kwargs, target))
        if self._schedule is None and self._executor is None:
            self._build_pipeline(narrow_batch(self.graph, local, 0, self._samples))
        self._check_shapes(local)
        self.optimizer.zero_grad(set_to_none=True)
        losses = self._run_microbatches(local)
        self.grad_sync.reduce_and_scale()
        loss, num_nonfinite = self._global_loss(losses)
        if num_nonfinite:
            return self._nonfinite_step(loss, losses)
        if self.max_grad_norm is not None:
            self.last_grad_norm = float(self.grad_sync.clip(self.max_grad_norm))
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
        self._input_shapes = [_shape_without_batch(self.graph, j, x) for j, x in enumerate(flat_microbatch)]
        if not top.uniform:
            stage = self.stages[0]  # uneven plans run one stage per rank group
            self._executor = UnevenExecutor(self.graph, plan, stage, top.replica, metadata[stage.spec.index],
                                            top.device)
            return
        recompute = [plan.stages[s.spec.index].recompute for s in self.stages]
        pipeline_stages = make_pipeline_stages(self.stages, recompute, metadata, plan.schedule, top.device,
                                               top.pp_group)
        chunks = root_chunk_spec(self.graph, self._root_indices)
        self._schedule = build_schedule(plan.schedule, pipeline_stages, plan.num_microbatches, chunks)
        # The schedule cuts `target` into micro-batches and hands them to the loss function,
        # which ignores them: the last stage computes the loss itself.
        self._dummy_target = torch.zeros(plan.num_microbatches, device=top.device)

    def _check_batch(self, flat: list) -> int:
        """The batch size; InputError unless it is the plan's global batch."""
        batch = _batch_of(self.graph, flat)
        if batch != self.plan.global_batch_size:
            raise InputError(f"the batch has {batch} samples but the plan's global batch is "
                             f"{self.plan.global_batch_size}: pass the whole global batch on every rank")
        return batch

    def _check_shapes(self, flat: list) -> None:
        """Static pipeline metadata fixes every non-batch dim (sequence length, image size)."""
        shapes = [_shape_without_batch(self.graph, j, x) for j, x in enumerate(flat)]
        if shapes != self._input_shapes:
            raise InputError(f"input shapes (batch dim left out) {shapes} differ from the first step's "
                             f"{self._input_shapes}: the pipeline's boundary tensors have static shapes; pad "
                             "every batch to the same sequence length")

    def _global_loss(self, losses: list[torch.Tensor]) -> tuple[float, int]:
        """The loss (mean over micro-batches on the last stage's ranks, then over its replicas) and the
        number of non-finite micro-batch losses and gradients over all ranks: one all-reduce, the
        same answer on every rank."""
        top = self.topology
        local = torch.zeros(2, dtype=torch.float32, device=top.device)  # (loss part, non-finite count)
        if losses:  # this rank runs the last stage
            local[0] = torch.stack([loss.detach().float() for loss in losses]).mean() / top.replicas
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        local[1] = count_nonfinite(losses, top.device) + count_nonfinite(grads, top.device)
        dist.all_reduce(local, op=dist.ReduceOp.SUM)
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
        findings = gather_findings(local)
        message = describe(findings, step=step, replicas=self.plan.stages[-1].num_replicas,  # the same on every rank
                           policy=self.on_nonfinite)
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


# ----------------------------------------------------------------------------- helpers


def _resolve_graph(model: nn.Module, plan: Plan, graph: OpGraph | None, example_inputs: tuple | None,
                   loss_fn: Callable | None) -> OpGraph:
    """The graph the plan was made for: given, or captured from ``model`` and the example inputs."""
    if graph is None:
        if example_inputs is None:
            raise InputError("the trainer needs the OpGraph the plan was made for: pass graph=, or "
                             "example_inputs=(args, kwargs, target) (and loss_fn=) to capture it as partita.plan did")
        args, kwargs, target = _example_triple(example_inputs)
        graph = capture(model, args, kwargs, loss_fn=loss_fn, target=target)
    check_plan_matches_graph(plan, graph, source="the plan")
    ours = {id(t) for t in [*model.parameters(), *model.buffers()]}
    foreign = [name for name, t in _graph_tensors(graph) if id(t) not in ours]
    if foreign:
        raise InputError(f"the graph reads tensors that are not this model's ({foreign[:3]} ...): it was captured "
                         "from another model object; capture it from the model you pass to the Trainer")
    return graph


def _example_triple(example_inputs: tuple) -> tuple[tuple, dict, Any]:
    if not isinstance(example_inputs, (tuple, list)) or len(example_inputs) != 3:
        raise InputError("example_inputs must be (args, kwargs, target), e.g. ((), {'input_ids': ids}, None)")
    args, kwargs, target = example_inputs
    return tuple(args or ()), dict(kwargs or {}), target


def _graph_tensors(graph: OpGraph) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every parameter and buffer the captured graph reads."""
    found = {}
    for target, name in graph.attr_to_param.items():
        value: Any = graph.graph_module
        for atom in target.split("."):
            value = getattr(value, atom)
        found.setdefault(name, value)
    return list(found.items())


def _holders(plan: Plan, stages: list[StageModule]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> sorted ranks whose stages read it (parameters and buffers)."""
    holders: dict[str, set[int]] = {}
    for stage in stages:
        ranks = plan.stages[stage.spec.index].ranks
        for name in stage.spec.param_names:
            holders.setdefault(name, set()).update(ranks)
    return {name: tuple(sorted(r)) for name, r in holders.items()}


def _state_names(model: nn.Module) -> set[str]:
    """Canonical names of what ``model.state_dict()`` holds (parameters, persistent buffers)."""
    canonical = canonical_names(model)
    return {canonical[id(t)] for t in model.state_dict(keep_vars=True).values()}


def _meta_microbatch(graph: OpGraph, microbatch_size: int) -> list:
    """Flat graph inputs of one micro-batch as meta tensors, from the captured shapes."""
    flat = []
    for info in graph.inputs:
        t = info.tensor
        if t is None:  # a constant of the captured graph (int, bool, None): no stage reads it
            flat.append(None)
            continue
        shape = [microbatch_size if d == t.batch_dim else s for d, s in enumerate(t.shape)]
        flat.append(torch.empty(shape, dtype=getattr(torch, t.dtype), device="meta"))
    return flat


def _batch_of(graph: OpGraph, flat: list) -> int:
    sizes = {x.shape[info.tensor.batch_dim] for info, x in zip(graph.inputs, flat)
             if info.tensor is not None and info.tensor.batch_dim is not None and isinstance(x, torch.Tensor)}
    if len(sizes) != 1:
        raise InputError(f"the inputs disagree on the batch size (sizes along their batch dims: {sorted(sizes)})"
                         if sizes else "no input has a batch dimension: the trainer cannot split the batch")
    return sizes.pop()


def _shape_without_batch(graph: OpGraph, j: int, x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return None
    dim = graph.inputs[j].tensor.batch_dim if graph.inputs[j].tensor is not None else None
    return tuple(s for d, s in enumerate(x.shape) if d != dim)
