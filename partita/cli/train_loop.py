"""The training loop behind `partita train`: one rank's steps, evaluations, logs and checkpoints.

Every rank builds the same model (same seed), loads the same plan and feeds every step the same
global batch (``plan.global_batch_size * accumulate`` samples; partita.cli.data_source says where
batches come from: a zoo model's deterministic ``make_batch``, a factory's data source, or the
factory's example batch repeated), so a resumed run sees exactly the batches an uninterrupted
one would. With ``accumulate = K`` the plan is made for ``1/K`` of the step's samples: the
Trainer runs K pipeline rounds and one optimizer step. ``--lr-schedule`` is
partita.cli.lr_schedule; ``--eval-every`` averages the loss of a fixed set of held-out batches
(``eval_batches``, the same at every evaluation) without changing weights or optimizer state;
``--log-dir`` is partita.cli.metrics.

Resuming: with ``resume=True``, or in a process torchrun restarted after a rank failed
(``--max-restarts``; TORCHELASTIC_RESTART_COUNT > 0), training continues from the latest
complete checkpoint in ``checkpoint_dir`` (``partita.runtime.checkpoint.latest_intact_checkpoint``:
``.partial`` writes and directories without DCP's metadata are skipped, and so are damaged
checkpoints -- files that differ from their manifest -- with a warning naming each); the
checkpoint holds the optimizer, LR schedule and RNG states, so the resumed run ends with the
parameters an uninterrupted one would have.

Every step's batch is checked against the graph first (``partita.runtime.batch_values``): ids
outside an embedding or labels outside the loss's classes stop the run with an InputError
naming the input and value, instead of a raw error inside a stage.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from partita.cli.data_source import DataPosition, StepBatches, eval_batches, training_batches
from partita.cli.lr_schedule import check_lr_schedule, lr_scheduler_factory
from partita.cli.metrics import MetricsWriter
from partita.cli.optimizers import OPTIMIZERS
from partita.errors import InputError
from partita.runtime.checkpoint_dir import checkpoint_path
from partita.runtime.launch import restart_count
from partita.runtime.numerics import NonFinitePolicy
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
    lr_schedule: str = "constant"  # a name of partita.cli.lr_schedule.LR_SCHEDULES
    warmup_steps: int = 0
    min_lr: float = 0.0  # where cosine and linear decay end
    eval_every: int = 0  # 0: never
    eval_batches: int = 4  # held-out step batches averaged per evaluation
    log_dir: str | None = None  # TensorBoard scalars and metrics.jsonl (rank 0)


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    stage_forward_s: dict[int, list[float]] = field(default_factory=dict)  # per stage index, per step
    resumed_from: int | None = None  # steps done before this run (its losses start at step resumed_from + 1)
    skipped_steps: list[int] = field(default_factory=list)  # 1-based steps whose update was skipped (non-finite)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (1-based step, held-out loss)

    @property
    def first_step(self) -> int:
        """The 1-based step of ``losses[0]``."""
        return (self.resumed_from or 0) + 1


def train(example, plan: Plan, graph: OpGraph, config: TrainConfig) -> TrainSummary:
    """Run ``config.steps`` optimizer steps (counting steps done before a resume), each on
    ``plan.global_batch_size * config.accumulate`` samples, evaluating every ``config.eval_every``."""
    from partita.runtime.trainer import Trainer

    step_samples = plan.global_batch_size * config.accumulate
    held_out = (
        eval_batches(example, graph, step_samples, config.eval_batches, seed=config.seed, note=_note)
        if config.eval_every
        else []
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
    summary = TrainSummary()
    resumed = _maybe_resume(trainer, config, summary)
    batches = training_batches(
        example,
        graph,
        step_samples,
        start_step=trainer.num_steps,
        position=DataPosition.from_dict(resumed.get("data_position")),
        seed=config.seed,
        note=_note,
    )
    log = _RunLog(trainer, config, summary, step_samples)
    while trainer.num_steps < config.steps:  # Trainer.step checks each batch's ids and labels
        log.before_step()
        args, kwargs, target = next(batches)
        lr = trainer.optimizer.param_groups[0]["lr"]  # this step's (the scheduler steps after it)
        start = time.perf_counter()
        loss = trainer.step(*args, **_with_target(graph, kwargs, target))
        log.after_step(loss, lr, time.perf_counter() - start)
        if config.eval_every and trainer.num_steps % config.eval_every == 0:
            log.evaluation(_evaluate(trainer, graph, held_out), len(held_out))
        if config.checkpoint_dir and config.checkpoint_every and trainer.num_steps % config.checkpoint_every == 0:
            _save(trainer, config, batches)
    log.close()
    if config.checkpoint_dir and (not config.checkpoint_every or trainer.num_steps % config.checkpoint_every):
        _save(trainer, config, batches)
    summary.stage_forward_s = _gather_stage_times(summary.stage_forward_s)
    return summary


def _save(trainer, config: TrainConfig, batches: StepBatches) -> None:
    """A checkpoint of this step, with where the data stands (a resume continues there, whatever
    its global batch: partita.cli.data_source)."""
    extra = {"data_position": batches.position.as_dict()} if batches.position is not None else None
    trainer.save_checkpoint(checkpoint_path(config.checkpoint_dir, trainer.num_steps), extra_state=extra)


def _with_target(graph: OpGraph, kwargs: dict, target: Any) -> dict:
    return {**kwargs, "target": target} if graph.has_loss_fn else kwargs


def _evaluate(trainer, graph: OpGraph, batches: list) -> float:
    """The mean held-out loss over ``batches`` (weights, optimizer state and step count unchanged)."""
    losses = [trainer.evaluate(*args, **_with_target(graph, kwargs, target)) for args, kwargs, target in batches]
    return sum(losses) / len(losses)


def _note(text: str) -> None:
    """A one-line note about the data, from rank 0."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"note: {text}", flush=True)


