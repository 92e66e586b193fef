"""Per-node costs at one micro-batch size: what the cost layer hands the planner."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class CostTable:
    """Costs of every node for ONE micro-batch size on ONE device type: the planner's view.

    Axes:
        n  node position in ``OpGraph.nodes`` (topological order), length ``num_nodes``.
        c  cut position, length ``num_nodes + 1``: cut ``c`` lies between node ``c - 1`` and
           node ``c``; cut 0 is before the first node, cut ``num_nodes`` after the last.
        p  unique parameter/buffer, in the order of ``param_names``.

    Arrays (numpy; seconds and bytes are per micro-batch unless the name says otherwise):
        forward_s[n]          forward time of node n.
        backward_s[n]         backward time of node n (input gradients + weight gradients).
        backward_weight_s[n]  the weight-gradient part of backward_s[n] (zero-bubble schedules
                              run it later); 0 for nodes without trainable parameters.
        split_backward_s[n]   what running node n's backward as two passes adds to its input-
                              gradient pass: collectives that its weight gradient hides when the
                              two run together (a fused column-parallel matmul's reduce-scatter,
                              ``partita.cost.collective_matmul``); 0 elsewhere and by default.
        activation_bytes[n]   bytes node n keeps alive for its backward (saved tensors).
        output_bytes[n]       bytes of node n's outputs (0 for views).
        cut_bytes[c]          bytes of every tensor produced before cut c and read at or after
                              it (skip connections included; graph inputs excluded, since every
                              rank has the batch): what one device sends at cut c, and what the
                              next stage keeps of it.
        whole_cut_bytes[c]    the same when the stage after the cut does not split its values as
                              this table does (another tensor-parallel degree, or none): under
                              sequence parallelism stages of one degree exchange each device's
                              tokens (cut_bytes), others the whole tensors. cut_bytes by default.
        param_bytes[p]        bytes of parameter p (in its own dtype).
        param_trainable[p]    whether p gets a gradient and optimizer state (False for buffers).
        param_uses[p]         sorted node positions that read parameter p.

    Selective recomputation (``Recompute.SELECTIVE``, ``partita.cost.recompute``), per node:
        saved_bytes[n]        bytes of node n's outputs it keeps per micro-batch (the outputs of
                              the ops its policy keeps: matmuls, attention; 0 for the others).
        recomputed_bytes[n]   the part of activation_bytes[n] it rebuilds in backward (the saved
                              tensors that are not such outputs), alive for one micro-batch.
        selective_recompute_s[n]  seconds node n's forward runs again in backward (0 for kept ones).
    A table made without them (None) keeps everything under selective recomputation and
    recomputes nothing: selective is then never cheaper than no recomputation.

    Repeated blocks (``OpGraph.blocks``: the units a stage runs by, ``partita.types.segments``), l
    their position, length L (0: none):
        block_ranges[l]       int64 (start, stop): the nodes of block l.
        block_input_bytes[l]  bytes of the values made since the previous block's start (the
                              graph's start for the first) that are read at or after block l's
                              start: what a stage that keeps each block's input keeps anew there
                              (values made earlier, relayed through the blocks, are kept already).
        block_output_bytes[l] bytes of the values made inside block l and read after it.
    """

    microbatch_size: int
    device: str  # device name in the catalog ("cpu", "h100", ...)
    source: str  # "measured" or "analytic"
    forward_s: Any
    backward_s: Any
    backward_weight_s: Any
    activation_bytes: Any
    output_bytes: Any
    cut_bytes: Any
    param_names: tuple[str, ...]
    param_bytes: Any
    param_trainable: Any
    param_uses: tuple[Any, ...]
    # The compute dtype its bytes and times are for ("fp32" or "bf16", a Precision value): the
    # activation, output and cut bytes are in it; param_bytes stay the parameters' own.
    precision: str = "fp32"
    # How measured costs were scaled to whole-graph timings (profiler only; empty when analytic):
    # forward_scale, backward_scale, whole_forward_s, whole_step_s, repeats, warmup, num_threads.
    calibration: Mapping[str, float] = field(default_factory=dict)
    # The tensor-parallel degree t its costs are for: with t > 1 every array is ONE device's of a
    # group of t that splits the graph (``partita.cost.tensor_parallel``): its share of the work
    # and bytes, its parameter shards, and the group's all-reduces in forward_s and backward_s.
    tensor_parallel: int = 1
    saved_bytes: Any = None
    recomputed_bytes: Any = None
    selective_recompute_s: Any = None
    whole_cut_bytes: Any = None
    split_backward_s: Any = None
    block_ranges: Any = None
    block_input_bytes: Any = None
    block_output_bytes: Any = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: fill what a hand-made table leaves out, once
        if self.whole_cut_bytes is None:
            set_(self, "whole_cut_bytes", self.cut_bytes)
        if self.saved_bytes is None:
            set_(self, "saved_bytes", np.asarray(self.activation_bytes, dtype=np.int64))
        if self.recomputed_bytes is None:
            set_(self, "recomputed_bytes", np.zeros(len(self.forward_s), dtype=np.int64))
        if self.selective_recompute_s is None:
            set_(self, "selective_recompute_s", np.zeros(len(self.forward_s)))
        if self.split_backward_s is None:
            set_(self, "split_backward_s", np.zeros(len(self.forward_s)))
        if self.block_ranges is None:
            set_(self, "block_ranges", np.zeros((0, 2), dtype=np.int64))
        for name in ("block_input_bytes", "block_output_bytes"):
            if getattr(self, name) is None:
                set_(self, name, np.zeros(len(self.block_ranges), dtype=np.int64))

    @property
    def num_nodes(self) -> int:
        return len(self.forward_s)

    def params_in_range(self, start: int, stop: int) -> list[int]:
        """Indices p of the parameters read by any node in positions [start, stop), ascending."""
        owners, uses = self._flat_param_uses
        return np.unique(owners[(uses >= start) & (uses < stop)]).tolist()

    @functools.cached_property
    def _flat_param_uses(self) -> tuple[Any, Any]:
        """(parameter index, node position) of every use, flat: one vectorised test per range (the
        planner asks for thousands of ranges of a table with ~1000 parameters)."""
        owners = [np.full(len(uses), p, dtype=np.int64) for p, uses in enumerate(self.param_uses)]
        uses = [np.asarray(u, dtype=np.int64).ravel() for u in self.param_uses]
        empty = np.zeros(0, dtype=np.int64)
        return (np.concatenate(owners) if owners else empty, np.concatenate(uses) if uses else empty)
