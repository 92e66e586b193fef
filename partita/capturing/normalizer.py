"""What the captured loss is a mean over: find the loss's reductions and their normalisers.

Unsplit training computes the loss once, over the global batch. A pipeline computes it once per
*slice* (a micro-batch of one replica of the last stage), ``S = num_microbatches x replicas`` times.
The mean of the slices' losses is the full-batch loss only when every slice's loss is a mean over
equally many elements. A loss that is a mean over a data-dependent count -- cross-entropy or NLL
with ``ignore_index`` (padded labels, ``-100``), a masked mean ``sum(x * mask) / mask.sum()`` --
is not: a slice with few valid tokens weighs as much as one with many. This module reads the
captured FX graph and says, for each part of the loss, how a slice's value must be scaled so that
the slices' values SUM to the full-batch loss; ``partita.runtime.loss_scaling`` rewrites the stage
that computes each part and feeds it the values measured on the global batch.

Grammar (``analyse_loss``): the loss is a *linear form* of *terms*. From the loss node down:

- pass-through ops on a 0-dim value (``to``, ``clone``, ``view``, ``neg``, ...) and ``add`` /
  ``sub`` of two 0-dim values, ``mul`` / ``div`` by a Python number, are linear;
- ``mul`` / ``div`` by a 0-dim tensor *factor*: one that reads no graph input (a constant or a
  function of the parameters) scales the term the same in every slice; one that reads graph
  inputs but no trainable parameter (``mask.sum()``, ``1 / num_tokens``) is a *global factor*:
  it is replaced by its value on the global batch (that is what the unsplit model computes);
- a term is a reduction:

  ========================  ==============================================  ===================
  term                      examples                                        per-slice scale
  ========================  ==============================================  ===================
  ``COUNT_MEAN``            ``cross_entropy`` / ``nll_loss``, reduction      rewritten to
                            ``mean``, class-index target (ignore_index,      ``sum / global
                            class weights)                                   count``
  ``SUM``                   ``x.sum()`` over a per-sample tensor,            1
                            ``reduction="sum"``
  ``MEAN``                  ``x.mean()`` over a per-sample tensor,           1 / S
                            ``mse_loss``, BCE, ``reduction="mean"`` without
                            a data-dependent count
  ``CONSTANT``              reads no graph input (``0.01 * (w ** 2).sum()``)  1 / S
  ========================  ==============================================  ===================

Anything else (a product of two data-dependent terms, ``loss ** 2``, a sum over a tensor without
batch dimension, a factor that reads both data and parameters) makes the structure
*unrecognised*: ``LossStructure.unknown`` names the node, its source line and why.

``global_values_module`` builds a GraphModule that evaluates nodes of the captured graph (the
targets and class weights of COUNT_MEAN terms, the global factors) from the flat graph inputs,
so that they can be computed on the whole global batch, which every rank is given.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from partita.types import OpGraph

__all__ = [
    "GlobalFactor",
    "LossStructure",
    "LossTerm",
    "TermKind",
    "Unrecognised",
    "analyse_loss",
    "global_values_module",
    "schema_arguments",
]

aten = torch.ops.aten

# Reductions with ignore_index whose mean divides by a data-dependent count (or class-weight sum).
COUNT_OPS = {aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default, aten.nll_loss2d.default}
# Losses with a ``reduction`` argument and a fixed count of elements under "mean".
FIXED_COUNT_OPS = {
    aten.mse_loss.default,
    aten.l1_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
    aten.kl_div.default,
    aten.soft_margin_loss.default,
    aten.multilabel_margin_loss.default,
    aten.hinge_embedding_loss.default,
    aten.margin_ranking_loss.default,
    aten.cosine_embedding_loss.default,
    aten.poisson_nll_loss.default,
    aten.multi_margin_loss.default,
}
SUM_OPS = {aten.sum.default, aten.sum.dim_IntList, aten.nansum.default}
MEAN_OPS = {aten.mean.default, aten.mean.dim, aten.nanmean.default}
# 0-dim -> 0-dim ops that are linear in their first argument.
PASS_THROUGH_OPS = {
    aten.to.dtype,
    aten.to.dtype_layout,
    aten.to.device,
    aten.to.other,
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.view.default,
    aten.reshape.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.unsqueeze.default,
    aten.contiguous.default,
    aten.neg.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
}
ADD_OPS = {aten.add.Tensor, aten.sub.Tensor}
SCALE_OPS = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, operator.mul, operator.truediv}
DIV_OPS = {aten.div.Tensor, aten.div.Scalar, operator.truediv}

REDUCTION_MEAN, REDUCTION_SUM = 1, 2  # at::Reduction


class TermKind(str, enum.Enum):
    """How one reduction of the loss behaves over slices of the batch (see the module docstring)."""

    COUNT_MEAN = "count_mean"  # mean over a data-dependent count: rewritten to sum / global count
    SUM = "sum"  # additive over slices as it is
    MEAN = "mean"  # mean over a fixed number of elements per slice: scaled by 1 / S
    CONSTANT = "constant"  # reads no graph input: the same in every slice, scaled by 1 / S


@dataclass(frozen=True)
class LossTerm:
    """One reduction of the loss (``node``: its FX node name in the captured graph)."""

    node: str
    kind: TermKind
    op: str  # e.g. "aten.cross_entropy_loss.default"
    target: str | None = None  # COUNT_MEAN: the node of the class-index target
    weight: str | None = None  # COUNT_MEAN: the node of the class weights (None: unweighted)
    ignore_index: int | None = None  # COUNT_MEAN


@dataclass(frozen=True)
class GlobalFactor:
    """A data-only scalar that scales a part of the loss: argument ``position`` of node ``consumer``
    (a ``mul`` or ``div``) is node ``node`` (``mask.sum()``, a token count, a size)."""

    node: str
    consumer: str
    position: int


@dataclass(frozen=True)
class Unrecognised:
    """The node where the loss stops being a recognised linear form of sums and means."""

    node: str
    op: str
    source: str  # "file.py:LINE in func" of the model code, "" when unknown
    reason: str


@dataclass(frozen=True)
class LossStructure:
    """The loss as a linear form of terms, with the global factors it is scaled by."""

    loss: str  # FX node name of the loss
    terms: tuple[LossTerm, ...] = ()
    factors: tuple[GlobalFactor, ...] = ()  # data-only scalar factors, evaluated on the global batch
    unknown: Unrecognised | None = None

    @property
    def recognised(self) -> bool:
        return self.unknown is None

    @property
    def averages_equal_counts(self) -> bool:
        """Every term is a mean over a fixed count (or a constant) and nothing is scaled by a
        data-dependent factor: the mean of the slices' losses is the full-batch loss as it is."""
        return (
            self.recognised
            and not self.factors
            and all(t.kind in (TermKind.MEAN, TermKind.CONSTANT) for t in self.terms)
        )

    def describe(self) -> str:
        if self.unknown is not None:
            u = self.unknown
            return f"unrecognised at {u.node} ({u.op}{', ' + u.source if u.source else ''}): {u.reason}"
        parts = [f"{t.kind.value} {t.node} ({t.op})" for t in self.terms]
        if self.factors:
            parts.append(f"global factors {', '.join(f.node for f in self.factors)}")
        return "; ".join(parts)


