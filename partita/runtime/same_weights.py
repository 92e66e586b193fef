"""Every rank starts from the same weights: rank 0's, as DDP makes them at construction.

A torchrun script builds the model on every rank. When the ranks seed its construction differently
(or not at all), each holds other random weights, and a pipeline would train rank 0's first stage
with rank 1's last one: a model that no rank holds, whose losses match none of them, with no error.
The plan's digest checks the plan, not the weights.

``agree_on_weights`` compares a fingerprint of every parameter and persistent buffer over the ranks
(one small all-gather); the tensors that differ anywhere are broadcast from rank 0, and rank 0
warns once, naming how many and which. Equal weights (the common case) cost the fingerprints
alone: no weight travels. A model built on ``meta`` is skipped: its weights come later from one
source (``init_from``, a seed checkpoint) on every rank.

The fingerprint reads a tensor's bytes as integers (exact on every device, unlike a floating-point
sum, whose rounding may differ between device types) and sums them twice, once weighted by position,
so that equal fingerprints mean equal tensors short of a deliberate collision.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from partita.capturing import canonical_names

__all__ = ["agree_on_weights", "fingerprint"]

_CHUNK = 1 << 22  # elements read at a time: the integer copies stay small beside the tensor
_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SHOWN = 3  # names a warning lists


def fingerprint(tensor: torch.Tensor) -> tuple[int, int]:
    """Two integers that equal tensors share: the sum of their elements' bytes read as integers,
    and the same sum weighted by position (modulo 2**64, as int64 arithmetic wraps)."""
    flat = tensor.detach().contiguous().reshape(-1)
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    integers = flat.view(_INTEGERS[flat.element_size()]) if flat.dtype != torch.bool else flat.view(torch.int8)
    plain = weighted = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, integers.numel(), _CHUNK):
        part = integers[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device)
        plain = plain + part.sum()
        weighted = weighted + (part * (position % 65521 + 1)).sum()
    return int(plain), int(weighted)


def agree_on_weights(model: nn.Module, device: torch.device, group: dist.ProcessGroup | None = None) -> list[str]:
    """Give every rank of ``group`` rank 0's parameters and persistent buffers where they differ
    (see the module docstring); returns the canonical names that were replaced, the same on every
    rank. ``device``: where this rank's collectives run (NCCL needs CUDA tensors)."""
    if dist.get_world_size(group) == 1 or any(t.is_meta for t in model.state_dict(keep_vars=True).values()):
        return []
    names = canonical_names(model)
    tensors = {names[id(t)]: t for t in model.state_dict(keep_vars=True).values()}
    mine = {name: fingerprint(t) for name, t in sorted(tensors.items())}
    everyone: list[dict[str, tuple[int, int]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    reference = everyone[0]
    differ = sorted(name for name in reference if any(theirs.get(name) != reference[name] for theirs in everyone))
    source = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for name in differ:
            tensor = tensors[name]
            moved = tensor.detach().to(device).contiguous()
            dist.broadcast(moved, src=source, group=group)
            tensor.copy_(moved)
    if differ and dist.get_rank(group) == 0:
        ranks = [r for r, theirs in enumerate(everyone) if theirs != reference]
        shown = ", ".join(differ[:_SHOWN]) + (f" and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else "")
        warnings.warn(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} built the model with other weights "
            f"than rank 0 ({len(differ)} of {len(reference)} tensors differ: {shown}); every rank now starts from "
            "rank 0's, as DDP does. Seed the model's construction alike on every rank (torch.manual_seed before "
            "building it) to train from weights you chose",
            UserWarning,
            stacklevel=4,
        )
    return differ
