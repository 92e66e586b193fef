"""Run torch.export on the user's model (plus loss function) with a dynamic batch dimension."""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch.export import Dim, ExportedProgram

from partita.capturing.diagnose import explain_export_failure
from partita.errors import CaptureError, InputError


class LossWrapper(torch.nn.Module):
    """``loss_fn(model(*args, **kwargs), target)`` as one module, so the loss is captured too.

    The model is registered as the submodule ``model``; capture strips that prefix again so
    every name the user sees is the original one.
    """

    PREFIX = "model."

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, args: tuple, kwargs: dict, target: Any) -> torch.Tensor:
        return self.loss_fn(self.model(*args, **kwargs), target)


def check_inputs(model: Any, args: Any, kwargs: Any, loss_fn: Any, target: Any) -> tuple[tuple, dict]:
    """Validate the user's arguments before anything expensive happens."""
    if not isinstance(model, torch.nn.Module):
        raise InputError(
            f"model must be a torch.nn.Module, got {type(model).__name__}: "
            "pass the module itself (not its class or a function)"
        )
    if not isinstance(args, (tuple, list)):
        raise InputError(
            f"args must be a tuple of positional inputs, got {type(args).__name__}: "
            "wrap a single tensor as args=(x,)"
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise InputError(f"kwargs must be a dict of keyword inputs, got {type(kwargs).__name__}")
    if loss_fn is not None and not callable(loss_fn):
        raise InputError(f"loss_fn must be callable as loss_fn(output, target), got {type(loss_fn).__name__}")
    if loss_fn is None and target is not None:
        raise InputError(
            "target was given but loss_fn is None: pass loss_fn=... to use the target, "
            "or drop target when the model computes its own loss (e.g. HF labels=)"
        )
    kwargs = dict(kwargs or {})
    leaves = [x for x in pytree.tree_leaves((args, kwargs, target)) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise InputError("the example inputs contain no tensor: pass the tensors the model takes")
    return tuple(args), kwargs


def batch_size_of(args: tuple, kwargs: dict, target: Any) -> int:
    """The batch size: dim 0 of the tensor inputs, which must agree."""
    sizes: dict[str, int] = {}
    for path, leaf in pytree.tree_flatten_with_path((args, kwargs, target))[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            sizes[_describe_path(path)] = leaf.shape[0]
    if not sizes:
        raise InputError(
            "no example input has a batch dimension (all are 0-dim): pass inputs shaped (batch, ...)"
        )
    distinct = sorted(set(sizes.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{k}: {v}" for k, v in sizes.items())
        raise InputError(
            f"example inputs disagree on the batch dimension (dim 0): {listing}. "
            "partita splits every input along dim 0 into micro-batches: give all inputs "
            "(and the target) the same leading batch size"
        )
    return distinct[0]


def _describe_path(path: tuple) -> str:
    """('args', 0) / ('kwargs', 'input_ids') / ('target',) as a readable string."""
    root = ("args", "kwargs", "target")[path[0].idx]
    return root + "".join(str(k) for k in path[1:])


def dynamic_shapes_for(module: torch.nn.Module, args: tuple, kwargs: dict, batch_size: int) -> dict:
    """Mark dim 0 of every tensor input whose size is the batch size as dynamic (Dim.AUTO).

    The spec is keyed by the names of ``module.forward``'s parameters, as torch.export wants.
    """

    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch_size:
            return {0: Dim.AUTO}
        return None

    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(
            f"the example inputs do not match {type(module).__name__}.forward{inspect.signature(module.forward)}: {e}"
        ) from e
    return {name: pytree.tree_map(spec, value) for name, value in bound.arguments.items()}


def run_export(module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> ExportedProgram:
    """torch.export (non-strict); failures become CaptureError with cause and fix."""
    try:
        return torch.export.export(module, args, kwargs or None, dynamic_shapes=dynamic_shapes, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every export failure is translated for the user
        raise explain_export_failure(e) from e
