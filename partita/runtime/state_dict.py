"""The trained weights as one state dict on rank 0, under the model's own keys."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partita.capturing import canonical_names
from partita.runtime.stage_set import StageSet

__all__ = ["gather_state_dict"]


def gather_state_dict(stages: StageSet) -> dict[str, torch.Tensor] | None:
    """``Trainer.gather_state_dict``: on rank 0 the full state dict (CPU tensors, the keys of
    ``model.state_dict()``, tied names included); None elsewhere. Collective.

    Each tensor comes from the first rank holding it (whole: gathered over a sharded stage's
    replicas and over a tensor-parallel group); tensors no stage reads (unused by the loss) come
    from rank 0's model, which never changes them.
    """
    rank = stages.topology.rank
    local = {}
    for name, t in sorted(stages.held_state().items()):  # one order on every rank: full_tensor is collective
        whole = t.full_tensor() if isinstance(t, DTensor) else t  # a sharded stage's: gathered over its replicas
        if stages.owner(name) == rank:
            local[name] = whole.detach().cpu().clone()
    gathered: list | None = [None] * stages.topology.world_size if rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if rank != 0:
        return None
    merged = {name: t for part in gathered for name, t in part.items()}
    canonical = canonical_names(stages.model)
    result = {}
    for key, t in stages.model.state_dict(keep_vars=True).items():
        name = canonical[id(t)]
        result[key] = merged[name] if name in merged else t.detach().cpu().clone()
    return result