class _RunLog:
    """What a run records besides training: losses and times (summary), the progress bar, the
    profiler's trace, per-stage timers and the --log-dir metrics."""

    def __init__(self, trainer, config: TrainConfig, summary: TrainSummary, step_samples: int):
        self.trainer, self.summary, self.step_samples = trainer, summary, step_samples
        self.timers = _stage_forward_timers(trainer, summary)
        self.bar = _progress_bar(trainer, config)
        self.tracer = _StepTracer(config.trace_dir)
        self.metrics = None
        if config.log_dir and dist.get_rank() == 0:
            self.metrics = MetricsWriter(config.log_dir, resumed_from=summary.resumed_from, note=_note)

    def before_step(self) -> None:
        self.tracer.before_step(self.trainer.num_steps + 1)

    def after_step(self, loss: float, lr: float, elapsed: float) -> None:
        step, summary = self.trainer.num_steps, self.summary
        self.timers.end_step()
        if not self.tracer.active:  # the profiler slows the steps it records
            summary.step_s.append(elapsed)
        self.tracer.after_step(step)
        summary.losses.append(loss)
        if not math.isfinite(loss):  # on_nonfinite="skip" (with "raise", step() raised)
            summary.skipped_steps.append(step)
        samples_per_s = self.step_samples / elapsed
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", step=f"{elapsed * 1e3:.0f}ms", samples_s=f"{samples_per_s:.1f}")
            self.bar.update(1)
        if self.metrics is not None:
            grad_norm = self.trainer.last_grad_norm
            self.metrics.train_step(
                step, loss=loss, lr=lr, grad_norm=grad_norm, step_s=elapsed, samples_per_s=samples_per_s
            )

    def evaluation(self, loss: float, num_batches: int) -> None:
        step = self.trainer.num_steps
        self.summary.eval_losses.append((step, loss))
        if self.bar is not None:
            self.bar.write(f"eval: step {step} loss {loss:.4f} ({num_batches} held-out batches)")
        if self.metrics is not None:
            self.metrics.evaluation(step, loss=loss, num_batches=num_batches)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.tracer.close()
        if self.metrics is not None:
            self.metrics.close()


TRACED_STEPS = range(2, 5)  # 1-based; the first step builds the pipeline


class _StepTracer:
    """torch's profiler over TRACED_STEPS (those this run reaches), exported as a Chrome trace per rank."""

    def __init__(self, trace_dir: str | None):
        self.trace_dir, self.profiler = trace_dir, None
        if trace_dir is not None:
            os.makedirs(trace_dir, exist_ok=True)

    @property
    def active(self) -> bool:
        return self.profiler is not None

    def before_step(self, step: int) -> None:
        if self.trace_dir is not None and self.profiler is None and step in TRACED_STEPS:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()

    def after_step(self, step: int) -> None:
        if self.profiler is not None and step >= TRACED_STEPS[-1]:
            self.close()

    def close(self) -> None:
        if self.profiler is None:
            return
        self.profiler.__exit__(None, None, None)
        self.profiler.export_chrome_trace(os.path.join(self.trace_dir, f"rank-{dist.get_rank()}.json"))
        self.profiler = None


