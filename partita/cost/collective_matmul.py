"""What a row-parallel matmul fused with its reduce-scatter costs (``partita.runtime.collective_matmul``).

The runtime computes the matmul in ``t`` token blocks around the ring of the group, each ring step's
transfer running while the next block computes. With ``C`` the matmul's seconds on one device
(``t`` blocks of ``C / t``) and ``M`` the collective's ring pass (``t - 1`` steps of ``m = M / (t - 1)``,
``partita.cost.comm``), the op takes::

    C / t + (t - 1) · (max(m, C / t) + k)        so it adds  (t - 1) · (max(0, m - C / t) + k)

to the matmul: nothing but the extra kernels ``k`` where a block computes longer than a step
transfers, the ring's time beyond ``C / t`` where it does not. ``k`` per step, each kernel a launch
and its memory traffic:

forward     the ring is the reduce-scatter (``forward_ring_s``), ``C`` the node's forward; a step
            adds a block's matmul (its input block copied out of the whole input: two input
            blocks) and the addition of the received partial (three output blocks).
backward    the ring is the output gradient's all-gather (``backward_ring_s``), ``C`` the input-gradient
            part of the node's backward (``backward_s - backward_weight_s``), whose block matmuls
            overlap it; a step adds a block's matmul, the copy of its rows into the input gradient
            (two input blocks) and of the received block into the gathered gradient (two output
            blocks). The weight gradient is one matmul of the gathered gradient after the ring, as
            unfused: ``backward_weight_s`` is unchanged (a zero-bubble schedule's weight pass reads the
            gradient its input pass gathered).

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
    "FusedRowSeconds",
    "block_of",
    "decomposes",
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


def decomposes(block_flops: Any, block_output_bytes: Any) -> Any:
    """Whether a fused row-parallel matmul whose token blocks take ``block_flops`` and make
    ``block_output_bytes`` each (on one device) is computed block by block around the ring; else
    whole, then reduce-scattered. Element-wise."""
    flops, output = np.asarray(block_flops), np.asarray(block_output_bytes)
    return (flops >= RING_MIN_BLOCK_FLOPS) & (output >= RING_MIN_BLOCK_BYTES)


class FusedRowSeconds(NamedTuple):
    """Seconds each fused node adds to its matmul, float64[n] each (its weight pass adds none)."""

    forward: np.ndarray
    backward: np.ndarray


def fused_row_seconds(
    *,
    forward_s: np.ndarray,
    backward_s: np.ndarray,
    backward_weight_s: np.ndarray,
    forward_ring_s: np.ndarray,
    backward_ring_s: np.ndarray,
    output_block_bytes: np.ndarray,
    input_block_bytes: np.ndarray,
    degree: int,
    device: DeviceSpec,
) -> FusedRowSeconds:
    """The seconds the fused op adds to each node's matmul (module docstring), from one device's
    matmul seconds (``forward_s``, ``backward_s``, ``backward_weight_s``), its ring passes and the bytes
    of one token block of its output and of its input, all float64[n]; ``degree`` > 1."""
    steps = degree - 1
    memory_rate = device.memory_bandwidth_bytes_per_s * device.memory_efficiency
    copies = 2 * (input_block_bytes + output_block_bytes)
    forward_kernels = 2 * device.op_overhead_s + (copies + output_block_bytes) / memory_rate
    backward_kernels = 3 * device.op_overhead_s + copies / memory_rate

    def added(ring_s: np.ndarray, compute_s: np.ndarray, kernels_s: np.ndarray) -> np.ndarray:
        return steps * (np.maximum(0.0, ring_s / steps - compute_s / degree) + kernels_s)

    return FusedRowSeconds(
        added(forward_ring_s, forward_s, forward_kernels),
        added(backward_ring_s, backward_s - backward_weight_s, backward_kernels),
    )
