"""Plans: frozen, serialisable descriptions of how to train a model (stages, ranks, schedule)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partita.types.choices import Accumulation, Precision, Recompute, Schedule, Sharding
from partita.types.cluster import Cluster
from partita.types.schedule_orders import UNEVEN_SCHEDULES

if TYPE_CHECKING:
    from partita.types.graph import OpGraph


# 2: a stage's "recompute" is a level ("none", "selective", "full"); schema 1's true / false load as full / none
PLAN_SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (1, 2)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes of one device at its peak, by kind; the parts sum to ``total_bytes``.

    ``params_bytes``: parameters and buffers as computed with (under full_shard / shard_grads_and_optimizer
    the shard plus what is gathered at the peak); ``grads_bytes``: the gradients alive at the peak;
    ``optimizer_bytes``: optimizer state plus fp32 master weights (bf16); ``activations_bytes``: kept
    for backward at the peak; ``buffers_bytes``: communication buffers, working memory of one
    operation, or the optimizer step's temporaries (whichever peak is the larger).
    """

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    buffers_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.buffers_bytes


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous range of nodes run by ``num_replicas`` data-parallel
    replicas, each a tensor-parallel group of ``tensor_parallel`` devices.

    ``ranks`` holds every device of the stage, replica-major: replica ``j`` runs on
    ``ranks[j * t:(j + 1) * t]`` (``t = tensor_parallel``), a block of consecutive ranks that
    starts at a multiple of ``t`` and lies in one node; its ``t`` devices split the parameters
    of the plan's tensor-parallel layout. Device ``i`` of every replica (its tensor-parallel
    index) forms the stage's data-parallel group ``ranks[i::t]``. With interleaved or V
    schedules there are more stages than rank groups: stage ``k`` runs on the ranks of
    ``rank_group``, which also run other stages.
    """

    index: int
    start: int  # first node position (inclusive)
    stop: int  # last node position (exclusive)
    first_node: str  # FX node names, so that a human (and Plan.load) can check the range
    last_node: str
    module_range: str  # "transformer.h.0 .. transformer.h.5": where the stage starts and ends
    ranks: tuple[int, ...]  # global ranks running this stage, replica-major (see above)
    rank_group: int  # index of the group of ranks (pipeline position) that runs this stage
    recompute: Recompute  # activation recomputation level of this stage (a bool is read as full / none)
    forward_s: float  # predicted, per micro-batch per replica
    backward_s: float  # predicted, per micro-batch per replica
    memory_bytes: int  # predicted peak per device of this stage's rank group
    param_bytes: int  # parameter bytes one device holds: tensor-parallel shards (manual plans: the whole stage's)
    cut_bytes: int  # bytes sent to the next stage per micro-batch, in the plan's precision (0 for the last stage)
    # how the stage's replicas share parameters, gradients and optimizer state (replicate for one replica)
    sharding: Sharding = Sharding.REPLICATE
    # memory_bytes by kind (None: plans made without costs, and older plan files)
    memory_breakdown: MemoryBreakdown | None = None
    # devices of one replica, splitting its matmuls (1: none; older plan files)
    tensor_parallel: int = 1
    # samples of each micro-batch that each replica runs, in replica order (they sum to the micro-batch);
    # None: an even split (plans on one device type, older plan files). Replicas of unequal speed (a
    # stage over several device groups) take unequal shares, so that none waits for another.
    replica_samples: tuple[int, ...] | None = None
    # predicted peak per device of each device group of the cluster (0 for groups the stage does not
    # run on); None: one-type clusters (``memory_bytes`` says it). A record, as memory_bytes is.
    memory_bytes_by_group: tuple[int, ...] | None = None
    # sequence parallelism: the tensor-parallel group also splits, by token, the regions it leaves
    # whole (norms, dropout, residual additions; partita.capturing.sequence_parallel)
    sequence_parallel: bool = False
    # how a sharded stage accumulates gradients over the micro-batches (whole: replicated stages,
    # one micro-batch, older plan files; partita.types.choices.Accumulation)
    accumulation: Accumulation = Accumulation.WHOLE
    # whole repeated blocks the stage holds (partita.types.segments): each its own FSDP2 unit when
    # sharded, and its own recomputation segment; a record (None: older plan files)
    blocks: int | None = None
    # recompute only the first this many whole blocks of the stage, at ``recompute``'s level, and keep
    # every tensor of the rest (Megatron-LM's "recompute N layers"); None: every segment recomputes
    recompute_blocks: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", Recompute.parse(self.recompute))  # frozen: normalised once

    @property
    def num_replicas(self) -> int:
        """Data-parallel replicas: tensor-parallel groups of ``tensor_parallel`` ranks."""
        return len(self.ranks) // self.tensor_parallel

    def samples_of_replicas(self, microbatch_samples: int) -> tuple[int, ...]:
        """Samples of one micro-batch of ``microbatch_samples`` that each replica runs (``replica_samples``,
        or an even split)."""
        if self.replica_samples is not None:
            return self.replica_samples
        return (microbatch_samples // self.num_replicas,) * self.num_replicas

    @property
    def even_shares(self) -> bool:
        """Whether every replica runs as many samples of each micro-batch."""
        return self.replica_samples is None or len(set(self.replica_samples)) <= 1

    def replica_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of replica ``replica``: its tensor-parallel group."""
        t = self.tensor_parallel
        return self.ranks[replica * t : (replica + 1) * t]


