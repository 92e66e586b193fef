"""Frozen data shared by every layer of partita.

Glossary
--------
node        one operation of the captured training computation (an FX ``call_function`` node),
            identified by its position ``index`` in topological order.
parameter   a parameter or buffer of the model, named by its *canonical* fully-qualified name:
            the first name ``model.named_parameters()`` / ``named_buffers()`` gives it. Tied
            parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) are one
            parameter with several ``aliases``.
batch dim   the dimension of a tensor that scales with the batch size. Shapes are recorded at
            the example batch size (``OpGraph.batch_size``); costs at another micro-batch size
            scale the batch-proportional parts.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class TensorInfo:
    """Shape, dtype and size of one tensor value, at the example batch size."""

    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", "int64"
    num_bytes: int
    batch_dim: int | None = None  # dimension proportional to the batch size; None if none

    def merges_samples(self, example_batch_size: int) -> bool:
        """Whether the batch dim holds several entries per sample (``(B*T, H)`` after a reshape):
        such a tensor cannot be split by sample, since its layout (batch- or T-major) is unknown."""
        return self.batch_dim is not None and self.shape[self.batch_dim] != example_batch_size

    def bytes_at_batch(self, batch_size: int, example_batch_size: int) -> int:
        """Bytes of this tensor when the batch is ``batch_size`` instead of the example's."""
        if self.batch_dim is None:
            return self.num_bytes
        return self.num_bytes * batch_size // example_batch_size


@dataclass(frozen=True)
class ParamInfo:
    """One parameter or buffer of the model (tied copies are one ParamInfo)."""

    name: str  # canonical fully-qualified name
    shape: tuple[int, ...]
    dtype: str
    num_bytes: int
    is_buffer: bool = False
    requires_grad: bool = True
    aliases: tuple[str, ...] = ()  # other fully-qualified names of the same tensor

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GraphInput:
    """One flat user input of the captured computation (a leaf of ``(args, kwargs)``)."""

    name: str  # FX placeholder name, e.g. "input_ids"
    path: str  # where the leaf sits in the user's inputs, e.g. "kwargs['input_ids']"
    tensor: TensorInfo | None  # None for a non-tensor leaf (int, bool, None)
    consumers: tuple[int, ...] = ()  # indices of the nodes that read it


@dataclass(frozen=True)
class OpNode:
    """One operation of the training computation's forward pass.

    ``inputs`` are producer node indices, ``graph_inputs`` indices into ``OpGraph.inputs`` and
    ``params`` canonical parameter/buffer names: together they are everything the node reads.
    """

    index: int  # position in topological order
    name: str  # FX node name, unique within the graph
    target: str  # e.g. "aten.mm.default", "operator.getitem", "wrap_with_set_grad_enabled"
    module_path: str  # innermost module, e.g. "transformer.h.0.attn" ("" for the root)
    module_type: str  # class name of that module, e.g. "GPT2Attention"
    source: str  # "modeling_gpt2.py:123 in forward" ("" when unknown)
    outputs: tuple[TensorInfo, ...]  # tensor outputs (several for tuple-returning ops)
    inputs: tuple[int, ...] = ()
    graph_inputs: tuple[int, ...] = ()
    params: tuple[str, ...] = ()
    consumers: tuple[int, ...] = ()
    flops: int = 0  # forward floating-point operations (FlopCounterMode)
    bytes_read: int = 0  # bytes of all tensor operands, parameters included
    bytes_written: int = 0  # bytes of new output memory (0 for views)
    is_view: bool = False  # output aliases an input (views, getitem): no new memory
    is_higher_order: bool = False  # a higher-order op with a nested graph (never split inside)

    @property
    def output_bytes(self) -> int:
        return sum(t.num_bytes for t in self.outputs)


@dataclass(frozen=True, eq=False)
class OpGraph:
    """The captured training computation: forward nodes in topological order up to the loss.

    ``graph_module`` is the exported module. Without ``loss_fn`` it is called exactly like the
    original model (same args/kwargs, same outputs). With ``loss_fn`` it is called as
    ``graph_module(args, kwargs, target)`` and returns the loss. ``loss(args, kwargs, target)``
    returns the scalar loss in both cases.
    """

    nodes: tuple[OpNode, ...]
    inputs: tuple[GraphInput, ...]
    parameters: Mapping[str, ParamInfo]  # canonical name -> info, parameters and buffers
    loss_node: int  # index of the node whose output is the scalar training loss
    batch_size: int  # the example batch size that shapes are recorded at
    dynamic_batch: bool  # whether the graph accepts other batch sizes
    fingerprint: str  # hash of structure + shapes + dtypes: same model and inputs -> same value
    graph_module: "torch.fx.GraphModule" = field(repr=False)
    exported_program: Any = field(repr=False)  # torch.export.ExportedProgram
    attr_to_param: Mapping[str, str] = field(repr=False, default_factory=dict)  # get_attr target -> canonical name
    has_loss_fn: bool = False
    loss_output_index: int = 0  # position of the loss among the flat outputs of graph_module

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def num_parameters(self) -> int:
        """Trainable parameter elements, tied parameters counted once."""
        return sum(p.numel for p in self.parameters.values() if not p.is_buffer and p.requires_grad)

    @property
    def parameter_bytes(self) -> int:
        return sum(p.num_bytes for p in self.parameters.values() if not p.is_buffer)

    @property
    def total_flops(self) -> int:
        """Forward FLOPs of one step at the example batch size."""
        return sum(n.flops for n in self.nodes)

    def node(self, name: str) -> OpNode:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} in this graph")

    def loss(self, args: tuple = (), kwargs: Mapping | None = None, target: Any = None) -> "torch.Tensor":
        """Run the captured computation and return the scalar loss."""
        import torch.utils._pytree as pytree

        kwargs = dict(kwargs or {})
        if self.has_loss_fn:
            return self.graph_module(tuple(args), kwargs, target)
        out = self.graph_module(*args, **kwargs)
        return pytree.tree_leaves(out)[self.loss_output_index]

    def replace(self, **changes: Any) -> "OpGraph":
        return dataclasses.replace(self, **changes)


