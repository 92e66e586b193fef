"""`partita train` on several nodes: the rendezvous flags, the cluster of nodes planned for, and the
one plan of the job.

Every node runs the same ``partita train --nnodes N --node-rank K --rdzv-endpoint HOST:PORT ...``
command. Each node's launcher starts ``--nproc`` ranks through torchrun's launcher at once (no
node plans before its launcher starts: a late node would make the others' rendezvous time out);
then rank 0 of the job, wherever the rendezvous put it, captures, plans for N x --nproc devices
in nodes of --nproc and shares the plan with every rank (``shared_plan``), so the job holds one
plan, made and written once. A plan file (``--plan``) is read by every node instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from partita.errors import InputError, RendezvousTimeoutError
from partita.types import Plan
from partita.types.cluster import Cluster

__all__ = ["Nodes", "job_plan", "launch_nodes", "local_nodes_cluster", "plan_on_rank0"]

RDZV_BACKENDS = ("c10d", "static")
DEFAULT_RDZV_TIMEOUT_S = 600  # torchrun's own default for both backends
_ENDPOINT_EXAMPLE = "node0.example.com:29400"


@dataclass(frozen=True)
class Nodes:
    """How the nodes of a job find each other: torchrun's --nnodes, --node-rank and --rdzv-*.

    ``backend`` c10d (torchrun's elastic rendezvous: the endpoint's machine hosts it, node ranks
    are assigned when the nodes meet) or static (node ``node_rank`` gets ranks ``node_rank x
    --nproc`` on; node 0 must be the endpoint). ``run_id`` is the same on every node; by default
    it is made from the endpoint, which every node shares and no two running jobs do.
    ``timeout_s``: how long a node waits for all nodes to join before it gives up
    (RendezvousTimeoutError); torchrun's ``join_timeout`` (c10d) or ``timeout`` (static).
    """

    num_nodes: int = 1
    node_rank: int = 0
    endpoint: str | None = None
    backend: str = "c10d"
    run_id: str | None = None
    timeout_s: int = DEFAULT_RDZV_TIMEOUT_S

    def __post_init__(self) -> None:
        n, k = self.num_nodes, self.node_rank
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InputError(f"--nnodes must be an int >= 1 (the machines of the job), got {n!r}")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n:
            raise InputError(
                f"--node-rank {k} is not a node of --nnodes {n}: nodes are numbered 0 to {n - 1}; give "
                f"each node its own --node-rank in that range" + ("" if n > 1 else ", or more --nnodes")
            )
        if self.backend not in RDZV_BACKENDS:
            raise InputError(f"--rdzv-backend {self.backend!r} is not one of {', '.join(RDZV_BACKENDS)}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise InputError(
                f"--rdzv-timeout must be a whole number of seconds >= 1 (how long a node waits for the others), got {t!r}"
            )
        if n == 1:
            return
        if self.endpoint is None:
            raise InputError(
                f"--nnodes {n} needs --rdzv-endpoint HOST:PORT, where the nodes meet: a machine and free "
                f"port every node reaches (e.g. node 0's, --rdzv-endpoint {_ENDPOINT_EXAMPLE}), the same "
                "on every node"
            )
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InputError(
                f"--rdzv-endpoint {self.endpoint!r} is not HOST:PORT with a port in 1-65535: write e.g. "
                f"--rdzv-endpoint {_ENDPOINT_EXAMPLE}"
            )
        if self.run_id is None:
            object.__setattr__(self, "run_id", "partita-" + re.sub(r"[^A-Za-z0-9]+", "-", self.endpoint))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Nodes:
        """The train command's flags; InputError for rendezvous flags on a one-node job."""
        given = [
            flag
            for flag, value in (
                ("--rdzv-endpoint", args.rdzv_endpoint),
                ("--rdzv-backend", args.rdzv_backend),
                ("--rdzv-id", args.rdzv_id),
                ("--rdzv-timeout", args.rdzv_timeout),
            )
            if value is not None
        ]
        if args.nnodes == 1 and given:
            raise InputError(
                f"{', '.join(given)} with --nnodes 1: a one-node job meets on this machine (torchrun "
                f"--standalone); drop {', '.join(given)}, or give the job's --nnodes"
            )
        return cls(
            num_nodes=args.nnodes,
            node_rank=args.node_rank,
            endpoint=args.rdzv_endpoint,
            backend=args.rdzv_backend or "c10d",
            run_id=args.rdzv_id,
            timeout_s=DEFAULT_RDZV_TIMEOUT_S if args.rdzv_timeout is None else args.rdzv_timeout,
        )

    def torchrun_args(self) -> list[str]:
        """torchrun's options for this node, in place of --standalone."""
        argv = [
            f"--nnodes={self.num_nodes}",
            f"--rdzv-backend={self.backend}",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={'join_timeout' if self.backend == 'c10d' else 'timeout'}={self.timeout_s}",
        ]
        if self.backend == "static":  # c10d assigns node ranks itself (torchrun warns that it ignores one)
            argv.append(f"--node-rank={self.node_rank}")
        return argv


