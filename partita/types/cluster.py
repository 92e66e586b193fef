"""The machines a plan runs on: ``num_devices`` identical devices in nodes of ``devices_per_node``.

The topology has two levels: devices in one node talk over the intra-node link (NVLink, or
loopback TCP for CPU ranks), devices in different nodes over the network. Ranks fill nodes in
order, as ``torchrun`` assigns them: rank ``r`` sits in node ``r // devices_per_node``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from partita.checks import positive_int
from partita.errors import InputError
from partita.types.devices import DeviceSpec, device_from_dict, device_to_dict, resolve_device

__all__ = ["Cluster"]

_LINK_FIELDS = (
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
    "intra_node_latency_s",
    "inter_node_latency_s",
)


@dataclass(frozen=True)
class Cluster:
    """``num_devices`` devices of one kind, ``devices_per_node`` to a node.

    Write ``Cluster(device="h100", num_devices=64, devices_per_node=8)``; ``device`` is a
    catalog name, a device-file path or a DeviceSpec. Every field left None takes the
    device's value: ``memory_bytes`` (per device) and the link bandwidths (bytes/s, per device
    and direction) and latencies (s). ``reserved_memory_fraction`` is the share of each
    device's memory the planner leaves free (allocator fragmentation, CUDA context, workspace).
    ``compute_slowdown`` multiplies every compute time of a cost table used with this cluster:
    how much slower one device computes while all of them do (1 for accelerators; CPU ranks
    sharing one host's memory system, measured by ``Cluster.local``). ``collective_efficiency``
    is the share of the link bandwidth a ring collective reaches (1: the ring model as is; gloo
    on CPUs reaches less, measured by ``Cluster.local``). After construction every field holds a concrete value (``device`` a DeviceSpec).
    """

    device: DeviceSpec | str
    num_devices: int
    devices_per_node: int = 8  # HGX/DGX nodes hold 8 GPUs
    memory_bytes: int | None = None
    intra_node_bandwidth_bytes_per_s: float | None = None
    inter_node_bandwidth_bytes_per_s: float | None = None
    intra_node_latency_s: float | None = None
    inter_node_latency_s: float | None = None
    reserved_memory_fraction: float = 0.05
    compute_slowdown: float = 1.0
    collective_efficiency: float = 1.0

    def __post_init__(self) -> None:
        device = resolve_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "num_devices", positive_int(self.num_devices, "num_devices"))
        object.__setattr__(self, "devices_per_node", positive_int(self.devices_per_node, "devices_per_node"))
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            fill = self.devices_per_node
            lower, upper = self.num_devices // fill * fill, (self.num_devices // fill + 1) * fill
            raise InputError(
                f"num_devices={self.num_devices} does not fill whole nodes of devices_per_node={fill}: "
                f"use num_devices={lower} or {upper}, or a devices_per_node that divides {self.num_devices}"
            )
        memory = device.memory_bytes if self.memory_bytes is None else self.memory_bytes
        if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory <= 0:
            raise InputError(
                f"memory_bytes must be a positive int (bytes per device), got {memory!r}: "
                "pass e.g. memory_bytes=40 * 2**30, or None for the device's own"
            )
        object.__setattr__(self, "memory_bytes", int(memory))
        for name in _LINK_FIELDS:
            value = getattr(device, name) if getattr(self, name) is None else getattr(self, name)
            positive = not name.endswith("latency_s")  # bandwidths > 0, latencies >= 0
            if (
                isinstance(value, bool)
                or not isinstance(value, numbers.Real)
                or not math.isfinite(value)
                or value < 0
                or (positive and value == 0)
            ):
                raise InputError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
            object.__setattr__(self, name, float(value))
        fraction = self.reserved_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction < 1:
            raise InputError(f"reserved_memory_fraction must be in [0, 1), got {fraction!r}: e.g. 0.05 leaves 5% free")
        object.__setattr__(self, "reserved_memory_fraction", float(fraction))
        slowdown = self.compute_slowdown
        if (
            isinstance(slowdown, bool)
            or not isinstance(slowdown, numbers.Real)
            or not math.isfinite(slowdown)
            or slowdown <= 0
        ):
            raise InputError(
                f"compute_slowdown must be a finite number > 0, got {slowdown!r}: 1.0 for devices "
                "that do not slow each other down"
            )
        object.__setattr__(self, "compute_slowdown", float(slowdown))
        efficiency = self.collective_efficiency
        if isinstance(efficiency, bool) or not isinstance(efficiency, numbers.Real) or not 0 < efficiency <= 1:
            raise InputError(
                f"collective_efficiency must be in (0, 1], got {efficiency!r}: the share of the link "
                "bandwidth a ring all-reduce reaches (1.0 for NCCL-class libraries)"
            )
        object.__setattr__(self, "collective_efficiency", float(efficiency))

    # ------------------------------------------------------------------ topology

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    @property
    def usable_memory_bytes(self) -> int:
        """Bytes per device the planner may fill: memory less the reserved fraction."""
        return int(self.memory_bytes * (1.0 - self.reserved_memory_fraction))

    def rank_to_node(self, rank: int) -> int:
        """The node index of ``rank`` (ranks fill nodes in order)."""
        if type(rank) is int and 0 <= rank < self.num_devices:  # the common case, without the ABC checks below
            return rank // self.devices_per_node
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self.num_devices:
            raise InputError(f"rank must be an int in [0, {self.num_devices}), got {rank!r}")
        return int(rank) // self.devices_per_node

    def link(self, rank_a: int, rank_b: int) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) between two ranks; (inf, 0) for a rank with itself."""
        if rank_a == rank_b:
            self.rank_to_node(rank_a)
            return math.inf, 0.0
        if self.rank_to_node(rank_a) == self.rank_to_node(rank_b):
            return self.intra_node_bandwidth_bytes_per_s, self.intra_node_latency_s
        return self.inter_node_bandwidth_bytes_per_s, self.inter_node_latency_s

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict with the DeviceSpec inlined, so that a plan file is self-contained."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["device"] = device_to_dict(self.device)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """The inverse of ``to_dict``; ``device`` may also be a catalog name. Validates every field."""
        if not isinstance(data, Mapping):
            raise InputError(f"a cluster description must be a dict, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        missing = [f for f in ("device", "num_devices") if f not in data]
        if unknown or missing:
            raise InputError(
                f"cluster description: unknown field(s) {unknown or 'none'}, missing field(s) "
                f"{missing or 'none'}; valid fields are {', '.join(sorted(fields))}"
            )
        values = dict(data)
        if isinstance(values["device"], Mapping):
            values["device"] = device_from_dict(values["device"], source="cluster field 'device'")
        return cls(**values)

    # ------------------------------------------------------------------ this machine

    @classmethod
    def local(
        cls,
        num_devices: int = 2,
        memory_bytes: int | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
        num_threads: int | None = None,
        compute_slowdown: float | None = None,
        reserved_memory_fraction: float | None = None,
    ) -> Cluster:
        """``num_devices`` CPU ranks on this machine, one node, calibrated by measurement:
        ``partita.cost.local_machine.local_cluster``, which documents the arguments.
        ``reserved_memory_fraction`` None is its default, ``LOCAL_RESERVED_MEMORY_FRACTION``."""
        from partita.cost import local_machine  # measuring code stays out of the data class's module

        if reserved_memory_fraction is None:
            reserved_memory_fraction = local_machine.LOCAL_RESERVED_MEMORY_FRACTION
        return local_machine.local_cluster(
            num_devices,
            memory_bytes,
            cache_dir=cache_dir,
            num_threads=num_threads,
            compute_slowdown=compute_slowdown,
            reserved_memory_fraction=reserved_memory_fraction,
        )
