"""The process groups of a plan's layout: which rank sits where, and the groups it talks over.

Two layouts:
- uniform (``Plan.on_mesh``): every stage has ``dp`` replicas and rank group ``g`` holds ranks
  ``[g * dp, (g + 1) * dp)`` (``partita.planning.build.stage_ranks``); the ranks form a pp x dp
  DeviceMesh (pp x dp x tp with tensor parallelism); torch's pipelining schedules run each column
  of the mesh as one pipeline (pipeline.py).
- uneven: stage ``k`` has its own ``r_k`` replicas, or replicas with unequal sample shares, or its
  ranks off the mesh's order (GPipe or 1F1B, one stage per rank group), on ranks of its own: those
  after the earlier groups' in a manual plan; on a mixed cluster, those of the device groups it runs
  on, the second group's stages possibly first (layout.py). No mesh expresses it: stages exchange
  slices of micro-batches many-to-many (uneven.py). Under tensor parallelism each index's ranks do
  so among themselves, and each replica's ``t`` ranks form a tensor-parallel group.

Glossary
--------
rank group   one pipeline position ``g``: the ranks each holding one replica of the same stages.
replica      a rank's index inside its rank group (uniform: ``rank % dp``; the ranks with the
             same replica index form one pipeline, one column of the mesh).

One plan per job: ``init_topology`` compares a digest of the plan on every rank
(``plan_digest.check_same_plan``) before it creates any group, since ranks with different plans
would create different groups and hang. A collective timeout (``collective_timeout_s``) applies to
every group partita uses: the process group partita initialises, or else partita's own world
group, the mesh's and the gradient holders' groups.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partita.cost.job_ranks import init_default_group
from partita.errors import InputError, PartitaError
from partita.runtime.layout import check_layout
from partita.runtime.plan_digest import check_same_plan
from partita.runtime.progress import Progress, is_timeout
from partita.types import Plan

__all__ = ["Topology", "init_process_group", "init_topology", "new_group", "start_topology", "timeout_of"]


@dataclass(frozen=True, eq=False)
class Topology:
    """Where this process sits in the plan's layout, and the groups it talks over."""

    rank: int
    world_size: int
    num_rank_groups: int  # pp
    rank_group: int  # this rank's pipeline position (its stages' rank group)
    replica: int  # this rank's index within its rank group
    replicas: int  # replicas of this rank's stages (dp when uniform)
    device: torch.device
    dp_group: dist.ProcessGroup  # this rank's rank group
    pp_group: dist.ProcessGroup | None = None  # uniform: this rank's pipeline (same replica index in every group)
    mesh: object = None  # uniform: the DeviceMesh with axes ("pp", "dp"); uneven: None (no mesh expresses it)
    world_group: dist.ProcessGroup | None = None  # all ranks, with partita's timeout; None: the default group
    timeout: datetime.timedelta | None = None  # collective timeout of partita's groups; None: torch's default
    # Tensor parallelism (tensor_parallel.py): this rank's index in its group of `tensor_parallel`
    # ranks (its stage's degree) and that group; the other fields describe the job that
    # `local_plan` shows this index, and `rank`/`world_size`/`world_group` stay global.
    tensor_parallel: int = 1
    tp_index: int = 0
    tp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False  # this rank's stage's: the tensor-parallel group also splits tokens

    @property
    def uniform(self) -> bool:
        return self.mesh is not None


