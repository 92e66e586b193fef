"""The captured training computation: OpGraph, its nodes, tensors, parameters and inputs (see the
glossary in ``partita.types``)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from partita.errors import InputError

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

    def shape_at_batch(self, batch_size: int, example_batch_size: int) -> tuple[int, ...]:
        """This tensor's shape when the batch is ``batch_size`` instead of the example's."""
        if self.batch_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.batch_dim] = shape[self.batch_dim] * batch_size // example_batch_size
        return tuple(shape)

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
    declared: bool = False  # the batch dims were declared (``batch_dims=``), not found

    def describe(self) -> str:
        where = f" ({self.module_path or 'root'}{', ' + self.source if self.source else ''})"
        inside = f" inside {self.within}" if self.within else ""
        dims = f" along {', '.join(self.batch_dims)}" if self.batch_dims else ""
        return f"node {self.node} [{self.target}]{inside}{where} {self.reason}{dims}"


@dataclass(frozen=True)
class Block:
    """One repeated block of the model (a transformer layer): an item of a module list whose items
    repeat, and the nodes ``[start, stop)`` of the graph it spans (``OpGraph.blocks``).

    Blocks are the unit of execution inside a stage, as in torchtitan and Megatron-LM: a sharded
    stage gathers one block's weights at a time, recomputation keeps each block's input and
    rebuilds one block at a time. ``structure`` is a hash of the block's operations, equal for
    blocks that compute alike (the unit that compilation compiles once).
    """

    module_path: str  # e.g. "model.layers.3"
    start: int
    stop: int
    structure: str

    @property
    def num_nodes(self) -> int:
        return self.stop - self.start


def find_blocks(nodes: Sequence[OpNode]) -> tuple[Block, ...]:
    """The repeated blocks of a graph's ``nodes`` (in graph order), as ``OpGraph.blocks`` gives them.

    A block is an item of a module list: the outermost numbered component of a node's
    ``module_path`` ("transformer.h.3.attn" -> block "transformer.h.3" of list "transformer.h").
    Lists are grouped by their own name ("h", "layers", "layer", "block"), so T5's
    "encoder.block" and "decoder.block" count together, and the group with the most items wins
    (ties: the one that starts first); a list of one item has no blocks. A block spans its first to its last node; the nodes between
    (root-level operations inside the span) are its own. Blocks whose spans overlap (a list whose
    items run interleaved) give none: nothing then runs per block. A model without module lists
    has no blocks (its stages run whole).
    """
    families: dict[str, dict[str, list[int]]] = {}
    for node in nodes:
        parts = node.module_path.split(".") if node.module_path else []
        k = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        if k is None:
            continue
        family = parts[k - 1] if k > 0 else ""
        span = families.setdefault(family, {}).setdefault(".".join(parts[: k + 1]), [node.index, node.index])
        span[0], span[1] = min(span[0], node.index), max(span[1], node.index)
    if not families:
        return ()
    best = min(families.values(), key=lambda spans: (-len(spans), min(s[0] for s in spans.values())))
    if len(best) < 2:  # one item (ALBERT's one group, applied at every depth) repeats nothing
        return ()
    ordered = sorted(best.items(), key=lambda item: item[1][0])
    if any(a[1][1] >= b[1][0] for a, b in zip(ordered, ordered[1:])):
        return ()
    return tuple(Block(path, first, last + 1, _structure(nodes[first : last + 1])) for path, (first, last) in ordered)


def _structure(nodes: Sequence[OpNode]) -> str:
    return hashlib.sha256(repr([n.target for n in nodes]).encode()).hexdigest()[:16]


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
    def blocks(self) -> tuple[Block, ...]:
        """The repeated blocks (``find_blocks``), in graph order; found once per graph."""
        return _blocks_of(self)

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
        """Run the captured computation and return the scalar loss: the eager model's loss and
        gradients. The inputs are checked as the Trainer checks a batch: the captured structure
        (positional inputs, keyword names, ``target`` with a ``loss_fn``), a tensor exactly where the
        example had one (a tensor where ``None`` was captured would be ignored), the captured
        constants and dtypes; InputError naming the input otherwise."""
        import torch.utils._pytree as pytree

        flat = flatten_call_inputs(self, args, kwargs, target)
        check_input_dtypes(self, flat, "graph.loss")
        kwargs = dict(kwargs or {})
        if self.has_loss_fn:
            return self.graph_module(tuple(args), kwargs, target)
        out = self.graph_module(*args, **kwargs)
        return pytree.tree_leaves(out)[self.loss_output_index]

    def replace(self, **changes: Any) -> OpGraph:
        return dataclasses.replace(self, **changes)


LossFn = Callable[[Any, Any], "torch.Tensor"]


# ----------------------------------------------------------------------------- calling the graph


def exported_call_inputs(args: tuple, kwargs: dict | None, target: Any, has_loss_fn: bool) -> tuple[tuple, dict]:
    """How the exported module is called: ``(args, kwargs)`` itself, or with a loss_fn
    ``((args, kwargs, target), {})`` (LossWrapper.forward takes the three as positional arguments).

    Flattening this pair with pytree gives the graph's placeholders in order; the runtime
    (``partita.runtime.stages.flatten_inputs``) uses it to feed later batches.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    return ((args, kwargs, target), {}) if has_loss_fn else (args, kwargs)


