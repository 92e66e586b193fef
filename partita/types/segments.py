"""How a stage runs by block: its node range cut at the repeated blocks it holds whole.

A stage ``[start, stop)`` of the graph runs as a chain of *segments*: the nodes before its first
whole block (the embedding, a block cut at the stage's start), each whole block (with the
root-level nodes after it, up to the next block), and the nodes after its last whole block (the
final norm, the head, the loss, a block cut at the stage's end). The runtime runs each segment
as a unit -- a sharded stage gathers one block's weights at a time (``partita.runtime.sharding``),
recomputation keeps each segment's input and rebuilds one segment at a time
(``partita.runtime.segments``) -- and the cost model counts memory the same way
(``partita.cost.memory``). A stage without a whole block is one segment: it runs whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partita.types.graph import Block, OpGraph

__all__ = ["Segment", "segment_ranges", "stage_segments", "whole_blocks"]


@dataclass(frozen=True)
class Segment:
    """Nodes ``[start, stop)`` of one stage's chain; ``block`` is the whole block it runs, or None
    for the nodes around the blocks."""

    start: int
    stop: int
    block: Block | None = None


def segment_ranges(blocks: Sequence[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int, int | None]]:
    """(start, stop, block index or None) of the segments of the stage ``[start, stop)``, given the
    blocks' node ranges in order (``OpGraph.blocks``, or a cost table's ``block_ranges``)."""
    whole = [k for k, (a, b) in enumerate(blocks) if start <= a and b <= stop]
    if not whole:
        return [(start, stop, None)]
    first, last = blocks[whole[0]], blocks[whole[-1]]
    segments = [(start, int(first[0]), None)] if start < first[0] else []
    for k, after in zip(whole, [*whole[1:], None]):
        segments.append((int(blocks[k][0]), int(blocks[after][0] if after is not None else blocks[k][1]), k))
    if last[1] < stop:
        segments.append((int(last[1]), stop, None))
    return segments


def stage_segments(graph: OpGraph, start: int, stop: int) -> tuple[Segment, ...]:
    """The segments of the stage ``[start, stop)`` of ``graph`` (see the module docstring)."""
    ranges = segment_ranges([(b.start, b.stop) for b in graph.blocks], start, stop)
    return tuple(Segment(a, b, None if k is None else graph.blocks[k]) for a, b, k in ranges)


def whole_blocks(graph: OpGraph, start: int, stop: int) -> int:
    """How many whole blocks the stage ``[start, stop)`` holds (``StagePlan.blocks``)."""
    return sum(start <= b.start and b.stop <= stop for b in graph.blocks)
