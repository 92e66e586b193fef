"""What a run of ``partita.fit`` records besides training: losses and times (its FitResult), the
progress bar, torch's profiler over TRACED_STEPS, each stage's forward time and the ``log_dir``
metrics (partita.training.metrics)."""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from partita.runtime.compiled_segments import compile_seconds, compiled_count
from partita.training.metrics import MetricsWriter

__all__ = ["TRACED_STEPS", "RunLog", "gather_stage_times"]


class RunLog:
    """What a run records besides training: losses and times (summary), the progress bar, the
    profiler's trace, per-stage timers and the --log-dir metrics."""

    def __init__(self, trainer, config, summary, step_samples: int, *, note: Callable[[str], None]):
        self.trainer, self.summary, self.step_samples = trainer, summary, step_samples
        self.timers = _stage_forward_timers(trainer, summary)
        self.bar = _progress_bar(trainer, config)
        self.tracer = _StepTracer(config.trace_dir)
        self.note = note
        self.compiling = trainer.plan.compile  # the first step compiles the blocks: its time is reported
        self.metrics = None
        if config.log_dir and dist.get_rank() == 0:
            # the steps before this run's stay in the log (a resume's, or an earlier run's of this trainer)
            before = summary.start_step if summary.start_step else None
            self.metrics = MetricsWriter(config.log_dir, resumed_from=before, note=note)

    def before_step(self) -> None:
        self.tracer.before_step(self.trainer.num_steps + 1)

    def after_step(self, loss: float, lr: float, elapsed: float) -> None:
        step, summary = self.trainer.num_steps, self.summary
        self.timers.end_step()
        if self.compiling and dist.get_rank() == 0:
            self.compiling = False
            self.note(
                f"compiled blocks: {compiled_count()} functions compiled (one per distinct block and shape) in "
                f"{compile_seconds():.1f} s of forward compilation; the first step, backward's included, took "
                f"{elapsed:.1f} s"
            )
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


# ----------------------------------------------------------------------------- timing


class _StageTimers:
    """Forward time of each of this rank's stage modules per step (module hooks)."""

    def __init__(self, summary):
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


def _stage_forward_timers(trainer, summary) -> _StageTimers:
    timers = _StageTimers(summary)
    for stage in trainer.stages:
        before, after = timers.hooks(stage.spec.index)
        stage.register_forward_pre_hook(before)
        stage.register_forward_hook(after)
    return timers


def gather_stage_times(local: dict[int, list[float]]) -> dict[int, list[float]]:
    """Every rank's per-stage forward times, merged (the first replica's numbers per stage)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[int, list[float]] = {}
    for part in gathered:
        for index, times in part.items():
            merged.setdefault(index, times)
    return merged


def _progress_bar(trainer, config):
    """tqdm's bar on a terminal; in a log file (not a tty) one line every tenth of the run instead."""
    if not config.progress or dist.get_rank() != 0:
        return None
    if not sys.stderr.isatty():
        return _LogLines(config.num_steps, trainer.num_steps)
    from tqdm import tqdm

    return tqdm(total=config.num_steps, initial=trainer.num_steps, desc="train", unit="step")


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
