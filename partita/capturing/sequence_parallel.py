"""Sequence parallelism on a captured graph: the regions tensor parallelism leaves whole, split by token.

Tensor parallelism (``partita.capturing.tensor_parallel``) splits the matmuls and attention of a layer
over a group of ``t`` devices, but every device still holds the whole of what lies between a
row-parallel matmul and the next column-parallel one: the residual stream, its norms, dropout and
additions. Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022) splits those regions along the tokens, so that their activations and
work divide by ``t``; the all-reduce after a row-parallel matmul becomes a reduce-scatter, and the
input of the next column-parallel matmul is all-gathered (its backward reduce-scatters).

Found on the graph, without model code. A *region* grows from its sources:

* the output of a row-parallel matmul or of a vocab-parallel embedding (reduce-scattered instead of
  all-reduced), and, in a stage graph, a received value that the whole graph splits (``inputs``:
  the stage's part of it is taken at its start);
* through operations that act on each token alone: elementwise ones, norms over the features,
  dropout, matmuls with a whole weight (a layer tensor parallelism left whole), views that keep the
  token axis, transposes;
* to its exits: the input of a column-parallel matmul (all-gathered, its backward reduce-scattered),
  and a graph output or an operation that runs whole (a matmul tensor parallelism left whole, an
  operation without a rule such as a loss): all-gathered whole there, its backward keeping this
  device's part (what runs whole runs alike on every device; the runtime sends a stage's output
  in part where the next stage takes that same part: ``partita.runtime.tensor_parallel.boundary_parts``).

A whole value that meets a split one is sliced to this device's tokens (its gradient all-gathered);
one broadcast over the tokens (a norm's weight, a bias) gets its gradient summed over the group,
since each device computes its tokens' part of it. A region that meets an operation mixing tokens
(a softmax, sum, cumsum or slice along them, a matmul contracting them) is refused: its sources
stay all-reduced and the region whole, with the reason in ``rejected``.

Token axis (``TokenSplit``): dim ``dim`` of a value, viewed as ``(-1, inner)``, splits its ``inner``
axis into ``t`` parts (device ``r`` holds part ``r`` of every run of ``inner`` entries). It is the
static (not batch) dim of the source's shape: the sequence of a ``(B, T, H)`` value (``inner = T``),
or the ``T`` factor of a merged ``(B*T, H)`` (GPT-2's Conv1D), which views then carry to the other.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from partita.capturing import tensor_parallel_graph as fx_read
from partita.capturing.tensor_parallel import TensorParallelAnalysis, whole_graph_analysis, whole_graph_layout
from partita.capturing.tensor_parallel_propagation import ELEMENTWISE_OPS, NEUTRAL_OPS
from partita.types import OpGraph
from partita.types.tensor_parallel import TensorParallelLayout

__all__ = [
    "SequenceParallelAnalysis",
    "TokenSplit",
    "analyze_sequence",
    "find_sequence_layout",
    "sequence_layout_fields",
    "whole_graph_splits",
]

_PASS_THROUGH = frozenset({"contiguous_grad", "boundary_tensor"})  # the stage builder's identity wrappers
_MATMULS = frozenset({"linear", "addmm", "mm", "matmul"})
_REDUCTIONS = frozenset({"mean", "sum", "amax", "amin"})
_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax"})
_TOKEN_MIXING = frozenset({"cumsum", "cumprod", "bmm", "baddbmm", "select", "index", "narrow", "gather", "roll"})


@dataclass(frozen=True)
class TokenSplit:
    """A value split along its token axis: dim ``dim`` viewed as ``(-1, inner)``, the ``inner`` axis
    split into equal parts over the group; made so by the sources named in ``origins``."""

    dim: int
    inner: int
    origins: frozenset[str]


@dataclass
class SequenceParallelAnalysis:
    """What sequence parallelism does to one graph, by node name (the rewrite's directives).

    ``states``: every value split along its tokens. ``sources``: row-parallel matmuls and
    vocab-parallel embeddings whose outputs are reduce-scattered, and stage inputs taken in part.
    ``column_gathers``: split values all-gathered for column-parallel matmuls (their backward
    reduce-scatters); ``column_matmuls`` those matmuls, by the value they read (``fused_columns``:
    the values read by one only, which the runtime all-gathers inside it). ``whole_gathers``: split
    values all-gathered whole for a graph output.
    ``gathers``: (node, argument position) -> the split of an operand all-gathered whole for an
    operation that runs whole (a matmul tensor parallelism left whole, one without a rule).
    ``scatters``: (node, argument position) -> the token split to slice a whole operand to.
    ``broadcasts``: (node, argument position) of whole operands broadcast over the tokens, whose
    gradient is summed over the group. ``resized``: view node -> the size element to divide.
    ``rejected``: source -> why its region stays whole.
    """

    states: dict[str, TokenSplit] = field(default_factory=dict)
    sources: dict[str, TokenSplit] = field(default_factory=dict)
    column_gathers: dict[str, TokenSplit] = field(default_factory=dict)
    column_matmuls: dict[str, list[str]] = field(default_factory=dict)
    whole_gathers: dict[str, TokenSplit] = field(default_factory=dict)
    gathers: dict[tuple[str, int], TokenSplit] = field(default_factory=dict)
    scatters: dict[tuple[str, int], TokenSplit] = field(default_factory=dict)
    broadcasts: set[tuple[str, int]] = field(default_factory=set)
    resized: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)

    @property
    def is_trivial(self) -> bool:
        return not self.sources

    @property
    def fused_columns(self) -> dict[str, str]:
        """Gathered value -> the one column-parallel matmul that reads it: where its blocks are large
        enough the runtime runs the two as one op (``partita.runtime.tensor_parallel_ops.all_gather_matmul``),
        keeping this device's tokens for backward. A value several matmuls read (Llama's query,
        key and value projections) is gathered once, apart, and kept whole."""
        return {x: matmuls[0] for x, matmuls in self.column_matmuls.items() if len(matmuls) == 1}


def analyze_sequence(
    graph: torch.fx.Graph,
    tensor_parallel: TensorParallelAnalysis,
    *,
    params: Mapping[str, str] | None = None,
    outputs: Collection[str] | None = None,
    inputs: Mapping[str, TokenSplit] | None = None,
) -> SequenceParallelAnalysis:
    """Sequence parallelism over ``tensor_parallel`` (the same graph's analysis at degree t > 1).

    ``params``: node name -> parameter name (None: every get_attr node). ``outputs``: the graph
    outputs that are used (None: all). ``inputs``: placeholder name -> the token split of the value
    it receives in the whole graph (a stage graph's received values, taken in part at its start).
    """
    rejected: dict[str, str] = {}
    while True:
        run = _Propagation(graph, tensor_parallel, rejected, params, outputs, dict(inputs or {}))
        run.propagate()
        failed = {o: r for o, r in run.errors.items() if o not in rejected}
        if not failed:
            return run.result()
        rejected.update(failed)


class _Failure(Exception):
    def __init__(self, origins: Iterable[str], reason: str):
        super().__init__(reason)
        self.origins, self.reason = frozenset(origins), reason


class _Whole(Exception):
    """The operation runs whole: its token-split operands are gathered before it (a region's exit)."""


class _Propagation:
    def __init__(
        self,
        graph: torch.fx.Graph,
        tp: TensorParallelAnalysis,
        rejected: dict[str, str],
        params: Mapping[str, str] | None,
        outputs: Collection[str] | None,
        inputs: dict[str, TokenSplit],
    ):
        self.graph, self.tp, self.t, self.rejected, self.inputs = graph, tp, tp.degree, rejected, inputs
        if params is None:
            params = {n.name: n.target for n in graph.nodes if n.op == "get_attr"}
        self.params = params
        self.outputs = None if outputs is None else frozenset(outputs)
        self.found = SequenceParallelAnalysis(rejected=rejected)
        self.states: dict[torch.fx.Node, TokenSplit] = {}
        self.errors: dict[str, str] = {}

    def result(self) -> SequenceParallelAnalysis:
        self.found.states = {n.name: s for n, s in self.states.items()}
        return self.found

    # -------------------------------------------------------------- driver

    def propagate(self) -> None:
        for node in self.graph.nodes:
            try:
                if node.op == "placeholder" and node.name in self.inputs and node.name not in self.rejected:
                    seed = self.inputs[node.name]
                    self._source(node, TokenSplit(seed.dim, seed.inner, frozenset({node.name})))
                elif node.op == "output":
                    self._visit_output(node)
                elif node.op == "call_function":
                    self._visit(node)
            except _Failure as failure:
                for origin in failure.origins:
                    self.errors.setdefault(origin, failure.reason)

    def _source(self, node: torch.fx.Node, split: TokenSplit) -> None:
        self.states[node] = split
        self.found.sources[node.name] = split

    def _visit_output(self, node: torch.fx.Node) -> None:
        for value in fx_read.tensor_args(node):
            split = self.states.get(value)
            if split is not None and (self.outputs is None or value.name in self.outputs):
                self.found.whole_gathers[value.name] = split

    def _visit(self, node: torch.fx.Node) -> None:
        kind = self.tp.kinds.get(node.name)
        if kind in ("row", "vocab_embedding") and node.name not in self.rejected:
            split = source_split(node, self.t)
            if split is None:
                raise _Failure({node.name}, f"{node.name}: no static token dim of its output divides by {self.t}")
            self._source(node, split)
            return
        inputs = fx_read.tensor_args(node)
        split_inputs = [v for v in inputs if v in self.states]
        if not split_inputs:
            return
        origins = frozenset().union(*(self.states[v].origins for v in split_inputs))
        name = fx_read.op_name(node)
        if kind == "column":
            x = fx_read.matmul_operands(node, name)[0]
            if split_inputs != [x]:
                raise _Failure(origins, f"{node.name}: a column-parallel matmul reads a token-split weight")
            self.found.column_gathers[x.name] = self.states[x]
            self.found.column_matmuls.setdefault(x.name, []).append(node.name)
            return
        if name in NEUTRAL_OPS:
            return
        if kind is not None or node.name in self.tp.states or any(v.name in self.tp.states for v in inputs):
            raise _Failure(origins, f"{node.name} ({node.target}) meets a value split by tensor parallelism")
        try:
            split = self._rule(node, name, origins)
        except _Whole:
            for position, v in fx_read.tensor_positions(node):
                if v in self.states:
                    self.found.gathers[(node.name, position)] = self.states[v]
            return
        if split is not None:
            self.states[node] = split

    def _rule(self, node: torch.fx.Node, name: str, origins: frozenset[str]) -> TokenSplit | None:
        """The token split of ``node``'s output (None: no tensor output); _Failure when it cannot run split."""
        x = node.args[0] if node.args else None
        if name in _PASS_THROUGH or name in ("to", "_to_copy", "clone", "contiguous", "alias", "type_as", "detach"):
            return self._elementwise(node, origins)
        if name in ELEMENTWISE_OPS:
            return self._elementwise(node, origins)
        if name == "layer_norm":
            return self._layer_norm(node, origins)
        if name in _MATMULS:
            return self._whole_matmul(node, name, origins)
        if name in fx_read.VIEWS:
            return self._view(node, origins)
        split = self.states.get(x) if isinstance(x, torch.fx.Node) else None
        if split is not None and name in ("transpose", "t", "permute", "unsqueeze", "squeeze"):
            return self._moved(node, name, split)
        if split is not None and name in _REDUCTIONS | _SOFTMAX:
            return self._reduction(node, name, split)
        if split is not None and name == "slice":
            return self._slice(node, split)
        if split is not None and name == "sym_size":
            if fx_read.dim(node.args[1], x) == split.dim:
                raise _Failure(origins, f"{node.name} reads the size of the token dim")
            return None
        if name in _TOKEN_MIXING:
            raise _Failure(origins, f"{node.name} ({node.target}) mixes tokens")
        raise _Whole()  # no rule: it runs whole, on gathered operands

    # -------------------------------------------------------------- rules

    def _elementwise(self, node: torch.fx.Node, origins: frozenset[str]) -> TokenSplit:
        """Operands broadcast to the output: the split ones on one token axis; whole ones sliced to it
        (full size along it) or broadcast over it (their gradient summed over the group)."""
        out = fx_read.shape(node) or fx_read.broadcast_shape(fx_read.tensor_args(node))
        if out is None:
            raise _Failure(origins, f"{node.name} ({node.target}): shapes unknown")
        placed: TokenSplit | None = None
        for v in fx_read.tensor_args(node):
            split = self.states.get(v)
            if split is None:
                continue
            aligned = split.dim + len(out) - len(fx_read.shape(v))
            if placed is not None and (placed.dim, placed.inner) != (aligned, split.inner):
                raise _Failure(origins, f"{node.name} ({node.target}) combines values split along different tokens")
            placed = TokenSplit(aligned, split.inner, origins)
        for position, v in fx_read.tensor_positions(node):
            if v not in self.states:
                self._whole_operand(node, position, v, placed, out)
        if fx_read.op_name(node) in ("zeros_like", "ones_like", "full_like", "empty_like") and node.kwargs.get("size"):
            raise _Failure(origins, f"{node.name} ({node.target}) makes a tensor of a whole size")
        return placed

    def _whole_operand(self, node: torch.fx.Node, position: int, v: torch.fx.Node, placed: TokenSplit, out) -> None:
        shape = fx_read.shape(v)
        if shape is None:
            raise _Failure(placed.origins, f"{node.name}: the shape of {v.name} is unknown")
        aligned = placed.dim - (len(out) - len(shape))
        if aligned < 0 or shape[aligned] == 1:
            self.found.broadcasts.add((node.name, position))
        elif shape[aligned] == out[placed.dim]:
            self.found.scatters[(node.name, position)] = TokenSplit(aligned, placed.inner, placed.origins)
        else:
            raise _Failure(placed.origins, f"{node.name}: {v.name} has {shape[aligned]} tokens, not {out[placed.dim]}")

    def _layer_norm(self, node: torch.fx.Node, origins: frozenset[str]) -> TokenSplit:
        x, normalized = node.args[0], node.args[1]
        split = self.states.get(x)
        if split is None or split.dim >= len(fx_read.shape(x)) - len(normalized):
            raise _Failure(origins, f"{node.name} normalises over the token dim")
        for position, v in fx_read.tensor_positions(node):
            if v is not x:
                self.found.broadcasts.add((node.name, position))
        return split

    def _whole_matmul(self, node: torch.fx.Node, name: str, origins: frozenset[str]) -> TokenSplit:
        """A matmul tensor parallelism left whole (a weight of two dims) runs whole on its gathered
        input, as it would without sequence parallelism (an LM head over a vocabulary too small to
        split would otherwise make its logits the region's, and gather those); a matmul of two
        token-split values, or contracting the tokens, mixes them."""
        x, weight, bias = fx_read.matmul_operands(node, name)
        split = self.states.get(x)
        shape = fx_read.shape(weight)
        if split is None or weight in self.states or bias in self.states or shape is None or len(shape) != 2:
            raise _Failure(origins, f"{node.name} ({node.target}) mixes tokens (a matmul of token-split values)")
        if split.dim == len(fx_read.shape(x)) - 1:
            raise _Failure(origins, f"{node.name} ({node.target}) contracts the token dim")
        raise _Whole()

    def _view(self, node: torch.fx.Node, origins: frozenset[str]) -> TokenSplit:
        x = node.args[0]
        split, before, after = self.states.get(x), fx_read.shape(x), fx_read.shape(node)
        if split is None or before is None or after is None:
            raise _Failure(origins, f"{node.name}: a view of unknown shape")
        stride = math.prod(before[split.dim + 1 :])
        dim = next(
            (
                d
                for d in range(len(after))
                if math.prod(after[d + 1 :]) == stride and after[d] % split.inner == 0 and after[d] >= split.inner
            ),
            None,
        )
        if dim is None:
            raise _Failure(origins, f"{node.name} ({node.target}) merges the token axis with other dims")
        sizes = node.args[1] if len(node.args) > 1 else None
        if isinstance(sizes, (list, tuple)) and len(sizes) == len(after):
            if isinstance(sizes[dim], int) and sizes[dim] != -1:
                self.found.resized[node.name] = dim
            elif not isinstance(sizes[dim], int):
                raise _Failure(origins, f"{node.name} names the size of the token dim symbolically")
        return TokenSplit(dim, split.inner, origins)

    def _moved(self, node: torch.fx.Node, name: str, split: TokenSplit) -> TokenSplit:
        x = node.args[0]
        ndim = len(fx_read.shape(x))
        if name == "transpose":
            a, b = node.args[1] % ndim, node.args[2] % ndim
            dim = b if split.dim == a else a if split.dim == b else split.dim
        elif name == "t":
            dim = 1 - split.dim if ndim == 2 else split.dim
        elif name == "permute":
            dim = [d % ndim for d in node.args[1]].index(split.dim)
        elif name == "unsqueeze":
            dim = split.dim + (node.args[1] % (ndim + 1) <= split.dim)
        else:  # squeeze
            dim = fx_read.mapped_dim(fx_read.shape(x), fx_read.shape(node), split.dim)
            if dim is None:
                raise _Failure(split.origins, f"{node.name} squeezes the token dim")
        return TokenSplit(dim, split.inner, split.origins)

    def _slice(self, node: torch.fx.Node, split: TokenSplit) -> TokenSplit:
        """A slice along another dim, or the whole of the token dim (``x[:, :]``), keeps the split."""
        x = node.args[0]
        dim = fx_read.dim(node.args[1] if len(node.args) > 1 else 0, x)
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        size = fx_read.shape(x)[dim]
        whole = start in (None, 0) and (end is None or (isinstance(end, int) and end >= size)) and step == 1
        if dim == split.dim and not whole:
            raise _Failure(split.origins, f"{node.name} ({node.target}) takes some of the tokens")
        return split

    def _reduction(self, node: torch.fx.Node, name: str, split: TokenSplit) -> TokenSplit:
        x = node.args[0]
        ndim = len(fx_read.shape(x))
        if name in _SOFTMAX:
            if fx_read.dim(node.args[1], x) == split.dim:
                raise _Failure(split.origins, f"{node.name} ({node.target}) mixes tokens (a softmax over them)")
            return split
        dims = node.args[1] if len(node.args) > 1 else None
        if dims is None:
            raise _Failure(split.origins, f"{node.name} ({node.target}) mixes tokens (reduces every dim)")
        dims = [d % ndim for d in ([dims] if isinstance(dims, int) else dims)]
        if split.dim in dims:
            raise _Failure(split.origins, f"{node.name} ({node.target}) mixes tokens (reduces over them)")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return TokenSplit(
            split.dim if keepdim else split.dim - sum(d < split.dim for d in dims), split.inner, split.origins
        )


def source_split(node: torch.fx.Node, degree: int) -> TokenSplit | None:
    """The token split of a source's output: its first static (not batch) dim other than the last
    whose size divides by ``degree``; else the static factor of a merged batch dim (``16*s0``: the
    tokens of a ``(B*T, H)`` value). None when there is none."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 2:
        return None
    merged = None
    for d, size in enumerate(val.shape[:-1]):
        if isinstance(size, int):
            if size >= degree and size % degree == 0:
                return TokenSplit(d, size, frozenset({node.name}))
        elif merged is None:
            coefficient = _static_factor(size)
            if coefficient >= degree and coefficient % degree == 0:
                merged = TokenSplit(d, coefficient, frozenset({node.name}))
    return merged


def _static_factor(size: Any) -> int:
    """The integer coefficient of a symbolic size (``16*s0`` -> 16; 1 when it has none)."""
    expr = getattr(getattr(size, "node", None), "expr", None)
    if expr is None:
        return 1
    coefficient, _ = expr.as_coeff_Mul()
    return int(coefficient) if coefficient.is_Integer else 1


def broadcast_only(
    values: Iterable[torch.fx.Node], sp: SequenceParallelAnalysis, also: Collection[tuple[str, int]] = ()
) -> set[str]:
    """The names of ``values`` (weights: get_attr nodes, a stage's parameter placeholders) that every
    use reads as an operand broadcast over the tokens of a split value (``sp.broadcasts``: a norm's
    weight and bias; ``also``: more such uses, (node, argument position)). Each rank's gradient of
    such a weight is then the part of its own tokens, which the runtime sums over the group once
    per step with the other gradients, as Megatron-LM does for its sequence-parallel norms, instead
    of after every micro-batch's backward."""
    found = set()
    for v in values:
        uses = [(user.name, p) for user in v.users for p, operand in fx_read.tensor_positions(user) if operand is v]
        if uses and all(use in sp.broadcasts or use in also for use in uses):
            found.add(v.name)
    return found


def sequence_layout_fields(graph: torch.fx.Graph, tp: TensorParallelAnalysis, sp: SequenceParallelAnalysis) -> dict:
    """The ``TensorParallelLayout`` fields of ``sp`` on ``graph`` (a whole captured graph): the split
    and gathered nodes, and the collectives by node, elements at the graph's example batch (the
    cost model's ``partita.cost.tensor_parallel``)."""
    nodes = {n.name: n for n in graph.nodes}
    forward = dict(tp.layout.forward_reductions)
    backward = dict(tp.layout.backward_reductions)
    fixed = dict(tp.layout.backward_fixed_reductions)
    forward_passes: dict[str, tuple[int, ...]] = {}
    backward_passes: dict[str, tuple[int, ...]] = {}
    fixed_passes: dict[str, tuple[int, ...]] = {}  # of whole operands without a batch dimension

    def add(passes: dict, name: str, elements: int) -> None:
        passes[name] = passes.get(name, ()) + (elements,)

    for name in sp.sources:
        if name in nodes:  # reduce-scattered instead of all-reduced; backward all-gathers the gradient
            forward.pop(name, None)
            add(forward_passes, name, fx_read.numel(nodes[name]))
            add(backward_passes, name, fx_read.numel(nodes[name]))
    fused = sp.fused_columns
    for name in sp.column_gathers:  # all-gathered; backward reduce-scatters instead of all-reducing
        backward.pop(name, None)
        elements = fx_read.numel(nodes[name])
        if name in fused:  # by its matmul; around the ring it gathers it again in backward
            add(forward_passes, fused[name], elements)
            add(backward_passes, fused[name], elements)
            add(backward_passes, fused[name], elements)
        else:
            add(forward_passes, name, elements)
            add(backward_passes, name, elements)
    gathered = set(sp.whole_gathers)
    operands = {(n.name, p): v for n in graph.nodes for p, v in fx_read.tensor_positions(n)}
    gathered |= {operands[use].name for use in sp.gathers}
    for name in sorted(gathered):  # one all-gather per value, whatever its whole consumers
        add(forward_passes, name, fx_read.numel(nodes[name]))
    for (name, position), _ in sp.scatters.items():  # backward all-gathers the part's gradient
        operand = operands[(name, position)]
        add(backward_passes if fx_read.batched(operand) else fixed_passes, name, fx_read.numel(operand))
    weights = [n for n in graph.nodes if n.op == "get_attr"]
    partial = broadcast_only(weights, sp)
    per_step = {n.target for n in weights if n.name in partial} - {n.target for n in weights if n.name not in partial}
    for name, position in sorted(sp.broadcasts):
        operand = operands[(name, position)]
        # a weight's gradient summed over the group: its size at any batch; once per step, with the
        # other gradients (not counted: a few norms' weights), where every use broadcasts it
        if operand.op == "get_attr" and operand.target not in per_step:
            fixed[name] = fixed.get(name, 0) + fx_read.numel(operand)
    return dict(
        sequence_parallel=True,
        sequence_nodes=frozenset(sp.states),
        gathered_nodes=frozenset(set(sp.column_gathers) - set(fused)) | frozenset(gathered),
        fused_gathers=fused,
        forward_reductions=forward,
        backward_reductions=backward,
        backward_fixed_reductions=fixed,
        forward_passes=forward_passes,
        backward_passes=backward_passes,
        backward_fixed_passes=fixed_passes,
        token_splits={
            **{name: (split.dim, split.inner) for name, split in sp.sources.items() if name in nodes},
            **{fused[name]: (sp.column_gathers[name].dim, sp.column_gathers[name].inner) for name in fused},
        },
        sequence_rejected=dict(sp.rejected),
    )


def find_sequence_layout(graph: OpGraph, degree: int) -> TensorParallelLayout:
    """``partita.capturing.tensor_parallel.find_layout`` with sequence parallelism: the planner's view
    of the whole captured graph (whose stages return the loss alone) on a group of ``degree``."""
    analysis = whole_graph_analysis(graph, degree)
    layout = whole_graph_layout(graph, analysis)
    if layout.is_trivial:
        return layout
    loss = graph.nodes[graph.loss_node].name
    sequence = analyze_sequence(graph.graph_module.graph, analysis, outputs=(loss,))
    return dataclasses.replace(layout, **sequence_layout_fields(graph.graph_module.graph, analysis, sequence))


def whole_graph_splits(graph: OpGraph, degree: int) -> dict[str, TokenSplit]:
    """The values of the whole captured graph that sequence parallelism splits, by node name: a stage
    takes its part of those it receives (``analyze_sequence``'s ``inputs``)."""
    analysis = whole_graph_analysis(graph, degree)
    if analysis.layout.is_trivial:
        return {}
    loss = graph.nodes[graph.loss_node].name
    return analyze_sequence(graph.graph_module.graph, analysis, outputs=(loss,)).states
