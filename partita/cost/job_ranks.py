"""What the processes of a job share, for the parts of partita that run before the trainer: whether
a body runs on this rank alone (``alone_on_this_rank``), how many processes a collective spans
(``job_world_size``), the default process group initialised and torn down (``init_default_group``),
and a measurement made on rank 0 for every rank (``measured_on_rank_zero``: ``Cluster.local``).

``torch.distributed`` is imported only where a job of several processes needs it, so a planning
process never imports it (``partita.cost.local_machine``'s docstring).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from partita.errors import PartitaError
from partita.types.cluster import Cluster

__all__ = ["alone_on_this_rank", "init_default_group", "job_world_size", "measured_on_rank_zero"]


# True inside ``alone_on_this_rank``: the body runs on one rank only (rank 0 making the job's plan
# while the others wait in a broadcast), so partita's collective helpers must act for this process.
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("partita_alone_on_this_rank", default=False)


@contextlib.contextmanager
def alone_on_this_rank() -> Iterator[None]:
    """Run the body as a process of its own: ``Cluster.local`` and ``partita.plan`` inside it
    measure and plan here instead of meeting the other ranks (``shared_plan`` runs the user's
    planning function so, on rank 0, while the other ranks wait for its plan)."""
    token = _ALONE.set(True)
    try:
        yield
    finally:
        _ALONE.reset(token)


def job_world_size() -> int:
    """How many processes a collective call of partita's spans from here: torch.distributed's world
    when it is initialised, else torchrun's ``WORLD_SIZE``, else 1; 1 inside ``alone_on_this_rank``."""
    if _ALONE.get():
        return 1
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_world_size()
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def init_default_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(*args, **kwargs)``, destroyed at interpreter exit.

    A script that never calls ``destroy_process_group`` (partita initialised the group for it) leaves
    the group to the interpreter's finalization, where gloo's worker threads may still hold work
    objects with tensors whose release needs the GIL: a rank now and then aborts after training
    ("terminate called without an active exception", exit -6 under torchrun; pytorch/pytorch#190489,
    and #179291 proposed this same handler in torch). Left alone when the caller destroyed it, and
    after an uncaught exception: its peers may be blocked in a collective, and destroying the group
    would wait on them (torchtitan destroys it only after a clean run for that reason)."""
    import torch.distributed as dist

    dist.init_process_group(*args, **kwargs)
    _register_teardown()


@functools.cache
def _register_teardown() -> None:
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if getattr(sys, "last_value", None) is None and dist.is_initialized():
        dist.destroy_process_group()


def measured_on_rank_zero(measure: Callable[[], Cluster]) -> Cluster:
    """``measure()`` in a process of its own; in a job of several processes, on rank 0 only, its
    Cluster given to every rank (one broadcast). The process group is initialised from torchrun's
    environment when it is not yet (torch's default backends: gloo for CPU tensors, NCCL for CUDA
    ones), as the Trainer would. Collective in a job: call it on every rank. A failure on rank 0
    is re-raised there and named on the other ranks."""
    if job_world_size() <= 1:
        return measure()
    import torch.distributed as dist

    if not dist.is_initialized():
        init_default_group()
    box: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            with alone_on_this_rank():
                box = [("cluster", measure().to_dict())]
        except Exception as e:  # noqa: BLE001 - told to every rank, then re-raised here
            failure, box = e, [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if failure is not None:
        raise failure
    if kind == "error":
        raise PartitaError(
            f"rank 0 failed to measure this machine, so no rank has its Cluster: {value}. The cause is in rank 0's log"
        )
    return Cluster.from_dict(value)