LossFn = Callable[[Any, Any], "torch.Tensor"]


# ----------------------------------------------------------------------------- choices


class Schedule(str, enum.Enum):
    """Pipeline schedules, as in torch.distributed.pipelining."""

    GPIPE = "gpipe"  # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"  # PipeDream-flush: warm-up forwards, then one forward / one backward
    INTERLEAVED_1F1B = "interleaved1f1b"  # Megatron-LM interleaving: several virtual stages per rank
    ZBV = "zbv"  # zero-bubble V schedule: 2 virtual stages per rank, backward split into input/weight

    @property
    def virtual_stages_per_rank(self) -> int | None:
        """Fixed number of stages each rank holds (None: chosen by the plan)."""
        return {Schedule.GPIPE: 1, Schedule.ONE_F_ONE_B: 1, Schedule.ZBV: 2}.get(self)

    @classmethod
    def parse(cls, value: "Schedule | str") -> "Schedule":
        from partita.errors import InputError

        if isinstance(value, Schedule):
            return value
        key = str(value).lower().replace("-", "").replace("_", "")
        for s in cls:
            if s.value == key:
                return s
        raise InputError(f"unknown schedule {value!r}: use one of {', '.join(s.value for s in cls)}")


class OptimizerKind(str, enum.Enum):
    """What the optimizer keeps per parameter (sets optimizer-state memory)."""

    NONE = "none"  # plain SGD without momentum: no state
    SGD_MOMENTUM = "sgd-momentum"  # one buffer per parameter
    ADAM = "adam"  # two buffers per parameter (Adam, AdamW)

    @property
    def states_per_parameter(self) -> int:
        return {OptimizerKind.NONE: 0, OptimizerKind.SGD_MOMENTUM: 1, OptimizerKind.ADAM: 2}[self]

    @classmethod
    def parse(cls, value: "OptimizerKind | str") -> "OptimizerKind":
        from partita.errors import InputError

        if isinstance(value, OptimizerKind):
            return value
        aliases = {"sgd": "none", "adamw": "adam", "momentum": "sgd-momentum", "sgd_momentum": "sgd-momentum"}
        key = aliases.get(str(value).lower(), str(value).lower())
        for o in cls:
            if o.value == key:
                return o
        raise InputError(f"unknown optimizer {value!r}: use one of none, sgd, sgd-momentum, adam, adamw")


# ----------------------------------------------------------------------------- costs


@dataclass(frozen=True, eq=False)
class CostTable:
    """Costs of every node for ONE micro-batch size on ONE device type: the planner's view.

    Axes:
        n  node position in ``OpGraph.nodes`` (topological order), length ``num_nodes``.
        c  cut position, length ``num_nodes + 1``: cut ``c`` lies between node ``c - 1`` and
           node ``c``; cut 0 is before the first node, cut ``num_nodes`` after the last.
        p  unique parameter/buffer, in the order of ``param_names``.

    Arrays (numpy; seconds and bytes are per micro-batch unless the name says otherwise):
        forward_s[n]          forward time of node n.
        backward_s[n]         backward time of node n (input gradients + weight gradients).
        backward_weight_s[n]  the weight-gradient part of backward_s[n] (zero-bubble schedules
                              run it later); 0 for nodes without trainable parameters.
        activation_bytes[n]   bytes node n keeps alive for its backward (saved tensors).
        output_bytes[n]       bytes of node n's outputs (0 for views).
        cut_bytes[c]          bytes of every tensor produced before cut c and read at or after
                              it (skip connections included; graph inputs excluded, since every
                              rank has the batch).
        param_bytes[p]        bytes of parameter p (in its own dtype).
        param_trainable[p]    whether p gets a gradient and optimizer state (False for buffers).
        param_uses[p]         sorted node positions that read parameter p.
    """

    microbatch_size: int
    device: str  # device name in the catalog ("cpu", "h100", ...)
    source: str  # "measured" or "analytic"
    forward_s: Any
    backward_s: Any
    backward_weight_s: Any
    activation_bytes: Any
    output_bytes: Any
    cut_bytes: Any
    param_names: tuple[str, ...]
    param_bytes: Any
    param_trainable: Any
    param_uses: tuple[Any, ...]
    # How measured costs were scaled to whole-graph timings (profiler only; empty when analytic):
    # forward_scale, backward_scale, whole_forward_s, whole_step_s, repeats, warmup, num_threads.
    calibration: Mapping[str, float] = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return len(self.forward_s)

    def params_in_range(self, start: int, stop: int) -> list[int]:
        """Indices p of the parameters read by any node in positions [start, stop), ascending."""
        import numpy as np

        owners, uses = self._flat_param_uses
        return np.unique(owners[(uses >= start) & (uses < stop)]).tolist()

    @functools.cached_property
    def _flat_param_uses(self) -> tuple[Any, Any]:
        """(parameter index, node position) of every use, flat: one vectorised test per range (the
        planner asks for thousands of ranges of a table with ~1000 parameters)."""
        import numpy as np

        owners = [np.full(len(uses), p, dtype=np.int64) for p, uses in enumerate(self.param_uses)]
        uses = [np.asarray(u, dtype=np.int64).ravel() for u in self.param_uses]
        empty = np.zeros(0, dtype=np.int64)
        return (np.concatenate(owners) if owners else empty, np.concatenate(uses) if uses else empty)


