"""What each recomputation level keeps and costs: the per-node arrays and the per-level formulas.

A stage runs at one ``Recompute`` level (``partita.types.choices``). Per micro-batch, with ``A``
the bytes its nodes keep for backward (``activation_bytes``), ``I`` its input (``cut_bytes`` at
its start), ``S`` the outputs selective recomputation keeps (``saved_bytes``), ``R`` the part of
``A`` it rebuilds (``recomputed_bytes``) and ``F`` the stage's forward seconds::

    level       kept per micro-batch in flight   added while one micro-batch rebuilds   seconds added to backward
    none        A                                0                                      0
    selective   I + S                            max(A - S, 0)                          F of the nodes not kept
    full        I                                A                                      F

for a stage of one segment. A stage that holds whole blocks runs by segment
(``partita.types.segments``): ``I`` is then every segment's input (relayed values once) and the
second column the largest segment's, one segment rebuilt at a time
(``partita.cost.segment_memory``); the seconds are the same.

``torch.utils.checkpoint`` keeps the stage's inputs (``I``); with selective contexts it also
caches the output of every op its policy keeps (``S``, whether or not backward reads it), and in
backward it runs the stage's forward again, the kept ops taking their cached outputs: the tensors
rebuilt (``R``, or all of ``A`` without a policy) are alive until that micro-batch's backward has
used them. Since ``A - R`` are kept outputs, ``S >= A - R``: selective never keeps less than full.
The recomputation takes each cached output out of the cache as it reaches its op, and the stage's
graph drops a value after its last use, so the kept outputs backward does not read (``S - (A - R)``:
a row-parallel matmul's output before its residual addition, the logits before the loss) are gone
once the micro-batch is rebuilt: it then holds ``I + A``, the larger of that and ``I + S`` at its
peak. Measured on an H100 (``bench/results/gpu``): one selective micro-batch in flight peaks where
none and full do; counting ``I + S + R`` over-predicted those stages by 10-14%.

Which nodes selective keeps is ``partita.capturing.recompute.keeps_node``, the op policy the
runtime's checkpoint contexts apply (``keeps_dispatched``). The memory model applies the first two
columns (``partita.cost.memory.kept_per_microbatch``, ``rebuilt_bytes``); ``extra_backward_s`` is
the third.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from partita.capturing.recompute import keeps_node
from partita.cost.table import activation_bytes, value_bytes
from partita.types import OpGraph, Precision, Recompute
from partita.types.graph import graph_memo

__all__ = ["SelectiveArrays", "extra_backward_s", "kept_mask", "selective_arrays"]


class SelectiveArrays(NamedTuple):
    """A CostTable's selective-recomputation arrays (``CostTable`` documents them)."""

    saved_bytes: np.ndarray  # int64[n]
    recomputed_bytes: np.ndarray  # int64[n]
    selective_recompute_s: np.ndarray  # float64[n]


@graph_memo
def kept_mask(graph: OpGraph) -> np.ndarray:
    """bool[n]: whether selective recomputation keeps node n's output (``keeps_node``; remembered per
    graph, read-only)."""
    mask = np.array([keeps_node(graph, node) for node in graph.nodes], dtype=bool)
    mask.flags.writeable = False
    return mask


def selective_arrays(
    graph: OpGraph,
    microbatch_size: int,
    forward_s: Any,
    precision: Precision = Precision.FP32,
    shards: np.ndarray | None = None,
    measured_activation_bytes: Any = None,
) -> SelectiveArrays:
    """The selective arrays of ``graph`` at ``microbatch_size``, in ``precision`` (``shards`` as
    ``partita.cost.table.value_bytes`` takes it), from the table's ``forward_s``.

    ``measured_activation_bytes``: a profiled table's activation bytes; the rebuilt part of each
    node's is then its modelled share (``R / A`` of the model), as ``partita.cost.tensor_parallel``
    scales measured bytes."""
    kept = kept_mask(graph)
    saved = np.where(kept, value_bytes(graph, microbatch_size, precision, shards), 0)
    rebuilt = activation_bytes(graph, microbatch_size, precision, shards, skip=kept)
    if measured_activation_bytes is not None:
        whole = np.asarray(activation_bytes(graph, microbatch_size, precision, shards), dtype=np.float64)
        ratio = np.divide(rebuilt, whole, out=np.ones_like(whole), where=whole > 0)
        rebuilt = np.round(np.asarray(measured_activation_bytes, dtype=np.float64) * ratio).astype(np.int64)
    seconds = np.where(kept, 0.0, np.asarray(forward_s, dtype=np.float64))
    return SelectiveArrays(saved.astype(np.int64), np.asarray(rebuilt, dtype=np.int64), seconds)


def extra_backward_s(level: Recompute, forward_s: Any, selective_s: Any) -> Any:
    """Seconds the recomputation adds to a stage's backward per micro-batch."""
    if level is Recompute.FULL:
        return 1 * forward_s
    if level is Recompute.SELECTIVE:
        return 1 * selective_s
    return 0 * forward_s
