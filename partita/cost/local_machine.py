"""Every measurement of the machine partita runs on, and the Cluster of CPU ranks built from them.

A plan for this machine's CPU needs what no catalog knows:

``local_cpu_spec``      matmul FLOP/s per dtype, copy bandwidth and the fixed cost of one op
``measure_gloo``        gloo send/recv bandwidth and latency between two processes, and the
                        share of that bandwidth a gloo all-reduce reaches
``measure_contention``  how much slower one rank computes while the other ranks compute too
``free_port``           a port for a rendezvous of processes on this machine
``local_cluster``       the Cluster of ``num_devices`` CPU ranks made of the three
                        (``Cluster.local`` calls it)

``partita.cost.hardware.cpu_model`` and ``machine_memory_bytes`` say what this machine is. Every measurement goes
through ``partita.cost.cache.measure_once``: with a ``cache_dir`` it runs once per key, in the
same folder as the profiler's cost tables. The profiler's per-node kernel timings stay in
``partita.cost.profiler``.

The probes that need processes of their own run this module as a program,
``python -m partita.cost.local_machine gloo-probe|contention-probe ARGS``, so the planning
process itself never imports ``torch.distributed``: of partita's modules only ``runtime/`` and
this one's gloo probe do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import select
import site
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from partita.checks import positive_int
from partita.cost.cache import measure_once
from partita.cost.hardware import cpu_model
from partita.cost.job_ranks import measured_on_rank_zero
from partita.types import DeviceSpec
from partita.types.cluster import Cluster
from partita.types.devices import get_device, machine_memory_bytes

__all__ = [
    "LOCAL_RESERVED_MEMORY_FRACTION",
    "local_cluster",
    "local_cpu_spec",
    "machine_memory_bytes",
    "measure_contention",
    "measure_gloo",
]

# Share of a CPU rank's memory the planner leaves to the allocator: a process's resident memory
# (what a memory limit sees) exceeds the bytes its tensors use, because glibc keeps freed memory
# for reuse (bench/results/e2e_memory.md).
LOCAL_RESERVED_MEMORY_FRACTION = 0.4

_MIB = 2**20


# ----------------------------------------------------------------------------- what this machine is


# ----------------------------------------------------------------------------- the Cluster


def local_cluster(
    num_devices: int = 2,
    memory_bytes: int | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    num_threads: int | None = None,
    compute_slowdown: float | None = None,
    reserved_memory_fraction: float = LOCAL_RESERVED_MEMORY_FRACTION,
) -> Cluster:
    """``num_devices`` CPU ranks on this machine, one node, calibrated by measurement.

    The device is ``local_cpu_spec`` measured with ``num_threads`` threads (default: this
    process's torch thread count shared out among the ranks); the intra-node link and the
    collective efficiency are what gloo achieves between two processes, ``measure_gloo``.
    ``memory_bytes`` (per rank) defaults to this machine's RAM shared out among the ranks.
    ``compute_slowdown`` defaults to ``measure_contention``: how much slower each rank
    computes while all ``num_devices`` ranks do. The measurements are cached in ``cache_dir``
    when given; uncached, they start a few interpreters.

    ``reserved_memory_fraction`` defaults to LOCAL_RESERVED_MEMORY_FRACTION: glibc keeps freed
    memory, so a rank's resident memory exceeds its tensors' bytes; trimming it back costs a
    large share of the step time instead (bench/results/e2e_memory.md, bench/results/probes.md).

    In a job of several processes (torch.distributed initialised with a world of more than one,
    or torchrun's ``WORLD_SIZE`` above 1), rank 0 measures while the other ranks wait, and every
    rank returns rank 0's Cluster (``measured_on_rank_zero``): ranks measuring at once would slow
    each other down and disagree.
    """
    import torch

    num_devices = positive_int(num_devices, "num_devices")
    threads = num_threads or max(1, torch.get_num_threads() // num_devices)
    memory = memory_bytes if memory_bytes is not None else machine_memory_bytes() // num_devices

    def measure() -> Cluster:
        device = local_cpu_spec(cache_dir, memory_bytes=memory, num_threads=threads)
        gloo = measure_gloo(cache_dir)
        slowdown = compute_slowdown
        if slowdown is None:
            slowdown = measure_contention(num_devices, threads, cache_dir=cache_dir)
        return Cluster(
            device=device,
            num_devices=num_devices,
            devices_per_node=num_devices,
            intra_node_bandwidth_bytes_per_s=gloo["bandwidth_bytes_per_s"],
            intra_node_latency_s=gloo["latency_s"],
            collective_efficiency=gloo["collective_efficiency"],
            compute_slowdown=slowdown,
            reserved_memory_fraction=reserved_memory_fraction,
        )

    return measured_on_rank_zero(measure)


# ----------------------------------------------------------------------------- the CPU


def local_cpu_spec(
    cache_dir: str | os.PathLike | None = None, *, memory_bytes: int | None = None, num_threads: int | None = None
) -> DeviceSpec:
    """The catalog's "cpu" entry calibrated on this machine: matmul FLOP/s per dtype, copy
    bandwidth and the fixed cost of one operation, in place of the catalog's guesses.

    ``num_threads`` (default: torch's current intra-op thread count) is the thread count to
    measure with, e.g. the share of cores one rank gets. With ``cache_dir`` the result is kept
    keyed by torch version, thread count and CPU model, and later calls read it instead of
    measuring. The measured rates are what this machine achieves, so both efficiency factors
    are 1.
    """
    import torch

    num_threads = num_threads or torch.get_num_threads()
    key = {"torch": torch.__version__, "num_threads": int(num_threads), "cpu": cpu_model(), "method": 2}
    measured = measure_once(cache_dir, "cpu-calibration", key, lambda: _calibrate_cpu(int(num_threads)))
    base = get_device("cpu")
    return dataclasses.replace(
        base,
        memory_bytes=memory_bytes if memory_bytes is not None else base.memory_bytes,
        peak_flops=dict(measured["peak_flops"]),
        memory_bandwidth_bytes_per_s=float(measured["memory_bandwidth_bytes_per_s"]),
        compute_efficiency=1.0,
        memory_efficiency=1.0,
        op_overhead_s=float(measured["op_overhead_s"]),
    )


_CHAIN_LENGTH = 200  # tiny ops timed for the per-op overhead


def _calibrate_cpu(num_threads: int) -> dict[str, Any]:
    """Median rates of a few 1024³ matmuls per dtype and of a 64 MiB tensor copy, and the fixed
    cost of one operation: the forward of a chain of tiny ops with autograd recording, per op."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        peak_flops = {}
        n = 1024
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
            a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
            seconds = _median_time(lambda: torch.mm(a, b), repeats=4 if dtype == torch.float32 else 3)  # noqa: B023 - timed at once
            peak_flops[name] = 2 * n**3 / seconds
        src = torch.ones(16 * _MIB)  # 64 MiB of float32
        dst = torch.empty_like(src)
        seconds = _median_time(lambda: dst.copy_(src), repeats=7)
        bandwidth = 2 * src.numel() * src.element_size() / seconds  # read + write
        leaf = torch.randn(8, 16, requires_grad=True)

        def chain() -> torch.Tensor:
            x = leaf
            for _ in range(_CHAIN_LENGTH // 2):
                x = torch.nn.functional.gelu(x) * 1.0001
            return x

        op_overhead_s = _median_time(chain, repeats=7) / _CHAIN_LENGTH
    finally:
        torch.set_num_threads(previous)
    return {"peak_flops": peak_flops, "memory_bandwidth_bytes_per_s": bandwidth, "op_overhead_s": op_overhead_s}


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and library initialisation
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------- gloo between two processes


def measure_gloo(
    cache_dir: str | os.PathLike | None = None,
    *,
    num_bytes: int = 16 * 2**20,
    repeats: int = 5,
    num_pings: int = 30,
    timeout_s: float = 120.0,
) -> dict[str, float]:
    """What gloo achieves between two processes of this machine (loopback TCP, as CPU ranks use it).

    Returns ``bandwidth_bytes_per_s`` and ``latency_s`` of send/recv (ping-pong of ``num_bytes``
    and of one float), and ``collective_efficiency``: the bandwidth a 2-rank all-reduce of
    ``num_bytes`` achieves under the ring model (``partita.cost.comm``) over the send/recv
    bandwidth. gloo's all-reduce also sums and copies on the CPU, so it reaches well under the
    link's bandwidth. Two interpreters run ``_gloo_probe``; cached in ``cache_dir`` when given.
    """
    import torch

    key = {
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "num_bytes": int(num_bytes),
        "torch": torch.__version__,
        "probe": "gloo-1",
    }

    def measure() -> dict:
        raw = _run_gloo_probe(num_bytes, repeats, num_pings, timeout_s)
        latency = raw["latency_s"]
        bandwidth = num_bytes / max(raw["transfer_s"] - latency, 1e-9)
        # 2 ranks: all-reduce = 2·α + (2·(n−1)/n = 1) · b / β_ring
        ring_bandwidth = num_bytes / max(raw["allreduce_s"] - 2 * latency, 1e-9)
        return {
            "bandwidth_bytes_per_s": bandwidth,
            "latency_s": latency,
            "collective_efficiency": min(1.0, ring_bandwidth / bandwidth),
            "raw": raw,
        }

    measured = measure_once(cache_dir, "gloo", key, measure)
    return {k: float(v) for k, v in measured.items() if k != "raw"}


def _run_gloo_probe(num_bytes: int, repeats: int, num_pings: int, timeout_s: float) -> dict[str, float]:
    """Start ``_gloo_probe`` as ranks 0 and 1 and return rank 0's timings."""
    port = free_port()
    env = _probe_env(num_threads=1)
    procs = [
        subprocess.Popen(
            _probe_command("gloo-probe", rank, port, num_bytes, repeats, num_pings),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
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


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nobody listens on now, below the kernel's ephemeral range.

    A port from ``bind(0)`` lies inside that range, where the kernel hands out the local ports of
    every outgoing connection: between the check and the moment a rank listens on it (seconds, while
    the rank imports torch), another process's connection may take it, and the rank then fails with
    EADDRINUSE. Below the range only another deliberate listener can; so the port is drawn at random
    there (from the OS's entropy, not the seeded ``random``: processes seeded alike would draw alike),
    and checked."""
    low = _ephemeral_range()[0]
    candidates = range(max(1024, low - 12000), low)
    for port in random.SystemRandom().sample(candidates, min(64, len(candidates))):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every one taken: let the OS pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; its default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _gloo_probe(rank: int, port: int, num_bytes: int, repeats: int, num_pings: int) -> None:
    """One rank of the gloo probe (run in a process of its own): ping-pong latency and
    bandwidth of send/recv, then all-reduce times; rank 0 prints them as one JSON line."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    peer = 1 - rank

    def ping_pong(t: torch.Tensor, count: int) -> float:
        times = []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, peer)
                dist.recv(t, peer)
            else:
                dist.recv(t, peer)
                dist.send(t, peer)
            times.append(time.perf_counter() - start)
        return statistics.median(times) / 2

    def all_reduce(t: torch.Tensor, count: int) -> float:
        times = []
        for _ in range(count):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    small, big = torch.zeros(1), torch.zeros(num_bytes // 4)
    ping_pong(small, 3)  # warm-up: connections, buffers
    ping_pong(big, 1)
    all_reduce(big, 1)
    out = {
        "latency_s": ping_pong(small, num_pings),
        "transfer_s": ping_pong(big, repeats),
        "allreduce_small_s": all_reduce(small, num_pings),
        "allreduce_s": all_reduce(big, repeats),
    }
    if rank == 0:
        print(json.dumps(out), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- ranks slowing each other down


def measure_contention(
    num_ranks: int,
    num_threads: int = 1,
    *,
    cache_dir: str | os.PathLike | None = None,
    duration_s: float = 0.5,
    rounds: int = 3,
    timeout_s: float = 120.0,
) -> float:
    """How much slower one rank's kernels run while ``num_ranks`` ranks of ``num_threads``
    threads compute at once on this machine, as a factor >= 1 (1 for a single rank).

    CPU ranks on one host share caches and memory bandwidth, so each computes slower than its
    solo profile while the others compute too (accelerators do not share their compute this
    way, so catalog clusters keep a factor of 1; ``partita.cost.table.contended`` applies the
    factor to a CostTable). ``num_ranks`` interpreters start once and run ``_contention_probe``,
    a transformer-like mix of kernels (matmul, GELU, layer norm, softmax, add); each of
    ``rounds`` rounds times probe 0 alone, then all of them released together. The factor is
    the smallest round's ratio (median concurrent / solo): other jobs on a shared machine only
    ever make a round look worse. Cached in ``cache_dir`` when given, keyed by CPU model, core
    count, rank and thread counts and torch version.
    """
    import torch

    if num_ranks <= 1:
        return 1.0
    key = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "num_ranks": int(num_ranks),
        "num_threads": int(num_threads),
        "torch": torch.__version__,
    }

    def measure() -> dict:
        ratios = _probe_rounds(num_ranks, num_threads, duration_s, rounds, timeout_s)
        return {"round_ratios": ratios, "slowdown": max(1.0, min(ratios))}

    return float(measure_once(cache_dir, "contention", key, measure)["slowdown"])


def _probe_rounds(count: int, num_threads: int, duration_s: float, rounds: int, timeout_s: float) -> list[float]:
    env = _probe_env(num_threads=num_threads)
    procs = [
        subprocess.Popen(
            _probe_command("contention-probe", num_threads, duration_s),
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]

    def run(group: list) -> list[float]:
        for p in group:  # released together
            p.stdin.write("run\n")
            p.stdin.flush()
        return [float(json.loads(_read_line(p, timeout_s))) for p in group]

    try:
        for p in procs:
            if _read_line(p, timeout_s) != "ready":
                raise RuntimeError("contention probe did not start")
        ratios = []
        for _ in range(rounds):
            solo = run(procs[:1])[0]
            ratios.append(statistics.median(run(procs)) / solo)
        return ratios
    finally:
        for p in procs:
            p.kill()
            _, err = p.communicate()
            if p.returncode not in (0, -9) and err:
                raise RuntimeError(f"contention probe failed: {err[-2000:]}")


def _read_line(p: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    line = p.stdout.readline() if ready else ""
    if not line:
        raise RuntimeError(f"contention probe gave no answer in {timeout_s:.0f} s (exit code {p.poll()})")
    return line.strip()


def _contention_probe(num_threads: int, duration_s: float) -> None:
    """One probe process: says "ready" once torch is imported and the tensors exist, then for
    every "run" line on stdin times its kernel mix and prints the median iteration (s)."""
    import torch

    torch.set_num_threads(num_threads)
    x = torch.randn(512, 512)
    w1, w2 = torch.randn(512, 2048) / 23, torch.randn(2048, 512) / 45
    scores = torch.randn(8, 128, 128)

    def step() -> torch.Tensor:
        h = torch.nn.functional.gelu(x @ w1) @ w2
        h = torch.nn.functional.layer_norm(h + x, (512,))
        return torch.softmax(scores, dim=-1).sum() + h.sum()

    step()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        end = time.perf_counter() + duration_s / 4
        while time.perf_counter() < end:  # warm-up
            step()
        times, end = [], time.perf_counter() + duration_s
        while time.perf_counter() < end:
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        print(json.dumps(statistics.median(times)), flush=True)


# ----------------------------------------------------------------------------- probe processes

# Variables a torchrun rank passes to its children: a probe that inherits them waits in
# init_process_group on the agent's store, which no one serves for it (../shared/FACTS.md).
_RENDEZVOUS_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _probe_command(probe: str, *args: Any) -> list[str]:
    return [sys.executable, "-m", "partita.cost.local_machine", probe, *map(str, args)]


def _probe_env(num_threads: int) -> dict[str, str]:
    """This process's environment for a probe: ``num_threads`` OpenMP threads, no torchrun
    rendezvous variables, and this partita on the import path (also when not installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_") and k not in _RENDEZVOUS_VARIABLES}
    env["OMP_NUM_THREADS"] = str(num_threads)
    root = os.path.realpath(Path(__file__).resolve().parents[2])  # the folder holding the partita package
    installed = {os.path.realpath(p) for p in (*site.getsitepackages(), site.getusersitepackages())}
    if root not in installed:  # a source checkout: a site-packages folder must not go before the stdlib
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def _main(argv: list[str]) -> None:
    probes = {
        "gloo-probe": (_gloo_probe, (int, int, int, int, int)),
        "contention-probe": (_contention_probe, (int, float)),
    }
    if not argv or argv[0] not in probes or len(argv) - 1 != len(probes[argv[0]][1]):
        sys.exit(
            "usage: python -m partita.cost.local_machine gloo-probe RANK PORT NUM_BYTES REPEATS PINGS\n"
            "       python -m partita.cost.local_machine contention-probe NUM_THREADS DURATION_S"
        )
    probe, types = probes[argv[0]]
    probe(*(cast(value) for cast, value in zip(types, argv[1:])))


if __name__ == "__main__":
    _main(sys.argv[1:])