@dataclass(frozen=True)
class Plan:
    """A complete, executable training plan. Frozen; JSON round-trips through partita.types.plan_file."""

    graph_fingerprint: str
    cluster: Cluster  # the machines it was made for (the plan file inlines the device spec)
    stages: tuple[StagePlan, ...]
    schedule: Schedule
    global_batch_size: int
    num_microbatches: int
    # samples per micro-batch per replica of a stage with the fewest replicas (with unequal shares: the largest share)
    microbatch_size: int
    options: Mapping[str, Any]  # the resolved planner options (what the user pinned and what was searched)
    method: str = "partita"  # "partita", a baseline name ("uniform", "parameters", "equal_flops") or "manual"
    predicted_step_s: float = 0.0
    predicted_bubble_fraction: float = 0.0
    # forward + backward seconds of one whole step's samples on one device (ideal step = this /
    # devices); None for plans made without costs (manual plans) and older plan files
    total_compute_s: float | None = None
    cost_source: str = "analytic"  # "measured" or "analytic"
    # compute dtype: bf16 = bf16 parameters as computed with, activations and boundary tensors, fp32
    # master weights, optimizer state and gradient reduction (partita.types.choices.Precision)
    precision: Precision = Precision.FP32
    # every block of every stage runs through torch.compile, compiled once per distinct block
    # (partita.runtime.compiled_segments), and the costs are those of compiled blocks
    compile: bool = False
    partita_version: str = ""
    torch_version: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def tensor_parallel(self) -> int:
        """The largest tensor-parallel degree of its stages (1: none). Stages of a plan for a mixed
        cluster may have their own (``uniform_tensor_parallel``), each its device type's."""
        return max(s.tensor_parallel for s in self.stages)

    @property
    def uniform_tensor_parallel(self) -> bool:
        """Whether every stage has the same tensor-parallel degree (else partita's executor runs it)."""
        return len({s.tensor_parallel for s in self.stages}) == 1

    @property
    def sequence_parallel(self) -> bool:
        """Whether the tensor-parallel groups also split tokens (the same for every stage of a degree
        above 1; stages of degree 1 have none)."""
        return any(s.sequence_parallel for s in self.stages)

    @property
    def num_rank_groups(self) -> int:
        return len({s.rank_group for s in self.stages})

    @property
    def num_devices(self) -> int:
        return len(set().union(*(s.ranks for s in self.stages)))

    @property
    def uniform_replicas(self) -> bool:
        """Every stage on as many replicas, each running an equal share of every micro-batch: a pp x dp
        mesh (else partita's own executor runs it: ``partita.runtime.uneven``)."""
        return len({s.num_replicas for s in self.stages}) == 1 and all(s.even_shares for s in self.stages)

    @property
    def on_mesh(self) -> bool:
        """Whether torch's pipelining runs it on a pp x dp (x tp) mesh: uniform replicas of one
        tensor-parallel degree, rank group ``g`` on ranks ``[g*dp*t, (g+1)*dp*t)``. A uniform GPipe or 1F1B plan of one stage per rank
        group whose stages sit on other ranks (on a mixed cluster the second device group's stage
        may come first) runs on partita's own executor, as uneven plans do (``partita.runtime.uneven``),
        with or without tensor parallelism; other schedules and several stages per rank group run on
        a mesh only (``partita.runtime.layout.check_layout`` refuses them elsewhere)."""
        if not self.uniform_replicas or not self.uniform_tensor_parallel:
            return False
        if self.schedule not in UNEVEN_SCHEDULES or self.num_rank_groups != self.num_stages:
            return True
        width = len(self.stages[0].ranks)
        return all(s.ranks == tuple(range(s.rank_group * width, (s.rank_group + 1) * width)) for s in self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Cut positions: (0, stage 1 start, ..., num_nodes)."""
        return tuple(s.start for s in self.stages) + (self.stages[-1].stop,)

    def summary(self, baselines: Mapping[str, Plan | None] = ()) -> str:
        """The plan as a readable table (stages, ranks, memory, times), then the predicted step,
        throughput, bubble and efficiency, with ``baselines`` side by side."""
        from partita.report.plan import plan_text  # report depends on types only: no cycle at import

        return plan_text(self, baselines=baselines)

    def to_json(self) -> str:
        from partita.types.plan_file import plan_to_json

        return plan_to_json(self)

    def save(self, path: str) -> None:
        """Write the plan as versioned JSON (never pickle)."""
        from partita.types.plan_file import save_plan

        save_plan(self, path)

    @staticmethod
    def load(path: str, *, graph: OpGraph | None = None, cluster: Any = None) -> Plan:
        """Read and validate a plan file; PlanFileError says which field is wrong."""
        from partita.types.plan_file import load_plan

        return load_plan(path, graph=graph, cluster=cluster)
