"""Non-finite losses and gradients: caught before the optimizer steps, on every rank alike.

Why before the optimizer: one NaN gradient entry makes AdamW write NaN into that weight and its
moment estimates for good. Why on every rank alike: a rank that stepped while another did not
would leave replicas and tied copies of a parameter out of sync.

How: each rank counts the non-finite tensors it holds (the last stage's micro-batch losses, its
parameters' gradients after the all-reduce over their holders). The count rides in the
all-reduce that already averages the loss, so a healthy step costs no extra collective and no
extra host sync. Only when the total is non-zero do the ranks gather the details (``NonFinite``
records) and build one message, the same everywhere; the trainer then raises ``NumericsError``
or, with ``on_nonfinite="skip"``, warns and leaves weights, optimizer state and LR schedule as
they were.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from partita.checks import parse_choice

__all__ = [
    "NonFinite",
    "NonFinitePolicy",
    "count_nonfinite",
    "describe",
    "gather_findings",
    "gradient_findings",
    "loss_findings",
]

MAX_LISTED = 6  # parameters named in a message; the rest are counted


class NonFinitePolicy(str, enum.Enum):
    """What a step does when its loss or a gradient is NaN or infinite."""

    RAISE = "raise"  # raise NumericsError on every rank, before the optimizer step
    SKIP = "skip"  # warn, skip the optimizer step, return the non-finite loss

    @classmethod
    def parse(cls, value: NonFinitePolicy | str) -> NonFinitePolicy:
        return parse_choice(cls, value, "on_nonfinite")


@dataclass(frozen=True)
class NonFinite:
    """One non-finite tensor: a micro-batch's loss, or a parameter's (reduced) gradient."""

    kind: str  # "loss" or "gradient"
    value: str  # what it holds: "nan", "inf", "-inf", or several of them ("nan, inf")
    stage_indices: tuple[int, ...]  # the stage(s) on ``rank`` that computed the loss or hold the parameter
    rank: int
    microbatch_index: int | None = None  # losses: index within the rank's replica
    replica: int | None = None  # losses: the rank's replica
    parameter: str | None = None  # gradients: canonical parameter name
    first_sample: int | None = None  # losses: the first global sample of the micro-batch's slice
    num_samples: int | None = None  # losses: how many samples the loss averaged


def count_nonfinite(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """How many of ``tensors`` hold a NaN or an inf: a 0-dim float32 tensor on ``device``
    (computed on the device, so a healthy step pays no host sync for it)."""
    # The largest |x| of each tensor is NaN or inf exactly when the tensor holds one (max propagates
    # NaN; unlike a 2-norm it cannot overflow): one fused pass per (device, dtype) group, without
    # a boolean copy of every tensor.
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.dtype), []).append(t.detach())
    counts = [
        (~torch.isfinite(torch.stack(torch._foreach_norm(group, float("inf"))))).sum().to(device)
        for group in groups.values()
    ]
    if not counts:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(counts).sum().float()


def loss_findings(
    losses: Sequence[torch.Tensor], *, stage_index: int, replica: int, rank: int, samples: Sequence[tuple[int, int]]
) -> list[NonFinite]:
    """The non-finite micro-batch losses of the last stage on this rank (list index = micro-batch).

    ``samples[i]``: (first global sample, number of samples) of micro-batch ``i``'s loss, which
    depends on the layout (uniform: replica-major; uneven: micro-batch-major, see uneven.py)."""
    found = []
    for i, loss in enumerate(losses):
        if not bool(torch.isfinite(loss.detach()).all()):
            first, count = samples[i]
            found.append(
                NonFinite(
                    "loss",
                    _value(loss),
                    (stage_index,),
                    rank,
                    microbatch_index=i,
                    replica=replica,
                    first_sample=first,
                    num_samples=count,
                )
            )
    return found


def gradient_findings(
    params: Mapping[str, torch.nn.Parameter], stages_of: Mapping[str, tuple[int, ...]], rank: int
) -> list[NonFinite]:
    """The parameters of this rank whose gradient holds a NaN or an inf."""
    found = []
    for name, p in params.items():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # a sharded stage's: this shard
        if grad is not None and not bool(torch.isfinite(grad).all()):
            found.append(NonFinite("gradient", _value(grad), stages_of.get(name, ()), rank, parameter=name))
    return found


def gather_findings(local: list[NonFinite], group: dist.ProcessGroup | None = None) -> list[NonFinite]:
    """Every rank's findings, in rank order. Collective over ``group`` (all ranks; None: the
    default group): call it on every rank, and only when the all-reduced count says some rank
    found something (so that all ranks call it, or none)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return [finding for part in gathered for finding in part]


