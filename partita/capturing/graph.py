"""Build an OpGraph from an exported program: nodes, parameters, inputs, loss and fingerprint."""

from __future__ import annotations

import hashlib
import operator
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from partita.capturing.measure import NodeMeasurement
from partita.errors import CaptureError
from partita.types import GraphInput, OpNode, ParamInfo, TensorInfo

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


# ----------------------------------------------------------------------------- parameters


def canonical_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(tensor)`` -> canonical name, for every parameter and buffer of ``model``.

    The canonical name is the first one PyTorch gives the tensor (parameters before buffers,
    tied copies included); the other names of a tied tensor are its aliases. Capture, stage
    splitting, seeds and checkpoints all key tensors by this name, so it is computed here only:
    a plan made for the graph then names the same tensors the runtime holds and saves.
    """
    names: dict[int, str] = {}
    for name, tensor, _ in _named_tensors(model):
        names.setdefault(id(tensor), name)
    return names


def canonical_parameters(model: torch.nn.Module) -> tuple[dict[int, str], dict[str, ParamInfo]]:
    """Map ``id(tensor)`` to its canonical name (``canonical_names``), and canonical name to
    ParamInfo, whose aliases are the tensor's other names (tied copies)."""
    id_to_name = canonical_names(model)
    aliases: dict[str, list[str]] = {}
    tensors: dict[str, tuple[torch.Tensor, bool]] = {}
    for name, tensor, is_buffer in _named_tensors(model):
        canonical = id_to_name[id(tensor)]
        if canonical == name:
            tensors[name] = (tensor, is_buffer)
            aliases[name] = []
        else:
            aliases[canonical].append(name)
    infos = {
        name: ParamInfo(
            name=name,
            shape=tuple(t.shape),
            dtype=_dtype_name(t.dtype),
            num_bytes=t.numel() * t.element_size(),
            is_buffer=is_buffer,
            requires_grad=bool(t.requires_grad) and not is_buffer,
            aliases=tuple(aliases[name]),
        )
        for name, (t, is_buffer) in tensors.items()
    }
    return id_to_name, infos


def _named_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_buffer) for every name of every parameter, then of every buffer."""
    named = [(n, p, False) for n, p in model.named_parameters(remove_duplicate=False)]
    named += [(n, b, True) for n, b in model.named_buffers(remove_duplicate=False)]
    return [(n, t, is_buffer) for n, t, is_buffer in named if t is not None]


def attr_to_param_map(gm: torch.fx.GraphModule, id_to_name: dict[int, str], prefix: str) -> dict[str, str]:
    """``get_attr`` target in the exported module -> canonical parameter/buffer name."""
    mapping: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value = _resolve_attr(gm, node.target)
        if isinstance(value, torch.Tensor):
            name = id_to_name.get(id(value))
            if name is None:  # a constant the export lifted, not one of the model's tensors
                continue
            mapping[node.target] = name
    return mapping


def _resolve_attr(gm: torch.nn.Module, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


# ----------------------------------------------------------------------------- nodes


def build_nodes(
    gm: torch.fx.GraphModule,
    measurements: dict[str, NodeMeasurement],
    attr_to_param: dict[str, str],
    module_prefix: str,
) -> tuple[tuple[OpNode, ...], dict[str, int], dict[str, int]]:
    """One OpNode per ``call_function`` node; returns nodes, node-name->index, placeholder-name->input index."""
    fx_nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    index_of = {n.name: i for i, n in enumerate(fx_nodes)}
    input_index = {n.name: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    nodes = []
    for i, fx_node in enumerate(fx_nodes):
        m = measurements[fx_node.name]
        read = list(_unique(fx_node.all_input_nodes))
        outputs = tensor_infos(m.value, fx_node.meta.get("val"))
        module_path, module_type = module_of(fx_node, module_prefix)
        nodes.append(
            OpNode(
                index=i,
                name=fx_node.name,
                target=target_name(fx_node.target),
                module_path=module_path,
                module_type=module_type,
                source=source_of(fx_node),
                outputs=outputs,
                inputs=tuple(index_of[r.name] for r in read if r.name in index_of),
                graph_inputs=tuple(input_index[r.name] for r in read if r.op == "placeholder"),
                params=tuple(
                    _unique(attr_to_param[r.target] for r in read if r.op == "get_attr" and r.target in attr_to_param)
                ),
                consumers=tuple(_unique(index_of[u.name] for u in fx_node.users if u.name in index_of)),
                flops=m.flops,
                bytes_read=0 if m.is_view else m.bytes_read,
                bytes_written=0 if m.is_view else sum(t.num_bytes for t in outputs),
                is_view=m.is_view,
                is_higher_order=isinstance(fx_node.target, torch._ops.HigherOrderOperator),
            )
        )
    return tuple(nodes), index_of, input_index


def build_inputs(
    gm: torch.fx.GraphModule, flat_leaves: list[tuple[str, Any]], nodes: Iterable[OpNode]
) -> tuple[GraphInput, ...]:
    """GraphInput per placeholder, with the user's path to it and the nodes that read it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    readers: dict[int, list[int]] = {i: [] for i in range(len(placeholders))}
    for node in nodes:
        for j in node.graph_inputs:
            readers[j].append(node.index)
    result = []
    for j, ph in enumerate(placeholders):
        path, value = flat_leaves[j] if j < len(flat_leaves) else (ph.name, None)
        info = tensor_infos(value, ph.meta.get("val"))
        constant = None if isinstance(value, torch.Tensor) else value
        result.append(
            GraphInput(
                name=ph.name, path=path, tensor=info[0] if info else None, consumers=tuple(readers[j]), value=constant
            )
        )
    return tuple(result)


