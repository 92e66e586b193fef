"""Start N ranks of a job in ``workers.py`` as separate processes, torchrun style, and collect results.

Every rank is a fresh ``python workers.py JOB DIR`` with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT and LOCAL_RANK set, one thread each. Ranks write ``DIR/result<rank>.pt``
(``torch.save``) and log to ``DIR/rank<rank>.log``. The first rank to fail ends the job at once:
the others are killed (only the processes started here) and the error shows that rank's log.
A job past its timeout is killed the same way, never left hanging.

``SharedLaunches`` runs the jobs that test modules declare in their ``SHARED_JOBS`` table together:
one launch per world size runs every job of that size that the selected tests use, one after the other
in the same ranks (``workers.job_several``), as each launch costs every rank seconds of interpreter,
torch and partita start-up. tests/dist/conftest.py makes the session's ``launches`` fixture.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from partita.cost.local_machine import free_port  # below the ephemeral ports: see its docstring

WORKERS = Path(__file__).with_name("workers.py")
REPO = Path(__file__).resolve().parents[2]


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


# ----------------------------------------------------------------------------- shared launches


@dataclass(frozen=True)
class Job:
    """A job of the ranks, ``target`` = ``"module:function"`` (a module under tests/dist, the function
    called with ``params`` on every rank), that shares its launch with the other jobs of its world size."""

    target: str
    world_size: int
    timeout_s: float
    params: dict = field(default_factory=dict)
    dir_params: tuple[str, ...] = ()  # params set to a fresh directory of the job's own
    last: bool = False  # runs after the launch's other jobs: it leaves a rank's peer broken off


class SharedLaunches:
    """The results of the jobs in the test modules' ``SHARED_JOBS`` (label -> Job), launched when a
    test first asks for one: with it, every job of the same world size in ``wanted`` that has not run.

    A shared launch that fails is not trusted for any of its jobs: each is then launched alone when
    asked for, so that a failure shows in the tests of the job that failed, with that job's log.
    """

    def __init__(self, wanted: dict[tuple[str, str], Job], out_dir: Path):
        self.wanted = dict(wanted)  # (module name, label) -> Job: what the selected tests use
        self.out_dir = out_dir
        self.results: dict[tuple[str, str], list[Any]] = {}
        self.errors: dict[tuple[str, str], AssertionError] = {}
        self.alone: set[tuple[str, str]] = set()  # the jobs of a shared launch that failed
        self.launches: list[list[str]] = []  # the jobs of each launch, in order

    def results_of(self, module: str, label: str) -> list[Any]:
        """Each rank's result of the job ``label`` of test module ``module``'s SHARED_JOBS, in rank order."""
        key = (module, label)
        if key not in self.results and key not in self.errors:
            self._launch(key, sys.modules[module].SHARED_JOBS[label])
        if key in self.errors:
            raise self.errors[key]
        return self.results[key]

    def _launch(self, key: tuple[str, str], job: Job) -> None:
        done = self.results.keys() | self.errors.keys() | self.alone
        batch = {k: j for k, j in self.wanted.items() if j.world_size == job.world_size and k not in done}
        if key in self.alone:
            batch = {}
        batch.setdefault(key, job)
        ordered = sorted(batch.items(), key=lambda kv: kv[1].last)  # stable: the tests' order otherwise
        out = self.out_dir / f"launch{len(self.launches)}-{job.world_size}ranks"
        jobs = []
        for (module, label), j in ordered:
            job_dir = out / f"{module}.{label}"
            job_dir.mkdir(parents=True)
            jobs.append((f"{module}:{label}", j.target, {**j.params, **dict.fromkeys(j.dir_params, str(job_dir))}))
        self.launches.append([name for name, _, _ in jobs])
        try:
            per_rank = run_ranks(
                "several", job.world_size, out, timeout_s=sum(j.timeout_s for j in batch.values()), jobs=jobs
            )
        except AssertionError as e:
            if len(batch) == 1:
                self.errors[key] = AssertionError(f"job {jobs[0][0]} ({job.target}): {e}")
                return
            self.alone |= batch.keys()  # each again on its own, when asked for
            self._launch(key, job)
            return
        for (module, label), _ in ordered:
            self.results[module, label] = [result[f"{module}:{label}"] for result in per_rank]
