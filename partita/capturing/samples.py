"""Which operations of a captured graph mix the samples of the batch.

Micro-batching and data parallelism are exact only when every sample's loss term depends on that
sample alone, and the loss is a sum or mean of those terms (what ``mixing_along`` checks).
The check reads the symbolic shapes torch.export leaves in ``node.meta["val"]``: the batch is
one or more symbols (``s17``), and every tensor shows in which dims they occur (exactly, ``s17``,
or merged, ``2*s17``, ``s17*s28``). An operation mixes samples when it

- attends, convolves, recurs (LSTM, GRU), normalises (layer/group/instance norm), takes a softmax,
  a cumulative sum, a top-k, a flip or a triangle along a batch dim, or contracts it in a matmul whose result still
  has the batch (attention over a sequence-first batch dim);
- makes a result with the batch in two dims (a ``(B, B)`` similarity matrix, ``x[:, None] - x[None]``);
- uses the batch size as a value: ``torch.arange(batch)`` anywhere but as the per-sample index
  of an indexing op (``logits[arange(B), last]`` is per-sample); cross-entropy whose classes are
  the batch (CLIP's ``cross_entropy(logits, arange(B))``);
- takes one sample or a fixed number of them (``x[0]``, ``x[:4]``, ``x[1:]``);
- reduces over the batch non-linearly (max, var, norm, logsumexp, ...), or combines a
  floating-point statistic of the whole batch (``x.mean(0)``) with per-sample values or feeds it
  through a non-linear function: only sums and means of per-sample terms, then scalar arithmetic
  (``sum / count``, ``a + 0.1 * b``), may follow a reduction over the batch.

Deliberately not counted as mixing: batch norm in training mode (its batch statistics are the
documented exception: each micro-batch is normalised on its own, as under DDP), integer
bookkeeping (token counts, expert offsets: a mixture-of-experts router that sorts tokens by expert
and puts them back is per-token), and permutations of the batch (gather, scatter, index, sort).
Only nodes that the loss depends on are read; buffer updates that the loss does not read (running
statistics, EMAs) are never mixing.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from partita.capturing.sample_ops import (
    ALONG_DIM,
    ARANGE,
    ARANGE_VIEWS,
    ATTENTION,
    BATCH_NORM,
    CLASS_LOSSES,
    CONVOLUTION,
    GROUP_NORM,
    INDEXING,
    INSTANCE_NORM,
    LINEAR,
    NONLINEAR_REDUCTIONS,
    NORMALISED_TAIL,
    RECURRENT,
    SHAPE_ONLY,
    WINDOWED,
)


@dataclass(frozen=True)
class Mixing:
    """The first operation, in graph order, that mixes samples along the batch symbols."""

    node: torch.fx.Node  # the node (inside a higher-order op's body when ``within`` is set)
    reason: str  # what it does to the samples, in words
    within: torch.fx.Node | None = None  # the higher-order op whose body holds ``node``


# ----------------------------------------------------------------------------- symbols


def symbols_of(size: Any) -> frozenset:
    """The free symbols of one dimension's size (empty for a plain int)."""
    if isinstance(size, torch.SymInt):
        return frozenset(size.node.expr.free_symbols)
    return frozenset()


def batch_symbol_dims(value: Any, symbols: frozenset) -> list[int]:
    """Dims of the tensor ``value`` whose size involves a batch symbol (exactly or merged)."""
    if not isinstance(value, torch.Tensor):
        return []
    return [d for d, size in enumerate(value.shape) if symbols_of(size) & symbols]


def exact_dim(value: Any, symbols: frozenset) -> int | None:
    """The first dim of ``value`` whose size is exactly one of ``symbols``, else None."""
    if not isinstance(value, torch.Tensor):
        return None
    for d, size in enumerate(value.shape):
        if isinstance(size, torch.SymInt) and size.node.expr in symbols:
            return d
    return None


def _expr(size: Any) -> Any:
    return size.node.expr if isinstance(size, torch.SymInt) else size