def flatten_call_inputs(graph: OpGraph, args: tuple = (), kwargs: dict | None = None, target: Any = None) -> list:
    """The flat graph inputs for the user's ``(args, kwargs[, target])``, in placeholder order.

    The structure must be the captured one (same positional arguments and keyword names); keyword
    order does not matter; every leaf must be of the kind it was at capture (``check_flat_inputs``).
    """
    import torch.utils._pytree as pytree

    if target is not None and not graph.has_loss_fn:
        raise InputError("target was given but the graph was captured without loss_fn: drop target")
    in_spec = graph.exported_program.call_spec.in_spec
    # pytree flattens dicts in key order: put the user's keywords in the captured order.
    kwargs_spec = _child(_child(in_spec, 0), 1) if graph.has_loss_fn else _child(in_spec, 1)
    call = exported_call_inputs(args, _reorder_like(dict(kwargs or {}), kwargs_spec), target, graph.has_loss_fn)
    flat, spec = pytree.tree_flatten(call)
    if spec != in_spec:
        raise InputError(
            f"the inputs do not have the structure the model was captured with: {_differences(graph, args, kwargs, target)}. "
            "Pass the same positional inputs and keyword names as at capture, each a tensor where the example "
            "had one" + (", and the loss target as target=" if graph.has_loss_fn else "")
        )
    check_flat_inputs(graph, flat)
    return flat


def _differences(graph: OpGraph, args: tuple, kwargs: Any, target: Any) -> str:
    """How ``(args, kwargs, target)`` differ from the example the graph was captured with, in words
    (a TreeSpec dump says it only to those who read pytree's internals)."""
    import torch.utils._pytree as pytree

    if graph.example_inputs is None:
        return "its structure differs"
    example_args, example_kwargs, _ = graph.example_inputs
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    found = []
    if len(args) != len(example_args):
        found.append(f"{len(args)} positional input(s) given, the example had {len(example_args)}")
    missing, unknown = sorted(set(example_kwargs) - set(kwargs)), sorted(set(kwargs) - set(example_kwargs))
    if missing:
        found.append(f"keyword input(s) {missing} missing")
    if unknown:
        found.append(f"keyword input(s) {unknown} not in the example")
    pairs = [(f"args[{i}]", a, e) for i, (a, e) in enumerate(zip(args, example_args))]
    pairs += [(f"kwargs[{k!r}]", kwargs[k], example_kwargs[k]) for k in example_kwargs if k in kwargs]
    for where, given, example in pairs:
        if pytree.tree_structure(given) != pytree.tree_structure(example):
            found.append(f"{where} is {_kind(given)}, the example's was {_kind(example)}")
    if graph.has_loss_fn and target is None:
        found.append("no target= given (the model was captured with a loss_fn)")
    elif graph.has_loss_fn and pytree.tree_structure(target) != pytree.tree_structure(graph.example_inputs[2]):
        found.append(f"target is {_kind(target)}, the example's was {_kind(graph.example_inputs[2])}")
    return "; ".join(found) or "its structure differs"


def _kind(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple, dict)):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"a {type(value).__name__}"


def _reorder_like(kwargs: Any, spec: Any) -> Any:
    """``kwargs`` with its keys in the order of the dict ``spec`` (unknown keys last), else unchanged."""
    if not isinstance(kwargs, dict) or spec.type is not dict:
        return kwargs
    order = {key: i for i, key in enumerate(spec.context)}
    return dict(sorted(kwargs.items(), key=lambda item: order.get(item[0], len(order))))


def _child(spec: Any, index: int) -> Any:
    """A TreeSpec's child (``child()`` replaced ``children_specs`` in recent torch)."""
    return spec.child(index) if hasattr(spec, "child") else spec.children_specs[index]


