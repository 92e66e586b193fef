"""Process groups of a plan's layout, and the gradient arithmetic that makes pipelined
training equal unsplit full-batch training.

Two layouts:
- uniform: every stage has ``dp`` replicas. Rank group ``g`` holds ranks ``[g * dp, (g + 1) * dp)``
  (``partita.planning.build.stage_ranks``) and the ranks form a pp x dp DeviceMesh; torch's
  pipelining schedules run each column of the mesh as one pipeline (pipeline.py).
- uneven: stage ``k`` has its own ``r_k`` replicas (GPipe or 1F1B, one stage per rank group),
  on the ranks that follow those of the earlier groups. No mesh can express it: stages exchange
  slices of micro-batches many-to-many (uneven.py).

Glossary
--------
rank group   one pipeline position ``g``: the ranks each holding one replica of the same stages.
replica      a rank's index inside its rank group (uniform: ``rank % dp``; the ranks with the
             same replica index form one pipeline, one column of the mesh).
holders      of a parameter: every rank whose stages read it. Usually one rank group; a tied
             parameter (GPT-2's ``wte`` in the first and the last stage) is held by several rank
             groups, and all their ranks sum its gradient.

Why the gradient is exact (fp32 up to summation order): the unsplit loss is the mean over the
global batch, ``L = 1/(m * r) * sum_{replica, microbatch} L_mb`` when every micro-batch's loss
is a mean over equally many elements, ``r`` being the LAST stage's replica count (``dp`` when
uniform): its replicas compute the losses. Each stage accumulates ``sum_mb dL_mb/dp`` over its
micro-batches (schedules built with ``scale_grads=False``), every sample's contribution reaching
exactly one replica of each stage; the holders all-reduce (SUM) that, and each unique parameter
is divided exactly once by ``m * r``. When the loss divides by a data-dependent count
(``partita.runtime.loss_scaling``), the last stage's slices compute parts that already SUM to the
full-batch loss, and the scale is 1 instead.

One plan per job: ``init_topology`` compares a digest of the plan on every rank (``check_same_plan``)
before it creates any group, since ranks with different plans would create different groups and
hang. A collective timeout (``collective_timeout_s``) applies to every group partita uses: the
process group partita initialises, or else partita's own world group, the mesh's and the
gradient holders' groups.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from partita.errors import InputError, PlanFileError
from partita.planning.uneven import UNEVEN_SCHEDULES
from partita.types import Plan
from partita.types.plan_file import plan_to_json

__all__ = [
    "Topology",
    "GradientSync",
    "check_same_plan",
    "init_process_group",
    "init_topology",
    "plan_digest",
    "timeout_of",
]


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
    # ranks and that group. Then `world_group` holds the ranks of this index only (the job that
    # `local_plan` describes), and `rank`/`world_size` stay global.
    tensor_parallel: int = 1
    tp_index: int = 0
    tp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False  # the plan's: the tensor-parallel group also splits tokens

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
    if plan.uniform_replicas:
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
    """A uniform plan of degree t on a pp x dp x tp mesh: rank = (group * dp + replica) * t + index."""
    from torch.distributed.device_mesh import init_device_mesh

    if not plan.uniform_replicas:
        raise InputError(
            f"the plan has tensor-parallel degree {plan.tensor_parallel} and uneven replica counts "
            f"{[s.num_replicas for s in plan.stages]}: tensor parallelism runs on pp x dp x tp meshes only; "
            "re-plan with tensor_parallel=1 or with one replica count for every stage"
        )
    t, rank = plan.tensor_parallel, common["rank"]
    pp, dp = plan.num_rank_groups, plan.stages[0].num_replicas
    override = _mesh_timeouts(timeout, ("pp", "dp", "tp")) if timeout is not None else None
    mesh = init_device_mesh(
        common["device"].type, (pp, dp, t), mesh_dim_names=("pp", "dp", "tp"), backend_override=override
    )
    # one group per index, every rank creating all of them in the same order
    slices = [new_group(list(range(i, plan.num_devices, t)), timeout) for i in range(t)]
    return Topology(
        **{**common, "world_group": slices[rank % t]},
        num_rank_groups=pp,
        rank_group=rank // (dp * t),
        replica=(rank // t) % dp,
        replicas=dp,
        dp_group=mesh.get_group("dp"),
        pp_group=mesh.get_group("pp"),
        mesh=mesh,
        tensor_parallel=t,
        tp_index=rank % t,
        tp_group=mesh.get_group("tp"),
        sequence_parallel=plan.sequence_parallel,
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
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            n = num_devices if num_devices is not None else "N"
            raise InputError(
                f"torch.distributed is not initialised and {', '.join(missing)} are not set: run the "
                f"training script under `torchrun --nproc-per-node {n} script.py`"
            )
        options = {"timeout": timeout} if timeout is not None else {}
        dist.init_process_group("nccl" if cuda else "gloo", **options)
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


def plan_digest(plan: Plan) -> str:
    """sha256 of the plan's JSON (``plan_to_json``): equal exactly when the plans are."""
    return hashlib.sha256(plan_to_json(plan).encode("utf-8")).hexdigest()


