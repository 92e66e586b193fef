"""Check a batch's ids and class labels before a stage fails on them.

An id outside an embedding's rows, a class label outside the loss's classes, or float ids where
the graph looks rows up fail deep inside a stage ("index out of range in self", "Target 18 is out
of bounds") -- while planning profiles the model, or at a training step on some rank. The graph
says which inputs are used that way: ``index_uses`` follows each ``aten.embedding`` index and each
cross-entropy / NLL target back to a graph input through ops that move values without changing
them (views, slices, casts, padding), and ``check_batch_values`` checks a batch's values against
them, naming the input, the value, the bound and the fix.

``check_batch_dtypes`` checks each input's dtype against the captured one. Used by the command
line (the example's inputs before planning, the first batch of each data source before launch)
and by ``partita.Trainer.step`` and ``evaluate`` (every batch, before any stage runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import Node

from partita.errors import InputError
from partita.types import OpGraph
from partita.types.graph import check_input_dtypes

__all__ = ["IndexUse", "check_batch_dtypes", "check_batch_values", "index_uses"]

# Ops whose output holds (a subset of) the input's values, possibly cast or padded.
_SAME_VALUES = {
    "aten.view.default",
    "aten.reshape.default",
    "aten._unsafe_view.default",
    "aten.unsqueeze.default",
    "aten.squeeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.dims",
    "aten.flatten.using_ints",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.expand.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.permute.default",
    "aten.transpose.int",
    "aten.t.default",
    "aten.alias.default",
    "aten.detach.default",
    "aten.pad.default",
    "aten.constant_pad_nd.default",
}
_CASTS = {"aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.to.device"}
_LOSSES = {
    "aten.cross_entropy_loss.default",
    "aten.nll_loss.default",
    "aten.nll_loss_nd.default",
    "aten.nll_loss2d.default",
}
_DEFAULT_IGNORE_INDEX = -100


@dataclass(frozen=True)
class IndexUse:
    """Graph input ``input_index`` indexes ``bound`` rows (an embedding) or classes (a loss target)."""

    input_index: int
    kind: str  # "embedding" or "target"
    bound: int  # values must lie in [0, bound)
    where: str  # the module path of the embedding, or of the loss
    ignore_index: int | None = None  # a target value the loss skips
    cast: bool = False  # the graph casts the input before using it (any dtype is accepted)


def index_uses(graph: OpGraph) -> list[IndexUse]:
    """Every graph input the graph uses as embedding ids or as class labels of its loss."""
    position = {info.name: k for k, info in enumerate(graph.inputs)}
    module_of = {node.name: node.module_path for node in graph.nodes}
    uses: list[IndexUse] = []
    for node in graph.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target == "aten.embedding.default" and len(node.args) >= 2:
            bound = _size(node.args[0], 0)
            kind, index, ignore = "embedding", node.args[1], None
        elif target in _LOSSES and len(node.args) >= 2:
            scores = _val(node.args[0])
            bound = None if scores is None or scores.dim() == 0 else scores.shape[1 if scores.dim() >= 2 else 0]
            kind, index = "target", node.args[1]
            ignore = node.args[4] if len(node.args) > 4 else node.kwargs.get("ignore_index", _DEFAULT_IGNORE_INDEX)
        else:
            continue
        source, cast = _source(index)
        if source is None or source.name not in position or not isinstance(bound, int):
            continue
        uses.append(
            IndexUse(
                position[source.name],
                kind,
                bound,
                module_of.get(node.name, "") or "the model",
                ignore if isinstance(ignore, int) else None,
                cast,
            )
        )
    return uses


def check_batch_dtypes(graph: OpGraph, flat: Sequence[Any], where: str) -> None:
    """InputError when a flat graph input's dtype differs from the captured one
    (``partita.types.graph.check_input_dtypes``)."""
    check_input_dtypes(graph, flat, where)


def check_batch_values(graph: OpGraph, flat: Sequence[Any], where: str, uses: list[IndexUse] | None = None) -> None:
    """InputError when a flat graph input (``partita.runtime.stages.flatten_inputs``) breaks one of
    ``uses`` (default ``index_uses(graph)``): float ids, an id >= the embedding's rows or < 0, a
    label outside the loss's classes (other than its ignore_index). ``where`` prefixes the message
    ("step 3", "the example inputs"). Values on the meta device are not checked."""
    for use in index_uses(graph) if uses is None else uses:
        x = flat[use.input_index]
        if not isinstance(x, torch.Tensor):
            continue
        name = graph.inputs[use.input_index].path or graph.inputs[use.input_index].name
        integer = not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)
        if use.kind == "embedding" and not integer and not use.cast:
            raise InputError(
                f"{where}: {name} is {str(x.dtype).removeprefix('torch.')}, but it holds the ids the "
                f"embedding {use.where} looks up: pass integer ids (torch.long)"
            )
        if not integer or x.is_meta or x.numel() == 0:
            continue  # float targets are class probabilities
        valid = (x >= 0) & (x < use.bound)
        if use.ignore_index is not None:
            valid |= x == use.ignore_index
        if bool(valid.all()):
            continue
        bad = x[~valid]
        value = int(bad.max()) if int(bad.max()) >= use.bound else int(bad.min())
        if use.kind == "embedding":
            raise InputError(
                f"{where}: {name} holds id {value}, but the embedding {use.where} has {use.bound} rows: "
                f"ids must be in [0, {use.bound}); make the data's vocabulary match the model's "
                "(e.g. vocab_size of its config)"
            )
        ignored = "" if use.ignore_index is None else f" or {use.ignore_index} (ignored)"
        raise InputError(
            f"{where}: {name} holds label {value}, but the loss scores {use.bound} classes: labels "
            f"must be in [0, {use.bound}){ignored}; make the labels match the model's number of classes"
        )


def _source(value: Any) -> tuple[Node | None, bool]:
    """The placeholder ``value`` is computed from through value-preserving ops, and whether a cast is on the way."""
    cast = False
    while isinstance(value, Node) and value.op == "call_function" and value.args:
        target = str(value.target)
        if target in _CASTS:
            cast = True
        elif target not in _SAME_VALUES:
            return None, cast
        value = value.args[0]
    if isinstance(value, Node) and value.op == "placeholder":
        return value, cast
    return None, cast


def _val(value: Any) -> torch.Tensor | None:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _size(value: Any, dim: int) -> int | None:
    val = _val(value)
    if val is None or val.dim() <= dim:
        return None
    size = val.shape[dim]
    return size if isinstance(size, int) else None