class _Unknown(Exception):
    def __init__(self, node: torch.fx.Node, reason: str):
        super().__init__(reason)
        self.node, self.reason = node, reason


def analyse_loss(graph: OpGraph) -> LossStructure:
    """The structure of ``graph``'s loss (see the module docstring)."""
    gm = graph.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    loss = by_name[graph.nodes[graph.loss_node].name]
    deps = _dependencies(gm, graph)
    walker = _Walker(deps)
    try:
        walker.visit(loss)
    except _Unknown as e:
        node = e.node
        return LossStructure(loss=loss.name, unknown=Unrecognised(node.name, _op_name(node), _source(node), e.reason))
    return LossStructure(loss=loss.name, terms=tuple(walker.terms.values()), factors=tuple(walker.factors))


def schema_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """Every argument of an aten call by its schema name, defaults filled in."""
    schema = node.target._schema
    bound: dict[str, Any] = {}
    for k, arg in enumerate(schema.arguments):
        if k < len(node.args):
            bound[arg.name] = node.args[k]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def global_values_module(graph: OpGraph, names: Sequence[str]) -> torch.fx.GraphModule:
    """A GraphModule ``m(*flat_inputs) -> tuple`` computing the nodes ``names`` of the captured
    graph (and only what they need) from the flat graph inputs (``flatten_inputs``), reading the
    same constants and buffers as the captured module."""
    gm = graph.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    needed: set[torch.fx.Node] = set()
    stack = [by_name[name] for name in names]
    while stack:
        node = stack.pop()
        if node not in needed:
            needed.add(node)
            stack.extend(node.all_input_nodes)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    attrs: dict[str, Any] = {}
    for node in gm.graph.nodes:  # every placeholder, so that the module takes all flat inputs
        if node.op == "placeholder":
            env[node] = g.placeholder(node.name)
            env[node].meta = dict(node.meta)
        elif node in needed and node.op != "output":
            if node.op == "get_attr":
                attrs[node.target] = _resolve(gm, node.target)
            env[node] = g.node_copy(node, lambda n: env[n])
    g.output(tuple(env[by_name[name]] for name in names))
    return torch.fx.GraphModule(attrs, g, class_name="GlobalValues")


