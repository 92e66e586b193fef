"""`partita train --nnodes`: the rendezvous flags are checked before anything starts, each node's
launcher starts its share of the ranks without planning, the planner is told the nodes, and the
job's plan is made once (and read back after a restart). The two-node run itself is in
tests/dist/test_multinode_cli.py."""

from __future__ import annotations

import argparse
import dataclasses
import importlib

import pytest

import partita
from partita.cli.main import main
from partita.cli.multinode import Nodes, local_nodes_cluster, plan_on_rank0
from partita.errors import InputError
from partita.planning.manual import manual_plan

CLI = importlib.import_module("partita.cli.main")
LAUNCH = importlib.import_module("partita.runtime.launch")
LOCAL_MACHINE = importlib.import_module("partita.cost.local_machine")
ENDPOINT = ("--rdzv-endpoint", "node0:29400")


def _forbid_starting(monkeypatch) -> None:
    """Loading the model, planning and launching fail the test: the flags must be refused first."""

    def reached(*args, **kwargs):
        raise AssertionError("the job went on past a bad flag")

    for name in ("_load", "_plan_for_training"):
        monkeypatch.setattr(CLI, name, reached)
    monkeypatch.setattr(LAUNCH, "launch_local", reached)


def _plan(graph, num_devices: int):
    cuts = [0, graph.num_nodes] if num_devices == 1 else [0, graph.num_nodes // 2, graph.num_nodes]
    plan = manual_plan(
        graph, cuts, schedule="1f1b", num_rank_groups=len(cuts) - 1, num_microbatches=2, global_batch_size=8
    )
    return dataclasses.replace(plan, predicted_step_s=0.1)  # as a searched plan has (its table divides by it)


# ----------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--nnodes", "2", "--node-rank", "2", *ENDPOINT], "--node-rank 2 is not a node of --nnodes 2: nodes are "
         "numbered 0 to 1; give each node its own --node-rank in that range"),
        (["--nnodes", "2", "--node-rank", "-1", *ENDPOINT], "--node-rank -1 is not a node of --nnodes 2"),
        (["--node-rank", "1"], "--node-rank 1 is not a node of --nnodes 1: nodes are numbered 0 to 0; give each "
         "node its own --node-rank in that range, or more --nnodes"),
        (["--nnodes", "0"], "--nnodes must be an int >= 1 (the machines of the job), got 0"),
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT, where the nodes meet"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0' is not HOST:PORT with a port in "
         "1-65535: write e.g. --rdzv-endpoint node0.example.com:29400"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0:99999"], "--rdzv-endpoint 'node0:99999' is not HOST:PORT"),
        ([*ENDPOINT, "--rdzv-id", "job7"], "--rdzv-endpoint, --rdzv-id with --nnodes 1: a one-node job meets on "
         "this machine (torchrun --standalone); drop --rdzv-endpoint, --rdzv-id, or give the job's --nnodes"),
        (["--rdzv-timeout", "5"], "--rdzv-timeout with --nnodes 1"),
        (["--nnodes", "2", *ENDPOINT, "--rdzv-timeout", "0"], r"--rdzv-timeout must be a whole number of seconds >= 1"),
    ],
)  # fmt: skip
def test_bad_node_flags_are_refused_before_anything_starts(flags, message, monkeypatch, capsys):
    _forbid_starting(monkeypatch)
    assert main(["train", "mlp", *flags]) == 2
    assert message in capsys.readouterr().err


def test_torchrun_gets_the_rendezvous_of_the_backend():
    c10d = Nodes(num_nodes=2, node_rank=1, endpoint="10.0.0.1:29400")
    assert c10d.torchrun_args() == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.1:29400",
        "--rdzv-id=partita-10-0-0-1-29400",  # the same on every node: made from the shared endpoint
        "--rdzv-conf=join_timeout=600",  # --rdzv-timeout's default
    ]  # c10d assigns node ranks itself; only the static backend takes --node-rank
    static = Nodes(num_nodes=2, node_rank=1, endpoint="10.0.0.1:29400", backend="static", run_id="job7", timeout_s=30)
    assert static.torchrun_args()[-3:] == ["--rdzv-id=job7", "--rdzv-conf=timeout=30", "--node-rank=1"]


# ----------------------------------------------------------------------------- each node's launcher


