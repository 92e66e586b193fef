"""Tensor-parallel layouts: which parameters a group of devices splits, and what that costs.

Found on the captured graph by ``partita.capturing.tensor_parallel`` (the rules), read by the
planner (work, memory and collectives divided or added per degree) and by the runtime
(``partita.runtime.tensor_parallel`` slices the parameters and rewrites the stage graphs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParamShard:
    """How a parameter is split over a tensor-parallel group of ``degree`` devices.

    ``dim`` is split; with ``blocks > 1`` it is ``blocks`` equal blocks (a fused QKV projection's
    query, key and value columns) and device ``r`` holds part ``r`` of every block, side by side.
    ``whole``: the size of ``dim`` when it does not divide by the degree (a vocabulary of 50,257):
    each part is rounded up and the last one padded with zeros (0: it divides).
    """

    dim: int
    blocks: int = 1
    whole: int = 0


@dataclass(frozen=True)
class TensorParallelLayout:
    """How one graph runs on a tensor-parallel group of ``degree`` devices.

    ``params``: the split parameters (canonical names for a whole captured graph, get_attr
    targets for a stage graph); every other parameter is replicated in the group.
    ``sharded_nodes``: nodes whose work and output memory divide by ``degree``.
    ``forward_reductions`` / ``backward_reductions``: node name -> elements all-reduced over the
    group after that node in the forward (the output of a row-parallel matmul or of a
    vocab-parallel embedding), or for its inputs in the backward (the input of column-parallel
    matmuls; the whole operands, e.g. T5's position bias, of an elementwise operation on split
    values, summed per node), elements at the graph's example batch. ``backward_fixed_reductions``:
    the same for whole operands without a batch dimension (a weight, T5's position bias), whose
    size is the same at every micro-batch size. The vocab-parallel cross-entropy all-reduces three values per row (max, sum of
    exponentials, target logit): counted in ``forward_reductions`` at the loss node.
    ``rejected``: pattern candidates left replicated, node name -> why (for ``partita inspect``).

    Sequence parallelism (``sequence_parallel``; ``partita.capturing.sequence_parallel``) also splits
    the regions between them by token: ``sequence_nodes`` are the nodes whose values and work divide
    by ``degree`` that way; ``gathered_nodes`` the split values all-gathered whole for column-parallel
    matmuls (which keep that whole copy for their backward) or for operations that run whole;
    ``fused_gathers`` split value -> the one column-parallel matmul that reads it, which gathers it
    itself (its collectives are that matmul's; where its blocks run around the ring it keeps the
    value's part for backward and gathers it again there: a second backward pass). Its collectives are single ring passes
    (a reduce-scatter or an all-gather; an all-reduce is two): ``forward_passes`` /
    ``backward_passes``, node name -> the elements of each pass after that node's forward or in its
    backward; the all-reduces they replace are gone from ``forward_reductions`` /
    ``backward_reductions``; ``backward_fixed_passes`` those of values without a batch dimension (the
    gradient of a whole position embedding scattered by token). ``token_splits``: each row-parallel
    source's and fused column-parallel matmul's token split of its output, ``(dim, inner)``: dim
    ``dim`` viewed as ``(-1, inner)``, ``inner`` split over the group (whether a token block's rows
    are contiguous, which the fused ops' cost depends on). ``sequence_rejected``: regions left whole, source node -> why.
    """

    degree: int
    params: Mapping[str, ParamShard] = field(default_factory=dict)
    sharded_nodes: frozenset[str] = frozenset()
    forward_reductions: Mapping[str, int] = field(default_factory=dict)
    backward_reductions: Mapping[str, int] = field(default_factory=dict)
    backward_fixed_reductions: Mapping[str, int] = field(default_factory=dict)
    rejected: Mapping[str, str] = field(default_factory=dict)
    sequence_parallel: bool = False
    sequence_nodes: frozenset[str] = frozenset()
    gathered_nodes: frozenset[str] = frozenset()
    fused_gathers: Mapping[str, str] = field(default_factory=dict)
    forward_passes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    backward_passes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    backward_fixed_passes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    token_splits: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    sequence_rejected: Mapping[str, str] = field(default_factory=dict)

    @property
    def is_trivial(self) -> bool:
        """Nothing is split: the group would run replicated."""
        return not self.params
