"""What a tensor-parallel matmul fused with its sequence-parallel collective costs
(``partita.runtime.collective_matmul``): a row-parallel one with its reduce-scatter, a column-parallel
one with its input's all-gather.

The runtime computes the matmul in ``t`` token blocks around the ring of the group, each ring step's
transfer running while the next block computes. With ``C`` the matmul's seconds on one device
(``t`` blocks of ``C / t``) and ``M`` the collective's ring pass (``t - 1`` steps of ``m = M / (t - 1)``,
``partita.cost.comm``), the op takes::

    C / t + (t - 1) · (max(m, C / t) + k)        so it adds  (t - 1) · (max(0, m - C / t) + k)

to the matmul: nothing but the extra kernels ``k`` where a block computes longer than a step
transfers, the ring's time beyond ``C / t`` where it does not. ``k`` per step, each kernel a launch
and its memory traffic, depends on whether a token block's rows are contiguous (``contiguous``:
the dims before the tokens all 1, a micro-batch of one sequence; the runtime's
``matmul_into``): a block's matmul then reads its input block where it lies and writes its
product where it belongs; else each is copied (two blocks of traffic: read and write).

forward     the ring is the reduce-scatter (``forward_ring_s``), ``C`` the node's forward; a step
            adds a block's matmul (its input block copied out of the whole input unless
            contiguous: two input blocks) and the addition of the received partial (three output
            blocks).
backward    the ring is the output gradient's all-gather (``backward_ring_s``), ``C`` the input-gradient
            part of the node's backward (``backward_s - backward_weight_s``), whose block matmuls
            overlap it; a step adds a block's matmul, and unless contiguous the copy of its rows into
            the input gradient (two input blocks) and of the received block into the gathered
            gradient (two output blocks; contiguous, only this device's own block is copied, once).
            The weight gradient is one matmul of the gathered gradient after the ring, as
            unfused: ``backward_weight_s`` is unchanged (a zero-bubble schedule's weight pass reads the
            gradient its input pass gathered).

A column-parallel matmul fused with its input's all-gather (``fused_column_seconds``) keeps only this
device's tokens of its input for backward:

forward     where its blocks are large enough, the same formula with the all-gather's ring and
            ``C`` the node's forward; a step adds a block's matmul and unless contiguous the copy of
            its rows into the product (two blocks of the output: this device's tokens of its
            features). Else the all-gather, then the matmul.
backward    the kept tokens' all-gather (``G``, for the weight gradient) runs while the input
            gradient's product (``C``, the input-gradient part) is formed, then that product is
            reduce-scattered (``R``) while the weight gradient (``W``) is formed, as Megatron-LM
            overlaps them: ``max(0, G - C) + max(0, R - W)``, blocks or not. A zero-bubble
            schedule forms the weight gradient in a later pass: its input pass waits for the
            reduce-scatter, ``min(R, W)`` more (``FusedSeconds.split``, the CostTable's
            ``split_backward_s``).

Only matmuls whose blocks are large enough are cut (``decomposes``: ``RING_MIN_BLOCK_FLOPS`` and
``RING_MIN_BLOCK_BYTES`` per block, the rule the runtime applies); the others run whole and
reduce-scatter after, their collectives serial as ``partita.cost.tensor_parallel`` counts them.

Assumed, not measured (no GPU has run it): a block's matmul runs at the rate of the whole one while
a transfer is in flight; NCCL's point-to-point kernels take a few of the GPU's SMs.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from partita.types import DeviceSpec

__all__ = [
    "RING_MIN_BLOCK_BYTES",
    "RING_MIN_BLOCK_FLOPS",
    "FusedSeconds",
    "block_of",
    "column_block_of",
    "decomposes",
    "fused_column_seconds",
    "fused_row_seconds",
]

# Per step the ring adds two or three kernel launches (5 us each on the catalog's GPUs) and memory
# traffic of half the step's transfer or more (the catalog's HBM is ~7x its NVLink), and hides the
# shorter of the step's transfer and the block's matmul: it pays only where both take well over
# 20 us. A block output of 8 MiB takes 33 us over the catalog's A100 NVLink and 8.6 GFLOP (2**33)
# of matmul 39 us at its 70% of the bf16 peak (12 us on an H100). Below either the op runs whole: the matmul,
# then the reduce-scatter (on a CPU, gloo's round trips would cost more still).
RING_MIN_BLOCK_FLOPS = 2**33
RING_MIN_BLOCK_BYTES = 8 * 2**20


def block_of(x_shape: tuple[int, ...], out_features: int, degree: int, element_size: int) -> tuple[int, int]:
    """(FLOPs, output bytes) of one token block of a row-parallel matmul on one device of ``degree``:
    ``x_shape`` the device's input (every token, its part of the features), ``out_features`` the
    weight's. What the runtime measures on its tensors; the cost model's per-node arrays equal it."""
    rows = math.prod(x_shape[:-1]) // degree
    return 2 * rows * x_shape[-1] * out_features, rows * out_features * element_size


def column_block_of(x_shape: tuple[int, ...], out_features: int, element_size: int) -> tuple[int, int]:
    """(FLOPs, input bytes) of one token block of a column-parallel matmul on one device: ``x_shape``
    the device's input (its tokens, every feature: one block), ``out_features`` its weight's part."""
    rows = math.prod(x_shape[:-1])
    return 2 * rows * x_shape[-1] * out_features, rows * x_shape[-1] * element_size


def decomposes(block_flops: Any, block_bytes: Any) -> Any:
    """Whether a fused matmul whose token blocks take ``block_flops`` and send ``block_bytes`` each
    per ring step (on one device: a row-parallel block's output, a column-parallel one's input) is
    computed block by block around the ring; else whole, its collective before or after. Element-wise."""
    flops, sent = np.asarray(block_flops), np.asarray(block_bytes)
    return (flops >= RING_MIN_BLOCK_FLOPS) & (sent >= RING_MIN_BLOCK_BYTES)


class FusedSeconds(NamedTuple):
    """Seconds each fused node adds to its matmul, float64[n] each (its weight pass adds none):
    ``backward`` with the input and weight gradients formed together, ``split`` what forming them
    in two passes adds to the input pass (None: nothing)."""

    forward: np.ndarray
    backward: np.ndarray
    split: np.ndarray | None = None


def fused_row_seconds(
    *,
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    backward_weight_s: np.ndarray,
    forward_ring_s: np.ndarray,
    backward_ring_s: np.ndarray,
    output_block_bytes: np.ndarray,
    input_block_bytes: np.ndarray,
    contiguous: np.ndarray,
    degree: int,
    device: DeviceSpec,
) -> FusedSeconds:
    """The seconds the fused op adds to each node's matmul (module docstring), from one device's
    matmul seconds (``forward_s``, ``backward_s``, ``backward_weight_s``), its ring passes and the bytes
    of one token block of its output and of its input, all float64[n], and whether a block's rows
    are contiguous (bool[n]); ``degree`` > 1."""
    memory_rate = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    launch = device.op_overhead_s
    input_copy = np.where(contiguous, 0.0, 2 * input_block_bytes)
    forward_kernels = 2 * launch + (input_copy + 3 * output_block_bytes) / memory_rate
    copied = 3 * launch + (input_copy + 2 * output_block_bytes) / memory_rate
    backward_kernels = np.where(contiguous, launch, copied)
    own_block = np.where(contiguous, launch + 2 * output_block_bytes / memory_rate, 0.0)  # once, not per step
    return FusedSeconds(
        _ring_added(forward_ring_s, forward_s, forward_kernels, degree),
        _ring_added(backward_ring_s, backward_s - backward_weight_s, backward_kernels, degree) + own_block,
    )


def fused_column_seconds(
    *,
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    backward_weight_s: np.ndarray,
    forward_ring_s: np.ndarray,
    backward_ring_s: np.ndarray,
    output_block_bytes: np.ndarray,
    contiguous: np.ndarray,
    degree: int,
    device: DeviceSpec,
) -> FusedSeconds:
    """The seconds column-parallel matmuls fused with their input's all-gather add (module docstring):
    ``forward`` around the ring (for the nodes whose blocks are large enough), ``backward`` at any
    block size. ``forward_ring_s`` the all-gather's pass, ``backward_ring_s`` the backward's two
    (the kept tokens' all-gather and the input gradient's reduce-scatter, of the same elements);
    ``output_block_bytes`` this device's tokens of its output, all float64[n]; ``contiguous``
    (bool[n]) whether a block's rows are."""
    memory_rate = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    copied = 2 * device.op_overhead_s + 2 * output_block_bytes / memory_rate
    forward_kernels = np.where(contiguous, device.op_overhead_s, copied)
    each_pass = backward_ring_s / 2  # the all-gather's, the reduce-scatter's
    gathering = np.maximum(0.0, each_pass - (backward_s - backward_weight_s))
    hidden = np.minimum(each_pass, backward_weight_s)  # by the weight gradient, formed together
    return FusedSeconds(
        _ring_added(forward_ring_s, forward_s, forward_kernels, degree), gathering + each_pass - hidden, hidden
    )


def _ring_added(ring_s: np.ndarray, compute_s: np.ndarray, kernels_s: np.ndarray, degree: int) -> np.ndarray:
    """``(t - 1) · (max(0, m - C / t) + k)``: what the ring adds to a matmul of ``compute_s`` seconds."""
    steps = degree - 1
    return steps * (np.maximum(0.0, ring_s / steps - compute_s / degree) + kernels_s)
