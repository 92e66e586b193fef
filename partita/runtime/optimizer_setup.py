"""The user's optimizer and LR scheduler over this rank's parameters, checked before training."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from partita.errors import InputError
from partita.runtime.stage_set import StageSet

__all__ = ["OptimizerFactory", "SchedulerFactory", "make_optimizer", "make_scheduler"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


def make_optimizer(factory: OptimizerFactory, stages: StageSet) -> torch.optim.Optimizer:
    """The user's optimizer over this rank's parameters; one empty parameter group when its
    stages hold none (torch refuses an empty parameter list), so that schedulers and checkpoints
    work alike on every rank."""
    if stages.params:
        return factory(list(stages.params.values()))
    try:
        return factory([{"params": []}])
    except Exception as e:  # noqa: BLE001 - the factory is user code; say what was asked of it
        raise InputError(
            f"rank {stages.topology.rank} runs {stages.describe()}, which hold no trainable parameter (frozen "
            "or parameter-free), so the trainer built its optimizer over one empty parameter group, "
            f"optimizer([{{'params': []}}]), and the optimizer factory failed on it ({type(e).__name__}: {e}): "
            "let the factory accept a list of parameter groups (e.g. lambda params: torch.optim.AdamW(params, "
            "lr=3e-4)), or re-plan so that every stage holds a trainable parameter"
        ) from e


def make_scheduler(factory: SchedulerFactory | None, optimizer: torch.optim.Optimizer) -> Any:
    """``factory(optimizer)`` (None without a factory), checked by ``check_scheduler``."""
    if factory is None:
        return None
    scheduler = factory(optimizer)
    check_scheduler(scheduler)
    return scheduler


def check_scheduler(scheduler: Any) -> None:
    """InputError now for a scheduler whose ``step()`` needs arguments (ReduceLROnPlateau's
    metrics): ``step`` calls it with none after the optimizer has stepped, and would fail there."""
    if scheduler is None:
        return
    if not callable(getattr(scheduler, "step", None)):
        raise InputError(
            f"lr_scheduler returned a {type(scheduler).__name__}, which has no step(): return a "
            "torch.optim.lr_scheduler.LRScheduler"
        )
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # not introspectable (a builtin): trust it
        return
    required = [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise InputError(
            f"lr_scheduler returned a {type(scheduler).__name__}, whose step() needs "
            f"{', '.join(required)}, but the trainer steps it with no arguments after every optimizer "
            "step: use a schedule by steps (LambdaLR, CosineAnnealingLR, OneCycleLR), or build "
            "ReduceLROnPlateau(trainer.optimizer) yourself and call its step(loss) after trainer.step()"
        )
