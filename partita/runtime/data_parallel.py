"""Process groups of a plan's pp x dp mesh, and the gradient arithmetic that makes pipelined
training equal unsplit full-batch training.

Glossary
--------
rank group   one pipeline position ``g``: the ``dp`` ranks ``[g * dp, (g + 1) * dp)``, each
             holding one replica of the same stages (``partita.plan.build.stage_ranks``).
replica      a rank's index ``rank % dp`` inside its rank group; the ranks with the same
             replica index form one pipeline (one column of the mesh).
holders      of a parameter: every rank whose stages read it. Usually one rank group (``dp``
             ranks); a tied parameter (GPT-2's ``wte`` in the first and the last stage) is held
             by several rank groups, and all their ranks sum its gradient.

Why the gradient is exact (fp32 up to summation order): the unsplit loss is the mean over the
global batch, ``L = 1/(m * dp) * sum_{replica, microbatch} L_mb`` when every micro-batch's loss
is a mean over equally many elements. Each stage accumulates ``sum_mb dL_mb/dp`` over its
micro-batches (schedules built with ``scale_grads=False``), the holders all-reduce (SUM) that,
and each unique parameter is divided exactly once by ``m * dp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.errors import InputError
from partita.types import Plan

__all__ = ["Topology", "GradientSync", "init_topology"]


@dataclass(frozen=True, eq=False)
class Topology:
    """Where this process sits in the plan's mesh, and the groups it talks over."""

    rank: int
    world_size: int
    num_rank_groups: int  # pp
    replicas: int  # dp
    device: torch.device
    pp_group: dist.ProcessGroup  # this rank's pipeline: same replica index in every rank group
    dp_group: dist.ProcessGroup  # this rank's rank group
    mesh: object  # torch.distributed.device_mesh.DeviceMesh with axes ("pp", "dp")

    @property
    def rank_group(self) -> int:
        return self.rank // self.replicas

    @property
    def replica(self) -> int:
        return self.rank % self.replicas


def init_topology(plan: Plan) -> Topology:
    """Initialise torch.distributed if needed (NCCL with CUDA, else gloo) and build the mesh.

    Run under torchrun (or with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), one process per device.
    """
    from torch.distributed.device_mesh import init_device_mesh

    check_layout(plan)
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
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    pp, dp = plan.num_rank_groups, plan.stages[0].num_replicas
    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    return Topology(rank=dist.get_rank(), world_size=world, num_rank_groups=pp, replicas=dp, device=device,
                    pp_group=mesh.get_group("pp"), dp_group=mesh.get_group("dp"), mesh=mesh)


def check_layout(plan: Plan) -> None:
    """The runtime runs uniform pp x dp meshes with rank group g on ranks [g*dp, (g+1)*dp)."""
    from partita.plan.schedules import stage_rank_groups

    if not plan.uniform_replicas:
        counts = [s.num_replicas for s in plan.stages]
        raise InputError(f"the plan gives stages different replica counts {counts}; the runtime trains uniform "
                         "pp x dp meshes only: re-plan with uniform_replicas=True")
    dp, pp = plan.stages[0].num_replicas, plan.num_rank_groups
    placement = stage_rank_groups(plan.schedule, pp, plan.num_stages)
    for s in plan.stages:
        expected = tuple(range(s.rank_group * dp, (s.rank_group + 1) * dp))
        if s.ranks != expected or s.rank_group != placement[s.index]:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; {plan.schedule.value} "
                f"places it on rank group {placement[s.index]}, ranks {list(expected)}: build the plan with "
                "partita.plan or partita.plan.manual.manual_plan")


class GradientSync:
    """Sums each parameter's gradient over its holders, scales it once, clips by the global norm.

    ``holders`` maps every trainable parameter read by some stage (canonical name) to the sorted
    ranks holding it, for the WHOLE plan: every rank creates the same process groups in the
    same order, as torch.distributed requires.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], holders: Mapping[str, Sequence[int]], rank: int,
                 scale: float):
        self.params = dict(params)  # this rank's trainable parameters, canonical name -> Parameter
        self.scale = scale  # 1 / (num_microbatches * replicas)
        self.owned = [name for name in self.params if min(holders[name]) == rank]  # counted once in the norm
        self.buckets: list[tuple[dist.ProcessGroup, list[str]]] = []
        for ranks in sorted({tuple(h) for h in holders.values() if len(h) > 1}):
            group = dist.new_group(list(ranks))  # collective: every rank creates every group, in this order
            names = [name for name in self.params if tuple(holders[name]) == ranks]
            if rank in ranks and names:
                self.buckets.append((group, names))

    def reduce_and_scale(self) -> None:
        """Gradient of the global mean loss: all-reduce (SUM) over the holders, then divide by m * dp."""
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
