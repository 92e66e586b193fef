"""Run torch.export on the user's model (plus loss function); the dynamic dims come from ``batch``."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

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
            f"args must be a tuple of positional inputs, got {type(args).__name__}: wrap a single tensor as args=(x,)"
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


def run_export(
    module: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any, log: SpecialisationLog | None = None
) -> ExportedProgram:
    """torch.export (non-strict); failures become CaptureError with cause and fix. With ``log``,
    records which lines fixed a dynamic size to a constant."""
    try:
        with log if log is not None else contextlib.nullcontext():
            return torch.export.export(module, args, kwargs or None, dynamic_shapes=dynamic_shapes, strict=False)
    except CaptureError:
        raise
    except Exception as e:  # noqa: BLE001 - every export failure is translated for the user
        raise explain_export_failure(e) from e


class SpecialisationLog(logging.Handler):
    """Reads torch's shape-environment log while export runs: for every symbolic size that export
    fixed to a constant (``Dim.AUTO`` specialises silently), the input dim it stood for and the line
    of the guard that fixed it. What is logged is torch's, not an API: unknown lines are ignored."""

    _CREATE = re.compile(r"create_symbol (s\d+) = (\d+) for (\S+)")
    _GUARD = re.compile(r"eval (.*) \[guard added\][^(]*\(([^)]*)\)")
    _FIXED = re.compile(r"set_replacement (s\d+) = (-?\d+)")
    _LOGGER = "torch.fx.experimental.symbolic_shapes"

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.sources: dict[str, str] = {}  # symbol -> "L['kwargs']['input_ids'].size()[0]"
        self.fixed: dict[str, tuple[int, str]] = {}  # symbol -> (value, "file.py:LINE in func" of the guard)
        self._guards: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a message that cannot be formatted is skipped
            return
        if m := self._CREATE.search(text):
            self.sources[m.group(1)] = m.group(3)
        elif m := self._GUARD.search(text):
            self._guards.append((m.group(1), m.group(2)))
        elif (m := self._FIXED.search(text)) and m.group(1) not in self.fixed:
            symbol = m.group(1)
            where = next((loc for expr, loc in reversed(self._guards) if re.search(rf"\b{symbol}\b", expr)), "")
            self.fixed[symbol] = (int(m.group(2)), where)

    def __enter__(self) -> SpecialisationLog:
        logger = logging.getLogger(self._LOGGER)
        self._saved = (logger.handlers[:], logger.level, logger.propagate)
        logger.handlers, logger.propagate = [self], False
        logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: Any) -> None:
        logger = logging.getLogger(self._LOGGER)
        logger.handlers, level, logger.propagate = self._saved
        logger.setLevel(level)

    def where_fixed(self, size: int) -> str:
        """The guard location that fixed a symbol of value ``size`` ('' when none was seen)."""
        return next((where for value, where in self.fixed.values() if value == size and where), "")