def test_each_node_starts_its_ranks_without_planning(monkeypatch, capsys):
    launched = []
    monkeypatch.setattr(CLI, "_plan_for_training", lambda args: pytest.fail("a node planned before starting"))
    monkeypatch.setattr(LAUNCH, "launch_local", lambda argv, **kw: launched.append((argv, kw)))
    argv = ["train", "mlp", "--nnodes", "2", "--node-rank", "1", *ENDPOINT, "--nproc", "3", "--steps", "2"]
    assert main(argv) == 0
    assert launched == [
        (
            argv,  # the ranks get the same flags, and no --plan: rank 0 of the job plans
            {
                "nproc": 3,
                "max_restarts": 0,
                "rendezvous": [
                    "--nnodes=2",
                    "--rdzv-backend=c10d",
                    "--rdzv-endpoint=node0:29400",
                    "--rdzv-id=partita-node0-29400",
                    "--rdzv-conf=join_timeout=600",
                ],
            },
        )
    ]
    out = capsys.readouterr().out
    assert "node 1: starting 3 of 6 processes; rank 0 of the job plans for 2 nodes x 3" in out
    assert "node 1: waiting up to 600 s (--rdzv-timeout) for all 2 nodes to join the rendezvous at node0:29400" in out


def test_a_plan_file_is_split_over_the_nodes(mlp_graph, tmp_path, monkeypatch, capsys):
    path = tmp_path / "plan.json"
    _plan(mlp_graph, 2).save(str(path))
    launched = []
    monkeypatch.setattr(LAUNCH, "launch_local", lambda argv, **kw: launched.append(kw["nproc"]))
    assert main(["train", "mlp", "--plan", str(path), "--nnodes", "2", *ENDPOINT]) == 0
    assert launched == [1]
    assert "was planned for nodes of 2 devices, this job has 2 nodes of 1" in capsys.readouterr().out
    assert main(["train", "mlp", "--plan", str(path), "--nnodes", "2", *ENDPOINT, "--nproc", "2"]) == 2
    assert f"{path} is a plan for 2 devices, but --nproc is 2 x --nnodes 2: drop --nproc" in capsys.readouterr().err
    odd = tmp_path / "one-device.json"
    _plan(mlp_graph, 1).save(str(odd))
    assert main(["train", "mlp", "--plan", str(odd), "--nnodes", "2", *ENDPOINT]) == 2
    assert f"{odd} is a plan for 1 devices, which do not split evenly over --nnodes 2" in capsys.readouterr().err


# ----------------------------------------------------------------------------- what rank 0 plans for


def test_the_planner_is_told_the_nodes(monkeypatch):
    def one_node(num_devices, memory_bytes=None, **kwargs):  # stands in for measuring this machine
        return partita.Cluster(
            device="cpu",
            num_devices=num_devices,
            devices_per_node=num_devices,
            intra_node_bandwidth_bytes_per_s=1e9,
            intra_node_latency_s=1e-4,
        )

    monkeypatch.setattr(LOCAL_MACHINE, "local_cluster", one_node)
    cluster = local_nodes_cluster(4, num_nodes=2)
    assert (cluster.num_devices, cluster.devices_per_node, cluster.num_nodes) == (4, 2, 2)
    assert cluster.link(0, 1) == (1e9, 1e-4)  # in a node: loopback, as measured
    # between nodes: the catalog's 25 GbE (3.1 GB/s), but never faster than loopback
    assert cluster.link(1, 2) == (1e9, 1e-4)
    assert local_nodes_cluster(2).devices_per_node == 2  # one node: Cluster.local as before


def test_rank0_plans_once_and_a_restart_reads_that_plan_back(mlp_graph, tmp_path, monkeypatch, capsys):
    path = tmp_path / "job" / "plan.json"
    path.parent.mkdir()
    path.write_text("a stale plan of another job")
    args = argparse.Namespace(plan_out=str(path), accumulate=1)
    calls = []

    def plan_for(num_devices, num_nodes):
        calls.append((num_devices, num_nodes))
        return _plan(mlp_graph, num_devices)

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = plan_on_rank0(args, mlp_graph, plan_for, world_size=2, devices_per_node=1)
    assert calls == [(2, 2)] and partita.Plan.load(str(path)) == first
    assert "plan for 2 nodes x 1 processes" in capsys.readouterr().out
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert plan_on_rank0(args, mlp_graph, plan_for, world_size=2, devices_per_node=1) == first
    assert calls == [(2, 2)]  # not planned again
    path.unlink()  # the first attempt failed before writing it: plan again
    plan_on_rank0(args, mlp_graph, plan_for, world_size=2, devices_per_node=1)
    assert calls == [(2, 2)] * 2


def test_a_plan_that_leaves_started_ranks_idle_is_refused(mlp_graph, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    args = argparse.Namespace(plan_out=str(tmp_path / "plan.json"), accumulate=1)
    with pytest.raises(InputError, match=r"the fastest plan for 2 nodes x 1 processes uses 1 devices, .*pin "):
        plan_on_rank0(args, mlp_graph, lambda n, nodes: _plan(mlp_graph, 1), world_size=2, devices_per_node=1)
    assert not (tmp_path / "plan.json").exists()