# ----------------------------------------------------------------------------- the walk


@dataclass(frozen=True)
class _Deps:
    reads_inputs: bool  # depends on a graph input (the batch)
    reads_trainable: bool  # depends on a trainable parameter


def _dependencies(gm: torch.fx.GraphModule, graph: OpGraph) -> dict[torch.fx.Node, _Deps]:
    deps: dict[torch.fx.Node, _Deps] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            deps[node] = _Deps(True, False)
        elif node.op == "get_attr":
            name = graph.attr_to_param.get(node.target)
            info = graph.parameters.get(name) if name is not None else None
            deps[node] = _Deps(False, bool(info is not None and info.requires_grad and not info.is_buffer))
        else:
            inputs = [deps[n] for n in node.all_input_nodes]
            deps[node] = _Deps(any(d.reads_inputs for d in inputs), any(d.reads_trainable for d in inputs))
    return deps


class _Walker:
    """Walks the linear form from the loss node down, collecting terms and global factors."""

    def __init__(self, deps: dict[torch.fx.Node, _Deps]):
        self.deps = deps
        self.terms: dict[str, LossTerm] = {}
        self.factors: list[GlobalFactor] = []
        self.expression: set[torch.fx.Node] = set()  # nodes of the linear form (where factors may be used)

    def visit(self, node: torch.fx.Node) -> None:
        if not isinstance(node, torch.fx.Node):
            raise AssertionError(f"not a node: {node!r}")
        if not self.deps[node].reads_inputs:
            self._add(node, TermKind.CONSTANT)
            return
        if node.op != "call_function":
            raise _Unknown(node, "the loss is a graph input itself")
        if not _is_scalar(node):
            raise _Unknown(node, "a non-scalar value enters the loss through an operation that is not a reduction")
        self.expression.add(node)
        op = node.target
        if op in PASS_THROUGH_OPS:
            self.visit(node.args[0])
        elif op in ADD_OPS:
            a, b = node.args[0], node.args[1]
            if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
                raise _Unknown(node, "a number is added to the loss (it would be counted once per micro-batch)")
            alpha = node.kwargs.get("alpha", 1)
            if isinstance(alpha, torch.fx.Node):
                raise _Unknown(node, "the loss adds terms with a tensor-valued alpha")
            self.visit(a)
            self.visit(b)
        elif op in SCALE_OPS:
            self._visit_scaled(node)
        elif op in COUNT_OPS or op in FIXED_COUNT_OPS:
            self._visit_loss_op(node)
        elif op in SUM_OPS or op in MEAN_OPS:
            self._visit_reduction(node)
        else:
            raise _Unknown(node, "the loss is not a sum, a mean, or a linear combination of them")

    def _visit_scaled(self, node: torch.fx.Node) -> None:
        a, b = node.args[0], node.args[1]
        if node.kwargs.get("rounding_mode") is not None:
            raise _Unknown(node, "the loss is divided with rounding")
        if not isinstance(b, torch.fx.Node):
            self.visit(a)
            return
        if not isinstance(a, torch.fx.Node):
            if node.target in DIV_OPS:
                raise _Unknown(node, "the loss is a number divided by a value computed from the batch")
            self.visit(b)
            return
        if node.target in DIV_OPS or not self.deps[b].reads_inputs:
            position = 1
        elif not self.deps[a].reads_inputs or (self._data_only(a) and self.deps[b].reads_trainable):
            position = 0
        else:
            position = 1
        self._factor(node, position)
        self.visit(node.args[1 - position])

    def _factor(self, consumer: torch.fx.Node, position: int) -> None:
        factor = consumer.args[position]
        d = self.deps[factor]
        if not d.reads_inputs:
            return  # a constant, or a function of the parameters: the same in every slice
        if d.reads_trainable:
            raise _Unknown(
                consumer,
                f"the loss is multiplied or divided by {factor.name}, which depends on both the "
                "batch and the parameters (a product of two terms)",
            )
        if not _is_scalar(factor):
            raise _Unknown(consumer, f"the loss is scaled by {factor.name}, which is not a scalar")
        self.factors.append(GlobalFactor(factor.name, consumer.name, position))

    def _visit_loss_op(self, node: torch.fx.Node) -> None:
        bound = schema_arguments(node)
        reduction = bound.get("reduction")
        if isinstance(reduction, torch.fx.Node):
            raise _Unknown(node, "the reduction mode is not a constant")
        if reduction == REDUCTION_SUM:
            self._add(node, TermKind.SUM)
            return
        if reduction != REDUCTION_MEAN:
            raise _Unknown(node, f"reduction {reduction!r} of {_op_name(node)} gives no scalar")
        if node.target not in COUNT_OPS:
            self._add(node, TermKind.MEAN)
            return
        target, weight = bound.get("target"), bound.get("weight")
        target_val = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
        if not isinstance(target_val, torch.Tensor) or target_val.dtype.is_floating_point:
            self._add(node, TermKind.MEAN)  # class probabilities: a mean over the batch entries
            return
        for name, value in (("target", target), ("class weights", weight)):
            if isinstance(value, torch.fx.Node) and self.deps[value].reads_trainable:
                raise _Unknown(node, f"the {name} of {_op_name(node)} depend on trainable parameters")
        ignore_index = bound.get("ignore_index")
        if isinstance(ignore_index, torch.fx.Node):
            raise _Unknown(node, "ignore_index is not a constant")
        if weight is not None and not isinstance(weight, torch.fx.Node):
            raise _Unknown(node, "the class weights are not a tensor")
        self._add(
            node,
            TermKind.COUNT_MEAN,
            target=target.name,
            weight=weight.name if weight is not None else None,
            ignore_index=int(ignore_index),
        )

    def _visit_reduction(self, node: torch.fx.Node) -> None:
        source = node.args[0]
        if isinstance(source, torch.fx.Node) and _is_scalar(source) and _batch_dim(source) is None:
            self.visit(source)  # the sum or mean of one element (``loss.mean()`` on a 0-dim loss)
            return
        if not isinstance(source, torch.fx.Node) or _batch_dim(source) is None:
            raise _Unknown(
                node,
                "the loss reduces a tensor without a batch dimension, whose value per micro-batch "
                "partita cannot relate to the full batch's",
            )
        self._add(node, TermKind.SUM if node.target in SUM_OPS else TermKind.MEAN)

    def _add(self, node: torch.fx.Node, kind: TermKind, **fields: Any) -> None:
        if node.op != "call_function":
            raise _Unknown(node, "a part of the loss is a parameter or constant itself, not an operation")
        self.terms.setdefault(node.name, LossTerm(node.name, kind, _op_name(node), **fields))

    def _data_only(self, node: torch.fx.Node) -> bool:
        d = self.deps[node]
        return d.reads_inputs and not d.reads_trainable


# ----------------------------------------------------------------------------- helpers


def _is_scalar(node: torch.fx.Node) -> bool:
    """A one-element tensor, or a (symbolic) number such as a size."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return isinstance(val, (int, float, torch.SymInt, torch.SymFloat))
    return all(isinstance(s, int) and s == 1 for s in val.shape)


def _batch_dim(node: torch.fx.Node) -> int | None:
    """The first symbolic dimension (the batch, which capture makes dynamic), as in capture."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return None
    for d, size in enumerate(val.shape):
        if isinstance(size, torch.SymInt) and not size.node.is_constant():
            return d
    return None


def _op_name(node: torch.fx.Node) -> str:
    from partita.capturing.graph import target_name

    return target_name(node.target) if node.op == "call_function" else node.op


def _source(node: torch.fx.Node) -> str:
    from partita.capturing.graph import source_of

    return source_of(node)


def _resolve(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value
