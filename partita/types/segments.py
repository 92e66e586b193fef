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

from dataclasses import dataclass

from partita.types.graph import Block, OpGraph

__all__ = ["Segment", "stage_segments", "whole_blocks"]


@dataclass(frozen=True)
class Segment:
    """Nodes ``[start, stop)`` of one stage's chain; ``block`` is the whole block it runs, or None
    for the nodes around the blocks."""

    start: int
    stop: int
    block: Block | None = None


def stage_segments(graph: OpGraph, start: int, stop: int) -> tuple[Segment, ...]:
    """The segments of the stage ``[start, stop)`` of ``graph`` (see the module docstring)."""
    whole = [b for b in graph.blocks if start <= b.start and b.stop <= stop]
    if not whole:
        return (Segment(start, stop),)
    segments = [Segment(start, whole[0].start)] if start < whole[0].start else []
    for block, after in zip(whole, [*whole[1:], None]):
        segments.append(Segment(block.start, after.start if after is not None else block.stop, block))
    if whole[-1].stop < stop:
        segments.append(Segment(whole[-1].stop, stop))
    return tuple(segments)


def whole_blocks(graph: OpGraph, start: int, stop: int) -> int:
    """How many whole blocks the stage ``[start, stop)`` holds (``StagePlan.blocks``)."""
    return sum(start <= b.start and b.stop <= stop for b in graph.blocks)
