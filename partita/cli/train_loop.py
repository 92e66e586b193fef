"""The training loop behind `partita train`: one rank's steps, progress, checkpoints, timings.

Every rank builds the same model (same seed), loads the same plan and feeds every step the same
global batch from the example's deterministic ``make_batch(global_batch, step)``, so a resumed
run sees exactly the batches an uninterrupted one would.

Resuming: with ``resume=True``, or in a process torchrun restarted after a rank failed
(``--max-restarts``; TORCHELASTIC_RESTART_COUNT > 0), training continues from the latest
complete checkpoint in ``checkpoint_dir`` (``partita.runtime.checkpoint.latest_intact_checkpoint``:
``.partial`` writes and directories without DCP's metadata are skipped, and so are damaged
checkpoints -- files that differ from their manifest -- with a warning naming each); the
checkpoint holds the optimizer and RNG states, so the resumed run ends with the parameters an
uninterrupted one would have.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from partita.capturing import exported_call_inputs
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


@dataclass
class TrainSummary:
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    stage_forward_s: dict[int, list[float]] = field(default_factory=dict)  # per stage index, per step
    resumed_from: int | None = None  # steps done before this run (its losses start at step resumed_from + 1)
    skipped_steps: list[int] = field(default_factory=list)  # 1-based steps whose update was skipped (non-finite)

    @property
    def first_step(self) -> int:
        """The 1-based step of ``losses[0]``."""
        return (self.resumed_from or 0) + 1


def train(example, plan: Plan, graph: OpGraph, config: TrainConfig) -> TrainSummary:
    """Run ``config.steps`` optimizer steps (counting steps done before a resume).

    Batches come from the example's ``make_batch``; a factory model without one trains on its
    example batch, repeated along each input's batch dim up to the plan's global batch."""
    from partita.runtime.trainer import Trainer

    make_batch = example.make_batch or repeating_batches(example, graph)
    torch.manual_seed(config.seed)
    trainer = Trainer(
        example.model,
        plan,
        graph=graph,
        optimizer=lambda params: OPTIMIZERS[config.optimizer](params, config.lr),
        max_grad_norm=config.max_grad_norm,
        on_nonfinite=config.on_nonfinite,
        init_from=config.init_from,
    )
    summary = TrainSummary()
    _maybe_resume(trainer, config, summary)
    timers = _stage_forward_timers(trainer, summary)
    bar = _progress_bar(trainer, config)
    tracer = _StepTracer(config.trace_dir)
    while trainer.num_steps < config.steps:  # Trainer.step checks each batch's ids and labels
        tracer.before_step(trainer.num_steps + 1)
        args, kwargs, target = make_batch(plan.global_batch_size, trainer.num_steps)
        if graph.has_loss_fn:
            kwargs = {**kwargs, "target": target}
        start = time.perf_counter()
        loss = trainer.step(*args, **kwargs)
        elapsed = time.perf_counter() - start
        timers.end_step()
        if not tracer.active:  # the profiler slows the steps it records
            summary.step_s.append(elapsed)
        tracer.after_step(trainer.num_steps)
        summary.losses.append(loss)
        if not math.isfinite(loss):  # on_nonfinite="skip" (with "raise", step() raised)
            summary.skipped_steps.append(trainer.num_steps)
        if bar is not None:
            bar.set_postfix(
                loss=f"{loss:.4f}", step=f"{elapsed * 1e3:.0f}ms", samples_s=f"{plan.global_batch_size / elapsed:.1f}"
            )
            bar.update(1)
        if config.checkpoint_dir and config.checkpoint_every and trainer.num_steps % config.checkpoint_every == 0:
            trainer.save_checkpoint(checkpoint_path(config.checkpoint_dir, trainer.num_steps))
    if bar is not None:
        bar.close()
    tracer.close()
    if config.checkpoint_dir and (not config.checkpoint_every or trainer.num_steps % config.checkpoint_every):
        trainer.save_checkpoint(checkpoint_path(config.checkpoint_dir, trainer.num_steps))
    summary.stage_forward_s = _gather_stage_times(summary.stage_forward_s)
    return summary


def repeating_batches(example, graph: OpGraph) -> Callable[[int, int], tuple[tuple, dict, Any]]:
    """``make_batch(batch_size, step)`` for an example without a data source: its own inputs (and
    target), tiled along each graph input's batch dim and cut to ``batch_size``; the same every step."""
    call = exported_call_inputs(example.args, example.kwargs, example.target, graph.has_loss_fn)
    flat, spec = pytree.tree_flatten(call)
    if len(flat) != len(graph.inputs):
        raise InputError(
            f"{example.name}: its example inputs have {len(flat)} leaves but the graph was captured "
            f"with {len(graph.inputs)}: capture the model from the factory's own inputs"
        )
    dims = [info.tensor.batch_dim if info.tensor is not None else None for info in graph.inputs]

    def make_batch(batch_size: int, step: int) -> tuple[tuple, dict, Any]:
        leaves = [_tiled(x, dim, batch_size) for x, dim in zip(flat, dims)]
        call = pytree.tree_unflatten(leaves, spec)
        if graph.has_loss_fn:
            (args, kwargs, target), _ = call
            return args, kwargs, target
        args, kwargs = call
        return args, kwargs, None

    return make_batch


def _tiled(x: Any, dim: int | None, batch_size: int) -> Any:
    if dim is None or not isinstance(x, torch.Tensor):
        return x
    copies = -(-batch_size // x.shape[dim])
    return torch.cat([x] * copies, dim=dim).narrow(dim, 0, batch_size).contiguous()


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


def _maybe_resume(trainer, config: TrainConfig, summary: TrainSummary) -> None:
    """Load the latest complete checkpoint when asked to (``resume``) or after a torchrun restart."""
    restarts = restart_count()
    if not (config.resume or restarts) or not config.checkpoint_dir:
        if restarts and dist.get_rank() == 0:
            print(f"restart {restarts}: no --checkpoint-dir, so training starts again from step 0", flush=True)
        return
    from partita.runtime.checkpoint import latest_intact_checkpoint, load_checkpoint

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = latest_intact_checkpoint(config.checkpoint_dir)  # collective: the same on every rank
    for warning in caught:  # rank 0's: damaged checkpoints skipped, one that cannot be verified
        print(f"warning: {warning.message}", file=sys.stderr, flush=True)
    if latest is None:
        if dist.get_rank() == 0:
            print(f"no complete checkpoint in {config.checkpoint_dir}: training starts from step 0", flush=True)
        return
    load_checkpoint(trainer, latest, verify=False)  # just verified
    summary.resumed_from = trainer.num_steps
    if dist.get_rank() == 0:
        why = f"restart {restarts}" if restarts else "--resume"
        print(f"{why}: resuming from {latest} (step {trainer.num_steps})", flush=True)


def write_losses(path: str, summary: TrainSummary) -> None:
    """The losses of this run's steps as JSON: ``{"first_step": k, "losses": [...], "skipped_steps": [...]}``,
    ``losses[i]`` being step ``k + i`` (1-based; ``k > 1`` after a resume), non-finite losses as null."""
    record = {
        "first_step": summary.first_step,
        "losses": [loss if math.isfinite(loss) else None for loss in summary.losses],
        "skipped_steps": summary.skipped_steps,
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
