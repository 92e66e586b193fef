"""The machines a plan runs on: ``num_devices`` identical devices in nodes of ``devices_per_node``.

The topology has two levels: devices in one node talk over the intra-node link (NVLink, or
loopback TCP for CPU ranks), devices in different nodes over the network. Ranks fill nodes in
order, as ``torchrun`` assigns them: rank ``r`` sits in node ``r // devices_per_node``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from partita.cost.contention import measure_contention
from partita.cost.devices import (
    cpu_model,
    device_from_dict,
    device_to_dict,
    local_cpu_spec,
    machine_memory_bytes,
    measure_once,
    resolve_device,
)
from partita.errors import InputError
from partita.types import DeviceSpec

__all__ = ["Cluster", "LOCAL_RESERVED_MEMORY_FRACTION", "measure_gloo"]

# Share of a CPU rank's memory the planner leaves to the allocator: resident memory measured
# 1.2-1.9x the bytes in use during training (glibc keeps freed memory; bench/results/e2e_memory.md).
LOCAL_RESERVED_MEMORY_FRACTION = 0.4

_LINK_FIELDS = ("intra_node_bandwidth_bytes_per_s", "inter_node_bandwidth_bytes_per_s",
                "intra_node_latency_s", "inter_node_latency_s")


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
        object.__setattr__(self, "num_devices", _check_count(self.num_devices, "num_devices"))
        object.__setattr__(self, "devices_per_node", _check_count(self.devices_per_node, "devices_per_node"))
        if self.num_devices > self.devices_per_node and self.num_devices % self.devices_per_node:
            fill = self.devices_per_node
            lower, upper = self.num_devices // fill * fill, (self.num_devices // fill + 1) * fill
            raise InputError(
                f"num_devices={self.num_devices} does not fill whole nodes of devices_per_node={fill}: "
                f"use num_devices={lower} or {upper}, or a devices_per_node that divides {self.num_devices}"
            )
        memory = device.memory_bytes if self.memory_bytes is None else self.memory_bytes
        if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory <= 0:
            raise InputError(f"memory_bytes must be a positive int (bytes per device), got {memory!r}: "
                             "pass e.g. memory_bytes=40 * 2**30, or None for the device's own")
        object.__setattr__(self, "memory_bytes", int(memory))
        for name in _LINK_FIELDS:
            value = getattr(device, name) if getattr(self, name) is None else getattr(self, name)
            positive = not name.endswith("latency_s")  # bandwidths > 0, latencies >= 0
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                raise InputError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
            object.__setattr__(self, name, float(value))
        fraction = self.reserved_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction < 1:
            raise InputError(f"reserved_memory_fraction must be in [0, 1), got {fraction!r}: e.g. 0.05 leaves 5% free")
        object.__setattr__(self, "reserved_memory_fraction", float(fraction))
        slowdown = self.compute_slowdown
        if isinstance(slowdown, bool) or not isinstance(slowdown, numbers.Real) or not math.isfinite(slowdown) \
                or slowdown <= 0:
            raise InputError(f"compute_slowdown must be a finite number > 0, got {slowdown!r}: 1.0 for devices "
                             "that do not slow each other down")
        object.__setattr__(self, "compute_slowdown", float(slowdown))
        efficiency = self.collective_efficiency
        if isinstance(efficiency, bool) or not isinstance(efficiency, numbers.Real) or not 0 < efficiency <= 1:
            raise InputError(f"collective_efficiency must be in (0, 1], got {efficiency!r}: the share of the link "
                             "bandwidth a ring all-reduce reaches (1.0 for NCCL-class libraries)")
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
    def from_dict(cls, data: Mapping[str, Any]) -> "Cluster":
        """The inverse of ``to_dict``; ``device`` may also be a catalog name. Validates every field."""
        if not isinstance(data, Mapping):
            raise InputError(f"a cluster description must be a dict, got {type(data).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        missing = [f for f in ("device", "num_devices") if f not in data]
        if unknown or missing:
            raise InputError(f"cluster description: unknown field(s) {unknown or 'none'}, missing field(s) "
                             f"{missing or 'none'}; valid fields are {', '.join(sorted(fields))}")
        values = dict(data)
        if isinstance(values["device"], Mapping):
            values["device"] = device_from_dict(values["device"], source="cluster field 'device'")
        return cls(**values)

    # ------------------------------------------------------------------ this machine

    @classmethod
    def local(cls, num_devices: int = 2, memory_bytes: int | None = None, *, cache_dir: str | os.PathLike | None = None,
              num_threads: int | None = None, compute_slowdown: float | None = None,
              reserved_memory_fraction: float = LOCAL_RESERVED_MEMORY_FRACTION) -> "Cluster":
        """``num_devices`` CPU ranks on this machine, one node, calibrated by measurement.

        The device is ``local_cpu_spec`` measured with ``num_threads`` threads (default: this
        process's torch thread count shared out among the ranks); the intra-node link and the
        collective efficiency are what gloo achieves between two processes, ``measure_gloo``. ``memory_bytes``
        (per rank) defaults to this machine's RAM shared out among the ranks.
        ``compute_slowdown`` defaults to ``measure_contention``: how much slower each rank
        computes while all ``num_devices`` ranks do. The measurements are cached in
        ``cache_dir`` when given. Takes ~5-10 s uncached.

        ``reserved_memory_fraction`` defaults to LOCAL_RESERVED_MEMORY_FRACTION: a process's
        resident memory (what a memory limit sees) exceeds the bytes its tensors use, because
        glibc keeps freed memory for reuse; measured 1.2-1.9x during training steps
        (bench/results/e2e_memory.md). Trimming it back costs 40-50% of the step time here
        (bench/results/probes.md).
        """
        import torch

        num_devices = _check_count(num_devices, "num_devices")
        threads = num_threads or max(1, torch.get_num_threads() // num_devices)
        memory = memory_bytes if memory_bytes is not None else machine_memory_bytes() // num_devices
        device = local_cpu_spec(cache_dir, memory_bytes=memory, num_threads=threads)
        gloo = measure_gloo(cache_dir)
        if compute_slowdown is None:
            compute_slowdown = measure_contention(num_devices, threads, cache_dir=cache_dir)
        return cls(device=device, num_devices=num_devices, devices_per_node=num_devices,
                   intra_node_bandwidth_bytes_per_s=gloo["bandwidth_bytes_per_s"], intra_node_latency_s=gloo["latency_s"],
                   collective_efficiency=gloo["collective_efficiency"], compute_slowdown=compute_slowdown,
                   reserved_memory_fraction=reserved_memory_fraction)


def _check_count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InputError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------- gloo on this machine

# The probe, run by ``python -c`` as rank RANK of 2 (the planning process itself never imports
# torch.distributed): ping-pong latency and bandwidth of send/recv, then all-reduce times.
_GLOO_PROBE = r"""
import json, os, statistics, sys, time
import torch
import torch.distributed as dist
torch.set_num_threads(1)
num_bytes, repeats, pings = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PORT']}",
                        rank=int(os.environ["RANK"]), world_size=2)
