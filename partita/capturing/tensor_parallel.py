"""Tensor-parallel structure on a captured graph: Megatron's patterns found on aten ops.

A group of ``degree`` devices runs one graph together. Rules, found here without any
model-specific code:

* **column-parallel** matmul (``linear``, ``addmm``/``mm``/``matmul`` with a weight parameter)
  on a replicated input: each device holds a slice of the output features (weight and bias
  split along them) and its output is *sharded* on the last dim;
* sharded values flow through ops that act on each slice alone -- elementwise ops (a
  replicated operand of full size on the sharded dim is sliced, ``scatter``), views and
  reshapes (the shape argument is divided: ``(B, S, 12 heads, 64)`` -> 6 heads), transposes,
  splits (a fused QKV projection's weight is split per block: ``ParamShard.blocks``), softmax
  and reductions over other dims, batched matmuls and attention over sharded heads (GQA's
  repeated key/value heads included);
* **row-parallel** matmul on an input sharded on its last dim: the weight is split along its
  input features, the partial outputs are all-reduced, then the bias is added;
* **vocab-parallel embedding**: a vocabulary (``is_vocabulary``: rows >= 8 x columns or at least
  16,384 rows; at least 16 columns: not a per-head bias table) is split by rows, looked up
  where it is held and all-reduced;
* **vocab-parallel cross-entropy**: a column-parallel LM head's logits (a vocabulary again, not
  a classifier's few classes) go into
  ``cross_entropy`` without being gathered (max, sum of exponentials and target logit are
  reduced over the group).

Anything else that meets a sharded value -- an op without a rule, a norm over the sharded dim,
a graph output -- rejects the column-parallel matmuls (and embeddings) it came from: they run
replicated, and the search is repeated until every sharded value ends in a row-parallel matmul
or the cross-entropy. Unknown ops are never guessed. So a graph without these patterns (a CNN)
gets an empty layout and runs replicated.

``analyze`` works on any FX graph (a whole captured graph, or one stage's graph) and returns
what the runtime rewrite (``partita.runtime.tensor_parallel``) needs; ``find_layout`` gives the
planner its ``TensorParallelLayout`` keyed by canonical parameter names.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from partita.capturing import tensor_parallel_graph as fx_read
from partita.errors import InputError
from partita.types import OpGraph
from partita.types.tensor_parallel import ParamShard, TensorParallelLayout

__all__ = ["Sharded", "TensorParallelAnalysis", "analyze", "find_layout"]

# An embedding is split by rows when it has at least this many rows per column, or at least
# VOCAB_MIN_ROWS rows, and this many columns (a vocabulary, not T5's relative position bias:
# buckets x heads); an LM head likewise (a vocabulary of classes, not a classifier's few).
VOCAB_ROWS_PER_COLUMN = 8
VOCAB_MIN_COLUMNS = 16
# Language vocabularies hold 30k-250k entries. The ratio alone misses them at wide hidden sizes:
# Megatron-LM's 39B-1T GPTs map 51,200 tokens to 8,192-25,600 features (2-6 rows per column),
# and Megatron splits that embedding and LM head along the vocabulary like any other (Shoeybi et
# al. 2019, sec. 3). Left whole, each device of the group ran the whole head on the last pipeline
# stage (at 1T: more than half the work of the stage's two layers, a 1.4x slower step) and held
# the whole table's weights, gradients and Adam state (24 GB at 1T).
VOCAB_MIN_ROWS = 16384


def is_vocabulary(rows: int, columns: int) -> bool:
    """Whether an embedding table's (rows, columns) or an LM head's (classes, features) are a
    vocabulary's, which tensor parallelism splits by rows (embeddings also need
    ``VOCAB_MIN_COLUMNS``)."""
    return rows >= VOCAB_ROWS_PER_COLUMN * columns or rows >= VOCAB_MIN_ROWS


_ELEMENTWISE = frozenset(
    "add sub mul div pow neg tanh gelu silu relu sigmoid rsqrt sqrt exp log abs clamp where masked_fill "
    "dropout to _to_copy type_as clone contiguous detach alias eq ne lt gt le ge logical_and logical_or "
    "logical_not __and__ __or__ bitwise_and bitwise_or erf sin cos softplus leaky_relu hardtanh "
    "add_ mul_ div_ sub_ masked_fill_ relu_ gelu_ zeros_like ones_like full_like empty_like "
    "rsub reciprocal square tanh_ sigmoid_ silu_ maximum minimum".split()
)
_NEUTRAL = frozenset({"_assert_tensor_metadata"})
_PADDED_OK = frozenset(
    {"to", "_to_copy", "contiguous", "clone", "view", "reshape", "_unsafe_view", "cross_entropy_loss"}
)
WHOLE = object()  # a rule's answer: the output is whole (replicated) again


@dataclass(frozen=True)
class Sharded:
    """A value split over the group along ``dim`` (``blocks`` equal blocks, each split), made so by
    the column-parallel matmuls / embeddings named in ``origins``."""

    dim: int
    blocks: int
    origins: frozenset[str]
    # the dim does not divide by the degree: each part is rounded up, the last one padded (an LM
    # head over GPT-2's 50,257 tokens); only conversions, views that keep the dim and the
    # vocab-parallel cross-entropy take such a value
    padded: bool = False


@dataclass
class TensorParallelAnalysis:
    """What one graph does on a tensor-parallel group: the layout (keyed by get_attr target) and
    the rewrite's directives, by node name.

    ``states``: node -> Sharded (or a tuple of them for a split) for every sharded value;
    ``kinds``: node -> "column", "row", "vocab_embedding" or "vocab_cross_entropy";
    ``copies``: replicated values read by column-parallel matmuls (their gradient is all-reduced);
    ``scatters``: (node, argument position) -> (dim, blocks): a replicated operand to slice;
    ``resized``: node -> (argument position, element): the size argument to divide by the degree,
    rounded up (element None: the argument itself, e.g. a split size); ``vocab``: the classes of
    each vocab-parallel cross-entropy (a padded last part ignores the columns past them).
    """

    degree: int
    layout: TensorParallelLayout
    states: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    copies: set[str] = field(default_factory=set)
    scatters: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    resized: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    vocab: dict[str, int] = field(default_factory=dict)  # vocab-parallel cross-entropy -> classes
    # sequence parallelism over this layout (``partita.capturing.sequence_parallel``): None without
    sequence: Any = None


def find_layout(graph: OpGraph, degree: int) -> TensorParallelLayout:
    """The planner's view: ``analyze`` on the whole captured graph (whose stages return the loss
    alone), parameters by canonical name."""
    return whole_graph_layout(graph, whole_graph_analysis(graph, degree))


@functools.lru_cache(maxsize=16)
def whole_graph_analysis(graph: OpGraph, degree: int) -> TensorParallelAnalysis:
    """``analyze`` on the whole captured graph, whose stages return the loss alone (remembered per
    graph and degree: the planner asks for it with and without sequence parallelism; read-only)."""
    return analyze(graph.graph_module.graph, degree, outputs=(graph.nodes[graph.loss_node].name,))


def whole_graph_layout(graph: OpGraph, analysis: TensorParallelAnalysis) -> TensorParallelLayout:
    """``analysis`` (of the whole captured graph) as the planner's layout: parameters by canonical name."""
    found = analysis.layout
    params = {graph.attr_to_param.get(target, target): shard for target, shard in found.params.items()}
    return TensorParallelLayout(
        degree=found.degree,
        params=params,
        sharded_nodes=found.sharded_nodes,
        forward_reductions=found.forward_reductions,
        backward_reductions=found.backward_reductions,
        backward_fixed_reductions=found.backward_fixed_reductions,
        rejected=found.rejected,
    )


