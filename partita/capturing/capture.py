"""``capture``: an unmodified nn.Module + example inputs -> OpGraph (torch.export, non-strict), and
``recapture`` of the same model at other shapes or in eval mode (``OpGraph.recapture``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from partita.capturing import batch, samples
from partita.capturing.export import LossWrapper, SpecialisationLog, check_inputs, run_export
from partita.capturing.graph import (
    attr_to_param_map,
    build_inputs,
    build_nodes,
    canonical_parameters,
    find_loss_output,
    fingerprint,
    module_of,
    source_of,
    target_name,
)
from partita.capturing.measure import measure_nodes
from partita.errors import InputError
from partita.types import OpGraph
from partita.types.graph import SampleCoupling, exported_call_inputs

__all__ = ["capture", "coupling_record"]


def capture(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    target: Any = None,
    dynamic_batch: bool = True,
    batch_dims: Mapping[Any, int | None] | None = None,
) -> OpGraph:
    """Capture the training computation of ``model`` on the example inputs as an OpGraph.

    Args:
        model: any ``nn.Module``, unchanged; it may live on the ``meta`` device.
        args, kwargs: example inputs, exactly as the model takes them.
        loss_fn, target: when the model does not return its own loss, ``loss_fn(output, target)``
            is captured with it.
        dynamic_batch: export with a symbolic batch dimension, so the graph runs at any
            micro-batch size.
        batch_dims: where the batch is in each input, e.g. ``{"src": 1}`` for a sequence-first
            ``(S, B, E)`` input (see ``partita.capturing.batch`` for the keys). By default dim 0,
            unless the samples mix along it and another dim keeps them apart (then that one);
            ``GraphInput.tensor.batch_dim`` records the result.

    An example batch of 1 is widened to 2 (repeated) before export, which would otherwise fix the
    batch size; ``graph.batch_size`` is then 2. When the loss mixes samples across the batch
    (CLIP's ``arange(batch)`` labels, in-batch negatives, batch statistics; batch norm excepted),
    ``graph.couples_samples`` says where. InputError when a declared batch dim mixes samples and
    another dim would not.

    The model is left as it was: its parameters are neither copied nor modified
    (``graph.graph_module`` reads the same ``nn.Parameter`` objects), and buffers that running
    the model once updates (``num_batches_tracked``, running statistics) are restored.
    """
    args, kwargs = check_inputs(model, args, kwargs, loss_fn, target)
    has_loss_fn = loss_fn is not None
    leaves = batch.input_leaves(model, args, kwargs, target, has_loss_fn)
    declared = batch.declared_dims(batch_dims, leaves)
    module, prefix = (LossWrapper(model, loss_fn), LossWrapper.PREFIX) if has_loss_fn else (model, "")
    with _restored_buffers(model):
        found = _export_with_batch(module, leaves, declared, args, kwargs, target, has_loss_fn, dynamic_batch)
    exported, gm, values, batch_size, coupling, fixed_at = found
    export_args, export_kwargs = exported_call_inputs(
        *batch.rebuild(values, args, kwargs, target, has_loss_fn), has_loss_fn
    )

    flat_leaves = _flat_inputs_with_paths(export_args, export_kwargs, has_loss_fn)
    with _restored_buffers(model):
        measurements = measure_nodes(gm, [value for _, value in flat_leaves])
    id_to_name, parameters = canonical_parameters(model)
    attr_to_param = attr_to_param_map(gm, id_to_name, prefix)
    nodes, index_of, _ = build_nodes(gm, measurements, attr_to_param, prefix)
    inputs = build_inputs(gm, flat_leaves, nodes)
    loss_node, loss_position = find_loss_output(gm, exported.call_spec.out_spec, has_loss_fn, index_of, measurements)
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
        has_loss_fn=has_loss_fn,
        loss_output_index=loss_position,
        example_inputs=(tuple(args), dict(kwargs), target),
        couples_samples=(
            coupling_record(gm, coupling, index_of, inputs, prefix, declared=bool(declared)) if coupling else None
        ),
        batch_fixed_at=fixed_at,
        recapture=functools.partial(
            _recapture,
            model,
            [m.training for m in model.modules()],
            loss_fn=loss_fn,
            dynamic_batch=dynamic_batch,
            batch_dims=batch_dims,
        ),
    )


def _recapture(
    model: torch.nn.Module,
    modes: list[bool],
    args: tuple,
    kwargs: dict,
    target: Any,
    *,
    training: bool = True,
    **options: Any,
) -> OpGraph:
    """``capture`` again, with the first capture's options and modules' train/eval modes
    (``training=False``: every module in eval mode, dropout off, batch norm from running
    statistics); the model's modes are restored afterwards (``OpGraph.recapture``)."""
    modules = list(model.modules())
    if len(modules) != len(modes):
        raise InputError(
            f"the model has {len(modules)} modules but had {len(modes)} when it was captured: capture it again"
        )
    now = [m.training for m in modules]
    try:
        for m, mode in zip(modules, modes):
            m.training = mode and training
        return capture(model, args, kwargs, target=target, **options)
    finally:
        for m, mode in zip(modules, now):
            m.training = mode


def _export_with_batch(module, leaves, declared, args, kwargs, target, has_loss_fn, dynamic_batch):
    """Export with the batch dims of ``batch`` symbolic (declared, dim 0, or found by a probe), and
    check the result for mixing samples: (exported, its GraphModule, the leaf values exported with,
    the batch size, the Mixing or None, where export fixed the batch size or "")."""
    assigned = batch.assign_dims(leaves, declared)
    if assigned is None and not dynamic_batch:
        raise batch.no_batch_error(leaves)
    if assigned is None:  # dim 0 of the inputs disagree: the batch must be elsewhere
        probed = _probe(module, leaves, args, kwargs, target, has_loss_fn)
        if probed is None:
            raise batch.no_batch_error(leaves)
        assigned = probed
    dims, batch_size = assigned
    values, batch_size = (
        batch.widened(leaves, dims, batch_size) if dynamic_batch else ([x.value for x in leaves], batch_size)
    )
    exported, gm, mixing, fixed_at = _export(
        module, values, dims if dynamic_batch else {}, args, kwargs, target, has_loss_fn
    )
    if not dynamic_batch or (mixing is None and not fixed_at):
        return exported, gm, values, batch_size, mixing, fixed_at
    # The samples mix along the first guess, or export fixed its size: look for a dim that keeps them apart.
    used = {j for j, ph in enumerate(p for p in gm.graph.nodes if p.op == "placeholder") if ph.users}
    probed = _probe(module, leaves, args, kwargs, target, has_loss_fn, required={j for j in dims if j in used})
    if probed is not None and probed[0] != dims:
        if declared and any(d is not None for d in declared.values()):
            if mixing is None:  # declared and fixed by the model: the planner says where
                return exported, gm, values, batch_size, mixing, fixed_at
            raise _declared_mixes_error(leaves, dims, probed[0], mixing)
        dims, batch_size = probed
        values, batch_size = batch.widened(leaves, dims, batch_size)
        exported, gm, mixing, fixed_at = _export(module, values, dims, args, kwargs, target, has_loss_fn)
    return exported, gm, values, batch_size, mixing, fixed_at


def _export(module, values, dims, args, kwargs, target, has_loss_fn, check: bool = True):
    """One export with ``dims`` (leaf index -> dim, or list of dims) symbolic: (exported, gm, the
    Mixing along the symbols of those dims or None, and when export fixed every one of those dims
    to a constant, the line that did, or "unknown")."""
    export_args, export_kwargs = exported_call_inputs(
        *batch.rebuild(values, args, kwargs, target, has_loss_fn), has_loss_fn
    )
    spec = batch.dynamic_shapes_for(module, export_args, export_kwargs, batch.dims_spec(values, dims)) if dims else None
    log = SpecialisationLog()
    exported = run_export(module, export_args, export_kwargs, spec, log=log)
    gm = exported.module(check_guards=False)
    if not check:
        return exported, gm, None, ""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    symbols: set = set()
    for j, d in dims.items():
        shape = _shape(placeholders[j]) if j < len(placeholders) else ()
        if isinstance(d, int) and d < len(shape):
            symbols |= samples.symbols_of(shape[d])
    fixed_at = ""
    if dims and not symbols:
        sizes = [values[j].shape[d] for j, d in dims.items() if isinstance(d, int)]
        fixed_at = log.where_fixed(sizes[0]) if sizes else ""
        fixed_at = fixed_at or "unknown"
    loss = _loss_fx_node(gm, exported, has_loss_fn)
    return exported, gm, samples.mixing_along(gm, symbols, loss) if loss is not None else None, fixed_at


def _probe(
    module, leaves, args, kwargs, target, has_loss_fn, required: set[int] = frozenset()
) -> tuple[dict[int, int], int] | None:
    """Export with every dim of size >= 2 symbolic and pick, among the symbols that reach the loss
    and that every leaf in ``required`` has (the inputs the first guess called batched), one along
    which no operation mixes samples (the one most inputs have first): the dims that have it, and
    its size. None when there is none, or when the probe export fails."""
    values = [leaf.value for leaf in leaves]
    try:
        exported, gm, _, _ = _export(
            module, values, batch.all_dims(values), args, kwargs, target, has_loss_fn, check=False
        )
    except Exception:  # noqa: BLE001 - a model that cannot be exported this way keeps its default
        return None
    loss = _loss_fx_node(gm, exported, has_loss_fn)
    if loss is None:
        return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    where: dict[Any, dict[int, int]] = {}
    for j, ph in enumerate(placeholders[: len(leaves)]):
        for d, size in enumerate(_shape(ph)):
            if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                where.setdefault(size.node.expr, {}).setdefault(j, d)
    symbol_at = {(j, d): symbol for symbol, found in where.items() for j, d in found.items()}
    for symbol in sorted(where, key=lambda s: (-len(where[s]), min(where[s].items()))):
        dims = dict(where[symbol])
        for k, leaf in enumerate(leaves):  # labels (S, B) beside ids (S, B): export cannot tie flattened dims
            twin = next((j for j in where[symbol] if batch.same_shape(leaves[j].value, leaf.value)), None)
            if k not in dims and twin is not None:
                dims[k] = dims[twin]
        symbols = {symbol} | _tied_by_size(leaves, dims, required, symbol_at)
        dims.update({j: d for (j, d), s in symbol_at.items() if s in symbols and j not in dims})
        if not required <= set(dims) or not samples.reaches_loss(gm, {symbol}, loss):
            continue
        if samples.mixing_along(gm, symbols, loss) is None:
            j, d = min(dims.items())
            return dict(sorted(dims.items())), int(leaves[j].value.shape[d])
    return None


def _tied_by_size(leaves, dims: dict[int, int], required: set[int], symbol_at: dict) -> set:
    """The probe's symbols of the required leaves that ``dims`` leaves out, each tied to the candidate
    by size where that is unambiguous: the one dim of such a leaf whose size is the candidate's
    (labels ``(S, B)`` beside a sequence-first ``(S, B, E)`` input, their dims merged by the loss's
    flattening, which export cannot tie). A leaf with two such dims ties nothing."""
    j, d = min(dims.items())
    size = leaves[j].value.shape[d]
    tied = set()
    for k in sorted(required - set(dims)):
        matching = [e for e, n in enumerate(leaves[k].value.shape) if n == size and (k, e) in symbol_at]
        if len(matching) == 1:
            tied.add(symbol_at[(k, matching[0])])
    return tied


def _shape(node: torch.fx.Node) -> tuple:
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _loss_fx_node(gm: torch.fx.GraphModule, exported: Any, has_loss_fn: bool) -> torch.fx.Node | None:
    """The FX node of the loss (as ``find_loss_output`` picks it, from the symbolic values)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(pytree.tree_leaves(output.args[0]))
    candidates = [k for k, o in enumerate(flat) if isinstance(o, torch.fx.Node) and o.op == "call_function"]
    if has_loss_fn:
        return flat[0] if 0 in candidates else None
    try:
        indexed = pytree.tree_unflatten(list(range(len(flat))), exported.call_spec.out_spec)
        if hasattr(indexed, "keys") and "loss" in indexed.keys() and indexed["loss"] in candidates:
            return flat[indexed["loss"]]
    except Exception:  # noqa: BLE001 - an unusual output structure falls through
        pass
    for k in candidates:
        value = flat[k].meta.get("val")
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype.is_floating_point:
            return flat[k]
    return None


def _declared_mixes_error(leaves, dims, better, mixing) -> InputError:
    declared = ", ".join(f"{leaves[j].path} dim {d}" for j, d in sorted(dims.items()))
    suggestion = ", ".join(f"{leaves[j].argument!r}: {d}" for j, d in sorted(better.items()))
    return InputError(
        f"batch_dims puts the batch at {declared}, but the samples mix along it: node {mixing.node.name} "
        f"({_target(mixing)}) {mixing.reason}. Along another dim they stay apart: pass "
        f"batch_dims={{{suggestion}}}, the dims that hold one sample each"
    )


def _target(mixing: samples.Mixing) -> str:
    return target_name(mixing.node.target)


def coupling_record(
    gm, mixing: samples.Mixing, index_of: dict, inputs, prefix: str, *, declared: bool = False
) -> SampleCoupling:
    """A SampleCoupling for the OpGraph from the analysis' Mixing (``declared``: the user gave the batch dims)."""
    outer = mixing.within or mixing.node
    module_path, _ = module_of(mixing.node, prefix)
    if not module_path:
        module_path, _ = module_of(outer, prefix)
    dims = tuple(
        f"{g.path} dim {g.tensor.batch_dim}" for g in inputs if g.tensor is not None and g.tensor.batch_dim is not None
    )
    return SampleCoupling(
        node=mixing.node.name,
        index=index_of.get(outer.name, -1),
        target=target_name(mixing.node.target),
        module_path=module_path,
        source=source_of(mixing.node) or source_of(outer),
        reason=mixing.reason,
        batch_dims=dims,
        within=mixing.within.name if mixing.within is not None else "",
        declared=declared,
    )


@contextlib.contextmanager
def _restored_buffers(model: torch.nn.Module) -> Iterator[None]:
    """Buffers as they were before: export and measurement run the model once, which advances
    ``num_batches_tracked`` and counters and updates statistics kept in place."""
    saved = [
        (module, name, b, b.detach().clone())
        for module in model.modules()
        for name, b in module._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, value in saved:
                if module._buffers.get(name) is not buffer:  # rebound (``self.count = self.count + 1``)
                    module._buffers[name] = buffer
                if not buffer.is_meta:
                    buffer.copy_(value)


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
