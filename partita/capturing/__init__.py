"""capture: an unmodified nn.Module + example inputs -> OpGraph (via torch.export, non-strict).

The captured computation is the *training* computation: forward up to the scalar loss,
either returned by the model itself (HF ``labels=``) or ``loss_fn(output, target)``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from partita.capturing.export import LossWrapper, batch_size_of, check_inputs, dynamic_shapes_for, run_export
from partita.capturing.graph import (
    attr_to_param_map,
    build_inputs,
    build_nodes,
    canonical_names,
    canonical_parameters,
    find_loss_output,
    fingerprint,
)
from partita.capturing.measure import measure_nodes
from partita.types import OpGraph

__all__ = ["canonical_names", "capture", "exported_call_inputs"]


def capture(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    dynamic_batch: bool = True,
) -> OpGraph:
    """Capture the training computation of ``model`` on the example inputs as an OpGraph.

    Args:
        model: any ``nn.Module``, unchanged; it may live on the ``meta`` device.
        args, kwargs: example inputs, exactly as the model takes them.
        loss_fn, target: when the model does not return its own loss, ``loss_fn(output, target)``
            is captured with it.
        dynamic_batch: export with a symbolic batch dimension (dim 0 of every input whose size
            is the batch size), so the graph runs at any micro-batch size.

    The model's parameters are neither copied nor modified: ``graph.graph_module`` reads the
    same ``nn.Parameter`` objects.
    """
    args, kwargs = check_inputs(model, args, kwargs, loss_fn, target)
    batch_size = batch_size_of(args, kwargs, target)
    export_args, export_kwargs = exported_call_inputs(args, kwargs, target, loss_fn is not None)
    module, prefix = (LossWrapper(model, loss_fn), LossWrapper.PREFIX) if loss_fn is not None else (model, "")
    dynamic = dynamic_shapes_for(module, export_args, export_kwargs, batch_size) if dynamic_batch else None
    exported = run_export(module, export_args, export_kwargs, dynamic)
    gm = exported.module(check_guards=False)

    flat_leaves = _flat_inputs_with_paths(export_args, export_kwargs, loss_fn is not None)
    measurements = measure_nodes(gm, [value for _, value in flat_leaves])
    id_to_name, parameters = canonical_parameters(model)
    attr_to_param = attr_to_param_map(gm, id_to_name, prefix)
    nodes, index_of, _ = build_nodes(gm, measurements, attr_to_param, prefix)
    inputs = build_inputs(gm, flat_leaves, nodes)
    loss_node, loss_position = find_loss_output(gm, exported.call_spec.out_spec, loss_fn is not None, index_of, measurements)
    return OpGraph(
        nodes=nodes,
        inputs=inputs,
        parameters=parameters,
        loss_node=loss_node,
        batch_size=batch_size,
        dynamic_batch=any(g.tensor is not None and g.tensor.batch_dim is not None for g in inputs),
        fingerprint=fingerprint(nodes, inputs, parameters),
        graph_module=gm,
        exported_program=exported,
        attr_to_param=attr_to_param,
        has_loss_fn=loss_fn is not None,
        loss_output_index=loss_position,
        example_inputs=(tuple(args), dict(kwargs), target),
    )


def exported_call_inputs(args: tuple, kwargs: dict | None, target: Any, has_loss_fn: bool) -> tuple[tuple, dict]:
    """How the exported module is called: ``(args, kwargs)`` itself, or with a loss_fn
    ``((args, kwargs, target), {})`` (LossWrapper.forward takes the three as positional arguments).

    Flattening this pair with pytree gives the graph's placeholders in order; the runtime
    (``partita.runtime.stages.flatten_inputs``) uses it to feed later batches.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    return ((args, kwargs, target), {}) if has_loss_fn else (args, kwargs)


def _flat_inputs_with_paths(args: tuple, kwargs: dict, has_loss_fn: bool) -> list[tuple[str, Any]]:
    """Leaves of the exported call's inputs, in placeholder order, with a readable path each."""
    leaves, _ = pytree.tree_flatten_with_path((args, kwargs))
    roots = ("args", "kwargs", "target") if has_loss_fn else None
    result = []
    for path, value in leaves:
        keys = path[1:] if not has_loss_fn else path[2:]
        root = ("args", "kwargs")[path[0].idx] if not has_loss_fn else roots[path[1].idx]
        result.append((root + "".join(str(k) for k in keys), value))
    return result
