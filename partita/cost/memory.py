"""Memory model of one device (one replica of a stage, or a rank holding several virtual stages).

memory = parameters + optimizer state (incl. master weights)
       + max(backward peak, optimizer-step peak)
backward peak = gathered parameter copies (sharded stages)
              + activations kept for backward x micro-batches in flight (schedule-dependent)
              + one set of bf16 weight copies (bf16 plans)
              + communication buffers (the received input and the output gradient; DDP's
                bucket; FSDP2's flat copy of one unit's gradients to reduce-scatter) + a
                working-memory peak
              + the gradients alive by then: all of them when some micro-batch's backward
                ran before the activation peak (1F1B steady state), else only the first one
                (GPipe, or as many micro-batches as in flight; gradients are set to None
                between steps) -- or, when every forward runs first, the start of the second
                micro-batch's backward if that is higher: one micro-batch fewer kept, but every
                gradient made (its rebuilt tensors too, under recomputation)
step peak     = the gradients the optimizer reads (a shard when sharded) + its temporaries: on a
                GPU, torch's default (foreach) step makes one state's worth at once (one copy of
                the trainable parameters, or of their shard); on the CPU, its single-tensor step
                makes about twice the largest parameter (``steps_foreach``)

Per trainable byte of the parameters in their own (captured, fp32) dtype, with ``k`` optimizer
states per parameter and ``r`` replicas of the stage::

                              params             master (shard)   optimizer   grads (backward / step)
    replicate                 1                  -                k           1 / 1
    shard_grads_and_opt       1 gathered         1/r              k/r         1 / 1/r
    full_shard                G gathered         1/r              k/r         1 / 1/r

bf16 (the runtime's autocast, partita/runtime/precision.py) keeps these fp32 parameters. A
replicated stage adds autocast's bf16 copies of the weights the forwards read, saved for their
backward, counted with the activations: a device whose stages keep their activations casts each
weight once per step and every micro-batch in flight shares that copy (1/2); a recomputing one
casts afresh and holds one segment's at a time while a micro-batch's backward rebuilds it. A
sharded stage gathers its weights in bf16 (FSDP2's ``param_dtype``, as torchtitan gathers): the
gathered copies are half the fp32 bytes, and autocast has nothing to cast.

Gradients are fp32 (the reduce dtype). Under ``whole`` accumulation (``Accumulation``) they
accumulate unsharded over the step's micro-batches: the sharded levels reduce-scatter them during
the last backward, unit by unit as each block's backward ends
(``partita.runtime.pipeline.backward_switches``), so with one micro-batch only the gradients of the
units still in backward are whole, and with more they save gradient memory at the optimizer step.
Under ``sharded`` accumulation every backward reduce-scatters them so, and a device holds its
``1/r`` shard of them plus the gradients of the unit in backward (the largest unit: a block's, or
the root's). Gathered copies are freed before the optimizer step (FSDP2 reshards after the last
backward). ``G``: under full_shard a stage that runs by block (``partita.types.segments``) holds
the weights outside its blocks (FSDP2's root unit) and two blocks' gathered at a time (the running
one and the next, prefetched: ``partita.cost.segment_memory``); a stage without a whole block is
one unit. Buffers and frozen parameters stay whole, in their own dtype, at every level.

Tensor parallelism: a CostTable of degree ``t > 1`` (``partita.cost.tensor_parallel``) holds one
device's share of a tensor-parallel group already: its parameter shards (``param_bytes``) and
its parts of the split values (activation, output and cut bytes). The formulas apply to those
bytes as they are, with ``r`` the data-parallel replicas (one group of ``t`` devices each): a
device's split parameters, gradients and optimizer state are 1/t of the whole, and the sharded
levels divide that by ``r`` again (each tensor-parallel index shards over its own ``r`` replicas).

Glossary
--------
in flight   micro-batches whose forward has run on this device and whose backward has not yet
            freed their activations. The schedule decides how many there are at the peak.
recompute   activation recomputation of a stage (``Recompute``): none keeps everything; full
            keeps only the stage's input, and backward re-runs the forward of one micro-batch
            at a time; selective also keeps the outputs of matmuls and attention and rebuilds
            the rest (``partita.cost.recompute`` tabulates what each level keeps).
precision   the CostTable's activation, output and cut bytes are already in the plan's
            precision (``partita.cost.table``); its ``param_bytes`` are the parameters' own
            (master) bytes, which this model converts.
sharding    ``partita.types.Sharding``: how a stage's ``r`` replicas share parameters,
            gradients and optimizer state (one replica: always replicate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partita.cost.partial_recompute import partial_segment_totals
from partita.cost.segment_memory import SegmentTotals, segment_totals
from partita.types import (
    Accumulation,
    CostTable,
    MemoryBreakdown,
    OptimizerKind,
    Precision,
    Recompute,
    Schedule,
    Sharding,
)

# DDP-style gradient bucket kept while replicas all-reduce (torch DDP's default bucket_cap_mb).
ALLREDUCE_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one device needs at its peak, by kind."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # kept for backward at the peak, all in-flight micro-batches
    comm_buffer_bytes: int
    working_bytes: int  # transient peak inside one operation's forward/backward
    optimizer_step_bytes: int = 0  # temporaries while the optimizer steps (activations are freed by then)
    backward_grad_bytes: int | None = None  # gradients alive at the backward peak (None: all of them)
    gathered_param_bytes: int = 0  # sharded stages: copies gathered for forward/backward, freed before the step
    step_grad_bytes: int | None = None  # gradients the optimizer step reads (None: grad_bytes; a shard)

    @property
    def total_bytes(self) -> int:
        """Persistent state (parameters, optimizer state) plus the larger of the two peaks:
        backward (gathered parameters, activations, buffers, working memory, the gradients alive
        by then) and the optimizer step (the gradients it reads, and the step's temporaries)."""
        return self.param_bytes + self.optimizer_bytes + np.maximum(self._during_backward, self._during_step)

    @property
    def _during_backward(self) -> int:
        grads_then = self.grad_bytes if self.backward_grad_bytes is None else self.backward_grad_bytes
        return (
            self.gathered_param_bytes + self.activation_bytes + self.comm_buffer_bytes + self.working_bytes + grads_then
        )

    @property
    def _during_step(self) -> int:
        grads = self.grad_bytes if self.step_grad_bytes is None else self.step_grad_bytes
        return grads + self.optimizer_step_bytes

    def breakdown(self) -> MemoryBreakdown:
        """``total_bytes`` by kind, at the larger of the two peaks (scalars only)."""
        if self._during_backward >= self._during_step:
            grads = self.grad_bytes if self.backward_grad_bytes is None else self.backward_grad_bytes
            return MemoryBreakdown(
                params_bytes=int(self.param_bytes + self.gathered_param_bytes),
                grads_bytes=int(grads),
                optimizer_bytes=int(self.optimizer_bytes),
                activations_bytes=int(self.activation_bytes),
                buffers_bytes=int(self.comm_buffer_bytes + self.working_bytes),
            )
        return MemoryBreakdown(
            params_bytes=int(self.param_bytes),
            grads_bytes=int(self.grad_bytes if self.step_grad_bytes is None else self.step_grad_bytes),
            optimizer_bytes=int(self.optimizer_bytes),
            activations_bytes=0,
            buffers_bytes=int(self.optimizer_step_bytes),
        )


def microbatches_in_flight(
    schedule: Schedule, num_microbatches: int, num_ranks: int, rank: int, virtual_stages: int = 1
) -> float:
    """Peak number of micro-batches whose activations a rank keeps, in units of the rank's whole
    share of the model (all its virtual stages).

    - GPipe: every micro-batch's forward runs before any backward: ``m``.
    - 1F1B (PipeDream-flush): rank ``r`` of ``S`` runs ``S - r - 1`` warm-up forwards, then
      alternates, so ``min(m, S - r)``.
    - Interleaved 1F1B with ``v`` virtual stages per rank (torch.distributed.pipelining's
      ScheduleInterleaved1F1B): ``(v - 1)·R + 2·(S - r - 1)`` warm-up forwards of one virtual
      stage each, plus the one in steady state, each 1/v of the rank's share:
      ``min(m, ((v - 1)·R + 2·(S - r - 1) + 1) / v)`` with ``R = m // max(1, m // S)``
      micro-batches per round (``R = S`` when S divides m), as torch computes it.
    - ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): the V-shaped placement
      gives every rank the peak of 1F1B's first stage: ``min(m, S)``.
    """
    m, s_count = num_microbatches, num_ranks
    if not 0 <= rank < s_count:
        raise ValueError(f"rank {rank} outside 0..{s_count - 1}")
    if schedule is Schedule.GPIPE:
        return float(m)
    if schedule is Schedule.ONE_F_ONE_B:
        return float(min(m, s_count - rank))
    if schedule is Schedule.INTERLEAVED_1F1B:
        v = virtual_stages
        per_round = m // max(1, m // s_count)
        return float(min(m, ((v - 1) * per_round + 2 * (s_count - rank - 1) + 1) / v))
    if schedule is Schedule.ZBV:
        return float(min(m, s_count))
    raise AssertionError(schedule)


def device_memory(
    costs: CostTable,
    ranges: Sequence[tuple[int, int]],
    *,
    in_flight: float,
    optimizer: OptimizerKind = OptimizerKind.ADAM,
    recompute: Recompute | bool = Recompute.NONE,
    precision: Precision = Precision.FP32,
    sharding: Sharding = Sharding.REPLICATE,
    num_replicas: int = 1,
    num_microbatches: int | None = None,
    accumulation: Accumulation = Accumulation.WHOLE,
    recompute_blocks: int | None = None,
) -> DeviceMemory:
    """Memory of one device holding the node ranges ``ranges`` (``[start, stop)`` positions).

    ``in_flight`` comes from :func:`microbatches_in_flight`; ``num_microbatches`` is the step's
    count (None: assume some backward runs before the activation peak, so every gradient is
    alive then). A parameter read by several ranges is counted once; a tied parameter held by
    two stages on two devices counts on each. ``costs`` must be in ``precision`` (its bytes).
    Under full_shard the largest range's trainable parameters are what is gathered at a time.
    ``recompute_blocks``: only the first that many whole blocks of the one range recompute
    (``partita.cost.partial_recompute``).
    """
    param_bytes = np.asarray(costs.param_bytes, dtype=np.int64)
    trainable = np.asarray(costs.param_trainable, dtype=bool)
    per_range = [np.asarray(costs.params_in_range(start, stop), dtype=np.int64) for start, stop in ranges]
    held = np.unique(np.concatenate(per_range)) if per_range else np.zeros(0, dtype=np.int64)
    held_trainable = held[trainable[held]]
    largest_unit = max((int(param_bytes[p[trainable[p]]].sum()) for p in per_range), default=0)
    segments = _device_segments(costs, ranges, [int(param_bytes[p[trainable[p]]].sum()) for p in per_range])
    level = Recompute.parse(recompute)
    if recompute_blocks is not None and level is not Recompute.NONE:
        assert len(ranges) == 1, "recomputing some blocks: one stage per device"
        (start, stop), held_bytes = ranges[0], int(param_bytes[held_trainable].sum())
        segments = partial_segment_totals(costs, start, stop, held_bytes, level, recompute_blocks)
    return memory_from_totals(
        first_grad_bytes=first_gradient_bytes(costs, ranges),
        param_bytes=int(param_bytes[held].sum()),
        trainable_bytes=int(param_bytes[held_trainable].sum()),
        activation_bytes=int(sum(costs.activation_bytes[start:stop].sum() for start, stop in ranges)),
        saved_bytes=int(sum(costs.saved_bytes[start:stop].sum() for start, stop in ranges)),
        stage_input_bytes=int(sum(costs.cut_bytes[start] for start, _ in ranges)),
        boundary_bytes=sum(int(costs.cut_bytes[start]) + int(costs.cut_bytes[stop]) for start, stop in ranges),
        largest_output_bytes=max((int(costs.output_bytes[a:b].max()) for a, b in ranges if b > a), default=0),
        largest_param_bytes=int(param_bytes[held_trainable].max()) if len(held_trainable) else 0,
        in_flight=in_flight,
        optimizer=optimizer,
        recompute=recompute,
        precision=precision,
        sharding=sharding,
        num_replicas=num_replicas,
        num_microbatches=num_microbatches,
        gathered_trainable_bytes=largest_unit if sharding is Sharding.FULL_SHARD else None,
        foreach_step=steps_foreach(costs.device),
        segments=segments,
        accumulation=accumulation,
    )


def _device_segments(
    costs: CostTable, ranges: Sequence[tuple[int, int]], trainable: Sequence[int]
) -> SegmentTotals | None:
    """The per-block terms of a device holding ``ranges`` (stages run one at a time): their kept
    inputs add up, the rest is the largest stage's. None without ranges."""
    if not ranges:
        return None
    each = [segment_totals(costs, a, b, t) for (a, b), t in zip(ranges, trainable)]
    return SegmentTotals(
        kept_inputs=sum(float(x.kept_inputs) for x in each),
        full_rebuilding=max(float(x.full_rebuilding) for x in each),
        selective_rebuilding=max(float(x.selective_rebuilding) for x in each),
        gathered=max(float(x.gathered) for x in each),
        recompute_weights=max(float(x.recompute_weights) for x in each),
        root=max(float(x.root) for x in each),
        largest_unit=max(float(x.largest_unit) for x in each),
    )


def first_gradient_bytes(costs: CostTable, ranges: Sequence[tuple[int, int]]) -> int:
    """Bytes of the first parameter gradients backward produces on a device: those of the last
    node (in the last range) that reads trainable parameters."""
    owners, uses = costs._flat_param_uses
    trainable = np.asarray(costs.param_trainable, dtype=bool)
    for start, stop in sorted(ranges, reverse=True):
        inside = (uses >= start) & (uses < stop) & trainable[owners]
        if inside.any():
            last = uses[inside].max()
            return int(sum(costs.param_bytes[p] for p in np.unique(owners[inside & (uses == last)])))
    return 0


def memory_from_totals(
    *,
    param_bytes: Any,
    trainable_bytes: Any,
    activation_bytes: Any,
    stage_input_bytes: Any,
    boundary_bytes: Any,
    largest_output_bytes: Any,
    in_flight: Any,
    largest_param_bytes: Any = 0,
    optimizer: OptimizerKind,
    recompute: Recompute | bool,
    precision: Precision = Precision.FP32,
    sharding: Sharding = Sharding.REPLICATE,
    num_replicas: int = 1,
    num_microbatches: Any = None,
    first_grad_bytes: Any = None,
    gathered_trainable_bytes: Any = None,
    saved_bytes: Any = None,
    rebuilding_bytes: Any = None,
    foreach_step: bool = False,
    segments: SegmentTotals | None = None,
    accumulation: Accumulation = Accumulation.WHOLE,
) -> DeviceMemory:
    """The memory formula on totals of a device's node ranges. Works element-wise on numpy
    arrays too, so the search evaluates every candidate stage at once with the same formula.

    activation_bytes: kept for backward per micro-batch; stage_input_bytes: bytes received per
    micro-batch; boundary_bytes: received + sent per micro-batch; largest_output_bytes: the
    largest single operation output; largest_param_bytes: the largest trainable parameter (a
    single-tensor Adam/momentum step, torch's default on CPU, makes temporaries of about twice
    it while every gradient is alive; measured in bench/results/cost_accuracy.md);
    num_microbatches: when it is at most ``in_flight``, every forward runs before the first
    backward, so only the first gradients exist at the activation peak: ``first_grad_bytes``
    (those of the last node reading trainable parameters; None: the largest parameter, an upper
    bound when no node reads several large parameters). param_bytes, trainable_bytes,
    largest_param_bytes, first_grad_bytes: in the parameters' own dtype (fp32); the rest in
    ``precision``. gathered_trainable_bytes: under full_shard, the trainable bytes gathered at a
    time (None: all of them). The table in the module docstring gives the formulas. ``recompute``:
    the level (a bool means full or none); saved_bytes: selective recomputation's kept outputs (per
    micro-batch, ``partita.cost.recompute``), needed at that level only; rebuilding_bytes: what one
    micro-batch holds beyond what it keeps while its backward rebuilds (None: ``rebuilt_bytes`` of
    the totals, exact for one range; ``device_memory`` gives the largest of its ranges' under
    selective recomputation: one stage rebuilds at a time).
    foreach_step: the optimizer steps every parameter at once (``steps_foreach``: on GPUs).
    segments: the stage's per-block terms (``partita.cost.segment_memory``): under recomputation
    each segment's input kept and one segment rebuilt (and its weights cast) at a time, in place
    of the stage's input, its whole rebuild and its weights; under full_shard its root unit and
    two blocks gathered, in place of ``gathered_trainable_bytes``. None: the stage is one unit.
    accumulation: how a sharded stage accumulates its gradients (module docstring).
    """
    recompute = Recompute.parse(recompute)
    recompute_weights = None
    if segments is not None and recompute is not Recompute.NONE:
        stage_input_bytes, recompute_weights = segments.kept_inputs, segments.recompute_weights
        rebuilding_bytes = segments.rebuilding(recompute)
    if segments is not None and sharding is Sharding.FULL_SHARD:
        gathered_trainable_bytes = segments.gathered
    if recompute is Recompute.SELECTIVE:
        assert saved_bytes is not None, "selective needs the saved bytes"
    sharded = sharding is not Sharding.REPLICATE and num_replicas > 1
    shards = num_replicas if sharded else 1
    gathered = trainable_bytes if gathered_trainable_bytes is None else gathered_trainable_bytes
    # A sharded stage's fp32 shard is its master copy (counted with the optimizer state); the
    # parameters of a replicated stage are their own master, in bf16 as in fp32.
    master_bytes = trainable_bytes / shards if sharded else 0 * trainable_bytes
    optimizer_bytes = np.ceil(optimizer.states_per_parameter * trainable_bytes / shards + master_bytes)
    if sharded:  # whole fp32 copies gathered for forward and backward only
        persistent_params = param_bytes - trainable_bytes
        gathered_bytes = (0.5 if precision is Precision.BF16 else 1) * gathered  # bf16: FSDP2's param_dtype
    else:
        persistent_params = 1 * param_bytes
        gathered_bytes = 0 * trainable_bytes
    copies = _weight_copies(
        precision, recompute, sharding, num_replicas, trainable_bytes, gathered_trainable_bytes, recompute_weights
    )

    def kept_with(count: Any) -> Any:  # kept for backward with ``count`` micro-batches in flight
        return _kept_bytes(count, recompute, activation_bytes, stage_input_bytes, copies, saved_bytes, rebuilding_bytes)

    unit = trainable_bytes if segments is None else np.maximum(segments.root, segments.largest_unit)
    grads = trainable_bytes  # the gradients held at once, unsharded (whole accumulation) or not
    if sharded and accumulation is Accumulation.SHARDED:
        grads = np.minimum(np.ceil(trainable_bytes / shards) + unit, trainable_bytes)
    kept, backward_grad_bytes = kept_with(in_flight), None
    comm_buffer_bytes = 1 * boundary_bytes  # the received input and the output gradient of the micro-batch
    if num_microbatches is not None:
        first = np.minimum(largest_param_bytes if first_grad_bytes is None else first_grad_bytes, grads)
        fewer = lambda: kept_with(np.maximum(in_flight - 1, 0))  # noqa: E731
        kept, backward_grad_bytes = _backward_peak(in_flight, num_microbatches, kept, fewer, first, grads)
    if num_replicas > 1 and not sharded:  # DDP's gradient bucket
        comm_buffer_bytes = comm_buffer_bytes + np.minimum(trainable_bytes, ALLREDUCE_BUCKET_BYTES)
    if sharded:  # FSDP2 copies one unit's gradients into a flat buffer to reduce-scatter them
        comm_buffer_bytes = comm_buffer_bytes + unit
    return DeviceMemory(
        param_bytes=_as_int(persistent_params),
        grad_bytes=_as_int(grads),
        optimizer_bytes=_as_int(optimizer_bytes),
        activation_bytes=_as_int(kept),
        comm_buffer_bytes=_as_int(comm_buffer_bytes),
        # an operation's output and its gradient coexist in backward
        working_bytes=_as_int(2 * largest_output_bytes),
        optimizer_step_bytes=_as_int(
            _step_temporaries(optimizer, largest_param_bytes, trainable_bytes, shards, foreach_step)
        ),
        backward_grad_bytes=backward_grad_bytes,
        gathered_param_bytes=_as_int(gathered_bytes),
        step_grad_bytes=_as_int(np.ceil(trainable_bytes / shards)) if sharded else None,
    )


def _weight_copies(
    precision: Precision,
    recompute: Recompute,
    sharding: Sharding,
    num_replicas: int,
    trainable_bytes: Any,
    gathered_trainable_bytes: Any,
    recompute_weights: Any = None,
) -> Any:
    """bf16: autocast's bf16 copies of the weights a replicated stage's forwards read, saved for their
    backward: one set for the step without recomputation (shared by the micro-batches in flight),
    else one set at a time, of the whole stage or of the segment being rebuilt (``recompute_weights``,
    a stage run by block); 0 in fp32, and 0 for a sharded stage, which gathers bf16 weights
    (module docstring)."""
    if precision is not Precision.BF16 or (sharding is not Sharding.REPLICATE and num_replicas > 1):
        return 0 * trainable_bytes
    if recompute is Recompute.NONE:
        return 0.5 * trainable_bytes
    return 0.5 * (trainable_bytes if recompute_weights is None else recompute_weights)


def _kept_bytes(
    in_flight: Any,
    recompute: Recompute,
    activation_bytes: Any,
    stage_input_bytes: Any,
    copies: Any,
    saved_bytes: Any = None,
    rebuilt: Any = None,
) -> Any:
    """Activations and bf16 weight copies kept for backward with ``in_flight`` micro-batches: each
    keeps ``kept_per_microbatch``, beside one set of copies (the step's, without recomputation; a
    recomputing stage's while it rebuilds one micro-batch's tensors, ``rebuilt_bytes``)."""
    if recompute is Recompute.NONE:
        return np.ceil(in_flight * activation_bytes) + np.ceil(copies)
    per_microbatch = kept_per_microbatch(recompute, activation_bytes, stage_input_bytes, saved_bytes)
    rebuilt = rebuilt_bytes(recompute, activation_bytes, saved_bytes) if rebuilt is None else rebuilt
    return np.ceil(in_flight * per_microbatch) + rebuilt + np.ceil(copies)


def kept_per_microbatch(level: Recompute, activation: Any, stage_input: Any, saved: Any) -> Any:
    """Bytes one micro-batch in flight keeps (``partita.cost.recompute``'s table); works on arrays."""
    if level is Recompute.FULL:
        return 1 * stage_input
    if level is Recompute.SELECTIVE:
        return stage_input + saved
    return 1 * activation


def rebuilt_bytes(level: Recompute, activation: Any, saved: Any) -> Any:
    """Bytes one micro-batch holds beyond what it keeps while its backward rebuilds and uses its
    tensors (``partita.cost.recompute``: selective drops the kept outputs backward does not read
    as it rebuilds the rest); works on arrays."""
    if level is Recompute.FULL:
        return 1 * activation
    if level is Recompute.SELECTIVE:
        return np.maximum(activation - saved, 0)
    return 0 * activation


def _backward_peak(
    in_flight: Any, num_microbatches: Any, kept: Any, fewer: Callable[[], Any], first: Any, all_grads: Any
) -> tuple:
    """(activations, gradients) at the backward peak. With some backward before the activation
    peak (more micro-batches than in flight) every gradient is alive with ``kept``. When every
    forward runs first, the first backward starts with ``kept`` and the first gradients, and the
    second (with two or more micro-batches) with one micro-batch fewer kept (``fewer()``, computed
    only then: the search asks this for every stage range) but every gradient: whichever is higher."""
    if np.ndim(num_microbatches) == 0 and np.ndim(in_flight) == 0:  # the search's case, decided in Python
        if num_microbatches > in_flight:
            return _as_int(kept), _as_int(all_grads)
        if num_microbatches < 2:
            return _as_int(kept), _as_int(first)
    m, f = np.asarray(num_microbatches), np.asarray(in_flight)
    no_steady_state = m <= f
    less = fewer()
    second = no_steady_state & (m >= 2) & (less + all_grads > kept + first)
    activations = np.where(second, less, kept)
    grads = np.where(no_steady_state & ~second, first, all_grads)
    return _as_int(activations), _as_int(grads)


class MemoryByInFlight:
    """``memory_from_totals(in_flight=f, **totals).total_bytes`` as a function of ``f`` alone: the
    search asks one stage table for many in-flight counts (one per pipeline position and
    schedule), so what does not depend on ``f`` is evaluated once. Takes ``memory_from_totals``'s
    arguments but ``in_flight``; equal to it byte for byte (tests/unit/test_memory.py)."""

    def __init__(self, **totals: Any):
        at_zero = memory_from_totals(in_flight=0, **totals)
        recompute = Recompute.parse(totals["recompute"])
        segments = totals.get("segments") if recompute is not Recompute.NONE else None
        self._copies = _weight_copies(
            totals.get("precision", Precision.FP32),
            recompute,
            totals.get("sharding", Sharding.REPLICATE),
            totals.get("num_replicas", 1),
            totals["trainable_bytes"],
            totals["segments"].gathered
            if totals.get("segments") is not None and totals.get("sharding") is Sharding.FULL_SHARD
            else totals.get("gathered_trainable_bytes"),
            None if segments is None else segments.recompute_weights,
        )
        self._persistent = at_zero.param_bytes + at_zero.optimizer_bytes
        self._step_peak = at_zero._during_step
        self._fixed = at_zero.gathered_param_bytes + at_zero.comm_buffer_bytes + at_zero.working_bytes
        self._grads = at_zero.grad_bytes
        if totals.get("num_microbatches") is not None:  # the first gradients, for every forward before a backward
            first = totals.get("first_grad_bytes")
            first = totals.get("largest_param_bytes", 0) if first is None else first
            self._first_grads = np.minimum(first, self._grads)
        self._totals = totals
        self._recompute = Recompute.parse(totals["recompute"])

    def nbytes(self) -> int:
        """Bytes of the arrays it evaluated once (not those of the totals it was given)."""
        return sum(v.nbytes for k, v in vars(self).items() if k != "_totals" and isinstance(v, np.ndarray))

    def _kept(self, in_flight: Any) -> Any:
        t = self._totals
        segments = t.get("segments") if self._recompute is not Recompute.NONE else None
        return _kept_bytes(
            in_flight,
            self._recompute,
            t["activation_bytes"],
            t["stage_input_bytes"] if segments is None else segments.kept_inputs,
            self._copies,
            t.get("saved_bytes"),
            t.get("rebuilding_bytes") if segments is None else segments.rebuilding(self._recompute),
        )

    def total_bytes(self, in_flight: float) -> Any:
        t = self._totals
        kept, grads = _as_int(self._kept(in_flight)), self._grads
        if t.get("num_microbatches") is not None:
            fewer = lambda: self._kept(np.maximum(in_flight - 1, 0))  # noqa: E731
            kept, grads = _backward_peak(in_flight, t["num_microbatches"], kept, fewer, self._first_grads, grads)
        return self._persistent + np.maximum(self._fixed + kept + grads, self._step_peak)


def steps_foreach(device: str) -> bool:
    """Whether torch's optimizers step all of a device's parameters at once on ``device`` (a
    catalog name or a device file's): their default implementation is foreach on GPUs (CUDA
    tensors and FSDP2's DTensors of them) and single-tensor on the CPU
    (``torch.optim.optimizer._default_to_fused_or_foreach``). Every device but ``cpu`` is a GPU."""
    return device != "cpu"


def _step_temporaries(
    optimizer: OptimizerKind, largest_param_bytes: Any, trainable_bytes: Any, shards: int, foreach_step: bool
) -> Any:
    """The optimizer step's temporaries (fp32), over a shard when sharded. Foreach: one state's
    worth, all at once (Adam's ``_foreach_sqrt`` of its second moments; measured on an H100:
    bench/results/gpu/README.md); single-tensor: about twice the largest parameter, one at a time
    (measured on the CPU: bench/results/cost_accuracy.md). Momentum SGD's step, in place unless it
    decays weights, is charged as Adam's: an upper bound."""
    if optimizer.states_per_parameter == 0:
        return 0 * largest_param_bytes  # plain SGD updates in place
    if foreach_step:
        return np.ceil(trainable_bytes / shards)
    return np.ceil(2 * largest_param_bytes / shards)


def _as_int(value: Any) -> Any:
    """Plain int for scalars, int64 arrays for arrays."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return int(value)
    if isinstance(value, np.ndarray):
        return value.astype(np.int64)
    return int(value)
