"""What a simulated training step costs, and its timeline: the simulator's output, which the
reports draw."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TimelineEvent:
    """One interval of the simulated step. ``microbatch`` is -1 for an all-reduce."""

    rank_group: int
    stage: int
    microbatch: int
    kind: str  # "F", "B", "I", "W" or "allreduce"
    start_s: float
    end_s: float


@dataclass(frozen=True)
class SimResult:
    """What one simulated training step costs."""

    step_s: float  # end of the last compute or all-reduce on any rank group
    bubble_fraction: float  # 1 - mean(rank_busy_s) / step_s
    rank_busy_s: tuple[float, ...]  # compute seconds per rank group
    rank_peak_activation_bytes: tuple[int, ...]  # per rank group: peak activations of in-flight micro-batches
    timeline: tuple[TimelineEvent, ...]  # empty when keep_timeline=False