def check_same_plan(plan: Plan, group: dist.ProcessGroup | None = None) -> None:
    """PlanFileError on every rank unless every rank holds the same plan (one all-gather of digests)."""
    mine = (plan_digest(plan), _plan_summary(plan))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    digests = {digest for digest, _ in gathered}
    if len(digests) == 1:
        return
    by_digest: dict[str, list[int]] = {}
    summaries = {}
    for rank, (digest, summary) in enumerate(gathered):
        by_digest.setdefault(digest, []).append(rank)
        summaries[digest] = summary
    listing = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: plan {digest[:12]} ({summaries[digest]})"
        for digest, ranks in by_digest.items()
    )
    raise PlanFileError(
        f"the ranks hold {len(digests)} different plans ({listing}). One plan per job: make it once, on rank 0, and "
        "give it to every rank -- plan = partita.runtime.trainer.shared_plan(lambda: partita.plan(...)) -- or save "
        "it once (plan.save('plan.json'), or `partita plan ... --out plan.json`) and load that same file on every "
        "rank (partita.Plan.load). Planning on every rank gives different plans when costs are measured."
    )


def _plan_summary(plan: Plan) -> str:
    replicas = sorted({s.num_replicas for s in plan.stages})
    return (
        f"{plan.num_stages} stages cut at nodes {list(plan.boundaries)}, {plan.schedule.value}, "
        f"{plan.num_microbatches} micro-batches, replicas {replicas[0] if len(replicas) == 1 else replicas}, "
        f"global batch {plan.global_batch_size}, {plan.num_devices} devices"
    )


def check_layout(plan: Plan) -> None:
    """InputError unless the runtime can run the plan's layout: a uniform pp x dp mesh with rank
    group g on ranks [g*dp, (g+1)*dp), or an uneven plan (GPipe/1F1B, one stage per rank group)
    whose rank groups hold consecutive ranks, group g after groups 0 .. g-1."""
    if plan.uniform_replicas:
        _check_uniform_layout(plan)
    else:
        _check_uneven_layout(plan)


def _check_uniform_layout(plan: Plan) -> None:
    from partita.planning.schedules import stage_rank_groups

    dp, pp, t = plan.stages[0].num_replicas, plan.num_rank_groups, plan.tensor_parallel
    placement = stage_rank_groups(plan.schedule, pp, plan.num_stages)
    for s in plan.stages:
        expected = tuple(range(s.rank_group * dp * t, (s.rank_group + 1) * dp * t))
        if s.ranks != expected or s.rank_group != placement[s.index]:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; {plan.schedule.value} "
                f"places it on rank group {placement[s.index]}, ranks {list(expected)}: build the plan with "
                "partita.plan or partita.planning.manual.manual_plan"
            )


def _check_uneven_layout(plan: Plan) -> None:
    counts = [s.num_replicas for s in plan.stages]
    if plan.schedule not in UNEVEN_SCHEDULES:
        raise InputError(
            f"the plan gives stages different replica counts {counts} under {plan.schedule.value}, "
            "which the runtime runs on uniform pp x dp meshes only: use schedule gpipe or 1f1b, or "
            "the same replica count for every stage"
        )
    if plan.num_rank_groups != plan.num_stages:
        raise InputError(
            f"the plan puts {plan.num_stages} stages on {plan.num_rank_groups} rank groups with "
            f"different replica counts {counts}: uneven plans run one stage per rank group"
        )
    first = 0
    for s in plan.stages:
        expected = tuple(range(first, first + s.num_replicas))
        if s.ranks != expected or s.rank_group != s.index:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; with replica counts "
                f"{counts} it must run on rank group {s.index}, ranks {list(expected)} (each group's ranks follow "
                "the earlier groups'): build the plan with partita.plan or partita.planning.manual.manual_plan"
            )
        first += s.num_replicas
    batch, m = plan.global_batch_size, plan.num_microbatches
    bad = [r for r in counts if batch % (m * r)]
    if bad:
        raise InputError(
            f"the global batch of {batch} samples in {m} micro-batches does not split evenly over "
            f"{bad[0]} replicas: use a global batch that is a multiple of num_microbatches x every "
            f"replica count {sorted(set(counts))}"
        )