def init_topology(plan: Plan, *, collective_timeout_s: float | None = None) -> Topology:
    """Initialise torch.distributed if needed (NCCL with CUDA, else gloo), check that every rank
    holds the same plan, and build the groups: the pp x dp mesh of a uniform plan, one group per
    stage of an uneven one.

    Run under torchrun (or with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set), one process per device.
    ``collective_timeout_s``: how long any collective or transfer of partita's may wait (see the
    module docstring); None leaves torch's default (30 min for gloo, 10 min for NCCL).
    """
    timeout = timeout_of(collective_timeout_s)
    device, world_group = init_process_group(timeout, num_devices=plan.num_devices)
    check_same_plan(plan, group=world_group)  # before any group that depends on the plan
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != plan.num_devices:
        raise InputError(
            f"the plan needs {plan.num_devices} ranks but {world} were started: run torchrun with "
            f"--nproc-per-node {plan.num_devices} (x nodes), or re-plan for {world} devices"
        )
    check_layout(plan)
    common = dict(rank=rank, world_size=world, device=device, world_group=world_group, timeout=timeout)
    if plan.tensor_parallel > 1:
        return _tensor_parallel_topology(plan, common, timeout)
    if plan.on_mesh:
        from torch.distributed.device_mesh import init_device_mesh

        pp, dp = plan.num_rank_groups, plan.stages[0].num_replicas
        override = _mesh_timeouts(timeout) if timeout is not None else None
        mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"), backend_override=override)
        dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
        return Topology(
            num_rank_groups=pp,
            rank_group=rank // dp,
            replica=rank % dp,
            replicas=dp,
            dp_group=dp_group,
            pp_group=pp_group,
            mesh=mesh,
            **common,
        )
    groups = [new_group(list(s.ranks), timeout) for s in plan.stages]  # collective: every rank, same order
    # One collective of all ranks before any point-to-point: NCCL sets up the world communicator
    # here, not in a batch_isend_irecv that only some ranks join (undefined behaviour per torch's docs).
    dist.barrier(group=world_group)
    stage = next(s for s in plan.stages if rank in s.ranks)
    return Topology(
        num_rank_groups=plan.num_rank_groups,
        rank_group=stage.rank_group,
        replica=stage.ranks.index(rank),
        replicas=stage.num_replicas,
        dp_group=groups[stage.index],
        **common,
    )