def describe(findings: Sequence[NonFinite], *, step: int, replicas: int, policy: NonFinitePolicy) -> str:
    """One message for every rank: what was non-finite and where, what happened, and the fix."""
    losses = [f for f in findings if f.kind == "loss"]
    grads = _merge_gradients([f for f in findings if f.kind == "gradient"])
    if losses:
        listed = "; ".join(_loss_text(f, replicas) for f in losses)
        parts = [f"step {step}: non-finite loss: {listed}."]
        if grads:  # they follow from the loss: count them only
            parts.append(f"The gradients of {len(grads)} parameter(s) are non-finite too.")
    else:
        names = ", ".join(grads[:MAX_LISTED]) + (
            f" and {len(grads) - MAX_LISTED} more" if len(grads) > MAX_LISTED else ""
        )
        parts = [f"step {step}: non-finite gradients (the loss is finite) in {len(grads)} parameter(s): {names}."]
    if policy is NonFinitePolicy.SKIP:
        parts.append("The optimizer step was skipped: weights, optimizer state and LR schedule are unchanged.")
        return " ".join(parts)
    cause = (
        "look for inf/NaN or huge values in that micro-batch's inputs, lower the learning rate, or clip "
        "gradients (max_grad_norm)"
        if losses
        else "a backward op overflowed or divided by zero (sqrt or norm at 0, log of 0, a custom backward): guard "
        "that op, lower the learning rate, or clip gradients (max_grad_norm)"
    )
    parts.append(
        f"The optimizer did not step: weights, optimizer state and LR schedule are unchanged. Fix: {cause}; "
        "or pass on_nonfinite='skip' (partita train --on-nonfinite skip) to skip such steps and go on."
    )
    return " ".join(parts)


def _loss_text(f: NonFinite, replicas: int) -> str:
    first, count = f.first_sample, f.num_samples
    replica = f" of replica {f.replica}" if replicas > 1 else ""
    return (
        f"micro-batch {f.microbatch_index}{replica} (samples {first}-{first + count - 1} of the "
        f"global batch) gave {f.value} on stage {f.stage_indices[0]}, the last stage (rank {f.rank})"
    )


def _merge_gradients(findings: Sequence[NonFinite]) -> list[str]:
    """``name (value, stage 0, rank 1)`` per parameter, holders of the same parameter merged."""
    merged: dict[str, tuple[set[str], set[int], set[int]]] = {}
    for f in findings:
        values, stages, ranks = merged.setdefault(f.parameter, (set(), set(), set()))
        values.update(f.value.split(", "))
        stages.update(f.stage_indices)
        ranks.add(f.rank)
    return [
        f"{name} ({', '.join(sorted(values))}; stage {_ints(stages)}, rank {_ints(ranks)})"
        for name, (values, stages, ranks) in merged.items()
    ]


def _ints(values: set[int]) -> str:
    return ", ".join(str(v) for v in sorted(values))


def _value(t: torch.Tensor) -> str:
    t = t.detach()
    kinds = [
        ("nan", bool(torch.isnan(t).any())),
        ("inf", bool(torch.isposinf(t).any())),
        ("-inf", bool(torch.isneginf(t).any())),
    ]
    return ", ".join(name for name, present in kinds if present)
