"""Graphs for batches the plan's graph was not captured at: shorter sequences, and evaluation.

The plan was made for the graph captured at the example's shapes: the longest batch the job
will see (its memory fit holds up to them). A batch padded to its own, shorter length, or an
evaluation (eval mode: dropout off, batch norm from running statistics), runs a *variant*: the
same model captured again (``OpGraph.recapture``) at that batch's shapes, split at the matching
nodes into the plan's stages, with the first graph's tensors bound into its stages, so that one
set of weights, buffers and optimizer state is trained whatever shape a step has. Each distinct
shape is captured once per graph and process, whichever trainer asks (bucketing the lengths keeps
them few).

Matching nodes: a stage boundary, the first node of a stage, is found in the variant by its
(module, op, occurrence within that module) -- FX node names are no key, as removing dropout
renumbers them. A boundary node absent from the variant (a dropout) moves to the next one that is
present. Every variant stage must read only tensors that the planned stage reads (the ranks hold
nothing else); InputError otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from partita.capturing import exported_call_inputs
from partita.errors import CaptureError, InputError
from partita.runtime.stages import StageModule, split_graph
from partita.runtime.uneven import check_uneven_boundaries
from partita.types import OpGraph, Plan
from partita.types.graph import graph_memo

__all__ = [
    "captured_shapes",
    "check_within_plan",
    "input_shapes",
    "mapped_boundaries",
    "recaptured",
    "rebind",
    "unsupported_shapes_message",
    "variant_stages",
]

Shapes = tuple[tuple[int, ...] | None, ...]


def input_shapes(graph: OpGraph, flat: Sequence[Any]) -> Shapes:
    """Each flat input's shape with its batch dim left out (None for non-tensors)."""
    shapes = []
    for info, x in zip(graph.inputs, flat):
        if not isinstance(x, torch.Tensor):
            shapes.append(None)
            continue
        dim = info.tensor.batch_dim if info.tensor is not None else None
        shapes.append(tuple(s for d, s in enumerate(x.shape) if d != dim))
    return tuple(shapes)


def captured_shapes(graph: OpGraph) -> Shapes:
    """``input_shapes`` of the example the graph was captured at."""
    shapes = []
    for info in graph.inputs:
        t = info.tensor
        shapes.append(None if t is None else tuple(s for d, s in enumerate(t.shape) if d != t.batch_dim))
    return tuple(shapes)


def check_within_plan(graph: OpGraph, shapes: Shapes) -> None:
    """InputError unless every input has the captured rank and no dim larger than the captured one."""
    for info, planned, got in zip(graph.inputs, captured_shapes(graph), shapes):
        if planned is None or got is None:
            continue
        if len(got) != len(planned) or any(g > p for g, p in zip(got, planned)):
            raise InputError(
                f"input {info.name!r} has shape {list(got)} (batch dim left out), but the plan was made for "
                f"{list(planned)}: a batch may be shorter than the example the model was captured at, never "
                "longer (the plan's memory fit holds up to its sizes); capture and plan with the longest batch "
                "the job will see"
            )


def unsupported_shapes_message(graph: OpGraph, shapes: Shapes, where: str, error: Exception) -> str:
    """Why a batch whose shapes differ from the captured ones cannot run: the inputs that differ,
    the capture's own words, and the fix."""
    differing = [
        f"{info.path or info.name} {list(got)} (the example: {list(planned)})"
        for info, planned, got in zip(graph.inputs, captured_shapes(graph), shapes)
        if planned is not None and got is not None and tuple(got) != tuple(planned)
    ]
    said = str(error).strip().splitlines()[-1].strip().rstrip(".") if str(error).strip() else type(error).__name__
    return (
        f"{where}: the model cannot run on this batch, whose shapes differ from the example it was captured with "
        f"(batch dim left out): {'; '.join(differing) or 'none differs'}. Capturing it at these shapes failed "
        f"({said[:300]}). Only dims the model takes at any size, such as a sequence length, may differ from the "
        "example's (and only be shorter): give batches shaped like the example inputs"
    )


def recaptured(
    graph: OpGraph, args: tuple, kwargs: dict, target: Any, *, samples: int, training: bool = True
) -> OpGraph:
    """The model of ``graph`` captured again on the first ``samples`` samples of this batch
    (CaptureError when it cannot be: the caller names the batch)."""
    if graph.recapture is None:
        raise InputError(
            "this batch's shapes differ from those the graph was captured at (or an evaluation asks for eval "
            "mode), which needs the model captured again, but the graph was not made by partita.capture: give "
            "the trainer the graph partita.capture returned, or batches of the captured shapes"
        )
    call = exported_call_inputs(args, kwargs, target, graph.has_loss_fn)
    leaves, spec = pytree.tree_flatten(call)
    narrowed = []
    for info, x in zip(graph.inputs, leaves):
        dim = info.tensor.batch_dim if info.tensor is not None else None
        narrowed.append(x.narrow(dim, 0, samples) if isinstance(x, torch.Tensor) and dim is not None else x)
    call = pytree.tree_unflatten(narrowed, spec)
    if graph.has_loss_fn:
        (args, kwargs, target), _ = call
    else:
        (args, kwargs), target = call, None
    key = _call_key(narrowed, spec, training)
    known = _recaptures(graph)
    if key is not None and key in known:
        return known[key]
    fake_tensor_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_tensor_log.level
    fake_tensor_log.setLevel(logging.CRITICAL)  # its traceback of a failed op: the caller names the batch
    try:
        found = graph.recapture(args, kwargs, target, training=training)
    except InputError as e:  # capture's words are about "the example inputs": this is a batch
        raise CaptureError(str(e)) from e
    finally:
        fake_tensor_log.setLevel(level)
    if key is not None:
        known[key] = found
    return found


