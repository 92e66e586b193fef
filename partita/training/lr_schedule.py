"""`partita train --lr-schedule`: the learning rate of every optimizer step.

For optimizer step ``s = 1 .. T`` (``T = --steps``, ``W = --warmup-steps``, peak ``lr = --lr``,
floor ``min_lr = --min-lr``):

    s <= W:               lr * s / W                                              (linear warm-up)
    s >  W, constant:     lr
    s >  W, cosine:       min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2
    s >  W, linear:       lr - (lr - min_lr) * (s - W) / (T - W)

so the peak is reached at step W and the floor at the last step. Built as a
``torch.optim.lr_scheduler.LambdaLR`` (factor ``lr_at(s) / lr``; LambdaLR calls it with the number
of steps done, ``s - 1``), which the Trainer steps after every optimizer step and checkpoints: a
resumed run continues the schedule where the checkpoint left it. An update skipped for a
non-finite loss (``--on-nonfinite skip``) does not advance the schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from partita.errors import InputError

LR_SCHEDULES = ("constant", "cosine", "linear")


def lr_at(step: int, *, lr: float, schedule: str, steps: int, warmup_steps: int = 0, min_lr: float = 0.0) -> float:
    """The learning rate of 1-based optimizer step ``step`` (the table above); steps past ``steps`` keep the last one's."""
    if step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / (steps - warmup_steps))
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * progress)) / 2
    return lr - (lr - min_lr) * progress


def check_lr_schedule(schedule: str, *, lr: float, steps: int, warmup_steps: int, min_lr: float) -> None:
    """InputError naming the flag, its value and the fix."""
    if schedule not in LR_SCHEDULES:
        raise InputError(f"--lr-schedule {schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
    if warmup_steps < 0:
        raise InputError(f"--warmup-steps must be >= 0, got {warmup_steps}")
    if schedule == "constant":
        if min_lr:
            raise InputError(
                f"--min-lr {min_lr} has no effect with --lr-schedule constant: add --lr-schedule cosine (or "
                "linear) to decay to it, or drop --min-lr"
            )
        if warmup_steps > steps:
            raise InputError(
                f"--warmup-steps {warmup_steps} is more than --steps {steps}: the warm-up would not reach --lr; "
                f"use at most {steps} warm-up steps"
            )
        return
    if warmup_steps >= steps:
        raise InputError(
            f"--warmup-steps {warmup_steps} leaves no step of --steps {steps} for the {schedule} decay: use fewer "
            "warm-up steps or more --steps"
        )
    if not (math.isfinite(min_lr) and 0 <= min_lr <= lr):
        raise InputError(f"--min-lr must be between 0 and --lr {lr}, got {min_lr}")


def lr_scheduler_factory(
    schedule: str, *, lr: float, steps: int, warmup_steps: int = 0, min_lr: float = 0.0
) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR] | None:
    """``optimizer -> LambdaLR`` for ``Trainer(lr_scheduler=...)``; None for a constant rate without warm-up."""
    if schedule == "constant" and not warmup_steps:
        return None

    def factor(steps_done: int) -> float:  # a plain function: LambdaLR checkpoints no state of it
        return (
            lr_at(steps_done + 1, lr=lr, schedule=schedule, steps=steps, warmup_steps=warmup_steps, min_lr=min_lr) / lr
        )

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
