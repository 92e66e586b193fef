"""Ranks that share one machine's memory system slow each other down.

CPU ranks on one host share caches and memory bandwidth: measured on the 2-core development
machines, each rank's kernels ran 15-30% slower while the other rank computed than in a solo
profile (../shared/FACTS.md). ``measure_contention`` measures that factor once per machine and
rank count; ``contended`` applies it to a CostTable's compute times. Accelerators do not share
their compute this way, so catalog clusters keep a factor of 1.

The probe runs a transformer-like mix of kernels (matmul, GELU, layer norm, softmax, add) in
fresh interpreters: one alone, then ``num_ranks`` at once, released together. The factor is the
median iteration time of the concurrent runs over the solo run's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys

from partita.cost.devices import cpu_model, measure_once
from partita.types import CostTable

__all__ = ["contended", "measure_contention"]

# The probe, run by ``python -c``: says "ready" once torch is imported and the tensors exist,
# then for every "run" line on stdin times its kernel mix and prints the median iteration (s).
_PROBE = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
duration = float(sys.argv[2])
x = torch.randn(512, 512)
w1, w2 = torch.randn(512, 2048) / 23, torch.randn(2048, 512) / 45
scores = torch.randn(8, 128, 128)
def step():
    h = torch.nn.functional.gelu(x @ w1) @ w2
    h = torch.nn.functional.layer_norm(h + x, (512,))
    return torch.softmax(scores, dim=-1).sum() + h.sum()
step()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "run":
        break
    end = time.perf_counter() + duration / 4
    while time.perf_counter() < end:  # warm-up
        step()
    times, end = [], time.perf_counter() + duration
    while time.perf_counter() < end:
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps(statistics.median(times)), flush=True)
"""


def measure_contention(num_ranks: int, num_threads: int = 1, *, cache_dir: str | os.PathLike | None = None,
                       duration_s: float = 0.5, rounds: int = 3, timeout_s: float = 120.0) -> float:
    """How much slower one rank's kernels run while ``num_ranks`` ranks of ``num_threads``
    threads compute at once on this machine, as a factor >= 1 (1 for a single rank).

    ``num_ranks`` probe interpreters start once; each of ``rounds`` rounds times probe 0 alone,
    then all of them released together. The factor is the smallest round's ratio (median
    concurrent / solo): other jobs on a shared machine only ever make a round look worse.
    ~3-6 s; cached in ``cache_dir`` when given, keyed by CPU model, core count, rank and
    thread counts and torch version.
    """
    import torch

    if num_ranks <= 1:
        return 1.0
    key = {"cpu": cpu_model(), "cores": os.cpu_count(), "num_ranks": int(num_ranks),
           "num_threads": int(num_threads), "torch": torch.__version__}

    def measure() -> dict:
        ratios = _probe_rounds(num_ranks, num_threads, duration_s, rounds, timeout_s)
        return {"round_ratios": ratios, "slowdown": max(1.0, min(ratios))}

    return float(measure_once(cache_dir, "contention", key, measure)["slowdown"])


def _probe_rounds(count: int, num_threads: int, duration_s: float, rounds: int, timeout_s: float) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
    procs = [subprocess.Popen([sys.executable, "-c", _PROBE, str(num_threads), str(duration_s)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(count)]

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


def contended(costs: CostTable, slowdown: float) -> CostTable:
    """``costs`` with its compute times at ``slowdown`` times the solo profile's. Idempotent: a
    table already slowed (``calibration["compute_slowdown"]``) is rescaled, never slowed twice;
    the same table comes back when nothing changes."""
    factor = slowdown / costs.calibration.get("compute_slowdown", 1.0)
    if factor == 1.0:
        return costs
    return dataclasses.replace(
        costs,
        forward_s=costs.forward_s * factor,
        backward_s=costs.backward_s * factor,
        backward_weight_s=costs.backward_weight_s * factor,
        calibration={**costs.calibration, "compute_slowdown": float(slowdown)},
    )
