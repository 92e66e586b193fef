"""Recomputing some of a stage's blocks: what a stage keeps and rebuilds when only its first ``n``
whole blocks recompute (``StagePlan.recompute_blocks``, Megatron-LM's "recompute N layers").

The stage's segments (``partita.types.segments``, from the cost table's ``block_ranges``) split in
two: the segments of its first ``n`` whole blocks recompute at the stage's level -- each keeps its
input (and, selective, its kept outputs) and is rebuilt one at a time in backward -- and every
other segment (the nodes before its first block, its later blocks, the nodes after its last) keeps
all of its activations, as without recomputation. The memory model reads the result as the
stage's per-block terms (``SegmentTotals``), so that ``partita.cost.memory``'s formulas apply:

    kept_inputs            the recomputed segments' inputs + the other segments' activations
                           (less their kept outputs under selective: the formula adds the stage's
                           kept outputs, of every segment)
    full / selective rebuilding   what rebuilding a recomputed segment holds beyond the micro-batch's
                           kept tensors: backward reaches the first blocks last, having freed the
                           later segments' tensors, and holds then the nodes before the blocks,
                           the inputs (and kept outputs) of the blocks up to the one it rebuilds,
                           and that one's tensors
    recompute_weights      the other segments' weights + the largest recomputed segment's (bf16:
                           autocast's copies, kept for the step by the others, cast afresh by a
                           segment that rebuilds)

Scalar: the planner asks for it for the stages of a plan it builds, not in its search.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from partita.cost.segment_memory import SegmentTotals, segment_totals, unit_bytes
from partita.types import CostTable, Recompute
from partita.types.segments import segment_ranges

__all__ = ["partial_segment_totals", "recomputed_ranges", "recomputed_seconds", "whole_block_count"]


def _segments(costs: CostTable, start: int, stop: int) -> list[tuple[int, int, int | None]]:
    """``segment_ranges`` of the stage on the table's blocks."""
    return segment_ranges(
        [tuple(r) for r in np.asarray(costs.block_ranges, dtype=np.int64).reshape(-1, 2)], start, stop
    )


def whole_block_count(costs: CostTable, start: int, stop: int) -> int:
    """How many of the table's blocks lie whole inside ``[start, stop)``."""
    return sum(k is not None for _, _, k in _segments(costs, start, stop))


def recomputed_ranges(costs: CostTable, start: int, stop: int, recompute_blocks: int | None) -> list[tuple[int, int]]:
    """Node ranges of the segments that recompute (None: the whole stage's, one range)."""
    if recompute_blocks is None:
        return [(start, stop)]
    return [(a, b) for a, b, k in _segments(costs, start, stop) if k is not None][:recompute_blocks]


def recomputed_seconds(costs: CostTable, start: int, stop: int, recompute_blocks: int | None) -> tuple[float, float]:
    """(forward, selectively recomputed) seconds per micro-batch of the segments that recompute:
    what ``extra_backward_s`` takes."""
    ranges = recomputed_ranges(costs, start, stop, recompute_blocks)
    forward = sum(float(costs.forward_s[a:b].sum()) for a, b in ranges)
    return forward, sum(float(costs.selective_recompute_s[a:b].sum()) for a, b in ranges)


def partial_segment_totals(
    costs: CostTable, start: int, stop: int, trainable_bytes: float, level: Recompute, recompute_blocks: int
) -> SegmentTotals:
    """The per-block terms of stage ``[start, stop)`` recomputing its first ``recompute_blocks`` whole
    blocks at ``level`` (module docstring)."""
    whole = segment_totals(costs, start, stop, trainable_bytes)
    segments = _segments(costs, start, stop)
    block_count = sum(k is not None for _, _, k in segments)
    assert 0 < recompute_blocks <= block_count, (recompute_blocks, block_count)
    activation = np.asarray(costs.activation_bytes, dtype=np.float64)
    saved = np.asarray(costs.saved_bytes, dtype=np.float64)
    units = unit_bytes(costs).astype(np.float64)
    inputs = np.asarray(costs.block_input_bytes, dtype=np.float64)
    selective = level is Recompute.SELECTIVE
    kept, kept_saved, weights_kept, weights_rebuilt = 0.0, 0.0, 0.0, 0.0
    before = 0.0  # what this micro-batch holds, in backward, of the segments before the one it rebuilds
    rebuild_peaks = []
    seen = 0
    for a, b, k in segments:
        act, own_saved = float(activation[a:b].sum()), float(saved[a:b].sum())
        if k is not None and seen < recompute_blocks:
            seen += 1
            own_input = float(costs.cut_bytes[start]) if a == start else float(inputs[k])
            kept += own_input
            kept_saved += own_saved if selective else 0.0
            rebuild_peaks.append(before + own_input + act)  # its input kept, its tensors all rebuilt
            before += own_input + (own_saved if selective else 0.0)
            weights_rebuilt = max(weights_rebuilt, float(units[k]))
        else:
            kept += act - (own_saved if selective else 0.0)
            kept_saved += own_saved if selective else 0.0
            before += act if not rebuild_peaks else 0.0  # the segments before the first block
            weights_kept += float(whole.root) if k is None else float(units[k])
    weights_kept -= float(whole.root) * max(sum(k is None for _, _, k in segments) - 1, 0)  # the root once
    # Backward frees each later segment's tensors before it reaches the first blocks, which it
    # rebuilds one at a time: what a rebuild holds beyond the micro-batch's kept tensors (>= 0).
    rebuilding = max(0.0, max(rebuild_peaks) - (kept + kept_saved))
    return dataclasses.replace(
        whole,
        kept_inputs=kept,
        full_rebuilding=rebuilding,
        selective_rebuilding=rebuilding,
        recompute_weights=weights_kept + weights_rebuilt,
    )
