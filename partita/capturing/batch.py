"""The batch dim of every example input: declared (``batch_dims=``), assumed (dim 0) or found.

Capture exports the model with the batch dim of every batched input symbolic. Which dim that is:

- declared by the user: ``partita.capture(model, (src,), batch_dims={"src": 1})``. Keys are
  ``forward``'s parameter names (the dim applies to every tensor under that argument), positional
  indices, ``"target"``, or a leaf's path as ``GraphInput.path`` writes it (``"kwargs['src']"``,
  ``"args[0]"``); values are a dim (negative counts from the end) or None (no batch dim). Inputs
  not named get dim 0 when it has the batch size, else none.
- otherwise dim 0 of every input whose dim 0 has the common size. When the graph then mixes
  samples along it (attention over a sequence-first ``(S, B, E)`` input), export fixed its size
  (an LSTM's time steps), or the inputs disagree on dim 0, a probe export makes every dim of size
  >= 2 symbolic, and a dim that reaches the loss, that every input batched by the first guess
  has, and along which no operation mixes samples (``partita.capturing.samples``) becomes the
  batch dim of every input that has it (the dim shared by the most inputs first; an input shaped
  exactly like one of those, such as labels ``(S, B)`` beside ids ``(S, B)``, gets the same dim).
  A declared dim is never replaced: when samples mix along it and another dim would keep them
  apart, capture raises InputError naming both.

An example batch of 1 is widened to 2 along the batch dims before export: torch.export fixes a
dim of size 1 (0/1 specialisation), which would make the graph's batch static.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import Dim

from partita.errors import InputError


@dataclass(frozen=True)
class Leaf:
    """One leaf of the example inputs ``(args, kwargs, target)``, in placeholder order."""

    path: str  # "args[0]", "kwargs['src']", "target" (as GraphInput.path)
    argument: str  # the forward parameter it is passed as ("src"), or "target"
    position: int | None  # the positional index of that argument, if passed positionally
    value: Any


def input_leaves(model: torch.nn.Module, args: tuple, kwargs: dict, target: Any, has_loss_fn: bool) -> list[Leaf]:
    """Every leaf of the user's inputs (target last, with a loss_fn), named for ``batch_dims``."""
    names = _positional_names(model, len(args))
    tree = (tuple(args), dict(kwargs), target) if has_loss_fn else (tuple(args), dict(kwargs))
    leaves = []
    for path, value in pytree.tree_flatten_with_path(tree)[0]:
        root, rest = path[0].idx, path[1:]
        if root == 0:
            argument, position = names[rest[0].idx], rest[0].idx
            text = "args" + "".join(str(k) for k in rest)
        elif root == 1:
            argument, position = rest[0].key, None
            text = "kwargs" + "".join(str(k) for k in rest)
        else:
            argument, position, text = "target", None, "target" + "".join(str(k) for k in rest)
        leaves.append(Leaf(text, str(argument), position, value))
    return leaves


def _positional_names(model: torch.nn.Module, count: int) -> list[str]:
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(count):
        fixed = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), None)
        names.append(fixed[i].name if i < len(fixed) else (star or f"args[{i}]"))
    return names


def same_shape(a: Any, b: Any) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tuple(a.shape) == tuple(b.shape)


def _is_batchable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


# ----------------------------------------------------------------------------- declared and default dims


def declared_dims(batch_dims: Mapping | None, leaves: list[Leaf]) -> dict[int, int | None] | None:
    """Leaf index -> its declared batch dim (None: no batch dim), for the leaves ``batch_dims`` names."""
    if batch_dims is None:
        return None
    if not isinstance(batch_dims, Mapping):
        raise InputError(f"batch_dims must be a dict such as {{'src': 1}}, got {type(batch_dims).__name__}")
    result: dict[int, int | None] = {}
    for key, dim in batch_dims.items():
        matched = [j for j, leaf in enumerate(leaves) if _names(key, leaf)]
        if not matched:
            known = sorted({leaf.argument for leaf in leaves} | {leaf.path for leaf in leaves})
            raise InputError(
                f"batch_dims names {key!r}, which is no input of the model: name a forward parameter, a "
                f"positional index, 'target' or an input path, one of {known}"
            )
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise InputError(f"batch_dims[{key!r}] must be an int dim or None (no batch dim), got {dim!r}")
        for j in matched:
            value = leaves[j].value
            if dim is None or not isinstance(value, torch.Tensor):
                result[j] = None
                continue
            if not -value.dim() <= dim < value.dim():
                raise InputError(
                    f"batch_dims[{key!r}] = {dim}, but {leaves[j].path} has shape {tuple(value.shape)} "
                    f"({value.dim()} dims): give a dim in [{-value.dim()}, {value.dim() - 1}] or None"
                )
            result[j] = dim % value.dim()
    return result


