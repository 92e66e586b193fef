"""Where stage boundaries may fall, and the chain of blocks the search works on.

Glossary
--------
cut         position c in [0, num_nodes]: between node c - 1 and node c (CostTable's axis c).
crosses     the value of node p crosses cut c when p < c <= last_use(p): the runtime stage
            builder ships every value produced before a boundary and read after it, each
            view as its own contiguous copy (SymInts it recomputes from the graph inputs,
            which every stage has).
storage     the memory a value lives in. A view (``is_view``: views, no-op casts, in-place
            ops, getitem of a view's list) lives in its first tensor input's storage; any
            other node owns its storage, and so does a getitem of a higher-order op's tuple
            (each element is a separate tensor). ``partita.cost.table.storage_roots`` differs
            only there: it is about bytes kept alive, and a tuple's elements die together.
block       a run of consecutive nodes between two chosen cuts; stages are ranges of blocks.

A cut is legal when the stage builder can ship exactly what crosses it, once:
1. no container crosses: a tuple/list (a multi-output op, a value read through
   ``operator.getitem``) is not a tensor and has no wire format;
2. no other non-tensor crosses, except a SymInt derivable from graph inputs alone
   (``aten.sym_size.int`` of an input, and arithmetic on those), which is recomputed;
3. no view of a parameter crosses: shipping it would send weights every micro-batch, and
   the weight's gradient would then arrive as an activation gradient;
4. no storage crosses twice: when a tensor and a view of it (or two views of one tensor)
   both cross, each would be shipped as its own copy, doubling the bytes and breaking
   aliasing (a later in-place op on the base would not reach the copied view). This also
   covers a cut just after a view whose base is still read later.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from partita.checks import positive_int
from partita.cost.memory import first_gradient_bytes, steps_foreach
from partita.cost.segment_memory import SegmentTotals, segment_totals
from partita.errors import InputError
from partita.planning.range_matrices import range_last, range_max, range_sums
from partita.types import CostTable, OpGraph
from partita.types.graph import reads_samples

__all__ = [
    "BlockCosts",
    "block_costs",
    "coarsen",
    "layer_boundaries",
    "legal_cuts",
    "range_last",
    "range_max",
    "range_sums",
]

_GETITEM = "operator.getitem"
# Relative weight of a boundary's cut bytes against a block's imbalance in coarsen():
# a boundary moved by ~0.35 of a block's target cost to halve the bytes it cuts is a fair trade.
_CUT_WEIGHT = 0.25
# Predecessors considered in coarsen()'s DP: blocks up to this many targets long (the
# quadratic imbalance makes longer ones worse than two blocks, unless nothing lies between).
_WINDOW_TARGETS = 3.0


# ----------------------------------------------------------------------------- legal cuts


def legal_cuts(graph: OpGraph) -> np.ndarray:
    """bool[num_nodes + 1]: whether a stage boundary may fall at cut c (module docstring, rules 1-4).

    Each value blocks the cuts it crosses, ``(p, last_use(p)]``, through a difference array,
    so this is linear in the graph size (plus a sort per shared storage).
    """
    num_nodes = graph.num_nodes
    last_use = np.array([max(n.consumers, default=-1) for n in graph.nodes], dtype=np.int64)
    roots, param_view = _storage(graph)
    derivable = _derivable_symints(graph)
    blocked = np.zeros(num_nodes + 2, dtype=np.int64)  # difference array over cuts
    groups: dict[int, list[int]] = {}
    for node in graph.nodes:
        p = node.index
        if last_use[p] <= p:
            continue  # read by nobody: crosses nothing
        if _must_not_cross(graph, p, param_view, derivable):
            blocked[p + 1] += 1
            blocked[last_use[p] + 1] -= 1
        elif node.outputs and roots[p] is not None:
            groups.setdefault(roots[p], []).append(p)
    for members in groups.values():
        if len(members) > 1:
            _block_shared_storage(members, last_use, blocked)
    legal = np.cumsum(blocked)[: num_nodes + 1] == 0
    legal[0] = legal[num_nodes] = True
    return legal


def per_sample_cuts(graph: OpGraph) -> np.ndarray:
    """bool[num_nodes + 1]: whether every tensor crossing cut c can be split by sample, so that
    the stages on its two sides may have different replica counts (``partita.planning.uneven``).

    A crossing tensor splits by sample when its batch dim's size is the batch itself, or when it
    has no batch dim and does not read the samples (sent whole: Llama's rotary tables). A batch dim
    of several batch entries merged (``(B*T, H)`` from a reshape) may or may not be batch-major,
    which shapes do not tell; a tensor without batch dim computed from the samples (an auxiliary
    loss summed across layers, ``types.graph.reads_samples``) holds one replica's samples only.
    Cuts either crosses are False (the runtime refuses them between different replica counts).
    Conservative: a view that the runtime would re-make in the next stage instead of sending
    counts as crossing.
    """
    num_nodes = graph.num_nodes
    reads = reads_samples(graph)
    blocked = np.zeros(num_nodes + 2, dtype=np.int64)  # difference array over cuts
    for node in graph.nodes:
        p, last = node.index, max(node.consumers, default=-1)
        unsplittable = any(
            t.merges_samples(graph.batch_size) or (t.batch_dim is None and reads[p]) for t in node.outputs
        )
        if last > p and unsplittable:
            blocked[p + 1] += 1
            blocked[last + 1] -= 1
    return np.cumsum(blocked)[: num_nodes + 1] == 0


def _storage(graph: OpGraph) -> tuple[list[int | None], np.ndarray]:
    """Per node: its storage root (node index, ``-(j + 1)`` for graph input j, None for a view
    of a parameter or constant), and whether it is a view of a parameter."""
    roots: list[int | None] = []
    param_view = np.zeros(graph.num_nodes, dtype=bool)
    for node in graph.nodes:
        source = next((p for p in node.inputs if graph.nodes[p].outputs), None)
        owns = not node.is_view or (node.target == _GETITEM and source is not None and not graph.nodes[source].is_view)
        if owns:
            roots.append(node.index)
        elif source is not None:
            roots.append(roots[source])
            param_view[node.index] = param_view[source]
        elif node.graph_inputs:
            roots.append(-(node.graph_inputs[0] + 1))
        else:
            roots.append(None)
            param_view[node.index] = bool(node.params)
    return roots, param_view


def _derivable_symints(graph: OpGraph) -> np.ndarray:
    """bool[n]: node n is a non-tensor computed from graph inputs only (a SymInt such as
    ``aten.sym_size.int(input_ids, 0)``, or arithmetic on those), so any stage can recompute it."""
    result = np.zeros(graph.num_nodes, dtype=bool)
    for node in graph.nodes:
        result[node.index] = (
            not node.outputs and not node.params and not node.is_higher_order and all(result[i] for i in node.inputs)
        )
    return result


def _must_not_cross(graph: OpGraph, p: int, param_view: np.ndarray, derivable: np.ndarray) -> bool:
    node = graph.nodes[p]
    if not node.outputs:
        return not derivable[p]  # rule 2
    is_container = len(node.outputs) > 1 or any(graph.nodes[c].target == _GETITEM for c in node.consumers)
    return is_container or bool(param_view[p])  # rules 1 and 3


def _block_shared_storage(members: list[int], last_use: np.ndarray, blocked: np.ndarray) -> None:
    """Rule 4: block the cuts where two or more values of one storage cross at once."""
    # Value p crosses cuts [p + 1, last_use + 1); sweep the interval ends, exits first at a tie.
    events = sorted([(p + 1, 1) for p in members] + [(int(last_use[p]) + 1, -1) for p in members])
    live = 0
    for (position, delta), (following, _) in zip(events, events[1:] + [(events[-1][0], 0)]):
        live += delta
        if live >= 2 and following > position:
            blocked[position] += 1
            blocked[following] -= 1


# ----------------------------------------------------------------------------- coarsening


def coarsen(graph: OpGraph, costs: CostTable, *, max_blocks: int = 256) -> np.ndarray:
    """Block boundaries: sorted legal cut positions, first 0, last num_nodes, at most ``max_blocks`` blocks.

    When the graph has no more than ``max_blocks`` legal blocks, every legal cut is a boundary
    (the finest chain is the search's best input). Otherwise a DP chooses boundaries among
    candidates: the legal cuts whose cut bytes are a local minimum (between transformer layers
    only the hidden state crosses) and the legal cuts around each node costlier than a block.
    With ``t`` the target cost of a block it minimises::

        sum over blocks of ((cost - t) / t)**2  +  _CUT_WEIGHT * sum over boundaries of cut_bytes / ref

    (``cost`` = forward_s + backward_s of the block's nodes, ``ref`` the median candidate cut
    bytes). Some boundaries are required: the legal starts of repeated layers (all of them when
    they leave room for the rest, else every k-th: ``_required_layer_starts``), since the best stage splits cut between layers even where
    balance alone would merge a small embedding block into layer 0; and the cuts around a node
    costing two targets or more (a big LM head is its own block, whatever its output's size).
    ``t`` is the total over ``max_blocks``, not counting nodes costlier than ``t``; it grows
    until the answer has at most ``max_blocks`` blocks. Ties go to the earliest position, so
    the result is deterministic.
    """
    max_blocks = positive_int(max_blocks, "max_blocks")
    if costs.num_nodes != graph.num_nodes:
        raise InputError(
            f"the CostTable has {costs.num_nodes} nodes but the graph {graph.num_nodes}: "
            "compute the costs of this graph"
        )
    legal = np.flatnonzero(legal_cuts(graph))
    if len(legal) - 1 <= max_blocks:
        return legal
    work = np.asarray(costs.forward_s, dtype=np.float64) + np.asarray(costs.backward_s, dtype=np.float64)
    if work.sum() <= 0:
        work = np.ones_like(work)  # no costs known: balance node counts
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    cut = np.asarray(costs.cut_bytes, dtype=np.float64)
    minima = _local_minima(legal, cut)
    layers = _required_layer_starts(
        np.intersect1d(np.asarray(layer_boundaries(graph), dtype=np.int64), legal), max_blocks
    )
    num_wanted = max_blocks
    while num_wanted >= 1:
        target = _block_target(work, num_wanted)
        required = np.union1d(layers, _cuts_around(work >= 2 * target, legal))
        positions = np.union1d(np.union1d(minima, _cuts_around(work >= target, legal)), required)
        chosen = _chain_dp(positions, np.isin(positions, required), prefix, cut, target)
        if len(chosen) - 1 <= max_blocks:
            return chosen
        # Too many blocks (costly nodes forced extra ones): aim lower, at least one fewer.
        num_wanted = min(num_wanted - 1, int(num_wanted * max_blocks / (len(chosen) - 1)))
    raise AssertionError("with one wanted block only the layer starts are required")


DEFAULT_MAX_BLOCKS = 128


def default_max_blocks(graph: OpGraph) -> int:
    """``DEFAULT_MAX_BLOCKS``, or for a model of more layers than those blocks keep every layer start of
    (``_required_layer_starts``: an eighth of the blocks left around the layers) the least count
    that keeps them all, so that a stage may hold any number of layers. At 128 blocks a GPT of 128
    layers kept every other layer start, and no plan of 64 rank groups x 2 stages of one layer
    (interleaved 1F1B, as Megatron-LM interleaves its 1T model) could be searched."""
    num_layers = len(np.intersect1d(layer_boundaries(graph), np.flatnonzero(legal_cuts(graph))))
    blocks = DEFAULT_MAX_BLOCKS
    while num_layers > blocks - max(2, blocks // 8):
        blocks += 1
    return blocks


def _required_layer_starts(layers: np.ndarray, max_blocks: int) -> np.ndarray:
    """The layer starts ``coarsen`` requires: every one while they leave an eighth of the blocks
    (at least two) for what lies around the layers (embeddings, a head, costly nodes); else every
    k-th, the least k that takes at most half the blocks, so that a stage may hold any multiple of
    k layers. Without them, 96 layers in 128 blocks are cut mid-layer: a stage of whole layers
    (Megatron's 3 per stage at 310B) is then no range of blocks, and the search misses it."""
    if len(layers) <= max_blocks - max(2, max_blocks // 8):
        return layers
    if max_blocks // 2 == 0:
        return layers[:0]
    return layers[:: -(-len(layers) // (max_blocks // 2))]


def _local_minima(legal: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Legal cuts whose cut bytes are <= both legal neighbours' (plateaus included), and the ends."""
    values = cut[legal]
    before = np.concatenate([[np.inf], values[:-1]])
    after = np.concatenate([values[1:], [np.inf]])
    keep = (values <= before) & (values <= after)
    keep[0] = keep[-1] = True
    return legal[keep]


def _block_target(work: np.ndarray, num_blocks: int) -> float:
    """Total cost / num_blocks, where nodes costlier than a block are blocks of their own
    and leave the rest of the total to the other blocks."""
    total = float(work.sum())
    target = total / num_blocks
    for _ in range(3):  # a few fixed-point steps; the DP is robust to a rough target
        costly = work >= target
        rest, num_rest = total - float(work[costly].sum()), num_blocks - int(costly.sum())
        if rest <= 0 or num_rest < 1:
            break
        target = rest / num_rest
    return target


def _cuts_around(nodes: np.ndarray, legal: np.ndarray) -> np.ndarray:
    """The nearest legal cut at or before, and at or after, each node of the mask ``nodes``."""
    positions = np.flatnonzero(nodes)
    before = legal[np.searchsorted(legal, positions, side="right") - 1]
    after = legal[np.searchsorted(legal, positions + 1, side="left")]
    return np.union1d(before, after)


def _chain_dp(
    positions: np.ndarray, required: np.ndarray, prefix: np.ndarray, cut: np.ndarray, target: float
) -> np.ndarray:
    """The subset of ``positions`` (sorted, first 0, last num_nodes) that keeps every ``required``
    one and minimises the objective in coarsen()'s docstring. best[i] is the least objective of
    a chain ending at positions[i]:

        best[i] = min over j < i of best[j] + ((P[i] - P[j] - t) / t)**2 + pen[i]

    with P the prefix cost and pen the boundary penalty; j ranges over blocks of at most
    _WINDOW_TARGETS targets (always including i - 1) and never skips a required position."""
    at = prefix[positions]
    inner = cut[positions[1:-1]]
    ref = float(np.median(inner)) if len(inner) and np.median(inner) > 0 else 1.0
    penalty = _CUT_WEIGHT * cut[positions] / ref
    penalty[0] = penalty[-1] = 0.0
    m = len(positions)
    best = np.full(m, np.inf)
    best[0] = 0.0
    parent = np.zeros(m, dtype=np.int64)
    starts = np.searchsorted(at, at - _WINDOW_TARGETS * target, side="left")
    last_required = 0
    for i in range(1, m):
        lo = max(min(int(starts[i]), i - 1), last_required)
        scores = best[lo:i] + ((at[i] - at[lo:i] - target) / target) ** 2
        k = int(np.argmin(scores))  # first minimum: earliest predecessor wins ties
        best[i] = scores[k] + penalty[i]
        parent[i] = lo + k
        if required[i]:
            last_required = i
    chosen = [m - 1]
    while chosen[-1] != 0:
        chosen.append(int(parent[chosen[-1]]))
    return positions[np.array(chosen[::-1])].astype(np.int64)


# ----------------------------------------------------------------------------- block costs


@dataclass(frozen=True, eq=False)
class BlockCosts:
    """A CostTable summed over the blocks of a chain: what the stage search sees.

    Axes:
        k     block, length K = ``num_blocks``: block k is nodes [boundaries[k], boundaries[k+1]).
        b     block boundary, length K + 1: boundary b is where block b starts (b = K: the end).
        j, i  a stage made of blocks [j, i), 0 <= j < i <= K; entries with i <= j are 0.

    Arrays (numpy, per micro-batch, like the CostTable they come from):
        boundaries[b]              node position (cut) of boundary b.
        forward_s[k], backward_s[k], backward_weight_s[k], activation_bytes[k], saved_bytes[k],
        selective_recompute_s[k]
                                   sums over the nodes of block k (the last two: selective
                                   recomputation's, ``partita.cost.recompute``).
        max_output_bytes[k]        largest new output of one node of block k (working memory).
        max_param_bytes[k]         largest trainable parameter a node of block k reads (the
                                   optimizer step's temporaries scale with it).
        last_grad_bytes[k]         trainable bytes read by the last node of block k that reads
                                   any (the first gradients its backward makes); 0 if none.
        cut_bytes[b]               CostTable.cut_bytes at boundary b (0 at both ends).
        param_bytes_matrix[j, i]   bytes of every parameter and buffer that a stage of blocks
                                   [j, i) holds: those read by any of its nodes, tied ones once.
        trainable_bytes_matrix[j, i]  the part of those that gets gradients and optimizer state.
        tied_matrix[j, i]          whether a stage of blocks [j, i) reads a trainable parameter
                                   that a block outside it reads too (tied weights split over
                                   stages): such a stage replicates (``build.rank_group_memory``).
    """

    boundaries: np.ndarray
    forward_s: np.ndarray
    backward_s: np.ndarray
    backward_weight_s: np.ndarray
    activation_bytes: np.ndarray
    max_output_bytes: np.ndarray
    max_param_bytes: np.ndarray
    cut_bytes: np.ndarray
    last_grad_bytes: np.ndarray
    param_bytes_matrix: np.ndarray
    trainable_bytes_matrix: np.ndarray
    tied_matrix: np.ndarray
    saved_bytes: np.ndarray
    selective_recompute_s: np.ndarray
    foreach_step: bool = False  # the optimizer's step on this device (``partita.cost.memory.steps_foreach``)
    segments: SegmentTotals | None = None  # [j, i]: a stage's per-block terms (``partita.cost.segment_memory``)

    @property
    def num_blocks(self) -> int:
        return len(self.boundaries) - 1

    def param_bytes(self, start: int, stop: int, *, trainable: bool = False) -> int:
        """Parameter bytes held by a stage of blocks [start, stop) (only trainable ones if asked)."""
        matrix = self.trainable_bytes_matrix if trainable else self.param_bytes_matrix
        return int(matrix[start, stop])

    @functools.cached_property
    def stage_totals(self) -> dict[str, np.ndarray]:
        """(K+1, K+1) matrices [j, i] over the stages of blocks [j, i): the time sums ``forward_s``,
        ``backward_s``, ``compute_s`` (their sum), ``selective_recompute_s`` and ``valid`` (j < i), the totals that
        ``partita.cost.memory.memory_from_totals`` takes, and ``work_prefix_s`` (K+1,): the prefix sums
        of the blocks' compute (``partition``'s banded DPs). They depend on the blocks alone, so every
        config searched at this micro-batch size shares them (computed once, on first use)."""
        cut = np.asarray(self.cut_bytes, dtype=np.float64)
        j, i = np.meshgrid(np.arange(self.num_blocks + 1), np.arange(self.num_blocks + 1), indexing="ij")
        forward, backward = range_sums(self.forward_s), range_sums(self.backward_s)
        return dict(
            forward_s=forward,
            backward_s=backward,
            compute_s=forward + backward,
            work_prefix_s=np.concatenate([[0.0], np.cumsum(self.forward_s + self.backward_s)]),
            valid=j < i,
            param_bytes=self.param_bytes_matrix,
            trainable_bytes=self.trainable_bytes_matrix,
            selective_recompute_s=range_sums(self.selective_recompute_s),
            activation_bytes=range_sums(self.activation_bytes),
            saved_bytes=range_sums(self.saved_bytes),
            stage_input_bytes=cut[j],
            boundary_bytes=cut[j] + cut[i],
            largest_output_bytes=range_max(self.max_output_bytes),
            largest_param_bytes=range_max(self.max_param_bytes),
            first_grad_bytes=range_last(self.last_grad_bytes),
            foreach_step=self.foreach_step,
            segments=self.segments,
        )


def block_costs(costs: CostTable, boundaries) -> BlockCosts:
    """Sum ``costs`` over the blocks between ``boundaries`` (sorted cuts, first 0, last num_nodes)."""
    b = np.asarray(boundaries, dtype=np.int64)
    n = costs.num_nodes
    if b.ndim != 1 or len(b) < 2 or b[0] != 0 or b[-1] != n or np.any(np.diff(b) <= 0):
        raise InputError(
            f"block boundaries must rise strictly from 0 to num_nodes={n}, got {b.tolist()[:8]}"
            f"{'...' if len(b) > 8 else ''}: pass the output of coarsen()"
        )
    starts = b[:-1]

    def per_block(values, dtype) -> np.ndarray:
        return np.add.reduceat(np.asarray(values, dtype=dtype), starts)

    params = _parameter_parts(costs, b)
    j, i = np.meshgrid(b, b, indexing="ij")
    segments = segment_totals(costs, j, np.maximum(i, j), params["trainable_bytes_matrix"])
    return BlockCosts(
        boundaries=b,
        forward_s=per_block(costs.forward_s, np.float64),
        backward_s=per_block(costs.backward_s, np.float64),
        backward_weight_s=per_block(costs.backward_weight_s, np.float64),
        activation_bytes=per_block(costs.activation_bytes, np.int64),
        saved_bytes=per_block(costs.saved_bytes, np.int64),
        selective_recompute_s=per_block(costs.selective_recompute_s, np.float64),
        max_output_bytes=np.maximum.reduceat(np.asarray(costs.output_bytes, dtype=np.int64), starts),
        cut_bytes=np.asarray(costs.cut_bytes, dtype=np.int64)[b],
        foreach_step=steps_foreach(costs.device),
        segments=segments,
        **params,
    )


# The parameter-derived fields of recent block_costs calls, by what they depend on: the tables of
# one planning run at different micro-batch sizes hold the same parameters (the search asks for
# dozens of sizes, and these fields are most of a table's blocking). A few chains at a time.
_PARAMETER_PARTS: dict[bytes, dict[str, np.ndarray]] = {}
_PARAMETER_PARTS_KEPT = 8


def _parameter_parts(costs: CostTable, boundaries: np.ndarray) -> dict[str, np.ndarray]:
    """The BlockCosts fields that depend on the parameters and the boundaries alone (read-only
    arrays, shared by every table with the same parameters, bytes and uses)."""
    uses = [np.asarray(u, dtype=np.int64) for u in costs.param_uses]
    key = b"|".join(
        [
            boundaries.tobytes(),
            np.asarray(costs.param_bytes, dtype=np.int64).tobytes(),
            np.asarray(costs.param_trainable, dtype=bool).tobytes(),
            np.array([len(u) for u in uses], dtype=np.int64).tobytes(),
            np.concatenate(uses).tobytes() if uses else b"",
        ]
    )
    if key not in _PARAMETER_PARTS:
        b = boundaries
        param_matrix, trainable_matrix = _held_param_matrices(costs, b)
        parts = dict(
            max_param_bytes=_largest_trainable_param(costs, b),
            last_grad_bytes=np.array(
                [first_gradient_bytes(costs, [(int(b[k]), int(b[k + 1]))]) for k in range(len(b) - 1)], dtype=np.int64
            ),
            param_bytes_matrix=param_matrix,
            tied_matrix=_tied_matrix(costs, b),
            trainable_bytes_matrix=trainable_matrix,
        )
        for array in parts.values():
            array.flags.writeable = False
        while len(_PARAMETER_PARTS) >= _PARAMETER_PARTS_KEPT:
            del _PARAMETER_PARTS[next(iter(_PARAMETER_PARTS))]
        _PARAMETER_PARTS[key] = parts
    return _PARAMETER_PARTS[key]


def _largest_trainable_param(costs: CostTable, boundaries: np.ndarray) -> np.ndarray:
    """Per block, the bytes of the largest trainable parameter any of its nodes reads."""
    largest = np.zeros(len(boundaries) - 1, dtype=np.int64)
    for p, uses in enumerate(costs.param_uses):
        if not costs.param_trainable[p] or len(uses) == 0:
            continue
        blocks = np.searchsorted(boundaries, np.asarray(uses), side="right") - 1
        np.maximum.at(largest, blocks, int(costs.param_bytes[p]))
    return largest


def _tied_matrix(costs: CostTable, boundaries: np.ndarray) -> np.ndarray:
    """bool (K+1, K+1) [j, i]: whether blocks [j, i) read some trainable parameter that a block
    outside them reads too. With u_1 < ... < u_m the blocks that read a parameter (m >= 2), [j, i)
    splits it unless it reads none of them (it lies in a gap, as in ``_held_param_matrices``) or
    all of them (j <= u_1 and i > u_m); both are rectangles of (j, i), counted with a 2-D
    difference array."""
    k = len(boundaries) - 1
    diff = np.zeros((k + 2, k + 2), dtype=np.int64)
    num_split = 0  # parameters that some range may split
    for p, uses in enumerate(costs.param_uses):
        if not costs.param_trainable[p]:
            continue
        blocks = np.unique(np.searchsorted(boundaries, np.asarray(uses, dtype=np.int64), side="right") - 1)
        if len(blocks) < 2:
            continue
        num_split += 1
        for a, c in zip([-1, *blocks.tolist()], [*blocks.tolist(), k]):  # gaps: j >= a + 1 and i <= c
            diff[a + 1, 0] += 1
            diff[a + 1, c + 1] -= 1
        first, last = int(blocks[0]), int(blocks[-1])  # all inside: j <= first and i >= last + 1
        diff[0, last + 1] += 1
        diff[first + 1, last + 1] -= 1
    whole_or_none = np.cumsum(np.cumsum(diff, axis=0), axis=1)[: k + 1, : k + 1]
    return np.triu(whole_or_none < num_split, 1)


def _held_param_matrices(costs: CostTable, boundaries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(K+1, K+1) matrices [j, i] of the bytes (all, trainable) held by a stage of blocks [j, i).

    A parameter is held iff one of its use blocks u_1 < ... < u_m lies in [j, i); it is NOT
    held iff [j, i - 1] fits in a gap between consecutive uses (a, c) (with sentinels a = -1,
    c = K): a < j and i <= c. So held = total - sum over gaps of bytes * [j >= a + 1][i <= c],
    a sum of rectangles built with a 2-D difference array; for j < i the gaps of one parameter
    never overlap. Worked example, K = 4, a tied weight used in blocks 0 and 3: gaps (-1, 0),
    (0, 3), (3, 4); the gap (0, 3) removes it from [1, 2), [1, 3), [2, 3) and no other range.
    """
    k = len(boundaries) - 1
    param_bytes = np.asarray(costs.param_bytes, dtype=np.int64)
    trainable = np.asarray(costs.param_trainable, dtype=bool)
    pids, blocks = [], []
    for p, uses in enumerate(costs.param_uses):
        ub = np.unique(np.searchsorted(boundaries, np.asarray(uses, dtype=np.int64), side="right") - 1)
        pids.append(np.full(len(ub), p, dtype=np.int64))
        blocks.append(ub)
    pid = np.concatenate(pids) if pids else np.zeros(0, dtype=np.int64)
    blk = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
    # Gaps (a, c): a = the previous use of the same parameter (or -1), c = this use; plus (last use, K).
    first = np.ones(len(pid), dtype=bool)
    first[1:] = pid[1:] != pid[:-1]
    last = np.ones(len(pid), dtype=bool)
    last[:-1] = pid[1:] != pid[:-1]
    a = np.concatenate([np.where(first, -1, np.roll(blk, 1)), blk[last]])
    c = np.concatenate([blk, np.full(int(last.sum()), k, dtype=np.int64)])
    gap_pid = np.concatenate([pid, pid[last]])
    used = np.zeros(len(param_bytes), dtype=bool)
    used[pid] = True  # parameters nobody reads are held by no stage
    matrices = []
    for weights in (param_bytes, np.where(trainable, param_bytes, 0)):
        diff = np.zeros((k + 2, k + 2), dtype=np.int64)
        np.add.at(diff, (a + 1, np.zeros_like(c)), weights[gap_pid])
        np.add.at(diff, (a + 1, c + 1), -weights[gap_pid])
        not_held = np.cumsum(np.cumsum(diff, axis=0), axis=1)[: k + 1, : k + 1]
        held = int(weights[used].sum()) - not_held
        matrices.append(np.triu(held, 1))
    return matrices[0], matrices[1]


# ----------------------------------------------------------------------------- layers


def layer_boundaries(graph: OpGraph) -> list[int]:
    """First node position of each repeated layer (``OpGraph.blocks``), in graph order; [] when the
    model has no module list of repeated items."""
    return [block.start for block in graph.blocks]