def analyze(
    graph: torch.fx.Graph,
    degree: int,
    *,
    params: Mapping[str, str] | None = None,
    replicated: Collection[str] = (),
    outputs: Collection[str] | None = None,
) -> TensorParallelAnalysis:
    """The tensor-parallel rewrite of ``graph`` on ``degree`` devices.

    ``params``: node name -> parameter name, for the nodes that read parameters (None: every
    get_attr node, named by its target); the layout is keyed by these names. ``replicated``:
    parameters that must stay whole (a weight another stage reads unsplit). ``outputs``: the
    names of the graph outputs that are used (None: all), which must be whole.
    """
    if degree < 1 or degree & (degree - 1):
        raise InputError(f"tensor-parallel degree must be a power of 2 (1, 2, 4, 8, ...), got {degree!r}")
    if degree == 1:
        return TensorParallelAnalysis(degree, TensorParallelLayout(degree=1))
    rejected: dict[str, str] = {}
    while True:
        run = _Propagation(graph, degree, rejected, frozenset(replicated), outputs, params)
        run.propagate()
        failed = run.failures()
        if not failed:
            return run.result()
        rejected.update(failed)


# ----------------------------------------------------------------------------- propagation


class _Failure(Exception):
    def __init__(self, origins: Iterable[str], reason: str):
        super().__init__(reason)
        self.origins, self.reason = frozenset(origins), reason


