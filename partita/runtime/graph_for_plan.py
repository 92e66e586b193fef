"""The graph a plan was made for, as the Trainer needs it: given, or captured from the model with
``partita.capture``'s keywords, and checked against the plan and the model."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from partita.capturing import capture
from partita.errors import InputError
from partita.types import OpGraph, Plan
from partita.types.plan_file import check_plan_matches_graph

__all__ = ["CaptureInputs", "graph_for_plan"]


@dataclass(frozen=True)
class CaptureInputs:
    """Example inputs and how to read them, exactly as ``partita.capture`` takes them."""

    args: tuple = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    loss_fn: Callable | None = None
    target: Any = None
    batch_dims: Mapping[Any, int | None] | None = None

    @property
    def given(self) -> bool:
        """Whether any example input was given (a model without inputs cannot be captured)."""
        return bool(self.args) or bool(self.kwargs) or self.target is not None

    @staticmethod
    def of(
        args: tuple | None,
        kwargs: Mapping | None,
        loss_fn: Callable | None,
        target: Any,
        batch_dims: Mapping | None,
        example_inputs: tuple | None,
    ) -> CaptureInputs:
        """The Trainer's keywords as one record; the older ``example_inputs=(args, kwargs, target)``
        still works, with a DeprecationWarning, and may not be mixed with the keywords."""
        if example_inputs is None:
            return CaptureInputs(tuple(args or ()), dict(kwargs or {}), loss_fn, target, batch_dims)
        if args or kwargs or target is not None:
            raise InputError(
                "pass the example inputs once: either args=/kwargs=/target= (as partita.capture takes them) or "
                "the older example_inputs=(args, kwargs, target), not both"
            )
        warnings.warn(
            "Trainer(example_inputs=(args, kwargs, target)) is deprecated: pass args=, kwargs=, target= (and "
            "loss_fn=, batch_dims=) as partita.capture takes them",
            DeprecationWarning,
            stacklevel=4,
        )
        if not isinstance(example_inputs, (tuple, list)) or len(example_inputs) != 3:
            raise InputError("example_inputs must be (args, kwargs, target), e.g. ((), {'input_ids': ids}, None)")
        old_args, old_kwargs, old_target = example_inputs
        return CaptureInputs(tuple(old_args or ()), dict(old_kwargs or {}), loss_fn, old_target, batch_dims)


def graph_for_plan(model: nn.Module, plan: Plan, graph: OpGraph | None, inputs: CaptureInputs) -> OpGraph:
    """The graph the plan was made for: ``graph`` itself, or captured from ``model`` on ``inputs``
    (as ``partita.plan`` captured it). InputError when neither is given, when both are (the inputs
    would be ignored), or when the graph reads another model object's tensors; PlanFileError when
    the plan was made for another graph."""
    if graph is not None and (inputs.given or inputs.loss_fn is not None or inputs.batch_dims is not None):
        given = [k for k, v in _capture_keywords(inputs).items() if v]
        raise InputError(
            f"the trainer was given graph= and {', '.join(given)}: the graph already holds how it was captured "
            "(its loss_fn, target and batch dims), so these would be ignored; pass the graph alone, or the example "
            "inputs alone to capture it here"
        )
    if graph is None:
        if not inputs.given:
            raise InputError(
                "the trainer needs the graph the plan was made for: pass the example inputs as partita.capture "
                "takes them (kwargs={'input_ids': ids}, or args=(x,), with loss_fn= and target= when the model "
                "does not return its loss), or graph= the graph partita.capture returned"
            )
        graph = capture(
            model,
            inputs.args,
            dict(inputs.kwargs),
            loss_fn=inputs.loss_fn,
            target=inputs.target,
            batch_dims=inputs.batch_dims,
        )
    check_plan_matches_graph(plan, graph, source="the plan")
    ours = {id(t) for t in [*model.parameters(), *model.buffers()]}
    foreign = [name for name, t in graph_tensors(graph) if id(t) not in ours]
    if foreign:
        raise InputError(
            f"the graph reads tensors that are not this model's ({foreign[:3]} ...): it was captured "
            "from another model object; capture it from the model you pass to the Trainer"
        )
    return graph


def _capture_keywords(inputs: CaptureInputs) -> dict[str, bool]:
    return {
        "args=": bool(inputs.args),
        "kwargs=": bool(inputs.kwargs),
        "loss_fn=": inputs.loss_fn is not None,
        "target=": inputs.target is not None,
        "batch_dims=": inputs.batch_dims is not None,
    }


def graph_tensors(graph: OpGraph) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every parameter and buffer the captured graph reads."""
    found = {}
    for target, name in graph.attr_to_param.items():
        value: Any = graph.graph_module
        for atom in target.split("."):
            value = getattr(value, atom)
        found.setdefault(name, value)
    return list(found.items())