def _proportional(new: Any, old: Any) -> bool:
    """Whether a dim of size ``new`` is a fixed fraction of one of size ``old`` (``s`` of ``2*s``):
    a slice or split that keeps a share of every sample, not a fixed number of samples."""
    a, b = _expr(new), _expr(old)
    if a == b:
        return True
    try:
        ratio = (a / b).simplify() if hasattr(a / b, "simplify") else a / b
    except Exception:  # noqa: BLE001 - an unusual expression is not proportional
        return False
    return bool(getattr(ratio, "is_number", False)) and not getattr(ratio, "free_symbols", set())


# ----------------------------------------------------------------------------- the check


def mixing_along(gm: torch.fx.GraphModule, symbols: Iterable, loss: torch.fx.Node) -> Mixing | None:
    """The first node that the loss depends on which mixes samples along ``symbols`` (see the
    module docstring), or None when every sample's loss term depends on that sample alone."""
    symbols = frozenset(symbols)
    if not symbols:
        return None
    live = _ancestors(loss)
    return _Checker(symbols).run(gm, live, {})


def _data_only(node: torch.fx.Node) -> bool:
    """Whether ``node`` depends on the graph's inputs alone: no parameter or buffer (get_attr) is
    among its ancestors, so its value is fixed by the batch."""
    return not any(a.op == "get_attr" for a in _ancestors(node))


def reaches_loss(gm: torch.fx.GraphModule, symbols: Iterable, loss: torch.fx.Node) -> bool:
    """Whether some operation the loss depends on has a batch symbol in its result's shape (an input
    that no operation of the loss reads is no batch)."""
    symbols = frozenset(symbols)
    return any(
        n.op == "call_function"
        and any(
            batch_symbol_dims(v, symbols) for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)
        )
        for n in _ancestors(loss)
    )


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    found: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        stack.extend(n.all_input_nodes)
    return found


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def _arg(node: torch.fx.Node, position: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if position < len(node.args) else default


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, torch.fx.Node) else x


def _norm_dims(dims: Any, ndim: int) -> list[int]:
    if dims is None or dims == [] or dims == ():
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex)