def check_flat_inputs(graph: OpGraph, flat: list) -> None:
    """InputError unless every flat input has the kind it had at capture: a tensor where the graph
    was captured with a tensor, and the captured value where it was captured with a non-tensor
    (None, int, bool, ...), which the graph has baked in and would silently keep."""
    import torch

    for info, value in zip(graph.inputs, flat):
        name = info.path.rsplit("[", 1)[-1].strip("']") if "[" in info.path else info.path
        if info.tensor is None and isinstance(value, torch.Tensor):
            raise InputError(
                f"{info.path} was {info.value!r} when the model was captured, so the graph has no use for it and "
                f"would ignore the tensor passed now (shape {tuple(value.shape)}): capture the model with this input "
                f"given as a tensor ({name}=...) to train with it, or pass {info.value!r} as at capture"
            )
        if info.tensor is not None and not isinstance(value, torch.Tensor):
            raise InputError(
                f"{info.path} was a tensor of shape {info.tensor.shape} when the model was captured, but "
                f"{value!r} is passed now: the graph needs a tensor there. Pass one (e.g. an all-ones "
                f"attention mask for 'attend everywhere'), or capture the model with {name}={value!r}"
            )
        if info.tensor is None and not _same_constant(value, info.value):
            raise InputError(
                f"{info.path} was {info.value!r} when the model was captured, and the graph has that value baked "
                f"in, but {value!r} is passed now: pass {info.value!r}, or capture the model with {name}={value!r}"
            )


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that cannot be compared are taken as different
        return a is b


_CONVERSIONS = {"int64": ".long()", "float32": ".float()", "int32": ".int()", "float64": ".double()", "bool": ".bool()"}


def check_input_dtypes(graph: OpGraph, flat: Sequence[Any], where: str) -> None:
    """InputError when a flat graph input's dtype differs from the one the model was captured with:
    the graph runs in the captured dtypes (a float64 input meets float32 weights, an int32 label an
    int64 loss target), and would fail inside with torch's words, not the input's name."""
    import torch

    for info, x in zip(graph.inputs, flat):
        if info.tensor is None or not isinstance(x, torch.Tensor):
            continue
        got = str(x.dtype).removeprefix("torch.")
        if got != info.tensor.dtype:
            how = _CONVERSIONS.get(info.tensor.dtype, f".to(torch.{info.tensor.dtype})")
            raise InputError(
                f"{where}: {info.path or info.name} is {got}, but the model was captured with {info.tensor.dtype} "
                f"there: the graph computes in the captured dtypes; pass {info.tensor.dtype} tensors "
                f"({info.path or info.name}{how}), as in the example inputs"
            )


def graph_memo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Remember ``fn(graph, *args)`` while ``graph`` lives (positional, hashable ``args``).

    For what one graph's planning asks again and again (kept masks, storage roots, the
    tensor-parallel analysis). An ``lru_cache`` would hold the graphs it was called with, and
    through their exported program every parameter of their models: on a GPU, the weights of
    models the user had dropped stayed allocated until the cache moved on. The memo here is
    keyed weakly by the graph, so it goes with the graph; values must not hold the graph.
    """
    memo: weakref.WeakKeyDictionary[OpGraph, dict[tuple, Any]] = weakref.WeakKeyDictionary()

    @functools.wraps(fn)
    def remembered(graph: OpGraph, *args: Any) -> Any:
        values = memo.get(graph)
        if values is None:
            values = memo[graph] = {}
        if args not in values:
            values[args] = fn(graph, *args)
        return values[args]

    remembered.cache_clear = memo.clear  # type: ignore[attr-defined]
    return remembered


@graph_memo
def reads_samples(graph: OpGraph) -> tuple[bool, ...]:
    """Per node: whether its value is computed from the samples' data, i.e. from a graph input
    with a batch dim through tensor values (not only through sizes: ``sym_size`` and SymInt
    arithmetic give no tensor, so position ids from ``arange(seq_len)`` and Llama's rotary
    tables do not read samples). A tensor without a batch dim that reads samples is a reduction
    over the batch (an auxiliary loss added up across layers): each data-parallel replica
    computes it from its own samples only."""
    batched = {j for j, g in enumerate(graph.inputs) if g.tensor is not None and g.tensor.batch_dim is not None}
    reads: list[bool] = []
    for node in graph.nodes:
        reads.append(
            bool(node.outputs) and (any(j in batched for j in node.graph_inputs) or any(reads[p] for p in node.inputs))
        )
    return tuple(reads)


@graph_memo
def _blocks_of(graph: OpGraph) -> tuple[Block, ...]:
    return find_blocks(graph.nodes)