class _Propagation:
    def __init__(
        self,
        graph: torch.fx.Graph,
        degree: int,
        rejected: dict[str, str],
        replicated: frozenset[str],
        outputs: Collection[str] | None,
        params: Mapping[str, str] | None,
    ):
        self.graph, self.t, self.rejected, self.replicated = graph, degree, rejected, replicated
        if params is None:
            params = {n.name: n.target for n in graph.nodes if n.op == "get_attr"}
        self.params = params
        self.outputs = None if outputs is None else frozenset(outputs)
        self.states: dict[torch.fx.Node, Any] = {}
        self.kinds: dict[str, str] = {}
        self.copies: set[str] = set()
        self.scatters: dict[tuple[str, int], tuple[int, int]] = {}
        self.resized: dict[str, tuple[int, int | None]] = {}
        self.param_uses: dict[str, list[tuple[ParamShard | None, frozenset[str]]]] = {}
        self.errors: dict[str, str] = {}
        self.widths: dict[str, tuple[int, int]] = {}  # column matmul -> (output, input) features
        self.vocab: dict[str, int] = {}  # vocab-parallel cross-entropy -> classes
        self.forward_reductions: dict[str, int] = {}
        self.backward_reductions: dict[str, int] = {}
        self.backward_fixed_reductions: dict[str, int] = {}

    # -------------------------------------------------------------- driver

    def propagate(self) -> None:
        for node in self.graph.nodes:
            if node.op == "output":
                for value in fx_read.tensor_args(node):
                    if self._state(value) is not None and (self.outputs is None or value.name in self.outputs):
                        self._fail(self._origins([value]), f"{value.name} is a graph output")
                continue
            if node.op != "call_function":
                continue
            try:
                self._visit(node)
            except _Failure as failure:
                self._fail(failure.origins, failure.reason)
                self.states.pop(node, None)
        self._check_params()

    def failures(self) -> dict[str, str]:
        return {o: r for o, r in self.errors.items() if o not in self.rejected}

    def result(self) -> TensorParallelAnalysis:
        params: dict[str, ParamShard] = {}
        for target, uses in self.param_uses.items():
            shards = {shard for shard, _ in uses}
            if len(shards) == 1 and None not in shards:
                params[target] = shards.pop()
        sharded = {n.name for n in self.states} | set(self.kinds)
        layout = TensorParallelLayout(
            degree=self.t,
            params=params,
            sharded_nodes=frozenset(sharded),
            forward_reductions=dict(self.forward_reductions),
            backward_reductions=dict(self.backward_reductions),
            backward_fixed_reductions=dict(self.backward_fixed_reductions),
            rejected=dict(self.rejected),
        )
        states = {n.name: s for n, s in self.states.items()}
        return TensorParallelAnalysis(
            self.t,
            layout,
            states,
            dict(self.kinds),
            set(self.copies),
            dict(self.scatters),
            dict(self.resized),
            dict(self.vocab),
        )

    def _fail(self, origins: frozenset[str], reason: str) -> None:
        for origin in origins:
            self.errors.setdefault(origin, reason)

    # -------------------------------------------------------------- helpers

    def _state(self, value: Any) -> Any:
        return self.states.get(value) if isinstance(value, torch.fx.Node) else None

    def _origins(self, values: Iterable[Any]) -> frozenset[str]:
        found: set[str] = set()
        for v in values:
            s = self._state(v)
            for part in s if isinstance(s, tuple) else (s,):
                if isinstance(part, Sharded):
                    found |= part.origins
        return frozenset(found)

    def _is_param(self, node: Any) -> bool:
        return isinstance(node, torch.fx.Node) and node.name in self.params

    def _use_param(self, node: Any, shard: ParamShard | None, origins: frozenset[str]) -> None:
        if self._is_param(node):
            self.param_uses.setdefault(self.params[node.name], []).append((shard, origins))

    def _check_params(self) -> None:
        for target, uses in self.param_uses.items():
            shards = {shard for shard, _ in uses}
            if len(shards) == 1 and (None in shards or target not in self.replicated):
                continue
            origins = frozenset().union(*(o for _, o in uses))
            why = (
                "must stay whole" if target in self.replicated else f"is read both split and whole ({len(shards)} ways)"
            )
            self._fail(origins, f"weight {target} {why}")

    # -------------------------------------------------------------- rules

    def _visit(self, node: torch.fx.Node) -> None:
        name = fx_read.op_name(node)
        inputs = fx_read.tensor_args(node)
        sharded_inputs = [v for v in inputs if self._state(v) is not None]
        if name in ("linear", "addmm", "mm", "matmul") and self._visit_matmul(node, name, sharded_inputs):
            return
        if name == "embedding" and self._visit_embedding(node):
            return
        for arg in inputs:  # a weight read by any other rule is read whole
            self._use_param(arg, None, frozenset())
        if not sharded_inputs:
            return
        origins = self._origins(sharded_inputs)
        if name in _NEUTRAL:
            return
        if name not in _PADDED_OK and any(getattr(self._state(v), "padded", False) for v in sharded_inputs):
            raise _Failure(origins, f"{node.name} ({node.target}) cannot take a padded split value")
        if name == "getitem":
            parts = self._state(node.args[0])
            self.states[node] = parts[node.args[1]] if isinstance(parts, tuple) else None
            if self.states[node] is None:
                raise _Failure(origins, f"{node.name} reads a sharded value by index")
            return
        rule = getattr(self, f"_rule_{name}", None)
        if rule is None and name in _ELEMENTWISE:
            rule = self._rule_elementwise
        if rule is None and name in fx_read.VIEWS:
            rule = self._rule_view
        if rule is None:
            raise _Failure(origins, f"{node.name} ({node.target}) has no tensor-parallel rule")
        result = rule(node)
        if result is None:
            raise _Failure(origins, f"{node.name} ({node.target}) cannot run on a split value here")
        if result is not WHOLE:
            self.states[node] = result

    def _visit_matmul(self, node: torch.fx.Node, name: str, sharded_inputs: list) -> bool:
        """Column- or row-parallel when the weight is a parameter; False to try other rules."""
        x, weight, bias = fx_read.matmul_operands(node, name)
        if not self._is_param(weight) or len(fx_read.shape(weight) or ()) != 2:
            return False
        out_dim = 0 if name == "linear" else 1  # linear: (out, in); addmm/mm/matmul: (in, out)
        xs = self._state(x)
        if any(v is not x for v in sharded_inputs):
            raise _Failure(self._origins(sharded_inputs), f"{node.name}: its weight or bias is split")
        if xs is None:
            if node.name in self.rejected or not fx_read.is_plain_matmul(node, name):
                self._use_param(weight, None, frozenset())
                self._use_param(bias, None, frozenset())
                return True
            features = fx_read.shape(weight)[out_dim]
            blocks = fx_read.fused_blocks(node)
            padded = blocks == 1 and features % self.t != 0
            if features % (self.t * blocks) and not padded:
                self._fail(frozenset({node.name}), f"{features} output features do not divide by {self.t}x{blocks}")
            origins = frozenset({node.name})
            whole = features if padded else 0
            self._use_param(weight, ParamShard(out_dim, blocks, whole), origins)
            self._use_param(bias, ParamShard(0, blocks, whole), origins)
            self.kinds[node.name] = "column"
            self.widths[node.name] = (features, fx_read.shape(weight)[1 - out_dim])
            self.copies.add(x.name)
            self.backward_reductions[x.name] = fx_read.numel(x)
            self.states[node] = Sharded(len(fx_read.shape(node)) - 1, blocks, origins, padded)
            return True
        if xs.dim != len(fx_read.shape(x)) - 1 or xs.padded or not fx_read.is_plain_matmul(node, name):
            raise _Failure(xs.origins, f"{node.name} contracts a value split on another dim")
        self._use_param(weight, ParamShard(1 - out_dim, xs.blocks), xs.origins)
        self._use_param(bias, None, xs.origins)
        self.kinds[node.name] = "row"
        self.forward_reductions[node.name] = fx_read.numel(node)
        return True

    def _visit_embedding(self, node: torch.fx.Node) -> bool:
        weight, ids = node.args[0], node.args[1]
        shape = fx_read.shape(weight) or ()
        if not self._is_param(weight) or len(shape) != 2 or self._state(ids) is not None:
            return False
        if node.name in self.rejected or not is_vocabulary(*shape) or shape[1] < VOCAB_MIN_COLUMNS:
            self._use_param(weight, None, frozenset())
            return True
        whole = shape[0] if shape[0] % self.t else 0  # rows rounded up per part, the last one padded
        self._use_param(weight, ParamShard(0, 1, whole), frozenset({node.name}))
        self.kinds[node.name] = "vocab_embedding"
        self.forward_reductions[node.name] = fx_read.numel(node)
        return True

    def _rule_elementwise(self, node: torch.fx.Node) -> Sharded | None:
        out = fx_read.shape(node) or fx_read.broadcast_shape(fx_read.tensor_args(node))
        if out is None:
            return None
        placed: Sharded | None = None
        for v in fx_read.tensor_args(node):
            s = self._state(v)
            if isinstance(s, Sharded):
                aligned = s.dim + len(out) - len(fx_read.shape(v))
                if placed is not None and (placed.dim, placed.blocks) != (aligned, s.blocks):
                    return None
                placed = Sharded(aligned, s.blocks, (placed.origins if placed else frozenset()) | s.origins, s.padded)
        for position, v in fx_read.tensor_positions(node):
            if self._state(v) is not None:
                continue
            shape = fx_read.shape(v)
            if shape is None:
                return None
            aligned = placed.dim - (len(out) - len(shape))
            if aligned >= 0 and shape[aligned] != 1:
                self.scatters[(node.name, position)] = (aligned, placed.blocks)
                # each device's gradient of the whole operand sums only its part: keyed by the node
                # (the cost model reads node names), one all-reduce per such operand; an operand without
                # a batch dimension (T5's position bias) moves as much at every micro-batch size
                sums = self.backward_reductions if fx_read.batched(v) else self.backward_fixed_reductions
                sums[node.name] = sums.get(node.name, 0) + fx_read.numel(v)
        if fx_read.op_name(node) in ("zeros_like", "ones_like", "full_like", "empty_like") and node.kwargs.get("size"):
            return None
        return placed

    def _rule_softmax(self, node: torch.fx.Node) -> Sharded | None:
        s, dim = self._state(node.args[0]), fx_read.dim(node.args[1], node.args[0])
        return s if dim != s.dim else None

    _rule_log_softmax = _rule_softmax
    _rule__softmax = _rule_softmax

    def _rule_mean(self, node: torch.fx.Node) -> Sharded | None:
        x = node.args[0]
        s, ndim = self._state(x), len(fx_read.shape(x))
        if len(node.args) < 2 or node.args[1] is None:
            return None
        dims = [node.args[1]] if isinstance(node.args[1], int) else list(node.args[1])
        dims = [d % ndim for d in dims]
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if s.dim in dims:
            return None
        return Sharded(s.dim if keepdim else s.dim - sum(d < s.dim for d in dims), s.blocks, s.origins)

    _rule_sum = _rule_mean
    _rule_amax = _rule_mean

    def _rule_view(self, node: torch.fx.Node) -> Sharded | None:
        x = node.args[0]
        s = self._state(x)
        before, after = fx_read.shape(x), fx_read.shape(node)
        if before is None or after is None:
            return None
        dim = fx_read.mapped_dim(before, after, s.dim)
        if dim is None:
            return None
        if after[dim] != before[s.dim] and (s.blocks != 1 or after[dim] % self.t or s.padded):
            return None
        self._resize(node, node.args[1], dim)
        return dataclasses.replace(s, dim=dim)

    def _resize(self, node: torch.fx.Node, sizes: Any, dim: int) -> None:
        """The size argument names the whole dim: the rewrite divides it (-1 and symbols are left)."""
        if isinstance(sizes, (list, tuple)) and isinstance(sizes[dim], int) and sizes[dim] != -1:
            self.resized[node.name] = (1, dim)

    def _rule_expand(self, node: torch.fx.Node) -> Sharded | None:
        x, sizes = node.args[0], node.args[1]
        s = self._state(x)
        dim = s.dim + len(sizes) - len(fx_read.shape(x))
        self._resize(node, sizes, dim)
        return Sharded(dim, s.blocks, s.origins)

    def _rule_transpose(self, node: torch.fx.Node) -> Sharded | None:
        x = node.args[0]
        s, ndim = self._state(x), len(fx_read.shape(x))
        a, b = node.args[1] % ndim, node.args[2] % ndim
        dim = b if s.dim == a else a if s.dim == b else s.dim
        return Sharded(dim, s.blocks, s.origins)

    def _rule_t(self, node: torch.fx.Node) -> Sharded | None:
        s = self._state(node.args[0])
        return Sharded(1 - s.dim, s.blocks, s.origins) if len(fx_read.shape(node.args[0])) == 2 else s

    def _rule_permute(self, node: torch.fx.Node) -> Sharded | None:
        s = self._state(node.args[0])
        ndim = len(fx_read.shape(node.args[0]))
        order = [d % ndim for d in node.args[1]]
        return Sharded(order.index(s.dim), s.blocks, s.origins)

    def _rule_unsqueeze(self, node: torch.fx.Node) -> Sharded | None:
        s = self._state(node.args[0])
        dim = node.args[1] % (len(fx_read.shape(node.args[0])) + 1)
        return Sharded(s.dim + (dim <= s.dim), s.blocks, s.origins)

    def _rule_squeeze(self, node: torch.fx.Node) -> Sharded | None:
        before, after = fx_read.shape(node.args[0]), fx_read.shape(node)
        s = self._state(node.args[0])
        dim = fx_read.mapped_dim(before, after, s.dim)
        return Sharded(dim, s.blocks, s.origins) if dim is not None and after[dim] == before[s.dim] else None

    def _rule_slice(self, node: torch.fx.Node) -> Sharded | None:
        s = self._state(node.args[0])
        dim = fx_read.dim(node.args[1] if len(node.args) > 1 else 0, node.args[0])
        if dim != s.dim:
            return s
        start = node.args[2] if len(node.args) > 2 else None
        end = node.args[3] if len(node.args) > 3 else None
        whole = (start in (None, 0)) and (
            end is None or (isinstance(end, int) and end >= fx_read.shape(node.args[0])[dim])
        )
        return s if whole and len(node.args) <= 4 else None

    def _rule_select(self, node: torch.fx.Node) -> Sharded | None:
        s = self._state(node.args[0])
        dim = fx_read.dim(node.args[1], node.args[0])
        return None if dim == s.dim else Sharded(s.dim - (dim < s.dim), s.blocks, s.origins)

    def _rule_split(self, node: torch.fx.Node) -> tuple | None:
        x = node.args[0]
        s, shape = self._state(x), fx_read.shape(x)
        dim = fx_read.dim(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0), x)
        parts = len(fx_read.outputs(node))
        if dim != s.dim:
            return tuple(s for _ in range(parts))
        sizes = node.args[1]
        sizes = [sizes] * parts if isinstance(sizes, int) else list(sizes)
        if s.blocks != parts or len(set(sizes)) != 1 or sizes[0] * parts != shape[dim]:
            return None
        self.resized[node.name] = (1, None)
        return tuple(Sharded(s.dim, 1, s.origins) for _ in range(parts))

    _rule_split_with_sizes = _rule_split

    def _rule_cat(self, node: torch.fx.Node) -> Sharded | None:
        values = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        states = [self._state(v) for v in values]
        if any(s is None for s in states):
            return None
        first = states[0]
        dim = dim % len(fx_read.shape(values[0]))
        if dim == first.dim or any((s.dim, s.blocks) != (first.dim, first.blocks) for s in states):
            return None
        return Sharded(first.dim, first.blocks, frozenset().union(*(s.origins for s in states)))

    def _rule_matmul(self, node: torch.fx.Node) -> Sharded | None:
        """Batched matmul of activations (attention scores, attention x values): sharded batch dims."""
        a, b = node.args[0], node.args[1]
        out = fx_read.shape(node)
        if out is None or len(out) < 3:
            return None
        placed: Sharded | None = None
        for v in (a, b):
            s = self._state(v)
            if s is None:
                continue
            ndim = len(fx_read.shape(v))
            if s.dim >= ndim - 2:
                return None
            aligned = s.dim + len(out) - ndim
            if placed is not None and (placed.dim, placed.blocks) != (aligned, s.blocks):
                return None
            placed = Sharded(aligned, s.blocks, (placed.origins if placed else frozenset()) | s.origins)
        for position, v in enumerate((a, b)):
            if self._state(v) is None:
                shape = fx_read.shape(v)
                if shape is None:
                    return None
                aligned = placed.dim - (len(out) - len(shape))
                if aligned >= 0 and shape[aligned] != 1:
                    self.scatters[(node.name, position)] = (aligned, placed.blocks)
        return placed

    _rule_bmm = _rule_matmul

    def _rule_scaled_dot_product_attention(self, node: torch.fx.Node) -> Sharded | None:
        q, k, v = node.args[:3]
        states = [self._state(x) for x in (q, k, v)]
        if any(s is None or s.dim != len(fx_read.shape(x)) - 3 for s, x in zip(states, (q, k, v))):
            return None
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        if isinstance(mask, torch.fx.Node):
            if self._state(mask) is not None:
                return None
            shape = fx_read.shape(mask)
            if shape is None:
                return None
            aligned = states[0].dim - (len(fx_read.shape(q)) - len(shape))
            if aligned >= 0 and shape[aligned] != 1:
                self.scatters[(node.name, 3)] = (aligned, 1)
        return Sharded(states[0].dim, 1, frozenset().union(*(s.origins for s in states)))

    def _rule_cross_entropy_loss(self, node: torch.fx.Node) -> Sharded | None:
        logits, target = node.args[0], node.args[1]
        s = self._state(logits)
        weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
        smoothing = node.args[5] if len(node.args) > 5 else node.kwargs.get("label_smoothing", 0.0)
        if (
            len(fx_read.shape(logits)) != 2
            or s.dim != 1
            or s.blocks != 1
            or weight is not None
            or smoothing
            or self._state(target) is not None
        ):
            raise _Failure(s.origins, f"{node.name}: only a 2-d cross-entropy without weights or smoothing splits")
        narrow = [o for o in s.origins if not is_vocabulary(*self.widths[o])]
        if narrow:  # a classifier's few classes: nothing worth splitting
            raise _Failure(narrow, f"{node.name}: {self.widths[narrow[0]][0]} classes are too few to split")
        self.kinds[node.name] = "vocab_cross_entropy"
        self.vocab[node.name] = fx_read.shape(logits)[1]
        self.forward_reductions[node.name] = 3 * fx_read.shape(logits)[0]
        return WHOLE

    def _rule_sym_size(self, node: torch.fx.Node) -> Any:
        s = self._state(node.args[0])
        return WHOLE if fx_read.dim(node.args[1], node.args[0]) != s.dim else None
