"""Typed errors for everything a user can get wrong.

Every message names the value, the cause and the fix, so that a user can act on it without
reading partita's source.
"""

from __future__ import annotations


class PartitaError(Exception):
    """Base class of every error partita raises on purpose."""


class CaptureError(PartitaError):
    """The model could not be captured as a graph (torch.export failed, or its output is unusable)."""


class InputError(PartitaError, ValueError):
    """An argument given to partita is invalid (wrong type, inconsistent shapes, unknown name)."""


class ModelSpecError(InputError):
    """A MODEL argument (zoo name or ``path/file.py:factory``) cannot be resolved."""


class InfeasiblePlanError(PartitaError):
    """No plan fits the devices' memory (the message says what would fit)."""


class PlanFileError(PartitaError):
    """A plan file is unreadable, invalid, or made for another model or cluster."""


class CompileError(PartitaError):
    """A block of a plan that compiles its blocks (``Plan.compile``) cannot be compiled whole by
    ``torch.compile``; the message names it and how to run without compiling."""


class NumericsError(PartitaError):
    """A training step produced a NaN or infinite loss or gradient; the optimizer did not step.

    Attributes: ``step``, the 1-based number of the failed step, and ``findings``, a tuple of
    ``partita.runtime.numerics.NonFinite`` (what was non-finite, on which stage, micro-batch,
    rank or parameter), the same on every rank.
    """

    def __init__(self, message: str, *, step: int = 0, findings: tuple = ()):
        super().__init__(message)
        self.step, self.findings = step, tuple(findings)

    def __reduce__(self):  # keep step and findings when pickled (multiprocessing)
        return (_numerics_error, (str(self), self.step, self.findings))


def _numerics_error(message: str, step: int, findings: tuple) -> NumericsError:
    return NumericsError(message, step=step, findings=findings)


class CollectiveTimeoutError(PartitaError, TimeoutError):
    """A collective or point-to-point transfer waited longer than the trainer's collective timeout:
    another rank is hung, or much slower.

    Attributes: ``step`` (the 1-based step, 0 while the trainer starts), ``rank`` (the rank that
    waited) and ``behind`` (the ranks known not to have reached that step, possibly empty).
    """

    def __init__(self, message: str, *, step: int = 0, rank: int = -1, behind: tuple = ()):
        super().__init__(message)
        self.step, self.rank, self.behind = step, rank, tuple(behind)

    def __reduce__(self):
        return (_collective_timeout_error, (str(self), self.step, self.rank, self.behind))


def _collective_timeout_error(message: str, step: int, rank: int, behind: tuple) -> CollectiveTimeoutError:
    return CollectiveTimeoutError(message, step=step, rank=rank, behind=behind)


class RendezvousTimeoutError(PartitaError, TimeoutError):
    """The nodes of a multi-node job did not all join the rendezvous within the rendezvous timeout
    (``partita train --rdzv-timeout``): another node was not started, or cannot reach the endpoint."""
