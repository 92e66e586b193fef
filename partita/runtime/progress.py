"""Which rank is behind when a collective times out: progress marks in the job's c10d store.

A hung rank (alive, but stuck in a data loader, a deadlock, a debugger) does not break any
connection: its peers wait in their next collective or transfer until the timeout, and torch's
error names neither the step nor the rank that is missing. With a collective timeout set, each
trainer rank writes, at the start of every step, the step's number under its own key in the
store that torchrun's rendezvous already serves (one small write per step). A rank whose wait
times out reads every rank's mark and names those that have not reached its step.

Keys: ``partita/progress/<trainer>/<rank>``, ``<trainer>`` counting the trainers a process has
built (every rank builds them in the same order, so the numbers agree across ranks).
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import torch.distributed as dist

from partita.errors import CollectiveTimeoutError

__all__ = ["Progress", "is_timeout"]

_TRAINERS = itertools.count()
_TIMEOUT = re.compile(r"timed?[ -]?out|timeout|deadline exceeded", re.IGNORECASE)
SETTING_UP = 0  # the mark of a rank that has built its trainer but started no step


def is_timeout(error: BaseException) -> bool:
    """Whether a torch.distributed error is a wait that ran past the timeout (gloo: "Timed out
    waiting 5000ms for recv operation to complete"; NCCL: "Watchdog caught collective operation timeout")."""
    return isinstance(error, (RuntimeError, TimeoutError)) and bool(_TIMEOUT.search(str(error)))


class Progress:
    """The progress marks of one trainer (see the module docstring); inert without a store."""

    def __init__(self, rank: int, world_size: int, enabled: bool):
        self.rank, self.world_size = rank, world_size
        self.prefix = f"partita/progress/{next(_TRAINERS)}/"
        self.store: Any = _default_store() if enabled else None

    def mark(self, step: int) -> None:
        """This rank has reached ``step`` (1-based; SETTING_UP before the first)."""
        if self.store is not None:
            try:
                self.store.set(f"{self.prefix}{self.rank}", str(step))
            except (RuntimeError, OSError):
                self.store = None  # the store went away (rank 0 died): marks are best effort

    def behind(self, step: int) -> dict[int, int | None]:
        """Ranks whose mark is below ``step``: rank -> its mark (None: it never wrote one)."""
        if self.store is None:
            return {}
        found: dict[int, int | None] = {}
        try:
            for rank in range(self.world_size):
                key = f"{self.prefix}{rank}"
                mark = int(self.store.get(key).decode()) if self.store.check([key]) else None
                if mark is None or mark < step:
                    found[rank] = mark
        except (RuntimeError, OSError, ValueError):
            return found
        return found

    def timeout_error(
        self, error: BaseException, *, step: int, doing: str, stages: str, timeout_s: float | None
    ) -> CollectiveTimeoutError:
        """The error to raise for ``error`` (a timed-out wait) in ``step`` (0: while starting)."""
        behind = self.behind(step if step > 0 else SETTING_UP)
        behind.pop(self.rank, None)
        when = f"step {step}" if step > 0 else "the trainer's start"
        waited = f"more than {timeout_s:g} s" if timeout_s is not None else "past the process group's timeout"
        if behind:
            listed = ", ".join(f"rank {r} ({_mark_text(m)})" for r, m in sorted(behind.items()))
            cause = f"{listed} {'has' if len(behind) == 1 else 'have'} not reached {when}: hung or far slower"
            look = "look at what those ranks are doing (py-spy dump --pid PID shows a Python process's stack)"
        else:
            cause = "every rank reached it (or the marks could not be read), so a rank is stuck inside the step"
            look = "look at the other ranks' stacks (py-spy dump --pid PID)"
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return CollectiveTimeoutError(
            f"{when}: rank {self.rank} ({stages}) waited {waited} in {doing}; {cause}. A hung rank stops every "
            f"rank that exchanges data with it: {look}, or raise collective_timeout_s if a step can legitimately "
            f"take that long. The wait that timed out: {first_line}",
            step=step,
            rank=self.rank,
            behind=tuple(sorted(behind)),
        )


def _mark_text(mark: int | None) -> str:
    if mark is None:
        return "it has not finished building its trainer"
    if mark == SETTING_UP:
        return "it has started no step"
    return f"its last step started is {mark}"


def _default_store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store() if dist.is_initialized() else None
    except (ImportError, RuntimeError, ValueError):
        return None
