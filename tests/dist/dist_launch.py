"""Start N ranks of a job in ``workers.py`` as separate processes, torchrun style, and collect results.

Every rank is a fresh ``python workers.py JOB DIR`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK set, one thread each. Ranks write ``DIR/result<rank>.pt``
(``torch.save``) and log to ``DIR/rank<rank>.log``. The first rank to fail ends the job at once:
the others are killed (only the processes started here) and the error shows that rank's log.
A job past its timeout is killed the same way, never left hanging.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORKERS = Path(__file__).with_name("workers.py")
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it; a small race is acceptable in tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    job: str, world_size: int, out_dir: Path, *, timeout_s: float, workers: Path = WORKERS, **params: Any
) -> list[Any]:
    """Run ``job`` of the ``workers`` script on ``world_size`` ranks; return each rank's result, in rank order."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(params, out_dir / "params.pt")
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_OFFLINE": "1",
        }
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(workers), job, str(out_dir)],
                    env=env,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    try:
        _wait(procs, out_dir, timeout_s)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return [torch.load(out_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


# Log lines of a rank that failed only because another one died first.
_PEER_DIED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _wait(procs: list, out_dir: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc, _ in procs]
        if any(code not in (None, 0) for code in codes):
            time.sleep(1.0)  # let the other ranks notice and flush their logs
            _raise_first_failure([proc.poll() for proc, _ in procs], out_dir)
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- rank {r} ---\n{_tail(out_dir / f'rank{r}.log', 1500)}" for r in range(len(procs)))
            raise AssertionError(
                f"job timed out after {timeout_s:.0f} s; running ranks "
                f"{[r for r, c in enumerate(codes) if c is None]}:\n{logs}"
            )
        time.sleep(0.05)


def _raise_first_failure(codes: list, out_dir: Path) -> None:
    """Report the rank whose own error ended the job, not the ranks that lost their peer."""
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
    logs = {rank: _tail(out_dir / f"rank{rank}.log") for rank in failed}
    causes = [rank for rank in failed if not any(marker in logs[rank] for marker in _PEER_DIED)] or failed
    rank = causes[0]
    others = ", ".join(str(r) for r in failed if r != rank) or "none"
    raise AssertionError(f"rank {rank} failed (exit {codes[rank]}; other failed ranks: {others}):\n{logs[rank]}")


def _tail(path: Path, num_chars: int = 6000) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError as e:
        return f"(no log: {e})"
