"""`partita train --nnodes 2`: two launcher processes on this machine, one "node" each, plan once and
train to the losses of one `partita train --nproc 2` run.

Every node runs the same command with its own --node-rank; rank 0 of the job plans for 2 nodes of
1 device (so the planner costs the link between the stages as a network link) and shares the plan
with the other node's rank. The three launchers start at once so that their start-up (imports,
capture, measuring this machine: ~1 min each on a loaded 2-core machine) overlaps; the plan's
layout is pinned, so that both jobs run a 2-stage 1F1B pipeline (the cut may differ: without
gradient clipping the losses do not depend on it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_launch import REPO, free_port

pytest.importorskip("transformers")

STEPS, TIMEOUT_S = 3, 300
# No gradient clipping: the global norm sums per-stage parts, whose rounding depends on the cut.
PINNED = [
    "--steps", str(STEPS), "--global-batch", "8", "--num-stages", "2", "--replicas", "1",
    "--microbatches", "2", "--schedule", "1f1b", "--tensor-parallel", "1", "--max-grad-norm", "0",
]  # fmt: skip


def _env() -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def _start(log: Path, *args: str) -> subprocess.Popen:
    """``partita train gpt2 ARGS`` writing to ``log``, in a session of its own (its torchrun agent and ranks with it)."""
    with log.open("w") as out:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-m", "partita.cli", "train", "gpt2", *PINNED, *args],
            cwd=REPO,
            env=_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(procs: list[subprocess.Popen], logs: list[Path]) -> list[str]:
    """Every process's output, once all have ended; past TIMEOUT_S every process group started here is killed."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [log.read_text() for log in logs]


def test_two_nodes_plan_once_and_train_as_one_node(tmp_path, machine_cache):
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "one-node.log"]
    nodes = [
        _start(
            logs[k],
            *("--nnodes", "2", "--nproc", "1", "--node-rank", str(k), "--rdzv-endpoint", f"127.0.0.1:{port}"),
            *("--losses-out", str(tmp_path / "two.json"), "--plan-out", str(tmp_path / "two-nodes-plan.json")),
            *("--cache-dir", str(tmp_path / f"cache-node{k}")),  # each node measures its own machine
        )
        for k in range(2)
    ]
    one_node = _start(
        logs[2], "--nproc", "2", "--losses-out", str(tmp_path / "one.json"), "--cache-dir", str(machine_cache)
    )
    outputs = _finish([*nodes, one_node], logs)
    assert all(p.returncode == 0 for p in (*nodes, one_node)), "\n-----\n".join(out[-3000:] for out in outputs)

    # One plan, made by rank 0 for 2 nodes of 1 device, written once.
    assert sum(out.count("written to") for out in outputs[:2]) == 1, outputs[:2]
    plan = json.loads((tmp_path / "two-nodes-plan.json").read_text())
    assert plan["cluster"]["num_devices"] == 2 and plan["cluster"]["devices_per_node"] == 1
    assert len(plan["stages"]) == 2

    expected = json.loads((tmp_path / "one.json").read_text())["losses"]
    assert len(expected) == STEPS and expected[-1] < expected[0]
    assert json.loads((tmp_path / "two.json").read_text())["losses"] == expected


def test_a_node_whose_partner_never_starts_gives_up_after_the_rendezvous_timeout(tmp_path):
    """Node 0 (c10d: it hosts the rendezvous) and node 1 (static: it connects to node 0's store) of
    two 2-node jobs whose other node never starts: each says what it waits for, and ends after
    --rdzv-timeout with an error naming the endpoint and the fix, not a silent wait."""
    logs = [tmp_path / "c10d.log", tmp_path / "static.log"]
    procs = [
        _start(
            log,
            *("--nnodes", "2", "--nproc", "1", "--node-rank", rank, "--rdzv-backend", backend),
            *("--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-timeout", "5"),
        )
        for log, rank, backend in zip(logs, ("0", "1"), ("c10d", "static"))
    ]
    started = time.monotonic()
    outputs = _finish(procs, logs)
    assert time.monotonic() - started < 120, "a node waited far beyond --rdzv-timeout 5"
    for proc, out, rank in zip(procs, outputs, ("0", "1")):
        assert proc.returncode == 2, out[-3000:]
        assert f"node {rank}: waiting up to 5 s (--rdzv-timeout) for all 2 nodes to join the rendezvous at" in out
        assert f"partita train: error: node {rank}: not all 2 nodes joined the rendezvous at 127.0.0.1:" in out, out
        assert "within 5 s (--rdzv-timeout): start the same command on every node" in out
        assert "Traceback" not in out, out[-3000:]
