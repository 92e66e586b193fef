"""What the Trainer settles before it trains: the graph the plan was made for (given or captured),
who holds each parameter, a micro-batch on meta for the pipeline's static shapes, the batch size
and shapes of a step's inputs, and whether an LR scheduler can be stepped without arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from partita.capturing import canonical_names, capture
from partita.errors import InputError
from partita.runtime.stages import StageModule
from partita.types import OpGraph, Plan
from partita.types.plan_file import check_plan_matches_graph


def resolve_graph(
    model: nn.Module, plan: Plan, graph: OpGraph | None, example_inputs: tuple | None, loss_fn: Callable | None
) -> OpGraph:
    """The graph the plan was made for: given, or captured from ``model`` and the example inputs."""
    if graph is None:
        if example_inputs is None:
            raise InputError(
                "the trainer needs the OpGraph the plan was made for: pass graph=, or "
                "example_inputs=(args, kwargs, target) (and loss_fn=) to capture it as partita.plan did"
            )
        args, kwargs, target = example_triple(example_inputs)
        graph = capture(model, args, kwargs, loss_fn=loss_fn, target=target)
    check_plan_matches_graph(plan, graph, source="the plan")
    ours = {id(t) for t in [*model.parameters(), *model.buffers()]}
    foreign = [name for name, t in graph_tensors(graph) if id(t) not in ours]
    if foreign:
        raise InputError(
            f"the graph reads tensors that are not this model's ({foreign[:3]} ...): it was captured "
            "from another model object; capture it from the model you pass to the Trainer"
        )
    return graph


def example_triple(example_inputs: tuple) -> tuple[tuple, dict, Any]:
    if not isinstance(example_inputs, (tuple, list)) or len(example_inputs) != 3:
        raise InputError("example_inputs must be (args, kwargs, target), e.g. ((), {'input_ids': ids}, None)")
    args, kwargs, target = example_inputs
    return tuple(args or ()), dict(kwargs or {}), target


def graph_tensors(graph: OpGraph) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) for every parameter and buffer the captured graph reads."""
    found = {}
    for target, name in graph.attr_to_param.items():
        value: Any = graph.graph_module
        for atom in target.split("."):
            value = getattr(value, atom)
        found.setdefault(name, value)
    return list(found.items())


def holders(plan: Plan, stages: list[StageModule]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> sorted ranks whose stages read it (parameters and buffers)."""
    holders: dict[str, set[int]] = {}
    for stage in stages:
        ranks = plan.stages[stage.spec.index].ranks
        for name in stage.spec.param_names:
            holders.setdefault(name, set()).update(ranks)
    return {name: tuple(sorted(r)) for name, r in holders.items()}


def state_names(model: nn.Module) -> set[str]:
    """Canonical names of what ``model.state_dict()`` holds (parameters, persistent buffers)."""
    canonical = canonical_names(model)
    return {canonical[id(t)] for t in model.state_dict(keep_vars=True).values()}


def meta_microbatch(graph: OpGraph, microbatch_size: int) -> list:
    """Flat graph inputs of one micro-batch as meta tensors, from the captured shapes."""
    flat = []
    for info in graph.inputs:
        t = info.tensor
        if t is None:  # a constant of the captured graph (int, bool, None): no stage reads it
            flat.append(None)
            continue
        shape = [microbatch_size if d == t.batch_dim else s for d, s in enumerate(t.shape)]
        flat.append(torch.empty(shape, dtype=getattr(torch, t.dtype), device="meta"))
    return flat


def batch_of(graph: OpGraph, flat: list) -> int:
    sizes = {
        x.shape[info.tensor.batch_dim]
        for info, x in zip(graph.inputs, flat)
        if info.tensor is not None and info.tensor.batch_dim is not None and isinstance(x, torch.Tensor)
    }
    if len(sizes) != 1:
        raise InputError(
            f"the inputs disagree on the batch size (sizes along their batch dims: {sorted(sizes)})"
            if sizes
            else "no input has a batch dimension: the trainer cannot split the batch"
        )
    return sizes.pop()


def shape_without_batch(graph: OpGraph, j: int, x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return None
    dim = graph.inputs[j].tensor.batch_dim if graph.inputs[j].tensor is not None else None
    return tuple(s for d, s in enumerate(x.shape) if d != dim)


def check_scheduler(scheduler: Any) -> None:
    """InputError now for a scheduler whose ``step()`` needs arguments (ReduceLROnPlateau's
    metrics): ``step`` calls it with none after the optimizer has stepped, and would fail there."""
    if scheduler is None:
        return
    import inspect

    if not callable(getattr(scheduler, "step", None)):
        raise InputError(
            f"lr_scheduler returned a {type(scheduler).__name__}, which has no step(): return a "
            "torch.optim.lr_scheduler.LRScheduler"
        )
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):  # not introspectable (a builtin): trust it
        return
    required = [p.name for p in parameters if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise InputError(
            f"lr_scheduler returned a {type(scheduler).__name__}, whose step() needs "
            f"{', '.join(required)}, but the trainer steps it with no arguments after every optimizer "
            "step: use a schedule by steps (LambdaLR, CosineAnnealingLR, OneCycleLR), or build "
            "ReduceLROnPlateau(trainer.optimizer) yourself and call its step(loss) after trainer.step()"
        )
