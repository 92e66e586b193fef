"""``partita.fit``: the training loop in one call -- data, global batches, evaluation, metrics,
checkpoints and resume. ``partita train`` runs the same loop (``run_loop``).

    trainer = partita.Trainer(model, plan, args=(x,), loss_fn=F.cross_entropy, target=y, optimizer=...)
    result = partita.fit(trainer, loader, num_steps=1000, eval_data=held_out, eval_every=100,
                         checkpoint_dir="ckpt", checkpoint_every=200, log_dir="runs/job")

Every rank calls it with the same arguments (under torchrun, as it builds the Trainer). A run:

1. resumes, with ``resume=True`` or in a process torchrun restarted (``--max-restarts``), from the
   latest intact checkpoint in ``checkpoint_dir`` (unfinished and damaged ones skipped, with a
   warning), and reads the data on from where that run stopped;
2. takes, at every step, the next ``plan.global_batch_size * accumulation_steps`` samples of
   ``data`` (its batches joined and cut along each input's batch dim; partita.training.data_source),
   the same on every rank, and calls ``trainer.step`` (whose LR scheduler steps with it);
3. every ``eval_every`` steps, averages ``trainer.evaluate`` over the first ``eval_batches`` step
   batches of ``eval_data`` (eval mode; nothing changes);
4. writes metrics to ``log_dir`` (TensorBoard scalars and ``metrics.jsonl``, rank 0) and progress
   to a bar on a terminal (one line every tenth of the run in a log file);
5. checkpoints every ``checkpoint_every`` steps and at the end, in ``checkpoint_dir``.

The batches and the weights after ``num_steps`` are those of an uninterrupted run, whatever
resumes happened between (a checkpoint holds the optimizer, LR schedule and RNG states).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from partita.checks import positive_int
from partita.errors import InputError
from partita.runtime.checkpoint import latest_intact_checkpoint
from partita.runtime.checkpoint_dir import checkpoint_path
from partita.runtime.launch import restart_count
from partita.runtime.trainer import Trainer
from partita.training.data_source import DataPosition, StepBatches, check_source, eval_batches, training_batches
from partita.training.run_log import RunLog, gather_stage_times

__all__ = ["FitConfig", "FitResult", "Sources", "fit", "run_loop"]


@dataclass(frozen=True)
class Sources:
    """Where a run's batches come from, and the example the graph was captured at (the structure
    every batch has: its keywords or positional inputs, plus the target with a ``loss_fn``).

    ``data``, ``eval_data``: a DataLoader or any iterable of batches, a function returning a new
    iterator of batches, or a map-style dataset of rows that ``collate_fn`` turns into batches;
    ``make_batch(batch_size, step)``: deterministic batches of a zoo model (``partita train``).
    """

    name: str
    args: tuple
    kwargs: dict
    target: Any = None
    data: Any = None
    eval_data: Any = None
    collate_fn: Callable | None = None
    make_batch: Callable[[int, int], Any] | None = None


@dataclass(frozen=True)
class FitConfig:
    """What a run does besides stepping: ``fit``'s keywords, validated once."""

    num_steps: int
    eval_every: int = 0  # 0: never
    eval_batches: int = 4  # held-out step batches averaged per evaluation
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end (when checkpoint_dir is given)
    resume: bool = False  # also resumes, whatever this says, in a process torchrun restarted
    log_dir: str | None = None  # TensorBoard scalars and metrics.jsonl (rank 0)
    progress: bool = True
    trace_dir: str | None = None  # torch's profiler over a few steps: a Chrome trace per rank
    seed: int = 0  # of the data sources' own RNG streams (a DataLoader shuffling without a generator)
    cli: bool = False  # messages name `partita train`'s flags, not fit's keywords

    def __post_init__(self) -> None:
        positive_int(self.num_steps, "num_steps")
        for name in ("eval_every", "checkpoint_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InputError(f"{name} must be an int >= 0 (0: never), got {value!r}")
        positive_int(self.eval_batches, "eval_batches")
        if self.eval_every > self.num_steps:
            raise InputError(
                f"eval_every={self.eval_every} is more than num_steps={self.num_steps}: no evaluation would run; "
                f"use at most {self.num_steps}, or 0"
            )
        if (self.resume or self.checkpoint_every) and not self.checkpoint_dir:
            raise InputError("resume=True and checkpoint_every need checkpoint_dir=, the folder checkpoints live in")


@dataclass
class FitResult:
    """What a run recorded: ``losses[i]`` is step ``first_step + i`` (1-based, counting the trainer's
    every step: later than 1 after a resume, ``resumed_from`` being the checkpoint's steps, and in a
    second run of the same trainer); ``eval_losses`` (step, held-out loss); ``skipped_steps`` whose
    update was skipped (non-finite, ``on_nonfinite="skip"``); ``step_s`` the wall time of each step;
    ``stage_forward_s`` each stage's forward time per step; ``start_step`` the steps the trainer had
    taken when the run's first step began (a resumed checkpoint's, or an earlier run's)."""

    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    stage_forward_s: dict[int, list[float]] = field(default_factory=dict)
    resumed_from: int | None = None
    skipped_steps: list[int] = field(default_factory=list)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    start_step: int = 0

    @property
    def first_step(self) -> int:
        """The 1-based step of ``losses[0]``."""
        return self.start_step + 1


def fit(
    trainer: Trainer,
    data: Any,
    *,
    num_steps: int,
    eval_data: Any = None,
    collate_fn: Callable | None = None,
    eval_every: int = 0,
    eval_batches: int = 4,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    log_dir: str | None = None,
    progress: bool = True,
    trace_dir: str | None = None,
    seed: int = 0,
) -> FitResult:
    """Train ``trainer`` for ``num_steps`` optimizer steps (counting those a resumed checkpoint had
    done) on ``data``; return what the run recorded (``FitResult``: losses, evaluations, times).

    ``data`` and ``eval_data``: a DataLoader or any iterable of batches shaped like the example
    inputs the trainer was built from (a tuple of the positional inputs plus the target last, as
    ``TensorDataset(x, y)`` yields, or a dict of the keywords plus ``"target"``), a function
    returning a new iterator of them, or a dataset of rows (``__len__`` + ``__getitem__``) that
    ``collate_fn`` batches (default torch's ``default_collate``). Every step takes the next
    ``plan.global_batch_size * accumulation_steps`` samples of ``data``, the same on every rank.

    ``eval_every``: every that many steps, the mean ``trainer.evaluate`` loss (eval mode; nothing
    changes) over the first ``eval_batches`` step batches of ``eval_data``, recorded in
    ``FitResult.eval_losses``; 0 (the default): never. It needs ``eval_data`` and may not exceed
    ``num_steps``.

    ``checkpoint_dir``: the folder checkpoints are written to (``step-NNNNNN``, with the optimizer,
    LR schedule, RNG states and where the data stands); None: none are written.
    ``checkpoint_every``: a checkpoint every that many steps, and one at the end; 0 (the default):
    only at the end. Needs ``checkpoint_dir``.

    ``resume``: start from the latest intact checkpoint in ``checkpoint_dir`` (unfinished and
    damaged ones skipped with a warning), reading the data on from where that run stopped, so the
    batches and weights after ``num_steps`` are those of an uninterrupted run; InputError when that
    checkpoint is at or past ``num_steps``. A process that torchrun restarted resumes whatever
    ``resume`` says. Needs ``checkpoint_dir``.

    ``log_dir``: rank 0 writes per-step metrics there: loss, learning rate, gradient norm, step time,
    samples/s and the evaluation loss, as TensorBoard scalars and ``metrics.jsonl``
    (``partita.training.metrics``); None: no metrics files.

    ``progress``: rank 0 shows a progress bar (tqdm) on a terminal, or one line every tenth of the
    run when stderr is a log file; False: neither. ``trace_dir``: torch's profiler over steps 2-4,
    one Chrome/Perfetto trace per rank (``rank-R.json``). ``seed`` seeds the sources' own RNG
    stream (the same on every rank).

    Raises InputError for a wrong argument or a batch that does not fit the graph (checked on the
    first batch of each source before any step). Collective: call it on every rank.
    """
    config = FitConfig(
        num_steps=num_steps,
        eval_every=eval_every,
        eval_batches=eval_batches,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
        resume=resume,
        log_dir=log_dir,
        progress=progress,
        trace_dir=trace_dir,
        seed=seed,
    )
    if data is None:
        raise InputError("fit needs data: a DataLoader, an iterable of batches or a dataset of rows")
    if eval_every and eval_data is None:
        raise InputError(f"eval_every={eval_every} needs eval_data=, the held-out batches to evaluate on")
    check_source(data, "data", collate_fn)
    if eval_data is not None:
        check_source(eval_data, "eval_data", collate_fn)
    args, kwargs, target = trainer.graph.example_inputs
    sources = Sources("data", tuple(args), dict(kwargs), target, data, eval_data, collate_fn)
    return run_loop(trainer, sources, config)


def run_loop(trainer: Trainer, sources: Sources, config: FitConfig) -> FitResult:
    """The loop of ``fit`` and of ``partita train``: ``config.num_steps`` steps of ``trainer`` on
    ``sources`` (see the module docstring)."""
    graph = trainer.graph
    step_samples = trainer.plan.global_batch_size * trainer.accumulation_steps
    held_out = (
        eval_batches(sources, graph, step_samples, config.eval_batches, seed=config.seed, note=note)
        if config.eval_every
        else []
    )
    result = FitResult()
    resumed = _maybe_resume(trainer, config, result)
    result.start_step = trainer.num_steps  # after a resume, or a run before this one on the same trainer
    if trainer.num_steps >= config.num_steps and result.resumed_from is None and not restart_count():
        raise InputError(
            f"num_steps={config.num_steps} counts every step of this trainer, which has taken {trainer.num_steps} "
            f"already: nothing would be trained; to train k more steps, pass num_steps={trainer.num_steps} + k"
        )
    batches = training_batches(
        sources,
        graph,
        step_samples,
        start_step=trainer.num_steps,
        position=DataPosition.from_dict(resumed.get("data_position")),
        seed=config.seed,
        note=note,
    )
    log = RunLog(trainer, config, result, step_samples, note=note)
    while trainer.num_steps < config.num_steps:  # Trainer.step checks each batch's ids and labels
        log.before_step()
        args, kwargs, target = next(batches)
        lr = trainer.optimizer.param_groups[0]["lr"]  # this step's (the scheduler steps after it)
        start = time.perf_counter()
        loss = trainer.step(*args, **_with_target(trainer, kwargs, target))
        log.after_step(loss, lr, time.perf_counter() - start)
        if config.eval_every and trainer.num_steps % config.eval_every == 0:
            log.evaluation(_evaluate(trainer, held_out), len(held_out))
        if config.checkpoint_dir and config.checkpoint_every and trainer.num_steps % config.checkpoint_every == 0:
            _save(trainer, config, batches)
    log.close()
    if config.checkpoint_dir and (not config.checkpoint_every or trainer.num_steps % config.checkpoint_every):
        _save(trainer, config, batches)
    result.stage_forward_s = gather_stage_times(result.stage_forward_s)
    return result


def _save(trainer: Trainer, config: FitConfig, batches: StepBatches) -> None:
    """A checkpoint of this step, with where the data stands (a resume continues there, whatever
    its global batch: partita.training.data_source)."""
    extra = {"data_position": batches.position.as_dict()} if batches.position is not None else None
    trainer.save_checkpoint(checkpoint_path(config.checkpoint_dir, trainer.num_steps), extra_state=extra)


def note(text: str) -> None:
    """A one-line note about the data, from rank 0."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"note: {text}", flush=True)


def _with_target(trainer: Trainer, kwargs: dict, target: Any) -> dict:
    return {**kwargs, "target": target} if trainer.graph.has_loss_fn else kwargs


def _evaluate(trainer: Trainer, batches: list) -> float:
    """The mean held-out loss over ``batches`` (weights, optimizer state and step count unchanged)."""
    losses = [trainer.evaluate(*args, **_with_target(trainer, kwargs, target)) for args, kwargs, target in batches]
    return sum(losses) / len(losses)


def _maybe_resume(trainer: Trainer, config: FitConfig, result: FitResult) -> dict:
    """Load the latest intact checkpoint when asked to (``resume``) or after a torchrun restart; its
    extra state ({} when none was loaded). InputError when ``resume`` finds a checkpoint at or
    beyond ``config.num_steps`` (nothing would be trained)."""
    restarts = restart_count()
    if not (config.resume or restarts) or not config.checkpoint_dir:
        if restarts and dist.get_rank() == 0:
            print(f"restart {restarts}: no checkpoint folder, so training starts again from step 0", flush=True)
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = latest_intact_checkpoint(config.checkpoint_dir)  # collective: the same on every rank
    for warning in caught:  # rank 0's: damaged checkpoints skipped, one that cannot be verified
        print(f"warning: {warning.message}", file=sys.stderr, flush=True)
    if latest is None:
        if dist.get_rank() == 0:
            print(f"no complete checkpoint in {config.checkpoint_dir}: training starts from step 0", flush=True)
        return {}
    extra = trainer.load_checkpoint(latest, verify=False)  # just verified
    result.resumed_from = trainer.num_steps
    if trainer.num_steps >= config.num_steps and not restarts:  # a restart after the last step has nothing left
        raise InputError(resume_past_steps_message(latest, trainer.num_steps, config.num_steps, cli=config.cli))
    if dist.get_rank() == 0:
        why = f"restart {restarts}" if restarts else "--resume"
        print(f"{why}: resuming from {latest} (step {trainer.num_steps})", flush=True)
    return extra


def resume_past_steps_message(checkpoint: str, step: int, steps: int, *, cli: bool = False) -> str:
    """Why a resume at ``step`` would train nothing with ``steps``, in the command line's words or ``fit``'s."""
    flag, resume = ("--steps", "--resume") if cli else ("num_steps", "resume=True")
    given = f"--steps {steps}" if cli else f"num_steps={steps}"
    return (
        f"{resume}: the latest checkpoint, {checkpoint}, is at step {step}, and {given} would train nothing more "
        f"({flag} counts the steps before the resume too): give {flag} above {step}, or drop {resume} to train "
        "from step 0"
    )
