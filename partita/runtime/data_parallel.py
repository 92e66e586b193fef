"""Process groups of a plan's layout, and the gradient arithmetic that makes pipelined
training equal unsplit full-batch training.

Two layouts:
- uniform: every stage has ``dp`` replicas. Rank group ``g`` holds ranks ``[g * dp, (g + 1) * dp)``
  (``partita.planning.build.stage_ranks``) and the ranks form a pp x dp DeviceMesh; torch's
  pipelining schedules run each column of the mesh as one pipeline (pipeline.py).
- uneven: stage ``k`` has its own ``r_k`` replicas (GPipe or 1F1B, one stage per rank group),
  on the ranks that follow those of the earlier groups. No mesh can express it: stages exchange
  slices of micro-batches many-to-many (uneven.py).

Glossary
--------
rank group   one pipeline position ``g``: the ranks each holding one replica of the same stages.
replica      a rank's index inside its rank group (uniform: ``rank % dp``; the ranks with the
             same replica index form one pipeline, one column of the mesh).
holders      of a parameter: every rank whose stages read it. Usually one rank group; a tied
             parameter (GPT-2's ``wte`` in the first and the last stage) is held by several rank
             groups, and all their ranks sum its gradient.

Why the gradient is exact (fp32 up to summation order): the unsplit loss is the mean over the
global batch, ``L = 1/(m * r) * sum_{replica, microbatch} L_mb`` when every micro-batch's loss
is a mean over equally many elements, ``r`` being the LAST stage's replica count (``dp`` when
uniform): its replicas compute the losses. Each stage accumulates ``sum_mb dL_mb/dp`` over its
micro-batches (schedules built with ``scale_grads=False``), every sample's contribution reaching
exactly one replica of each stage; the holders all-reduce (SUM) that, and each unique parameter
is divided exactly once by ``m * r``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.errors import InputError
from partita.planning.uneven import UNEVEN_SCHEDULES
from partita.types import Plan

__all__ = ["Topology", "GradientSync", "init_topology"]


@dataclass(frozen=True, eq=False)
class Topology:
    """Where this process sits in the plan's layout, and the groups it talks over."""

    rank: int
    world_size: int
    num_rank_groups: int  # pp
    rank_group: int  # this rank's pipeline position (its stages' rank group)
    replica: int  # this rank's index within its rank group
    replicas: int  # replicas of this rank's stages (dp when uniform)
    device: torch.device
    dp_group: dist.ProcessGroup  # this rank's rank group
    pp_group: dist.ProcessGroup | None = None  # uniform: this rank's pipeline (same replica index in every group)
    mesh: object = None  # uniform: the DeviceMesh with axes ("pp", "dp"); uneven: None (no mesh expresses it)

    @property
    def uniform(self) -> bool:
        return self.mesh is not None


def init_topology(plan: Plan) -> Topology:
    """Initialise torch.distributed if needed (NCCL with CUDA, else gloo) and build the groups:
    the pp x dp mesh of a uniform plan, one group per stage of an uneven one.

    Run under torchrun (or with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), one process per device.
    """
    check_layout(plan)
    device = _init_process_group(plan)
    rank, world = dist.get_rank(), dist.get_world_size()
    if plan.uniform_replicas:
        from torch.distributed.device_mesh import init_device_mesh

        pp, dp = plan.num_rank_groups, plan.stages[0].num_replicas
        mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
        return Topology(rank=rank, world_size=world, num_rank_groups=pp, rank_group=rank // dp, replica=rank % dp,
                        replicas=dp, device=device, dp_group=mesh.get_group("dp"), pp_group=mesh.get_group("pp"),
                        mesh=mesh)
    groups = [dist.new_group(list(s.ranks)) for s in plan.stages]  # collective: every rank, same order
    # One collective of all ranks before any point-to-point: NCCL sets up the world communicator
    # here, not in a batch_isend_irecv that only some ranks join (undefined behaviour per torch's docs).
    dist.barrier()
    stage = next(s for s in plan.stages if rank in s.ranks)
    return Topology(rank=rank, world_size=world, num_rank_groups=plan.num_rank_groups, rank_group=stage.rank_group,
                    replica=stage.ranks.index(rank), replicas=stage.num_replicas, device=device,
                    dp_group=groups[stage.index])