def local_nodes_cluster(
    num_devices: int, *, num_nodes: int = 1, memory_bytes: int | None = None, cache_dir: str | None = None
) -> Cluster:
    """``num_nodes`` machines like this one with ``num_devices / num_nodes`` CPU ranks each.

    A node is ``Cluster.local`` for its ranks (this CPU, the loopback link and the slowdown of
    that many ranks, measured); between nodes the catalog CPU's network (25 GbE), never taken
    faster than the loopback link measured here.
    """
    per_node = num_devices // num_nodes
    node = Cluster.local(num_devices=per_node, memory_bytes=memory_bytes, cache_dir=cache_dir)
    if num_nodes == 1:
        return node
    return dataclasses.replace(
        node,
        num_devices=num_devices,
        devices_per_node=per_node,
        inter_node_bandwidth_bytes_per_s=min(
            node.inter_node_bandwidth_bytes_per_s, node.intra_node_bandwidth_bytes_per_s
        ),
        inter_node_latency_s=max(node.inter_node_latency_s, node.intra_node_latency_s),
    )


def launch_nodes(args: argparse.Namespace, nodes: Nodes, plan_nproc: Callable[[], int]) -> None:
    """This node's share of a multi-node job: ``--nproc`` ranks (or the plan file's devices per
    node, ``plan_nproc``) through torchrun's launcher, rendezvousing with the other nodes."""
    from partita.runtime.launch import launch_local

    nproc = plan_nproc() if args.plan else (2 if args.nproc is None else args.nproc)
    world = nodes.num_nodes * nproc
    if args.plan:
        print(f"node {nodes.node_rank}: starting {nproc} of the {world} processes of {args.plan}")
    else:
        print(
            f"node {nodes.node_rank}: starting {nproc} of {world} processes; rank 0 of the job plans for "
            f"{nodes.num_nodes} nodes x {nproc} and shares the plan"
        )
    print(
        f"node {nodes.node_rank}: waiting up to {nodes.timeout_s} s (--rdzv-timeout) for all {nodes.num_nodes} nodes "
        f"to join the rendezvous at {nodes.endpoint} (run id {nodes.run_id}, backend {nodes.backend})",
        flush=True,
    )
    try:
        launch_local(args.argv, nproc=nproc, max_restarts=args.max_restarts, rendezvous=nodes.torchrun_args())
    except Exception as e:
        if not _is_rendezvous_timeout(e):
            raise
        raise RendezvousTimeoutError(
            f"node {nodes.node_rank}: not all {nodes.num_nodes} nodes joined the rendezvous at {nodes.endpoint} within "
            f"{nodes.timeout_s} s (--rdzv-timeout): start the same command on every node, each with its own "
            f"--node-rank (0 to {nodes.num_nodes - 1}) and the same --rdzv-endpoint {nodes.endpoint} and --rdzv-id; "
            f"check that every node reaches {nodes.endpoint} (host name, firewall); or give the nodes longer to "
            f"start with a larger --rdzv-timeout (torchrun: {_first_line(e)})"
        ) from e


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _is_rendezvous_timeout(error: BaseException) -> bool:
    """torchrun's rendezvous gave up waiting: c10d raises RendezvousTimeoutError; static, a store
    that timed out waiting for the other nodes (DistStoreError) or connecting to node 0's (DistNetworkError)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError as TorchRendezvousTimeout

    for e in (error, error.__cause__, error.__context__):
        text = str(e).lower()
        if isinstance(e, TorchRendezvousTimeout) or (
            isinstance(e, DistError) and ("timeout" in text or "timed out" in text)
        ):
            return True
    return False


def job_plan(args: argparse.Namespace, graph, plan_for: Callable[[int, int], Plan]) -> Plan:
    """The job's plan, made on rank 0 for the ranks torchrun started and given to every rank.

    ``plan_for(num_devices, num_nodes)`` plans (on rank 0 only). Collective: call on every rank.
    """
    from partita.runtime.job import shared_plan
    from partita.types.plan_file import check_plan_matches_graph

    world, per_node = int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    plan = shared_plan(lambda: plan_on_rank0(args, graph, plan_for, world_size=world, devices_per_node=per_node))
    check_plan_matches_graph(plan, graph, source="the plan shared by rank 0")  # each node captured its own model
    return plan


def plan_on_rank0(
    args: argparse.Namespace, graph, plan_for: Callable[[int, int], Plan], *, world_size: int, devices_per_node: int
) -> Plan:
    """Plan for ``world_size`` devices in nodes of ``devices_per_node``, write the plan file, print it.

    After a restart (torchrun's --max-restarts) the plan written by an earlier attempt is read
    back, so that the resumed run continues with the plan its checkpoint was trained under; the
    first attempt removes any older file there first, so that no restart reads another job's plan.
    """
    from partita.runtime.launch import restart_count

    path = job_plan_path(args.plan_out)
    if restart_count() > 0 and os.path.exists(path):
        print(f"restart {restart_count()}: the plan of the first attempt, {path}")
        return Plan.load(path, graph=graph)
    if restart_count() == 0 and os.path.exists(path):
        os.remove(path)
    if world_size % devices_per_node:
        raise InputError(
            f"{world_size} ranks do not make whole nodes of {devices_per_node}: start the same --nproc on every node"
        )
    num_nodes = world_size // devices_per_node
    plan = plan_for(world_size, num_nodes)
    if plan.num_devices != world_size:
        raise InputError(
            f"the fastest plan for {num_nodes} nodes x {devices_per_node} processes uses {plan.num_devices} "
            f"devices, but every node has started its processes: pin --num-stages and --replicas (x "
            f"--tensor-parallel) to use all {world_size}, or start fewer (--nnodes, --nproc)"
        )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    plan.save(path)
    rounds = f", {args.accumulate} rounds per optimizer step" if args.accumulate > 1 else ""
    print(
        f"plan for {num_nodes} nodes x {devices_per_node} processes ({plan.cost_source} costs{rounds}), "
        f"written to {path} on rank 0's node:"
    )
    print(plan.summary())
    return plan


def job_plan_path(plan_out: str | None) -> str:
    """``--plan-out``, or a file named after torchrun's run id (the same in every attempt of a job)."""
    import tempfile

    if plan_out:
        return plan_out
    run_id = re.sub(r"[^A-Za-z0-9_.-]+", "-", os.environ.get("TORCHELASTIC_RUN_ID", "none"))
    return os.path.join(tempfile.gettempdir(), f"partita-job-{run_id}", "plan.json")
