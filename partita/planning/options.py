"""``PlanOptions``: every choice of a planning run that a user may pin, validated once.

A field left at None is searched; a set field pins that choice. The resolved options (what was
pinned and what the search was allowed) go into the plan file, so a plan says how it was made.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass
from typing import Any

from partita.checks import optional_positive_int, parse_choice
from partita.errors import InputError
from partita.types import DeviceSpec, OptimizerKind, Precision, Recompute, Schedule, Sharding


class CostSource(str, enum.Enum):
    """Where the planner's per-node costs come from."""

    AUTO = "auto"  # measured when the target is this machine's CPU and the model has real weights
    MEASURED = "measured"  # the profiler runs every node here (partita.cost.profiler)
    ANALYTIC = "analytic"  # a roofline from FLOPs and bytes for the target device (partita.cost.analytic)


def recompute_allowed(schedule: Schedule) -> bool:
    """ZBV never recomputes: torch's ScheduleZBVZeroBubble keeps a recomputed stage's activations
    alive between its input- and weight-gradient passes, beyond what the memory model counts."""
    return schedule is not Schedule.ZBV


@dataclass(frozen=True)
class PlanOptions:
    """What ``partita.plan`` may choose, and what the user pinned.

    ``schedules``: the schedules searched (default: all; one name or Schedule pins it).
    ``num_stages``: pipeline depth in rank groups. ``replicas``: data-parallel replicas per rank
    group, each a group of ``tensor_parallel`` devices (pins the same count for every stage).
    ``num_microbatches``: pins that. ``recompute``: the recomputation level of every stage,
    "none", "selective" or "full" (True / False: full / none);
    None: each stage takes the least level with which it fits (``Recompute``).
    ``uniform_replicas``: True restricts the search to pp x dp meshes, False asks for
    per-stage replica counts explicitly, None searches them where the search can (see
    ``partita.planning.uneven``). ``optimizer`` sets optimizer-state memory.
    ``precision``: "fp32" or "bf16" (bf16 compute, fp32 master weights, optimizer state and gradient
    reduction); None: bf16 on GPU device types, fp32 on the CPU (decided where the cluster is known,
    ``resolve_precision``). ``sharding``: "replicate", "shard_grads_and_optimizer" or "full_shard"
    pins every stage with several replicas (stages with one replica always replicate, and so do
    stages that share a weight with another stage: tied weights across stages are never sharded);
    None: each stage's level is searched. ``tensor_parallel``: devices per tensor-parallel group
    (each replica of a stage splits its matmuls over that many devices of one node; one degree for
    the whole plan); None: searched over 1, 2, 4 and 8 where the cluster allows
    (``partita.planning.tensor_parallel``). ``sequence_parallel``: whether the tensor-parallel
    groups also split, by token, the regions they leave whole (norms, dropout, residual additions:
    their activations divide by the degree; ``partita.capturing.sequence_parallel``); None: on
    wherever a degree's layout splits a region by token (``partita.planning.tensor_parallel``). ``costs``: where costs come from.
    ``compile``: whether every block runs through ``torch.compile``, compiled once per distinct
    block, and is costed as compiled (``Plan.compile``); None: on for GPU device types, off on
    the CPU (``resolve_compile``). ``max_blocks``: how finely the graph is coarsened into a chain of blocks;
    None: 128, or as many as keep a boundary at every layer start of a deeper model
    (``partita.planning.chain.default_max_blocks``).
    ``cache_dir``: where profiles and calibrations are cached (default: the user cache folder).
    """

    schedules: tuple[Schedule, ...] = tuple(Schedule)
    num_stages: int | None = None
    replicas: int | None = None
    num_microbatches: int | None = None
    recompute: Recompute | str | bool | None = None
    uniform_replicas: bool | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAM
    precision: Precision | str | None = None
    sharding: Sharding | str | None = None
    tensor_parallel: int | None = None
    sequence_parallel: bool | None = None
    costs: CostSource = CostSource.AUTO
    compile: bool | None = None
    max_blocks: int | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise the given spellings once, here
        set_(self, "schedules", _parse_schedules(self.schedules))
        for name in ("num_stages", "replicas", "num_microbatches", "tensor_parallel"):
            set_(self, name, optional_positive_int(getattr(self, name), name))
        set_(self, "max_blocks", optional_positive_int(self.max_blocks, "max_blocks"))
        for name in ("uniform_replicas", "sequence_parallel", "compile"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True, False or None (searched), got {getattr(self, name)!r}")
        if self.uniform_replicas is False and self.replicas is not None:
            raise InputError(
                f"replicas={self.replicas} pins the same replica count for every stage, but uniform_replicas=False "
                "asks for different counts: drop one of the two"
            )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise InputError(
                "sequence_parallel=True splits the regions a tensor-parallel group leaves whole, but tensor_parallel=1 "
                "pins no tensor parallelism: pin tensor_parallel to 2 or more (or leave it unpinned), or unpin "
                "sequence_parallel"
            )
        if self.recompute is not None:
            set_(self, "recompute", Recompute.parse(self.recompute))
        if self.precision is not None:
            set_(self, "precision", Precision.parse(self.precision))
        if self.sharding is not None:
            set_(self, "sharding", Sharding.parse(self.sharding))
        set_(self, "optimizer", OptimizerKind.parse(self.optimizer))
        set_(self, "costs", parse_choice(CostSource, self.costs, "costs"))
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise InputError(
                    f"cache_dir must be a folder path (str or os.PathLike) or None (the user cache folder), got "
                    f"{self.cache_dir!r} of type {type(self.cache_dir).__name__}"
                )
            set_(self, "cache_dir", os.fspath(self.cache_dir))
        recomputes = self.recompute not in (None, Recompute.NONE)
        if recomputes and not any(recompute_allowed(s) for s in self.schedules):
            names = ", ".join(repr(s.value) for s in self.schedules)
            level = self.recompute.value
            raise InputError(
                f"schedule {names} with recompute={level!r} is not supported: under ZBV (torch's "
                "ScheduleZBVZeroBubble) a recomputed stage keeps its recomputed activations alive between the "
                "input-gradient and the weight-gradient pass, so its memory cannot be predicted; use schedule "
                f"'1f1b' or 'interleaved1f1b' with recompute={level!r}, or 'zbv' with recompute='none' (or unpinned)"
            )

    def replace(self, **changes: Any) -> PlanOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def resolve_precision(precision: Precision | None, device: DeviceSpec) -> Precision:
    """The precision a plan computes in: the pinned one; else fp32 on the CPU ("cpu", whose plans
    are usually measured, and the profiler measures in the captured dtype); else bf16 where the
    device's bf16 peak exceeds its fp32 peak (every GPU of the catalog: 2-16x), fp32 otherwise."""
    if precision is not None:
        return precision
    if device.name == "cpu":
        return Precision.FP32
    peaks = device.peak_flops
    faster = peaks.get("bfloat16", 0.0) > peaks.get("float32", float("inf"))
    return Precision.BF16 if faster else Precision.FP32


def resolve_compile(compile: bool | None, device: DeviceSpec) -> bool:
    """Whether a plan compiles its blocks: the pinned choice; else on for GPU device types, where
    an eager step pays a kernel launch per operation (35 us measured on one H100, against
    microseconds of work for most elementwise operations: bench/results/gpu/README.md) that
    compiled blocks fuse away, and off on the CPU, where inductor's C++ compilation costs seconds
    per distinct block at start-up for a smaller gain (bench/results/compiled_blocks.md)."""
    if compile is not None:
        return compile
    return device.name != "cpu"


def _parse_schedules(value: Any) -> tuple[Schedule, ...]:
    if isinstance(value, (str, Schedule)):
        return (Schedule.parse(value),)
    chosen = tuple(Schedule.parse(s) for s in value)
    if not chosen:
        raise InputError("schedules is empty: give at least one of " + ", ".join(s.value for s in Schedule))
    return chosen