def _tensor_parallel_topology(plan: Plan, common: dict, timeout: datetime.timedelta | None) -> Topology:
    """A plan with tensor parallelism: the ranks of each index ``i`` in their groups run
    ``local_plan(plan, i)`` (``partita.runtime.tensor_parallel``). On a mesh (``Plan.on_mesh``)
    the pp x dp x tp mesh, rank = (group * dp + replica) * t + index; otherwise partita's executor,
    with one group per stage and index (the stage's ranks of that index) and one per replica (its
    t consecutive ranks), each stage at its own degree."""
    if not plan.on_mesh:
        return _uneven_tensor_parallel_topology(plan, common)
    from torch.distributed.device_mesh import init_device_mesh

    t, rank = plan.tensor_parallel, common["rank"]
    pp, dp = plan.num_rank_groups, plan.stages[0].num_replicas
    override = _mesh_timeouts(timeout, ("pp", "dp", "tp")) if timeout is not None else None
    mesh = init_device_mesh(
        common["device"].type, (pp, dp, t), mesh_dim_names=("pp", "dp", "tp"), backend_override=override
    )
    return Topology(
        **common,
        num_rank_groups=pp,
        rank_group=rank // (dp * t),
        replica=(rank // t) % dp,
        replicas=dp,
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
        mesh=mesh,
        tp_group=mesh.get_group("tp"),
        tensor_parallel=t,
        tp_index=rank % t,
        sequence_parallel=plan.sequence_parallel,
    )


def _uneven_tensor_parallel_topology(plan: Plan, common: dict) -> Topology:
    """Partita's executor under tensor parallelism (``_tensor_parallel_topology``): this rank's
    stage, its replica (the index of its group of t ranks in the stage), the stage's ranks of this
    rank's index as its data-parallel group, and its replica's ranks as its tensor-parallel group."""
    rank, timeout = common["rank"], common["timeout"]
    dp_groups = {
        (s.index, i): new_group(list(s.ranks[i :: s.tensor_parallel]), timeout)
        for s in plan.stages
        for i in range(s.tensor_parallel)
    }
    tp_groups = {
        (s.index, j): new_group(list(s.replica_ranks(j)), timeout)
        for s in plan.stages
        if s.tensor_parallel > 1
        for j in range(s.num_replicas)
    }
    dist.barrier(group=common["world_group"])  # as the uneven layout does: a collective before any transfer
    stage = next(s for s in plan.stages if rank in s.ranks)
    t, position = stage.tensor_parallel, stage.ranks.index(rank)
    return Topology(
        **common,
        num_rank_groups=plan.num_rank_groups,
        rank_group=stage.rank_group,
        replica=position // t,
        replicas=stage.num_replicas,
        dp_group=dp_groups[stage.index, position % t],
        tp_group=tp_groups.get((stage.index, position // t)),
        tensor_parallel=t,
        tp_index=position % t,
        sequence_parallel=stage.sequence_parallel,
    )


def init_process_group(
    timeout: datetime.timedelta | None = None, *, num_devices: int | None = None
) -> tuple[torch.device, dist.ProcessGroup | None]:
    """Join the job's process group from torchrun's environment, unless one is initialised:
    (this rank's device, the group of all ranks with ``timeout``, or None for the default group).

    When partita initialises the process group, it gets ``timeout`` itself; when the caller did,
    a group of all ranks is created with ``timeout`` (the caller's default group keeps its own).
    """
    cuda = torch.cuda.is_available()
    world_group = None
    if not dist.is_initialized():
        options = {"timeout": timeout} if timeout is not None else {}
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing and num_devices == 1:
            # A one-device plan in a plain `python script.py`: a world of one, rendezvous in this process.
            init_default_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1, **options)
        elif missing:
            n = num_devices if num_devices is not None else "N"
            raise InputError(
                f"torch.distributed is not initialised and {', '.join(missing)} are not set: run the "
                f"training script under `torchrun --nproc-per-node {n} script.py` (a plan for one device "
                "also runs without torchrun)"
            )
        else:
            init_default_group("nccl" if cuda else "gloo", **options)
    elif timeout is not None:
        world_group = new_group(None, timeout)
    if not cuda:
        return torch.device("cpu"), world_group
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
    torch.cuda.set_device(device)
    return device, world_group


def new_group(ranks: list[int] | None, timeout: datetime.timedelta | None) -> dist.ProcessGroup:
    """``dist.new_group`` with partita's timeout (None: torch's default). Collective: every rank."""
    return dist.new_group(ranks, timeout=timeout) if timeout is not None else dist.new_group(ranks)


def _mesh_timeouts(timeout: datetime.timedelta, dims: tuple[str, ...] = ("pp", "dp")) -> dict | None:
    """``init_device_mesh``'s backend_override giving the mesh dims' groups ``timeout`` (setting it
    on a gloo group afterwards does not reach its transfers), or None, with a warning, where this
    torch has no such options."""
    backend = dist.get_backend()
    try:
        options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
        options._timeout = timeout
    except (AttributeError, RuntimeError, TypeError) as e:
        warnings.warn(
            f"cannot give the pipeline's process groups a timeout on backend {backend} ({e}): transfers "
            "between stages wait for torch's default timeout",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return {dim: (backend, options) for dim in dims}


def timeout_of(seconds: float | None) -> datetime.timedelta | None:
    """``collective_timeout_s`` as a timedelta (None stays None); InputError unless it is > 0."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise InputError(f"collective_timeout_s must be a number of seconds > 0 or None, got {seconds!r}")
    return datetime.timedelta(seconds=float(seconds))


def start_topology(plan: Plan, collective_timeout_s: float | None) -> Topology:
    """init_topology, with a timed-out wait (a rank that never starts its trainer) as CollectiveTimeoutError."""
    try:
        return init_topology(plan, collective_timeout_s=collective_timeout_s)
    except (RuntimeError, TimeoutError) as e:
        if isinstance(e, PartitaError) or not is_timeout(e) or not dist.is_initialized():
            raise
        progress = Progress(dist.get_rank(), dist.get_world_size(), enabled=False)
        raise progress.timeout_error(
            e,
            step=0,
            doing="checking that every rank holds the same plan and creating "
            "the process groups (a rank has not started its trainer)",
            stages="starting",
            timeout_s=collective_timeout_s,
        ) from e