def _maybe_resume(trainer, config: TrainConfig, summary: TrainSummary) -> dict:
    """Load the latest complete checkpoint when asked to (``resume``) or after a torchrun restart;
    its extra state ({} when none was loaded). InputError when ``--resume`` finds a checkpoint at
    or beyond ``config.steps`` (nothing would be trained)."""
    restarts = restart_count()
    if not (config.resume or restarts) or not config.checkpoint_dir:
        if restarts and dist.get_rank() == 0:
            print(f"restart {restarts}: no --checkpoint-dir, so training starts again from step 0", flush=True)
        return {}
    from partita.runtime.checkpoint import latest_intact_checkpoint, load_checkpoint

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = latest_intact_checkpoint(config.checkpoint_dir)  # collective: the same on every rank
    for warning in caught:  # rank 0's: damaged checkpoints skipped, one that cannot be verified
        print(f"warning: {warning.message}", file=sys.stderr, flush=True)
    if latest is None:
        if dist.get_rank() == 0:
            print(f"no complete checkpoint in {config.checkpoint_dir}: training starts from step 0", flush=True)
        return {}
    extra = load_checkpoint(trainer, latest, verify=False)  # just verified
    summary.resumed_from = trainer.num_steps
    if trainer.num_steps >= config.steps and not restarts:  # a restart after the last step has nothing left
        raise InputError(resume_past_steps_message(latest, trainer.num_steps, config.steps))
    if dist.get_rank() == 0:
        why = f"restart {restarts}" if restarts else "--resume"
        print(f"{why}: resuming from {latest} (step {trainer.num_steps})", flush=True)
    return extra


def check_resume_steps(checkpoint_dir: str, steps: int) -> None:
    """Before launch: InputError when the latest complete checkpoint that ``--resume`` would load is
    already at ``steps`` or beyond (by its name; the processes check the one they load again)."""
    from partita.runtime.checkpoint_dir import CHECKPOINT_PATTERN, complete_checkpoints

    found = complete_checkpoints(checkpoint_dir)
    if found:
        step = int(CHECKPOINT_PATTERN.match(os.path.basename(found[0])).group(1))
        if step >= steps:
            raise InputError(resume_past_steps_message(found[0], step, steps))


def resume_past_steps_message(checkpoint: str, step: int, steps: int) -> str:
    return (
        f"--resume: the latest checkpoint, {checkpoint}, is at step {step}, and --steps {steps} would train "
        f"nothing more (--steps counts the steps before the resume too): give --steps above {step}, or drop "
        "--resume to train from step 0"
    )


def write_losses(path: str, summary: TrainSummary) -> None:
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


# ----------------------------------------------------------------------------- timing


class _StageTimers:
    """Forward time of each of this rank's stage modules per step (module hooks)."""

    def __init__(self, summary: TrainSummary):
        self.summary, self.current, self.started = summary, {}, {}

    def hooks(self, index: int):
        def before(module, args):
            self.started[index] = time.perf_counter()

        def after(module, args, output):
            self.current[index] = self.current.get(index, 0.0) + time.perf_counter() - self.started.pop(index)

        return before, after

    def end_step(self) -> None:
        for index, seconds in self.current.items():
            self.summary.stage_forward_s.setdefault(index, []).append(seconds)
        self.current = {}


def _stage_forward_timers(trainer, summary: TrainSummary) -> _StageTimers:
    timers = _StageTimers(summary)
    for stage in trainer.stages:
        before, after = timers.hooks(stage.spec.index)
        stage.register_forward_pre_hook(before)
        stage.register_forward_hook(after)
    return timers


def _gather_stage_times(local: dict[int, list[float]]) -> dict[int, list[float]]:
    """Every rank's per-stage forward times, merged (the first replica's numbers per stage)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[int, list[float]] = {}
    for part in gathered:
        for index, times in part.items():
            merged.setdefault(index, times)
    return merged


def _progress_bar(trainer, config: TrainConfig):
    """tqdm's bar on a terminal; in a log file (not a tty) one line every tenth of the run instead."""
    if not config.progress or dist.get_rank() != 0:
        return None
    if not sys.stderr.isatty():
        return _LogLines(config.steps, trainer.num_steps)
    from tqdm import tqdm

    return tqdm(total=config.steps, initial=trainer.num_steps, desc="train", unit="step")


class _LogLines:
    """The progress bar's interface (``set_postfix``, ``update``, ``close``) as plain log lines."""

    def __init__(self, total: int, initial: int):
        self.total, self.done, self.every, self.postfix = total, initial, max(1, total // 10), {}

    def set_postfix(self, **values: str) -> None:
        self.postfix = values

    def update(self, count: int) -> None:
        self.done += count
        if self.done % self.every == 0 or self.done == self.total:
            details = " ".join(f"{k}={v}" for k, v in self.postfix.items())
            print(f"train: step {self.done}/{self.total} {details}", file=sys.stderr, flush=True)

    def write(self, text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def timing_rows(plan: Plan, summary: TrainSummary) -> list[tuple]:
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
