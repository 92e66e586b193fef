"""Devices and clusters: the hardware a plan is made for, as data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of accelerator (or the local CPU), from the catalog or a user's file."""

    name: str  # "h100", "a100-80gb", "cpu", ...
    memory_bytes: int
    peak_flops: Mapping[str, float]  # dense FLOP/s per dtype name ("float32", "bfloat16", "float16")
    memory_bandwidth_bytes_per_s: float
    intra_node_bandwidth_bytes_per_s: float  # per device, NVLink-class
    inter_node_bandwidth_bytes_per_s: float  # per device, network
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    compute_efficiency: float = 0.6  # achieved fraction of peak FLOP/s for matmul-like ops
    memory_efficiency: float = 0.7  # achieved fraction of memory bandwidth for memory-bound ops
    op_overhead_s: float = 5e-6  # fixed cost of launching one operation (kernel launch / dispatch)