rank, peer = dist.get_rank(), 1 - dist.get_rank()

def ping_pong(t, count):
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(t, peer); dist.recv(t, peer)
        else:
            dist.recv(t, peer); dist.send(t, peer)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / 2

def all_reduce(t, count):
    times = []
    for _ in range(count):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - start)
    return statistics.median(times)

small, big = torch.zeros(1), torch.zeros(num_bytes // 4)
ping_pong(small, 3); ping_pong(big, 1); all_reduce(big, 1)  # warm-up: connections, buffers
out = {"latency_s": ping_pong(small, pings), "transfer_s": ping_pong(big, repeats),
       "allreduce_small_s": all_reduce(small, pings), "allreduce_s": all_reduce(big, repeats)}
if rank == 0:
    print(json.dumps(out), flush=True)
dist.destroy_process_group()
"""


def measure_gloo(cache_dir: str | os.PathLike | None = None, *, num_bytes: int = 16 * 2**20, repeats: int = 5,
                 num_pings: int = 30, timeout_s: float = 120.0) -> dict[str, float]:
    """What gloo achieves between two processes of this machine (loopback TCP, as CPU ranks use it).

    Returns ``bandwidth_bytes_per_s`` and ``latency_s`` of send/recv (ping-pong of ``num_bytes``
    and of one float), and ``collective_efficiency``: the bandwidth a 2-rank all-reduce of
    ``num_bytes`` achieves under the ring model (``partita.cost.comm``) over the send/recv
    bandwidth. gloo's all-reduce also sums and copies on the CPU, so it reaches well under the
    link's bandwidth. Two interpreters start (~3-5 s); cached in ``cache_dir`` when given.
    """
    import torch

    key = {"host": socket.gethostname(), "cpu": cpu_model(), "num_bytes": int(num_bytes), "torch": torch.__version__,
           "probe": "gloo-1"}

    def measure() -> dict:
        raw = _run_gloo_probe(num_bytes, repeats, num_pings, timeout_s)
        latency = raw["latency_s"]
        bandwidth = num_bytes / max(raw["transfer_s"] - latency, 1e-9)
        # 2 ranks: all-reduce = 2·α + (2·(n−1)/n = 1) · b / β_ring
        ring_bandwidth = num_bytes / max(raw["allreduce_s"] - 2 * latency, 1e-9)
        return {"bandwidth_bytes_per_s": bandwidth, "latency_s": latency,
                "collective_efficiency": min(1.0, ring_bandwidth / bandwidth), "raw": raw}

    measured = measure_once(cache_dir, "gloo", key, measure)
    return {k: float(v) for k, v in measured.items() if k != "raw"}


def _run_gloo_probe(num_bytes: int, repeats: int, num_pings: int, timeout_s: float) -> dict[str, float]:
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-c", _GLOO_PROBE, str(num_bytes), str(repeats), str(num_pings)],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout_s))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"the gloo probe failed (exit code {p.returncode}): {err[-2000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])
