"""What a stage that runs by block holds: the memory model's per-block terms, for any node ranges.

A stage runs as a chain of segments (``partita.types.segments``): the nodes before its first
whole block, each whole block (with the root-level nodes after it, up to the next block), the
nodes after its last whole block. The runtime (``partita.runtime.segments``) makes each block a
unit of its own, and this module counts what that changes, per micro-batch, for a stage of nodes
``[a, b)`` with whole blocks ``l0 .. l1 - 1``:

    recomputation keeps    the stage's input (cut_bytes[a]) and, at every later segment start,
                           the values made since the previous one that are read on
                           (block_input_bytes, block_output_bytes: relayed values once)
    full rebuilds          the largest segment's activations, one segment at a time
    selective rebuilds     the largest segment's rebuilt part (its activations less its kept outputs)
    full_shard gathers     the stage's weights outside its blocks (FSDP2's root unit, gathered
                           for the whole stage's forward and backward) and two blocks' (the one
                           running and the next, prefetched)
    recomputation reads    one segment's weights at a time (bf16: autocast's copies of them)

A block's unit is the trainable weights that only its segment reads (``unit_bytes``), as the
runtime's ``block_containers`` takes them. A stage without a whole block is one segment: every
term is then the stage's whole (the formulas of ``partita.cost.memory`` for one unit).

Everything is vectorised over arrays of ranges (the search asks for every candidate stage at once).
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from partita.types import CostTable

__all__ = ["SegmentTotals", "segment_totals", "unit_bytes"]


@dataclass(frozen=True)
class SegmentTotals:
    """Per stage range (arrays of the ranges' shape), the per-block terms of the module docstring."""

    kept_inputs: Any  # kept per micro-batch under recomputation as segment inputs
    full_rebuilding: Any  # full recomputation: the largest segment's activations
    selective_rebuilding: Any  # selective: the largest segment's rebuilt part
    gathered: Any  # full_shard: trainable bytes gathered at a time
    recompute_weights: Any  # trainable bytes one segment's recomputation reads at a time
    root: Any = None  # trainable bytes outside the whole blocks' units (FSDP2's root unit)
    largest_unit: Any = None  # the largest whole block's unit (0: the stage holds no whole block)

    @property
    def first_gathered(self) -> Any:
        """What a sharded stage gathers before it computes anything: the root unit and the first block."""
        return self.root + self.largest_unit

    def rebuilding(self, level: Any) -> Any:
        from partita.types import Recompute

        return self.full_rebuilding if level is Recompute.FULL else self.selective_rebuilding


def unit_bytes(costs: CostTable) -> np.ndarray:
    """int64[L]: trainable bytes of the weights that only block l's segment (its nodes and those
    after it, up to the next block) reads: its FSDP2 unit."""
    return _blocks_of(costs).units.astype(np.int64)


class _Blocks:
    """What ``segment_totals`` reads of one table, computed once per table (the planner asks for
    thousands of ranges of each)."""

    def __init__(self, costs: CostTable):
        self.scalars: dict[tuple[int, int, float], SegmentTotals] = {}  # one stage's, by (start, stop, trainable)
        ranges = np.asarray(costs.block_ranges, dtype=np.int64).reshape(-1, 2)
        self.count = len(ranges)
        self.starts, self.stops = ranges[:, 0], ranges[:, 1]
        self.activation = np.concatenate([[0.0], np.cumsum(np.asarray(costs.activation_bytes, dtype=np.float64))])
        rebuilt = np.maximum(np.asarray(costs.activation_bytes) - np.asarray(costs.saved_bytes), 0.0)
        self.rebuilt = np.concatenate([[0.0], np.cumsum(rebuilt)])
        self.cut = np.asarray(costs.cut_bytes, dtype=np.float64)
        self.block_inputs = np.asarray(costs.block_input_bytes, dtype=np.float64)
        self.block_outputs = np.asarray(costs.block_output_bytes, dtype=np.float64)
        self.inputs_prefix = np.concatenate([[0.0], np.cumsum(self.block_inputs)])
        if not self.count:
            return
        # a block's segment when another block follows it in the stage: up to that block's start
        self.inner_end = np.append(self.starts[1:], self.stops[-1])
        self.inner_max = {
            name: _range_max(prefix[self.inner_end] - prefix[self.starts])
            for name, prefix in (("activation", self.activation), ("rebuilt", self.rebuilt))
        }
        self.units = self._units(costs)
        self.units_prefix = np.concatenate([[0.0], np.cumsum(self.units)])
        self.units_max = _range_max(self.units)

    def _units(self, costs: CostTable) -> np.ndarray:
        owners, uses = costs._flat_param_uses
        count = len(costs.param_bytes)
        first = np.full(count, np.iinfo(np.int64).max)
        last = np.full(count, -1)
        np.minimum.at(first, owners, uses)
        np.maximum.at(last, owners, uses)
        block = np.searchsorted(self.starts, first, side="right") - 1
        inside = (last >= 0) & (block >= 0) & np.asarray(costs.param_trainable, dtype=bool)
        inside &= last < self.inner_end[np.clip(block, 0, self.count - 1)]
        weights = np.asarray(costs.param_bytes, dtype=np.float64)[inside]
        return np.bincount(block[inside], weights=weights, minlength=self.count).astype(np.float64)


_TABLES: weakref.WeakKeyDictionary[CostTable, _Blocks] = weakref.WeakKeyDictionary()


def _blocks_of(costs: CostTable) -> _Blocks:
    found = _TABLES.get(costs)
    if found is None:
        found = _TABLES[costs] = _Blocks(costs)
    return found


def segment_totals(costs: CostTable, starts: Any, stops: Any, trainable_bytes: Any) -> SegmentTotals:
    """The per-block terms of the stages ``[starts, stops)`` (node positions, arrays or scalars),
    whose trainable bytes are ``trainable_bytes`` (what the memory model counts for them). One
    stage's (scalars) are remembered with the table: the planner asks for the same stages again and
    again while it drafts plans."""
    t = _blocks_of(costs)
    if np.ndim(starts) == 0 and np.ndim(stops) == 0 and np.ndim(trainable_bytes) == 0:
        key = (int(starts), int(stops), float(trainable_bytes))
        found = t.scalars.get(key)
        if found is None:
            found = t.scalars[key] = SegmentTotals(*(float(v) for v in dataclasses.astuple(_segment_totals(t, *key))))
        return found
    return _segment_totals(t, starts, stops, trainable_bytes)


def _segment_totals(t: _Blocks, starts: Any, stops: Any, trainable_bytes: Any) -> SegmentTotals:
    a = np.asarray(starts, dtype=np.int64)
    b = np.asarray(stops, dtype=np.int64)
    trainable = np.asarray(trainable_bytes, dtype=np.float64)
    whole_a, whole_r = t.activation[b] - t.activation[a], t.rebuilt[b] - t.rebuilt[a]
    if not t.count:
        return SegmentTotals(t.cut[a], whole_a, whole_r, trainable, trainable, trainable, 0.0 * trainable)
    s, e = t.starts, t.stops
    l0 = np.searchsorted(s, a, side="left")  # the first block starting in the stage
    l1 = np.searchsorted(e, b, side="right")  # blocks ending in it: l0 .. l1 - 1 are whole
    has = l1 > l0
    first, last = np.minimum(l0, t.count - 1), np.clip(l1 - 1, 0, t.count - 1)

    def per_segment(prefix: np.ndarray, inner_max: np.ndarray) -> Any:
        head = np.where(has & (a < s[first]), prefix[s[first]] - prefix[a], 0.0)
        tail = np.where(has & (e[last] < b), prefix[b] - prefix[e[last]], 0.0)
        own = prefix[e[last]] - prefix[s[last]]
        inner = np.where(last > first, inner_max[first, np.maximum(last, first)], 0.0)
        return np.where(has, np.maximum.reduce([head, tail, own, inner]), prefix[b] - prefix[a])

    block_inputs = t.inputs_prefix[np.maximum(l1, l0)] - t.inputs_prefix[l0]
    block_inputs = block_inputs - np.where(has & (s[first] == a), t.block_inputs[first], 0.0)
    tail_input = np.where(has & (e[last] < b), t.block_outputs[last], 0.0)
    kept = t.cut[a] + np.where(has, block_inputs + tail_input, 0.0)

    in_units = np.where(has, t.units_prefix[np.maximum(l1, l0)] - t.units_prefix[l0], 0.0)
    largest = np.where(has, t.units_max[first, np.maximum(l1, first + 1)], 0.0)
    root = np.maximum(trainable - in_units, 0.0)
    gathered = root + np.minimum(l1 - l0, 2).clip(min=0) * largest
    weights = np.where(has, np.maximum(root, largest), trainable)
    return SegmentTotals(
        kept,
        per_segment(t.activation, t.inner_max["activation"]),
        per_segment(t.rebuilt, t.inner_max["rebuilt"]),
        gathered,
        weights,
        root,
        largest,
    )


def _range_max(values: np.ndarray) -> np.ndarray:
    """out[j, i]: the largest of values[j:i] (0 where i <= j); (L + 1) x (L + 1)."""
    count = len(values)
    out = np.zeros((count + 1, count + 1))
    for j in range(count):
        out[j, j + 1 :] = np.maximum.accumulate(values[j:])
    return out
