"""Two "nodes" on this machine: torchrun's c10d rendezvous with two launcher processes, one rank each.

A 2-stage pipeline whose stages sit on different nodes trains exactly as the same plan on one node
(the same losses, step for step): multi-node runs are the single-node code path with another
rendezvous.
"""

import json
import os
import subprocess
import sys

from dist_launch import REPO, free_port

import partita
from partita import examples
from partita.planning.manual import manual_plan

STEPS, GLOBAL_BATCH = 3, 8


def _plan_file(tmp_path) -> str:
    ex = examples.build("gpt2", batch_size=8)  # what `partita train gpt2` captures
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cut = next(n.index for n in graph.nodes if n.module_path.startswith("transformer.h.1"))
    cluster = partita.Cluster(device="cpu", num_devices=2, devices_per_node=1)  # two nodes of one device
    plan = manual_plan(
        graph,
        [0, cut, graph.num_nodes],
        schedule="1f1b",
        num_rank_groups=2,
        num_microbatches=2,
        global_batch_size=GLOBAL_BATCH,
        cluster=cluster,
    )
    path = str(tmp_path / "plan.json")
    plan.save(path)
    return path


def _env() -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_OFFLINE": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def _train_args(plan: str, losses) -> list[str]:
    return [
        "train",
        "gpt2",
        "--plan",
        plan,
        "--steps",
        str(STEPS),
        "--global-batch",
        str(GLOBAL_BATCH),
        "--losses-out",
        str(losses),
    ]


def test_a_pipeline_across_two_nodes_trains_as_on_one(tmp_path):
    plan = _plan_file(tmp_path)
    one_node = tmp_path / "one-node.json"
    done = subprocess.run(
        [sys.executable, "-m", "partita.cli", *_train_args(plan, one_node)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]

    two_nodes, port = tmp_path / "two-nodes.json", free_port()
    launchers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "partita-two-nodes",
                "-m",
                "partita.cli",
                *_train_args(plan, two_nodes),
            ],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=300)[0] for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    assert all(p.returncode == 0 for p in launchers), "\n".join(out[-3000:] for out in outputs)
    expected = json.loads(one_node.read_text())["losses"]
    assert len(expected) == STEPS and expected[-1] < expected[0]
    assert json.loads(two_nodes.read_text())["losses"] == expected
