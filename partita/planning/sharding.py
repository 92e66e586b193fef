"""Choosing a stage's sharding level: which levels may be tried, and what each costs per step.

The memory model (``partita.cost.memory``) says which levels fit; this module estimates the
seconds per step that each level adds to the stage's compute, as the simulator
(``partita.planning.simulate``) counts them, so that a rank group takes the fastest level that
fits (ties: the least sharded). With ``T`` the stage's trainable bytes (fp32), ``T_c`` the bytes
gathered (T/2 in bf16 plans: the runtime gathers bf16 weights), ``F``, ``B`` its forward and backward seconds per
micro-batch, ``m`` micro-batches and ``r`` replicas:

    replicate                  max(AR(T) - B, AR(bucket)) + opt(T)
    shard_grads_and_optimizer  AG(T_c) + RS' + opt(T) / r
    full_shard                 AG(T_c) + RS' + opt(T) / r + m (X(F) + X(B))

AR/AG/RS: ring all-reduce / all-gather / reduce-scatter over the r replicas
(``partita.cost.comm``; AG and RS also pay FSDP2's copy-in / copy-out, ``collective_times_s``); opt:
the optimizer step (``optimizer_step_s``). DDP all-reduces its gradient buckets while the last
backward runs, so only what exceeds that backward (at least the last bucket) shows.

A sharded stage that runs by block (``partita.types.segments``; ``SegmentTotals``) is one FSDP2
unit per whole block and one for the rest (the root, ``R``): before it computes, it gathers the
root and its first block (``G1 = R + U``), and each later block while the one before it computes,
so a forward (or backward) of ``C`` seconds shows ``X(C) = AG(G1) + max(0, AG(T_c) - AG(G1) - C)``;
its gradients are reduce-scattered unit by unit as each block's backward ends, so after the last
backward only ``RS' = max(RS(R), RS(T) - B)`` shows. Under sharded accumulation (``Accumulation``)
every backward reduce-scatters so: ``m RS'`` in place of ``RS'``. A stage without a whole block is one unit,
gathered during the rank group's previous action (``X(C) = max(0, AG(T_c) - C)``) and
reduce-scattered after its last backward (``RS' = RS(T)``). Each replica steps its own shard.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from partita.cost import comm
from partita.cost.analytic import optimizer_step_s
from partita.cost.memory import ALLREDUCE_BUCKET_BYTES
from partita.cost.segment_memory import SegmentTotals
from partita.types import Accumulation, Cluster, OptimizerKind, Precision, Sharding

__all__ = [
    "LEVELS",
    "ShardedExposure",
    "accumulations",
    "collective_times_s",
    "levels",
    "shards_as_pinned",
    "step_overhead_s",
]

LEVELS = (Sharding.REPLICATE, Sharding.SHARD_GRADS_AND_OPTIMIZER, Sharding.FULL_SHARD)  # least sharded first


def levels(pinned: Sharding | None, num_replicas: int) -> tuple[Sharding, ...]:
    """The levels a stage with ``num_replicas`` replicas may take: replicate alone for one replica,
    the pinned level otherwise, else every level, least sharded first (the tie-break)."""
    if num_replicas == 1:
        return (Sharding.REPLICATE,)
    return LEVELS if pinned is None else (pinned,)


def accumulations(level: Sharding, num_replicas: int, num_microbatches: int) -> tuple[Accumulation, ...]:
    """How a stage at ``level`` may accumulate its gradients, the one that moves less first: whole,
    and for a sharded stage of several micro-batches sharded too (it holds fewer gradients, and
    reduce-scatters them in every backward)."""
    if level is Sharding.REPLICATE or num_replicas == 1 or num_microbatches == 1:
        return (Accumulation.WHOLE,)
    return (Accumulation.WHOLE, Accumulation.SHARDED)


def shards_as_pinned(plan: Any, pinned: Sharding | None) -> bool:
    """Whether ``plan`` honours a pinned sharding level: some stage has it, or the pin is replicate
    or none. Stages sharing a weight with another stage (tied embeddings) always replicate, so a
    plan whose every stage does honours no other level (``partita.planning.api`` refuses it)."""
    return pinned is None or pinned is Sharding.REPLICATE or any(s.sharding is pinned for s in plan.stages)


def collective_times_s(
    level: Sharding,
    trainable_bytes: Any,
    *,
    num_replicas: int,
    precision: Precision,
    cluster: Cluster,
    spans_nodes: bool,
) -> tuple[Any, Any, Any]:
    """(gradient collective, its part that cannot overlap the last backward, all-gather) seconds of
    a stage with ``trainable_bytes`` (fp32) over ``num_replicas`` replicas; element-wise on arrays.

    replicate: DDP's ring all-reduce of the fp32 gradients; the tail is its last bucket's. Sharded:
    the ring reduce-scatter of the fp32 gradients (no overlap: the tail is all of it) and the ring
    all-gather of the parameters in ``precision``, each with FSDP2's copy-in / copy-out through
    device memory ((1 + 1/r) of the unsharded bytes, at the device's memory bandwidth)."""
    trainable_bytes = np.asarray(trainable_bytes, dtype=np.float64)
    zero = 0.0 * trainable_bytes
    if num_replicas == 1:
        return zero, zero, zero
    latency_s, per_byte_s = comm.ring_pass_coefficients(num_replicas, cluster, spans_nodes=spans_nodes)
    if level is Sharding.REPLICATE:
        bucket = np.minimum(trainable_bytes, ALLREDUCE_BUCKET_BYTES)
        return 2 * (latency_s + per_byte_s * trainable_bytes), 2 * (latency_s + per_byte_s * bucket), zero
    device = cluster.device
    copy_s_per_byte = (1 + 1 / num_replicas) / (device.memory_bandwidth_bytes_per_s * device.memory_efficiency)
    # gathered in the compute dtype (bf16: FSDP2's param_dtype, partita/runtime/precision.py)
    compute_bytes = trainable_bytes / 2 if precision is Precision.BF16 else trainable_bytes
    reduce_s = latency_s + (per_byte_s + copy_s_per_byte) * trainable_bytes
    gather_s = latency_s + (per_byte_s + copy_s_per_byte) * compute_bytes
    return reduce_s, reduce_s, gather_s


def step_overhead_s(
    level: Sharding,
    *,
    trainable_bytes: Any,
    forward_s: Any,
    backward_s: Any,
    num_microbatches: int,
    num_replicas: int,
    precision: Precision,
    optimizer: OptimizerKind,
    cluster: Cluster,
    spans_nodes: bool,
    segments: SegmentTotals | None = None,
    accumulation: Accumulation = Accumulation.WHOLE,
) -> Any:
    """Seconds per step a stage's communication and optimizer step add to its compute under
    ``level`` (formulas in the module docstring; ``segments``: the stages' per-block terms, None: one
    unit each; ``accumulation``: the gradients reduce-scattered once per step, or in every backward).
    Element-wise on arrays of stages."""
    trainable_bytes = np.asarray(trainable_bytes, dtype=np.float64)
    step_s = cluster.compute_slowdown * optimizer_step_s(
        trainable_bytes, optimizer, cluster.device, precision=precision
    )
    if num_replicas == 1:
        return step_s
    times = dict(num_replicas=num_replicas, precision=precision, cluster=cluster, spans_nodes=spans_nodes)
    reduce_s, tail_s, gather_s = collective_times_s(level, trainable_bytes, **times)
    if level is Sharding.REPLICATE:
        return np.maximum(reduce_s - backward_s, tail_s) + step_s
    exposed = ShardedExposure.of(level, gather_s, reduce_s, segments, **times)
    reductions = num_microbatches if accumulation is Accumulation.SHARDED else 1
    overhead = gather_s + reductions * exposed.reduce_shown(backward_s) + step_s / num_replicas
    if level is Sharding.FULL_SHARD:
        overhead = overhead + num_microbatches * (exposed.gather_shown(forward_s) + exposed.gather_shown(backward_s))
    return overhead


class ShardedExposure:
    """What a sharded stage's gathers and reduce-scatter show beside its compute (module docstring):
    ``gather_shown(C)`` of a forward or backward of ``C`` seconds, ``reduce_shown(B)`` after the last
    backward of ``B`` seconds; element-wise on arrays."""

    def __init__(self, gather_s: Any, first_gather_s: Any, reduce_s: Any, root_reduce_s: Any, by_block: Any):
        self.gather_s, self.first_gather_s = gather_s, first_gather_s
        self.reduce_s, self.root_reduce_s, self.by_block = reduce_s, root_reduce_s, by_block

    @classmethod
    def of(cls, level: Sharding, gather_s: Any, reduce_s: Any, segments: SegmentTotals | None, **times: Any):
        if segments is None:
            return cls(gather_s, gather_s, reduce_s, reduce_s, False)
        _, _, first = collective_times_s(level, segments.first_gathered, **times)
        root_reduce, _, _ = collective_times_s(level, segments.root, **times)
        return cls(gather_s, first, reduce_s, root_reduce, np.asarray(segments.largest_unit) > 0)

    def gather_shown(self, compute_s: Any) -> Any:
        blocked = self.first_gather_s + np.maximum(0.0, self.gather_s - self.first_gather_s - compute_s)
        return np.where(self.by_block, blocked, np.maximum(0.0, self.gather_s - compute_s))

    def reduce_shown(self, backward_s: Any) -> Any:
        blocked = np.maximum(self.root_reduce_s, self.reduce_s - backward_s)
        return np.where(self.by_block, blocked, self.reduce_s)
