"""The captured training computation: OpGraph, its nodes, tensors, parameters and inputs (see the
glossary in ``partita.types``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    value: Any = None  # a non-tensor leaf's captured value (baked into the graph); None for tensors


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


@dataclass(frozen=True)
class SampleCoupling:
    """Where the loss couples the samples of a batch, so that splitting the batch changes it.

    A CLIP loss (similarities between every image and every text, labels ``arange(batch)``),
    in-batch negatives or a batch statistic make each sample's loss term depend on the others:
    micro-batches or data-parallel replicas would each see a smaller batch and train a different
    loss. ``partita.capturing.samples`` finds the first such operation.
    """

    node: str  # FX node name of the operation (inside ``within``'s body when that is set)
    index: int  # position in OpGraph.nodes of the operation, or of the higher-order op holding it
    target: str  # e.g. "aten.mm.default"
    module_path: str
    source: str  # "file.py:LINE in func" ("" when unknown)
    reason: str  # what the operation does to the samples
    batch_dims: tuple[str, ...] = ()  # the batch dims it mixes, e.g. ("args[0] dim 0", "target dim 0")
    within: str = ""  # the higher-order op whose body holds ``node`` ("" when none)

    def describe(self) -> str:
        where = f" ({self.module_path or 'root'}{', ' + self.source if self.source else ''})"
        inside = f" inside {self.within}" if self.within else ""
        dims = f" along {', '.join(self.batch_dims)}" if self.batch_dims else ""
        return f"node {self.node} [{self.target}]{inside}{where} {self.reason}{dims}"


@dataclass(frozen=True, eq=False)
class OpGraph:
    """The captured training computation: forward nodes in topological order up to the loss.

    ``graph_module`` is the exported module. Without ``loss_fn`` it is called exactly like the
    original model (same args/kwargs, same outputs). With ``loss_fn`` it is called as
    ``graph_module(args, kwargs, target)`` and returns the loss. ``loss(args, kwargs, target)``
    returns the scalar loss in both cases.

    ``couples_samples`` is set when the loss mixes the samples of the batch (see SampleCoupling):
    the planner then gives every step's whole batch to one pipeline, in one micro-batch.
    """

    nodes: tuple[OpNode, ...]
    inputs: tuple[GraphInput, ...]
    parameters: Mapping[str, ParamInfo]  # canonical name -> info, parameters and buffers
    loss_node: int  # index of the node whose output is the scalar training loss
    batch_size: int  # the example batch size that shapes are recorded at
    dynamic_batch: bool  # whether the graph accepts other batch sizes
    fingerprint: str  # hash of structure + shapes + dtypes: same model and inputs -> same value
    graph_module: torch.fx.GraphModule = field(repr=False)
    exported_program: Any = field(repr=False)  # torch.export.ExportedProgram
    attr_to_param: Mapping[str, str] = field(repr=False, default_factory=dict)  # get_attr target -> canonical name
    has_loss_fn: bool = False
    loss_output_index: int = 0  # position of the loss among the flat outputs of graph_module
    couples_samples: SampleCoupling | None = None  # the operation that mixes samples, if any
    batch_fixed_at: str = ""  # static batch although a dynamic one was asked: the line that fixed it, if known
    # (args, kwargs, target) the graph was captured from: what the profiler runs when planning is
    # given the graph alone (None for graphs built by hand)
    example_inputs: tuple | None = field(repr=False, default=None)
    # ``recapture(args, kwargs, target, training=True)``: the same model captured again, with the
    # same options, on other inputs (another sequence length) or in eval mode; None for graphs
    # built by hand or loaded. The runtime uses it for batches of other shapes and for evaluation.
    recapture: Callable[..., OpGraph] | None = field(repr=False, default=None)

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

    def loss(self, args: tuple = (), kwargs: Mapping | None = None, target: Any = None) -> torch.Tensor:
        """Run the captured computation and return the scalar loss."""
        import torch.utils._pytree as pytree

        kwargs = dict(kwargs or {})
        if self.has_loss_fn:
            return self.graph_module(tuple(args), kwargs, target)
        out = self.graph_module(*args, **kwargs)
        return pytree.tree_leaves(out)[self.loss_output_index]

    def replace(self, **changes: Any) -> OpGraph:
        return dataclasses.replace(self, **changes)


LossFn = Callable[[Any, Any], "torch.Tensor"]
