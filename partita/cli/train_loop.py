"""`partita train`'s rank: the Trainer its flags describe, trained by partita.fit's loop.

Every rank builds the same model (same seed), loads the same plan and runs
``partita.training.fit.run_loop`` on the example's data: a zoo model's deterministic
``make_batch``, a factory's data source, or the factory's example batch repeated
(partita.training.data_source). With ``accumulate = K`` the plan is made for ``1/K`` of the step's
samples: the Trainer runs K pipeline rounds and one optimizer step. ``--lr-schedule`` is
partita.training.lr_schedule; evaluation, metrics, checkpoints, resumes and restarts are the loop's
(partita.training.fit). Writes the losses as JSON (``write_losses``) and the predicted against
measured times (``timing_rows``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass

import torch

from partita.cli.optimizers import OPTIMIZERS
from partita.errors import InputError
from partita.runtime.numerics import NonFinitePolicy
from partita.training.fit import FitConfig, FitResult, resume_past_steps_message, run_loop
from partita.training.lr_schedule import check_lr_schedule, lr_scheduler_factory
from partita.types import OpGraph, Plan


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float = 3e-3
    optimizer: str = "adamw"  # a name of OPTIMIZERS
    max_grad_norm: float | None = 1.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is given)
    resume: bool = False  # also resumes, whatever this says, in a process torchrun restarted
    progress: bool = True
    seed: int = 0  # of torch's RNG on every rank (dropout); the example's weights and data have their own
    on_nonfinite: str = "raise"  # or "skip": see partita.Trainer
    init_from: str | None = None  # a seed checkpoint: the model is on meta, see partita.Trainer
    trace_dir: str | None = None  # write TRACED_STEPS as a Chrome trace per rank here
    accumulate: int = 1  # pipeline rounds (of plan.global_batch_size samples) per optimizer step
    lr_schedule: str = "constant"  # a name of partita.training.lr_schedule.LR_SCHEDULES
    warmup_steps: int = 0
    min_lr: float = 0.0  # where cosine and linear decay end
    eval_every: int = 0  # 0: never
    eval_batches: int = 4  # held-out step batches averaged per evaluation
    log_dir: str | None = None  # TensorBoard scalars and metrics.jsonl (rank 0)


def train(example, plan: Plan, graph: OpGraph, config: TrainConfig) -> FitResult:
    """Run ``config.steps`` optimizer steps (counting steps done before a resume), each on
    ``plan.global_batch_size * config.accumulate`` samples, evaluating every ``config.eval_every``:
    the Trainer the flags describe, driven by ``partita.fit``'s loop on the example's data."""
    from partita.runtime.trainer import Trainer

    fit_config = FitConfig(
        num_steps=config.steps,
        eval_every=config.eval_every,
        eval_batches=config.eval_batches,
        checkpoint_dir=config.checkpoint_dir,
        checkpoint_every=config.checkpoint_every,
        resume=config.resume,
        log_dir=config.log_dir,
        progress=config.progress,
        trace_dir=config.trace_dir,
        seed=config.seed,
        cli=True,
    )
    torch.manual_seed(config.seed)
    trainer = Trainer(
        example.model,
        plan,
        graph=graph,
        optimizer=lambda params: OPTIMIZERS[config.optimizer](params, config.lr),
        lr_scheduler=lr_scheduler_factory(
            config.lr_schedule, lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps, min_lr=config.min_lr
        ),
        max_grad_norm=config.max_grad_norm,
        on_nonfinite=config.on_nonfinite,
        init_from=config.init_from,
        **({"accumulation_steps": config.accumulate} if config.accumulate > 1 else {}),
    )
    return run_loop(trainer, example, fit_config)


def write_losses(path: str, summary: FitResult) -> None:
    """The losses of this run's steps as JSON: ``{"first_step": k, "losses": [...], "skipped_steps": [...],
    "eval_losses": [{"step": s, "loss": x}, ...]}``, ``losses[i]`` being step ``k + i`` (1-based; ``k > 1``
    after a resume), non-finite losses as null."""
    record = {
        "first_step": summary.first_step,
        "losses": [loss if math.isfinite(loss) else None for loss in summary.losses],
        "skipped_steps": summary.skipped_steps,
        "eval_losses": [{"step": step, "loss": loss} for step, loss in summary.eval_losses],
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def check_train_config(config: TrainConfig) -> None:
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise InputError(f"--lr must be a positive number, got {config.lr}")
    if config.optimizer not in OPTIMIZERS:
        raise InputError(f"--optimizer {config.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if config.steps < 1:
        raise InputError(f"--steps must be >= 1, got {config.steps}")
    if config.checkpoint_every < 0:
        raise InputError(f"--checkpoint-every must be >= 0, got {config.checkpoint_every}")
    if (config.resume or config.checkpoint_every) and not config.checkpoint_dir:
        raise InputError("--resume and --checkpoint-every need --checkpoint-dir")
    NonFinitePolicy.parse(config.on_nonfinite)
    if config.accumulate < 1:
        raise InputError(f"--accumulate must be >= 1 (pipeline rounds per optimizer step), got {config.accumulate}")
    check_lr_schedule(
        config.lr_schedule, lr=config.lr, steps=config.steps, warmup_steps=config.warmup_steps, min_lr=config.min_lr
    )
    if config.eval_every < 0:
        raise InputError(f"--eval-every must be >= 0 (0: never), got {config.eval_every}")
    if config.eval_every > config.steps:
        raise InputError(
            f"--eval-every {config.eval_every} is more than --steps {config.steps}: no evaluation would run; "
            f"use at most {config.steps}"
        )
    if config.eval_batches < 1:
        raise InputError(f"--eval-batches must be >= 1, got {config.eval_batches}")


def timing_rows(plan: Plan, summary: FitResult) -> list[tuple]:
    """(stage, predicted forward per step, measured forward per step) and the whole step."""
    rows = []
    skip = 1 if len(summary.step_s) > 2 else 0  # the first step builds the pipeline
    for stage in plan.stages:
        measured = summary.stage_forward_s.get(stage.index, [])[skip:]
        rows.append(
            (
                f"stage {stage.index} forward",
                stage.forward_s * plan.num_microbatches,
                statistics.median(measured) if measured else float("nan"),
            )
        )
    steps = summary.step_s[skip:]
    rows.append(("step", plan.predicted_step_s, statistics.median(steps) if steps else float("nan")))
    return rows


def check_resume_steps(checkpoint_dir: str, steps: int) -> None:
    """Before launch: InputError when the latest complete checkpoint that ``--resume`` would load is
    already at ``steps`` or beyond (by its name; the processes check the one they load again)."""
    from partita.runtime.checkpoint_dir import CHECKPOINT_PATTERN, complete_checkpoints

    found = complete_checkpoints(checkpoint_dir)
    if found:
        step = int(CHECKPOINT_PATTERN.match(os.path.basename(found[0])).group(1))
        if step >= steps:
            raise InputError(resume_past_steps_message(found[0], step, steps, cli=True))