@graph_memo
def _recaptures(graph: OpGraph) -> dict[tuple, OpGraph]:
    """The graphs ``recaptured`` made of ``graph``, by call key (they go with it). A graph stands for
    its module as it was captured, and so do its variants: the trainers of one graph (checkpoints
    loaded into fresh trainers, plans compared in one process) capture each shape once."""
    return {}


def _call_key(leaves: Sequence[Any], spec: Any, training: bool) -> tuple | None:
    """What a capture of these inputs depends on: the structure, each tensor's shape, dtype, device
    and requires_grad (export traces fake tensors: values never enter the graph), every other leaf's
    value; None when such a value is not hashable (then the model is captured again)."""
    key: list[Any] = [str(spec), training]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
            continue
        try:
            hash(x)
        except TypeError:
            return None
        key.append((type(x), x))
    return tuple(key)


def mapped_boundaries(planned: OpGraph, variant: OpGraph, boundaries: Sequence[int]) -> tuple[int, ...]:
    """The plan's stage boundaries (node positions of ``planned``) as positions in ``variant``."""
    if [(n.name, n.target) for n in planned.nodes] == [(n.name, n.target) for n in variant.nodes]:
        return tuple(boundaries)
    position = {key: i for i, key in enumerate(_node_keys(variant))}
    keys = _node_keys(planned)
    mapped = [0]
    for b in boundaries[1:-1]:
        found = next((position[key] for key in keys[b:] if key in position), None)
        if found is None or found <= mapped[-1]:
            raise InputError(
                f"the model captured at this batch's shapes (or in eval mode) has no node matching the start of "
                f"a planned stage ({planned.nodes[b].name}, {planned.nodes[b].target} in "
                f"{planned.nodes[b].module_path or 'the root module'}): its computation differs from the planned "
                "one beyond shapes; feed batches of the captured shapes"
            )
        mapped.append(found)
    return (*mapped, variant.num_nodes)


def check_same_tensors(planned: Sequence[StageModule], variant: Sequence[StageModule]) -> None:
    """InputError when a variant stage reads a tensor its planned stage does not (no rank holds it)."""
    for p, v in zip(planned, variant):
        extra = sorted(set(v.spec.param_names) - set(p.spec.param_names))
        if extra:
            raise InputError(
                f"stage {p.spec.index} of the model captured at this batch's shapes (or in eval mode) reads "
                f"{extra[:3]}, which the planned stage {p.spec.index} does not hold: feed batches of the "
                "captured shapes"
            )


def rebind(stages: Sequence[StageModule], planned_stages: Sequence[StageModule]) -> None:
    """Make each stage hold what the planned stage of its index holds, in the same containers
    (``StageModule.hold_tensors_of``): a weight two stages read (tied embeddings) may be a different
    tensor in each (a tensor-parallel part in one, whole in the other, on a rank that runs only one
    of them), and a sharded stage's parameters are FSDP2's, gathered for each forward and resharded
    after it, which the variant then reads as the planned stage does."""
    for stage, planned in zip(stages, planned_stages, strict=True):
        stage.hold_tensors_of(planned)


def variant_stages(
    planned: OpGraph,
    plan: Plan,
    planned_stages: Sequence[StageModule],
    call: tuple[tuple, dict, Any],
    training: bool,
    device: torch.device,
) -> tuple[OpGraph, list[StageModule]]:
    """The model captured again on the batch ``call`` = (args, kwargs, target), in training or eval
    mode, and split into the plan's stages, which read the planned stages' tensors."""
    samples = min(plan.global_batch_size, planned.batch_size)
    graph = recaptured(planned, *call, samples=samples, training=training)
    stages = split_graph(graph, mapped_boundaries(planned, graph, plan.boundaries))
    check_same_tensors(planned_stages, stages)
    if device.type != "cpu":  # what the stages hold besides the planned tensors (lifted constants)
        for stage in stages:
            stage.to(device)
    rebind(stages, planned_stages)
    if not plan.on_mesh:
        check_uneven_boundaries(graph, plan, stages)
    return graph, stages


def _node_keys(graph: OpGraph) -> list[tuple[str, str, int]]:
    """(module, op, occurrence of that op within that module) per node."""
    seen: dict[tuple[str, str], int] = {}
    keys = []
    for n in graph.nodes:
        key = (n.module_path, n.target)
        keys.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return keys