def tensor_infos(value: Any, symbolic: Any) -> tuple[TensorInfo, ...]:
    """TensorInfo for each tensor leaf of ``value``; ``symbolic`` (meta['val']) tells the batch dim."""
    concrete = [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]
    symbolic_leaves = [x for x in pytree.tree_leaves(symbolic) if isinstance(x, torch.Tensor)]
    infos = []
    for k, t in enumerate(concrete):
        sym = symbolic_leaves[k] if k < len(symbolic_leaves) else None
        infos.append(
            TensorInfo(
                shape=tuple(int(d) for d in t.shape),
                dtype=_dtype_name(t.dtype),
                num_bytes=t.numel() * t.element_size(),
                batch_dim=_batch_dim(sym),
            )
        )
    return tuple(infos)


def _batch_dim(sym: torch.Tensor | None) -> int | None:
    """The first dimension whose size is symbolic: only the batch size is made dynamic. (A SymInt
    whose expression export fixed to a constant, ``s72 = 8``, is not symbolic any more.)"""
    if sym is None:
        return None
    for d, size in enumerate(sym.shape):
        if isinstance(size, torch.SymInt) and not size.node.is_constant() and size.node.expr.free_symbols:
            return d
    return None


def target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return (
            f"aten.{target._schema.name.split('::')[-1]}.{target._overloadname}"
            if target.namespace == "aten"
            else str(target)
        )
    if target is operator.getitem:
        return "operator.getitem"
    return getattr(target, "__name__", None) or getattr(target, "name", lambda: str(target))()


def module_of(node: torch.fx.Node, prefix: str) -> tuple[str, str]:
    """Innermost module path and class name from ``nn_module_stack`` (prefix of a wrapper removed)."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, type_ in reversed(list(stack.values())):
        if "_empty_nn_module_stack" in str(path):
            continue
        path = str(path)
        if prefix and (path + ".").startswith(prefix):
            path = path[len(prefix) :]
        type_name = type_.__name__ if isinstance(type_, type) else str(type_).rsplit(".", 1)[-1]
        return path, type_name
    return "", ""


def source_of(node: torch.fx.Node) -> str:
    """``file.py:LINE in func`` of the innermost frame outside torch (or the innermost frame)."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    if not frames:
        return ""
    chosen = next((f for f in reversed(frames) if not f[0].startswith(_TORCH_DIR)), frames[-1])
    return f"{os.path.basename(chosen[0])}:{chosen[1]} in {chosen[2]}"