# ----------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of accelerator (or the local CPU), from the catalog or a user's file."""

    name: str  # "h100", "a100-80gb", "cpu", ...
    memory_bytes: int
    peak_flops: Mapping[str, float]  # dense FLOP/s per dtype name ("float32", "bfloat16", "float16")
    memory_bandwidth_bytes_per_s: float
    intra_node_bandwidth_bytes_per_s: float  # per device, NVLink-class
    inter_node_bandwidth_bytes_per_s: float  # per device, network
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    compute_efficiency: float = 0.6  # achieved fraction of peak FLOP/s for matmul-like ops
    memory_efficiency: float = 0.7  # achieved fraction of memory bandwidth for memory-bound ops
    op_overhead_s: float = 5e-6  # fixed cost of launching one operation (kernel launch / dispatch)


# ----------------------------------------------------------------------------- plans


PLAN_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: a contiguous range of nodes run by ``len(ranks)`` replicas.

    With interleaved or V schedules there are more stages than rank groups: stage ``k`` runs on
    the ranks of ``rank_group``, which also run other stages.
    """

    index: int
    start: int  # first node position (inclusive)
    stop: int  # last node position (exclusive)
    first_node: str  # FX node names, so that a human (and Plan.load) can check the range
    last_node: str
    module_range: str  # "transformer.h.0 .. transformer.h.5": where the stage starts and ends
    ranks: tuple[int, ...]  # global ranks holding a replica of this stage
    rank_group: int  # index of the group of ranks (pipeline position) that runs this stage
    recompute: bool  # activation recomputation for this stage
    forward_s: float  # predicted, per micro-batch per replica
    backward_s: float  # predicted, per micro-batch per replica
    memory_bytes: int  # predicted peak per device of this stage's rank group
    param_bytes: int
    cut_bytes: int  # bytes sent to the next stage per micro-batch (0 for the last stage)

    @property
    def num_replicas(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Plan:
    """A complete, executable training plan. Frozen; JSON round-trips through partita.plan.io."""

    graph_fingerprint: str
    cluster: Mapping[str, Any]  # Cluster.to_dict(): self-contained, device spec inlined
    stages: tuple[StagePlan, ...]
    schedule: Schedule
    global_batch_size: int
    num_microbatches: int
    microbatch_size: int  # samples per micro-batch per replica of a stage with the fewest replicas
    options: Mapping[str, Any]  # the resolved planner options (what the user pinned and what was searched)
    method: str = "partita"  # "partita", a baseline name ("uniform", "parameters", "equal_flops") or "manual"
    predicted_step_s: float = 0.0
    predicted_bubble_fraction: float = 0.0
    cost_source: str = "analytic"  # "measured" or "analytic"
    partita_version: str = ""
    torch_version: str = ""
    schema_version: int = PLAN_SCHEMA_VERSION

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_rank_groups(self) -> int:
        return len({s.rank_group for s in self.stages})

    @property
    def num_devices(self) -> int:
        return len({r for s in self.stages for r in s.ranks})

    @property
    def uniform_replicas(self) -> bool:
        return len({s.num_replicas for s in self.stages}) == 1

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Cut positions: (0, stage 1 start, ..., num_nodes)."""
        return tuple(s.start for s in self.stages) + (self.stages[-1].stop,)

    def to_json(self) -> str:
        from partita.plan.io import plan_to_json

        return plan_to_json(self)

    def save(self, path: str) -> None:
        """Write the plan as versioned JSON (never pickle)."""
        from partita.plan.io import save_plan

        save_plan(self, path)

    @staticmethod
    def load(path: str, *, graph: "OpGraph | None" = None, cluster: Any = None) -> "Plan":
        """Read and validate a plan file; PlanFileError says which field is wrong."""
        from partita.plan.io import load_plan

        return load_plan(path, graph=graph, cluster=cluster)