class _Checker:
    """One pass over a graph (and, recursively, over higher-order ops' bodies)."""

    def __init__(self, symbols: frozenset):
        self.symbols = symbols
        self.reduced: dict[torch.fx.Node, torch.fx.Node] = {}  # value -> the reduction over the batch it comes from
        self.arange: set[torch.fx.Node] = set()  # values that are an arange over the batch (or views of one)
        self.tuple_status: dict[torch.fx.Node, list] = {}  # higher-order op -> per output: reduction or "arange"

    def carries(self, value: Any) -> bool:
        return any(batch_symbol_dims(v, self.symbols) for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor))

    def run(self, gm: torch.fx.GraphModule, live: set | None, seeded: dict) -> Mixing | None:
        for node, status in seeded.items():
            self._mark(node, status)
        for node in gm.graph.nodes:
            if node.op != "call_function" or (live is not None and node not in live):
                continue
            found = self.visit(gm, node)
            if found is not None:
                return found
        return None

    def _mark(self, node: torch.fx.Node, status: Any) -> None:
        if status == "arange":
            self.arange.add(node)
        elif isinstance(status, torch.fx.Node):
            self.reduced[node] = status

    def visit(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> Mixing | None:
        target = node.target
        if isinstance(target, torch._ops.HigherOrderOperator):
            return self._higher_order(gm, node)
        name = _op_name(target)
        inputs = [a for a in node.all_input_nodes if a.op != "get_attr" or isinstance(_val(a), torch.Tensor)]
        if target is operator.getitem:
            return self._getitem(node)
        if name in SHAPE_ONLY or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return None  # SymInt arithmetic, assertions, constants shaped like the batch
        if name in ARANGE:
            if any(
                symbols_of(x) & self.symbols
                for x in pytree.tree_leaves((node.args, node.kwargs))
                if isinstance(x, torch.SymInt)
            ) or any(
                isinstance(x, torch.fx.Node) and symbols_of(_val(x)) & self.symbols
                for x in pytree.tree_leaves((node.args, node.kwargs))
            ):
                self.arange.add(node)
            return None
        from_arange = [a for a in inputs if a in self.arange]
        if from_arange:
            return self._arange_use(node, name, from_arange)
        from_reduction = [a for a in inputs if a in self.reduced]
        out = _val(node)
        if from_reduction:
            return self._after_reduction(node, name, inputs, from_reduction, out)
        if not any(self.carries(_val(a)) for a in inputs):
            return None
        found = self._op_rule(node, name, out)
        if found is not None:
            return Mixing(node, found)
        return self._generic(node, name, inputs, out)

    # -- statuses ---------------------------------------------------------------------------

    def _getitem(self, node: torch.fx.Node) -> Mixing | None:
        source, index = node.args[0], node.args[1]
        if source in self.tuple_status:
            statuses = self.tuple_status[source]
            if isinstance(index, int) and index < len(statuses):
                self._mark(node, statuses[index])
        elif source in self.reduced and _is_float(_val(node)):
            self.reduced[node] = self.reduced[source]
        elif source in self.arange:
            self.arange.add(node)
        return None

    def _arange_use(self, node: torch.fx.Node, name: str, from_arange: list) -> Mixing | None:
        if name in ARANGE_VIEWS:
            self.arange.add(node)
            return None
        if name in INDEXING:
            base, indices = _val(node.args[0]), node.args[1]
            ok = all(
                idx not in self.arange
                or (isinstance(base, torch.Tensor) and i < base.dim() and symbols_of(base.shape[i]) & self.symbols)
                for i, idx in enumerate(indices)
            )
            if ok and node.args[0] not in self.arange:
                return None
        source = next(iter(from_arange))
        return Mixing(
            node,
            f"uses the position of each sample in the batch as a value (an arange over the batch "
            f"size, {source.name}, reaches {_op_name(node.target)})",
        )

    def _after_reduction(
        self, node: torch.fx.Node, name: str, inputs: list, from_reduction: list, out: Any
    ) -> Mixing | None:
        reduction = self.reduced[from_reduction[0]]
        if any(self.carries(_val(a)) for a in inputs if a not in self.reduced) or self.carries(out):
            return Mixing(
                node,
                f"combines a statistic of the whole batch ({reduction.name}, "
                f"{_op_name(reduction.target)} over the batch) with each sample's values",
            )
        if name not in LINEAR and not _data_only(reduction):
            # A statistic of the data alone (mask.sum(), a count) is a constant of the step that the
            # runtime evaluates on the whole global batch (partita.runtime.loss_scaling): any function
            # of it is exact. A statistic of the model's outputs is not.
            return Mixing(
                node,
                f"applies {name} to a statistic of the whole batch ({reduction.name}, "
                f"{_op_name(reduction.target)} over the batch): only sums and means of per-sample "
                "terms may reach the loss, combined linearly",
            )
        if _is_float(out):
            self.reduced[node] = reduction
        return None

    # -- rules ------------------------------------------------------------------------------

    def _show(self, shape: Any) -> str:
        """A symbolic shape with the batch symbols written as B: ``(B, B)``, ``(2*B, 16)``."""
        import sympy

        batch = sympy.Symbol("B", positive=True, integer=True)
        sizes = [_expr(d) for d in shape]
        sizes = [d.subs({sym: batch for sym in self.symbols}) if hasattr(d, "subs") else d for d in sizes]
        return "(" + ", ".join(str(d) for d in sizes) + ("," if len(sizes) == 1 else "") + ")"

    def _dims(self, x: Any) -> list[int]:
        return batch_symbol_dims(_val(x), self.symbols)

    def _op_rule(self, node: torch.fx.Node, name: str, out: Any) -> str | None:
        args = node.args
        first = _val(args[0]) if args else None
        ndim = first.dim() if isinstance(first, torch.Tensor) else 0
        dims = self._dims(args[0]) if args else []
        if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm"):
            a = _val(args[1] if name in ("addmm", "baddbmm", "addbmm") else args[0])
            if isinstance(a, torch.Tensor) and a.dim() and batch_symbol_dims(a, self.symbols)[-1:] == [a.dim() - 1]:
                if self.carries(out):
                    return f"contracts the batch dim in {name} while the result still has it (e.g. attention along it)"
        if name == "einsum":
            return self._einsum(node, out)
        if name in ATTENTION:
            q, k = _val(args[0]), _val(args[1])
            for role, t in (("query", q), ("key", k)):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and symbols_of(t.shape[-2]) & self.symbols:
                    return f"attends along the batch dim (the {role} positions of {name} are the batch)"
        if name in RECURRENT and ndim >= 2:
            time = (1 if _arg(node, 8, "batch_first", False) else 0) if ndim == 3 else 0
            if time in dims:
                return f"runs a recurrence along the batch dim ({name} steps through it in order)"
        if CONVOLUTION.match(name):
            if any(d >= 1 for d in dims):
                return f"convolves along the batch dim ({name} slides its kernel over it)"
        if WINDOWED.search(name):
            spatial = _spatial_dims(name, ndim)
            if any(d in spatial for d in dims):
                return f"pools or resamples along the batch dim ({name})"
        if name in NORMALISED_TAIL:
            shape = _arg(node, 1, "normalized_shape", ())
            tail = range(ndim - len(shape), ndim)
            if any(d in tail for d in dims):
                return f"normalises over the batch dim ({name} over its last {len(shape)} dims)"
        if name in GROUP_NORM and any(d >= 1 for d in dims):
            return f"normalises over the batch dim ({name} over channels and positions)"
        if name in INSTANCE_NORM and any(d >= 2 for d in dims):
            return f"normalises over the batch dim ({name} over positions)"
        if BATCH_NORM.search(name):
            return None  # the documented exception: each micro-batch is normalised on its own
        if name in ALONG_DIM:
            default = -1 if name in ("topk", "kthvalue") else None
            position = {"topk": 2, "kthvalue": 2}.get(name, 1)
            dim = _arg(node, position, "dim", default)
            along = _norm_dims(dim, ndim) if dim is not None else list(range(ndim))
            if any(d in along for d in dims):
                return f"takes {name} along the batch dim"
        if name in CLASS_LOSSES:
            class_dim = 1 if ndim >= 2 else 0
            if class_dim in dims:
                return (
                    f"its classes are the samples of the batch ({name} over logits whose class dim is the "
                    "batch: in-batch negatives, as in a contrastive loss)"
                )
        if name in ("select", "select_copy"):
            if _norm_dims(_arg(node, 1, "dim", 0), ndim)[0] in dims:
                return "takes one sample of the batch (select along the batch dim)"
        if name in ("slice", "narrow", "slice_copy"):
            dim = _norm_dims(_arg(node, 1, "dim", 0), ndim)[0]
            if dim in dims and isinstance(out, torch.Tensor) and not _proportional(out.shape[dim], first.shape[dim]):
                return f"takes a fixed part of the batch ({name} along the batch dim)"
        if name in ("split", "split_with_sizes", "chunk", "unbind", "tensor_split", "unsafe_split"):
            dim = _norm_dims(_arg(node, 2 if name != "unbind" else 1, "dim", 0), ndim)[0]
            pieces = [p for p in pytree.tree_leaves(out) if isinstance(p, torch.Tensor)]
            if dim in dims and (
                name == "unbind" or any(not _proportional(p.shape[dim], first.shape[dim]) for p in pieces)
            ):
                return f"takes a fixed part of the batch ({name} along the batch dim)"
        if name in ("flip", "roll", "tril", "triu", "diagonal", "diag_embed", "diag", "trace"):
            along = {
                "flip": _arg(node, 1, "dims", None),
                "roll": _arg(node, 2, "dims", None),
                "tril": [-2, -1],
                "triu": [-2, -1],
            }.get(name, [_arg(node, 2, "dim1", 0), _arg(node, 3, "dim2", 1)])
            if any(d in _norm_dims(along, ndim) for d in dims):
                return f"depends on the order of the samples ({name} along the batch dim)"
        if name in ("constant_pad_nd", "pad"):
            pad = list(_arg(node, 1, "pad", ()))
            for k in range(len(pad) // 2):
                d = ndim - 1 - k
                if d in dims and (pad[2 * k] or pad[2 * k + 1]):
                    return f"pads the batch dim ({name})"
        return None

    def _einsum(self, node: torch.fx.Node, out: Any) -> str | None:
        equation = str(node.args[0]).replace(" ", "")
        operands = node.args[1] if len(node.args) > 1 else []
        terms, arrow, result = equation.partition("->")
        terms = terms.split(",")
        if not arrow:
            letters = "".join(terms).replace(".", "")
            result = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        for term, operand in zip(terms, operands):
            value = _val(operand)
            if not isinstance(value, torch.Tensor):
                continue
            head, dots, tail = term.partition("...")
            labels = list(head) + ([None] * (value.dim() - len(head) - len(tail)) if dots else []) + list(tail)
            for d in batch_symbol_dims(value, self.symbols):
                if d < len(labels) and labels[d] is not None and labels[d] not in result and self.carries(out):
                    return "contracts the batch dim in einsum while the result still has it"
        return None

    def _generic(self, node: torch.fx.Node, name: str, inputs: list, out: Any) -> Mixing | None:
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        for t in outs:
            if len(batch_symbol_dims(t, self.symbols)) >= 2:
                return Mixing(
                    node,
                    f"pairs samples with each other: its result ({name}, shape "
                    f"{self._show(t.shape)}) has the batch B in two dims",
                )
        if outs and not any(batch_symbol_dims(t, self.symbols) for t in outs):
            # a reduction over the batch: every batch dim of the inputs is gone
            if name in NONLINEAR_REDUCTIONS and any(_is_float(t) for t in outs):
                return Mixing(node, f"takes a non-linear statistic over the batch ({name})")
            if any(_is_float(t) for t in outs):
                self.reduced[node] = node
        return None

    # -- higher-order ops -------------------------------------------------------------------

    def _higher_order(self, gm: torch.fx.GraphModule, node: torch.fx.Node) -> Mixing | None:
        bodies = [
            (i, a)
            for i, a in enumerate(node.args)
            if isinstance(a, torch.fx.Node)
            and a.op == "get_attr"
            and isinstance(_resolve(gm, a.target), torch.fx.GraphModule)
        ]
        if not bodies:
            return self._generic(node, _op_name(node.target), list(node.all_input_nodes), _val(node))
        last = bodies[-1][0]
        operands = list(pytree.tree_leaves(list(node.args[last + 1 :])))
        statuses = []
        for _, body_node in bodies:
            body = _resolve(gm, body_node.target)
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            seeded = {}
            for ph, operand in zip(placeholders, operands):
                if operand in self.arange:
                    seeded[ph] = "arange"
                elif operand in self.reduced:
                    seeded[ph] = self.reduced[operand]
            inner = _Checker(self.symbols)
            found = inner.run(body, None, seeded)
            if found is not None:
                return Mixing(found.node, found.reason, within=node)
            output = next(n for n in body.graph.nodes if n.op == "output")
            results = list(pytree.tree_leaves(output.args[0]))
            statuses = ["arange" if r in inner.arange else inner.reduced.get(r) for r in results]
        self.tuple_status[node] = [s if not isinstance(s, torch.fx.Node) else node for s in statuses]
        return None


def _spatial_dims(name: str, ndim: int) -> set[int]:
    match = re.search(r"(\d)d", name)
    k = int(match.group(1)) if match else max(ndim - 2, 1)
    return set(range(max(ndim - k, 0), ndim))


def _resolve(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for atom in target.split("."):
        value = getattr(value, atom, None)
    return value