class GradientSync:
    """Sums each parameter's gradient over its holders, scales it once, clips by the global norm.

    ``holders`` maps every trainable parameter read by some stage (canonical name) to the sorted
    ranks holding it, for the WHOLE plan: every rank creates the same process groups in the
    same order, as torch.distributed requires.
    """

    def __init__(
        self,
        params: Mapping[str, nn.Parameter],
        holders: Mapping[str, Sequence[int]],
        rank: int,
        scale: float,
        *,
        timeout: datetime.timedelta | None = None,
        world_group: dist.ProcessGroup | None = None,
        sharded: Collection[str] = (),
        group_sets: Sequence[tuple[int, ...]] | None = None,
        tp_split: Collection[str] = (),
        tp_group: dist.ProcessGroup | None = None,
    ):
        self.params = dict(params)  # this rank's trainable parameters, canonical name -> Parameter
        # Read by sharded stages (sharding.py): FSDP2 reduce-scatters them over the replicas, and
        # each replica's shard is its own part of the norm.
        self.sharded = frozenset(sharded)
        self.scale = scale  # 1 / (num_microbatches * replicas of the last stage), or 1 (loss_scaling.py)
        self.world_group = world_group  # the norm's all-reduce (None: the default group)
        self.owned = [
            name for name in self.params if name in self.sharded or min(holders[name]) == rank
        ]  # once in the norm
        # Split by tensor parallelism (tensor_parallel.py): every rank of the group holds its own
        # part, so their squares are summed over `tp_group` too. `group_sets`: the holder sets of
        # every tensor-parallel index, which all ranks create (default: those of `holders`).
        self.tp_split, self.tp_group = frozenset(tp_split), tp_group
        self.buckets: list[tuple[dist.ProcessGroup, list[str]]] = []
        if group_sets is None:
            group_sets = sorted({tuple(h) for h in holders.values() if len(h) > 1})
        for ranks in group_sets:
            group = new_group(list(ranks), timeout)  # collective: every rank creates every group, in this order
            names = [name for name in self.params if tuple(holders[name]) == ranks and name not in self.sharded]
            if rank in ranks and names:
                self.buckets.append((group, names))

    def reduce_and_scale(self) -> None:
        """Gradient of the global mean loss: all-reduce (SUM) over the holders, then multiply by ``scale``."""
        reduced: set[str] = set()
        for group, names in self.buckets:
            grads = [self._grad(name) for name in names]
            flat = torch.cat([g.reshape(-1) for g in grads])  # one collective per holder set
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.mul_(self.scale)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            reduced.update(names)
        for name, p in self.params.items():
            if name not in reduced and p.grad is not None:
                p.grad.mul_(self.scale)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Scale gradients so that their global 2-norm (each parameter once) is at most ``max_norm``.

        Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` over the unsplit model. Returns the
        norm before clipping (on every rank).
        """
        device = next(iter(self.params.values())).device if self.params else _group_device(self.world_group)
        squares = torch.zeros(2, dtype=torch.float64, device=device)  # (whole in the group, split by it)
        for name in self.owned:
            grad = self.params[name].grad
            if grad is not None:
                norm = torch.linalg.vector_norm(local_tensor(grad).detach(), dtype=torch.float32).double()
                squares[int(name in self.tp_split)] += norm**2
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.world_group)
        if self.tp_group is not None:
            split = squares[1:].clone()
            dist.all_reduce(split, op=dist.ReduceOp.SUM, group=self.tp_group)
            squares[1:] = split
        total = squares.sum().sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.params.values():
            if p.grad is not None:
                grad = local_tensor(p.grad)  # a shard's local tensor: scaled in place
                grad.mul_(coef.to(grad.device, grad.dtype))
        return total

    def _grad(self, name: str) -> torch.Tensor:
        """The parameter's gradient; zeros when this holder's stages did not reach it this step."""
        p = self.params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        return p.grad


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (FSDP2's parameters and gradients), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a rank without parameters puts its part of a collective (NCCL needs a CUDA tensor)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unique_parameters(modules: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """Trainable parameters of ``modules`` by canonical name, each Parameter object once."""
    found: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                found[name] = p
    return found
