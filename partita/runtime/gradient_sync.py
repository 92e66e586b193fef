"""The gradient arithmetic that makes pipelined, replicated training equal unsplit full-batch
training: each parameter's gradient summed over its holders, scaled once, clipped by the global norm.

Glossary
--------
holders      of a parameter: every rank whose stages read it. Usually one rank group; a tied
             parameter (GPT-2's ``wte`` in the first and the last stage) is held by several rank
             groups, and all their ranks sum its gradient.

Why the gradient is exact (fp32 up to summation order): the unsplit loss is the mean over the
global batch, ``L = 1/(m * r) * sum_{replica, microbatch} L_mb`` when every micro-batch's loss
is a mean over equally many elements, ``r`` being the LAST stage's replica count (``dp`` when
uniform): its replicas compute the losses. Each stage accumulates ``sum_mb dL_mb/dp`` over its
micro-batches (schedules built with ``scale_grads=False``), every sample's contribution reaching
exactly one replica of each stage; the holders all-reduce (SUM) that, and each unique parameter
is divided exactly once by ``m * r``. When the loss divides by a data-dependent count
(``partita.runtime.loss_scaling``), the last stage's slices compute parts that already SUM to the
full-batch loss, and the scale is 1 instead.
"""

from __future__ import annotations

import datetime
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partita.runtime.process_groups import new_group

__all__ = ["GradientSync", "local_tensor", "unique_parameters"]


class GradientSync:
    """Sums each parameter's gradient over its holders, scales it once, clips by the global norm.

    ``holders`` maps every trainable parameter read by some stage (canonical name) to the sorted
    ranks holding it, for the WHOLE plan: every rank creates the same process groups in the
    same order, as torch.distributed requires.
    """

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        holders: Mapping[str, Sequence[int]],
        rank: int,
        scale: float,
        *,
        timeout: datetime.timedelta | None = None,
        world_group: dist.ProcessGroup | None = None,
        sharded: Collection[str] = (),
        group_sets: Sequence[tuple[int, ...]] | None = None,
        spanning: Mapping[str, Sequence[int]] | None = None,
        tp_index: int = 0,
        tp_split: Collection[str] = (),
    ):
        self.params = dict(params)  # this rank's trainable parameters, canonical name -> Parameter
        # Read by sharded stages (sharding.py): FSDP2 reduce-scatters them over the replicas, and
        # each replica's shard is its own part of the norm.
        self.sharded = frozenset(sharded)
        self.scale = scale  # 1 / (num_microbatches * replicas of the last stage), or 1 (loss_scaling.py)
        self.world_group = world_group  # the norm's all-reduce over all ranks (None: the default group)
        # Tensor parallelism (tensor_parallel.py): `holders` are this rank's index's (its
        # `local_plan`), `group_sets` the holder sets of every index, which all ranks create
        # (default: those of `holders`). A weight read by stages of different degrees (`spanning`)
        # is summed over all its holders, each replica's gradient (the same on every rank of its
        # group) taken from the ranks of index 0 only. In the norm, a weight the group splits
        # (`tp_split`) counts each index's part, any other weight only index 0's copy.
        holders = {**holders, **(spanning or {})}
        self.spanning = frozenset(spanning or ()) & frozenset(self.params)
        self.tp_index, self.tp_split = tp_index, frozenset(tp_split)
        self.owned = [
            name
            for name in self.params
            if (name in self.sharded or min(holders[name]) == rank) and (name in self.tp_split or tp_index == 0)
        ]  # once in the norm
        self.buckets: list[tuple[dist.ProcessGroup, list[str]]] = []
        if group_sets is None:
            group_sets = sorted({tuple(h) for h in holders.values() if len(h) > 1})
        for ranks in group_sets:
            group = new_group(list(ranks), timeout)  # collective: every rank creates every group, in this order
            # In one order on every holder: the all-reduce sums the flattened buffers position by
            # position, and a rank's own order (that of its stages' parameters) differs between ranks
            # whose stages read the shared weights in different orders (a layer reused at every depth).
            names = sorted(name for name in self.params if tuple(holders[name]) == ranks and name not in self.sharded)
            if rank in ranks and names:
                self.buckets.append((group, names))

    def sum_over(self, names: Collection[str], group: dist.ProcessGroup | None) -> None:
        """Sum the gradients of ``names`` over ``group`` (one collective; none without names): those
        each rank of a tensor-parallel group holds only its tokens' part of under sequence
        parallelism (``partita.runtime.tensor_parallel_rewrite.partial_gradients``), summed once per
        step before ``reduce_and_scale`` sums them over their holders."""
        if not names or group is None or dist.get_world_size(group) == 1:
            return
        _sum_together([local_tensor(self._grad(name)) for name in sorted(names)], group)

    def reduce_and_scale(self) -> None:
        """Gradient of the global mean loss: all-reduce (SUM) over the holders, then multiply by ``scale``."""
        reduced: set[str] = set()
        for group, names in self.buckets:
            grads = [self._grad(name) for name in names]
            if self.tp_index != 0:  # a copy of index 0's: left out of the sum (class docstring)
                for name, g in zip(names, grads):
                    if name in self.spanning:
                        g.zero_()
            _sum_together(grads, group, scale=self.scale)  # one collective per holder set
            reduced.update(names)
        for name, p in self.params.items():
            if name not in reduced and p.grad is not None:
                p.grad.mul_(self.scale)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that their global 2-norm (each parameter once) is at most ``max_norm``.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` over the unsplit model. Returns the
        norm before clipping (on every rank).
        """
        device = next(iter(self.params.values())).device if self.params else _group_device(self.world_group)
        squares = torch.zeros(1, dtype=torch.float64, device=device)
        for name in self.owned:
            grad = self.params[name].grad
            if grad is not None:
                norm = torch.linalg.vector_norm(local_tensor(grad).detach(), dtype=torch.float32).double()
                squares += norm**2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.world_group)
        total = squares.sum().sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params.values():
            if p.grad is not None:
                grad = local_tensor(p.grad)  # a shard's local tensor: scaled in place
                grad.mul_(coef.to(grad.device, grad.dtype))
        return total

    def _grad(self, name: str) -> torch.Tensor:
        """The parameter's gradient; zeros when this holder's stages did not reach it this step."""
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad


def _sum_together(grads: Sequence[torch.Tensor], group: dist.ProcessGroup, *, scale: float = 1.0) -> None:
    """Each of ``grads`` replaced, in place, by its sum over ``group`` times ``scale``: one
    all-reduce of them all, flattened into one buffer."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2's parameters and gradients), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a rank without parameters puts its part of a collective (NCCL needs a CUDA tensor)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