def _names(key: Any, leaf: Leaf) -> bool:
    if isinstance(key, bool):
        return False
    if isinstance(key, int):
        return leaf.position == key
    return key in (leaf.argument, leaf.path) or leaf.path.startswith(str(key) + "[")


def assign_dims(leaves: list[Leaf], declared: dict[int, int | None] | None) -> tuple[dict[int, int], int] | None:
    """Leaf index -> batch dim, and the batch size; None when dim 0 of the inputs disagree (and nothing
    is declared that settles the size). Undeclared inputs get dim 0 when it has the batch size."""
    declared = declared or {}
    sizes = {leaves[j].value.shape[d] for j, d in declared.items() if d is not None}
    if len(sizes) > 1:
        listing = ", ".join(
            f"{leaves[j].path} dim {d}: {leaves[j].value.shape[d]}" for j, d in declared.items() if d is not None
        )
        raise InputError(
            f"the batch dims given in batch_dims have different sizes ({listing}): every batch dim "
            "must hold the same samples; fix the sizes or the dims"
        )
    if not sizes:
        firsts = {
            leaf.value.shape[0] for j, leaf in enumerate(leaves) if j not in declared and _is_batchable(leaf.value)
        }
        if len(firsts) != 1:
            return None
        sizes = firsts
    batch = sizes.pop()
    dims = {j: d for j, d in declared.items() if d is not None}
    for j, leaf in enumerate(leaves):
        if j not in declared and _is_batchable(leaf.value) and leaf.value.shape[0] == batch:
            dims[j] = 0
    return dims, batch


def no_batch_error(leaves: list[Leaf]) -> InputError:
    shapes = ", ".join(f"{leaf.path}: {tuple(leaf.value.shape)}" for leaf in leaves if _is_batchable(leaf.value))
    if not shapes:
        return InputError("no example input has a batch dimension (all are 0-dim): pass inputs shaped (batch, ...)")
    return InputError(
        f"the example inputs disagree on dim 0 ({shapes}) and no dim of theirs was found along which the "
        "samples are independent: declare where the batch is, e.g. partita.capture(..., batch_dims={'src': 1}) "
        "for a sequence-first (S, B, E) input, and give the batch dims of all inputs the same size"
    )


# ----------------------------------------------------------------------------- widening and specs


def widened(leaves: list[Leaf], dims: dict[int, int], batch: int) -> tuple[list[Any], int]:
    """Leaf values with a batch of 1 repeated to 2 along their batch dims (export would fix a batch of
    1); otherwise unchanged. Returns the values and the batch size they have."""
    if batch != 1:
        return [leaf.value for leaf in leaves], batch
    values = []
    for j, leaf in enumerate(leaves):
        value = leaf.value
        if j in dims:
            value = torch.cat([value, value], dim=dims[j])
        values.append(value)
    return values, 2


def dims_spec(values: list[Any], dims: Mapping[int, Any]) -> list[Any]:
    """Per leaf, its torch.export dynamic-shapes spec: ``{dim: Dim.AUTO}`` for each dim in ``dims[j]``."""
    spec = []
    for j, value in enumerate(values):
        wanted = dims.get(j)
        wanted = [wanted] if isinstance(wanted, int) else list(wanted or ())
        spec.append({d: Dim.AUTO for d in wanted} if isinstance(value, torch.Tensor) and wanted else None)
    return spec


def all_dims(values: list[Any]) -> dict[int, list[int]]:
    """Every dim of size >= 2 of every tensor leaf (a probe export makes them all symbolic)."""
    return {j: [d for d, s in enumerate(v.shape) if s >= 2] for j, v in enumerate(values) if _is_batchable(v)}


def rebuild(values: list[Any], args: tuple, kwargs: dict, target: Any, has_loss_fn: bool) -> tuple[tuple, dict, Any]:
    """``(args, kwargs, target)`` with their leaves replaced by ``values`` (in ``input_leaves`` order)."""
    tree = (tuple(args), dict(kwargs), target) if has_loss_fn else (tuple(args), dict(kwargs))
    spec = pytree.tree_structure(tree)
    rebuilt = pytree.tree_unflatten(values, spec)
    return (rebuilt[0], rebuilt[1], rebuilt[2]) if has_loss_fn else (rebuilt[0], rebuilt[1], target)


def dynamic_shapes_for(module: torch.nn.Module, export_args: tuple, export_kwargs: dict, leaf_specs: list[Any]) -> dict:
    """The leaf specs arranged like ``module.forward``'s arguments, as torch.export wants them."""
    spec_tree = pytree.tree_unflatten(leaf_specs, pytree.tree_structure((export_args, export_kwargs)))
    try:
        bound = inspect.signature(module.forward).bind(*spec_tree[0], **spec_tree[1])
    except TypeError as e:
        raise InputError(
            f"the example inputs do not match {type(module).__name__}.forward{inspect.signature(module.forward)}: {e}"
        ) from e
    return dict(bound.arguments)