# ----------------------------------------------------------------------------- loss


def find_loss_output(
    gm: torch.fx.GraphModule,
    out_spec: Any,
    has_loss_fn: bool,
    index_of: dict[str, int],
    measurements: dict[str, NodeMeasurement],
) -> tuple[int, int]:
    """(node index of the loss, position of the loss among the flat outputs)."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(pytree.tree_leaves(output_node.args[0]))
    tensor_outputs = [
        (k, o)
        for k, o in enumerate(flat)
        if isinstance(o, torch.fx.Node) and o.name in index_of and isinstance(measurements[o.name].value, torch.Tensor)
    ]
    if not tensor_outputs:
        raise CaptureError(
            "the model returns no tensor computed from its inputs: partita trains on a scalar loss. "
            "Return the loss (HF models: pass labels=...), or return the output and pass "
            "loss_fn=..., target=... to partita"
        )
    position = 0 if has_loss_fn else _loss_position(flat, out_spec, tensor_outputs, measurements)
    node = flat[position]
    if not isinstance(node, torch.fx.Node) or node.name not in index_of:
        raise CaptureError(
            f"the loss output (flat output {position}) is not computed by the model's operations: "
            "return a loss that depends on the parameters"
        )
    value = measurements[node.name].value
    if not isinstance(value, torch.Tensor) or value.dim() != 0 or not value.dtype.is_floating_point:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise CaptureError(
            f"the loss must be a 0-dim floating-point tensor, but it is {shape}"
            f"{' of ' + str(value.dtype) if isinstance(value, torch.Tensor) else ''}: reduce it "
            "(e.g. .mean() or reduction='mean') so that it is a scalar"
        )
    return index_of[node.name], position


def _loss_position(flat: list, out_spec: Any, tensor_outputs: list, measurements: dict) -> int:
    """The output named ``loss`` (HF ModelOutput / dict), else the first 0-dim float output."""
    try:
        indexed = pytree.tree_unflatten(list(range(len(flat))), out_spec)
        if hasattr(indexed, "keys") and "loss" in indexed.keys() and isinstance(indexed["loss"], int):
            return indexed["loss"]
    except Exception:  # noqa: BLE001 - an unusual output structure just falls through
        pass
    for k, node in tensor_outputs:
        value = measurements[node.name].value
        if value.dim() == 0 and value.dtype.is_floating_point:
            return k
    shapes = ", ".join(str(tuple(measurements[n.name].value.shape)) for _, n in tensor_outputs[:4])
    raise CaptureError(
        f"the model's outputs contain no scalar loss (tensor outputs have shapes {shapes}): "
        "HF models return a loss when given labels=...; for other models pass "
        "loss_fn=... and target=... to partita"
    )


# ----------------------------------------------------------------------------- fingerprint


def fingerprint(nodes: Iterable[OpNode], inputs: Iterable[GraphInput], params: dict[str, ParamInfo]) -> str:
    """A hash of structure, shapes and dtypes; equal for the same model and example inputs."""
    h = hashlib.sha256()
    for n in nodes:
        h.update(repr((n.name, n.target, n.inputs, n.graph_inputs, n.params, n.outputs)).encode())
    for g in inputs:
        h.update(repr((g.name, g.tensor)).encode())
    for p in sorted(params):
        info = params[p]
        h.update(repr((info.name, info.shape, info.dtype, info.is_buffer, info.aliases)).encode())
    return h.hexdigest()[:16]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _unique(items: Iterable[Any]) -> Iterable[Any]:
    seen = set()
    for x in items:
        if x not in seen:
            seen.add(x)
            yield x