def _init_process_group(plan: Plan) -> torch.device:
    """Join (or check) the process group of ``plan.num_devices`` ranks; this rank's device."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise InputError(f"torch.distributed is not initialised and {', '.join(missing)} are not set: run the "
                             f"training script under `torchrun --nproc-per-node {plan.num_devices} script.py`")
        dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    if world != plan.num_devices:
        raise InputError(f"the plan needs {plan.num_devices} ranks but {world} were started: run torchrun with "
                         f"--nproc-per-node {plan.num_devices} (x nodes), or re-plan for {world} devices")
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    torch.cuda.set_device(device)
    return device


def check_layout(plan: Plan) -> None:
    """InputError unless the runtime can run the plan's layout: a uniform pp x dp mesh with rank
    group g on ranks [g*dp, (g+1)*dp), or an uneven plan (GPipe/1F1B, one stage per rank group)
    whose rank groups hold consecutive ranks, group g after groups 0 .. g-1."""
    if plan.uniform_replicas:
        _check_uniform_layout(plan)
    else:
        _check_uneven_layout(plan)


def _check_uniform_layout(plan: Plan) -> None:
    from partita.planning.schedules import stage_rank_groups

    dp, pp = plan.stages[0].num_replicas, plan.num_rank_groups
    placement = stage_rank_groups(plan.schedule, pp, plan.num_stages)
    for s in plan.stages:
        expected = tuple(range(s.rank_group * dp, (s.rank_group + 1) * dp))
        if s.ranks != expected or s.rank_group != placement[s.index]:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; {plan.schedule.value} "
                f"places it on rank group {placement[s.index]}, ranks {list(expected)}: build the plan with "
                "partita.plan or partita.planning.manual.manual_plan")


def _check_uneven_layout(plan: Plan) -> None:
    counts = [s.num_replicas for s in plan.stages]
    if plan.schedule not in UNEVEN_SCHEDULES:
        raise InputError(f"the plan gives stages different replica counts {counts} under {plan.schedule.value}, "
                         "which the runtime runs on uniform pp x dp meshes only: use schedule gpipe or 1f1b, or "
                         "the same replica count for every stage")
    if plan.num_rank_groups != plan.num_stages:
        raise InputError(f"the plan puts {plan.num_stages} stages on {plan.num_rank_groups} rank groups with "
                         f"different replica counts {counts}: uneven plans run one stage per rank group")
    first = 0
    for s in plan.stages:
        expected = tuple(range(first, first + s.num_replicas))
        if s.ranks != expected or s.rank_group != s.index:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; with replica counts "
                f"{counts} it must run on rank group {s.index}, ranks {list(expected)} (each group's ranks follow "
                "the earlier groups'): build the plan with partita.plan or partita.planning.manual.manual_plan")
        first += s.num_replicas
    batch, m = plan.global_batch_size, plan.num_microbatches
    bad = [r for r in counts if batch % (m * r)]
    if bad:
        raise InputError(f"the global batch of {batch} samples in {m} micro-batches does not split evenly over "
                         f"{bad[0]} replicas: use a global batch that is a multiple of num_microbatches x every "
                         f"replica count {sorted(set(counts))}")


class GradientSync:
    """Sums each parameter's gradient over its holders, scales it once, clips by the global norm.

    ``holders`` maps every trainable parameter read by some stage (canonical name) to the sorted
    ranks holding it, for the WHOLE plan: every rank creates the same process groups in the
    same order, as torch.distributed requires.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], holders: Mapping[str, Sequence[int]], rank: int,
                 scale: float):
        self.params = dict(params)  # this rank's trainable parameters, canonical name -> Parameter
        self.scale = scale  # 1 / (num_microbatches * replicas of the last stage)
        self.owned = [name for name in self.params if min(holders[name]) == rank]  # counted once in the norm
        self.buckets: list[tuple[dist.ProcessGroup, list[str]]] = []
        for ranks in sorted({tuple(h) for h in holders.values() if len(h) > 1}):
            group = dist.new_group(list(ranks))  # collective: every rank creates every group, in this order
            names = [name for name in self.params if tuple(holders[name]) == ranks]
            if rank in ranks and names:
                self.buckets.append((group, names))

    def reduce_and_scale(self) -> None:
        """Gradient of the global mean loss: all-reduce (SUM) over the holders, then multiply by ``scale``."""
        reduced: set[str] = set()
        for group, names in self.buckets:
            grads = [self._grad(name) for name in names]
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per holder set
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.mul_(self.scale)
            offset = 0
            for name, g in zip(names, grads):
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            reduced.update(names)
        for name, p in self.params.items():
            if name not in reduced and p.grad is not None:
                p.grad.mul_(self.scale)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that their global 2-norm (each parameter once) is at most ``max_norm``.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` over the unsplit model. Returns the
        norm before clipping (on every rank).
        """
        device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for name in self.owned:
            grad = self.params[name].grad
            if grad is not None:
                squares += torch.linalg.vector_norm(grad.detach(), dtype=torch.float32).double() ** 2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
        total = squares.sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params.values():
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device, p.grad.dtype))
        return total

    def _grad(self, name: str) -> torch.Tensor:
        """The parameter's gradient; zeros when this holder's stages did not reach it this step."""
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad


def unique_parameters(modules: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """Trainable parameters of ``modules`` by canonical name, each Parameter object once."""
    found: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                found[name] = p
    return found
