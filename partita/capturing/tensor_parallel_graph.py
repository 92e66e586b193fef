"""Reading a captured FX graph for the tensor-parallel rules: op names, operands, concrete shapes
(symbolic sizes at their example values), where a view moves a dim, fused projections."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx

VIEWS = frozenset({"view", "reshape", "_unsafe_view"})


def op_name(node: torch.fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))


def tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [v for _, v in tensor_positions(node)]


def tensor_positions(node: torch.fx.Node) -> list[tuple[int, torch.fx.Node]]:
    """(position in args, node) of every operand that is (or may be) a tensor: not a symbolic
    size. Keyword operands get positions after the args. An operand without a recorded value is
    kept: rules that need its shape then refuse to split (``shape`` is None)."""
    found = []
    for i, a in enumerate(list(node.args) + list(node.kwargs.values())):
        for v in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(v, torch.fx.Node) and not isinstance(v.meta.get("val"), (torch.SymInt, int, float, bool)):
                found.append((i, v))
    return found


def concrete(size: Any) -> int:
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None)
    if hint is not None:
        return int(hint)
    return int(node.shape_env.size_hint(node.expr))


def shape(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, torch.fx.Node):
        return None
    val = value.meta.get("val")
    return tuple(concrete(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def batched(value: Any) -> bool:
    """Whether ``value``'s size follows the batch: a dimension of it is symbolic (captured dynamic)."""
    val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape)


def outputs(node: torch.fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val) if isinstance(val, (list, tuple)) else (val,)


def numel(node: torch.fx.Node) -> int:
    found = shape(node)
    return math.prod(found) if found is not None else 0


def dim(dim: Any, value: torch.fx.Node) -> int:
    return dim % len(shape(value))


def broadcast_shape(values: list[torch.fx.Node]) -> tuple[int, ...] | None:
    shapes = [shape(v) for v in values]
    if any(s is None for s in shapes):
        return None
    return tuple(torch.broadcast_shapes(*shapes))


def mapped_dim(before: tuple[int, ...], after: tuple[int, ...], dim: int) -> int | None:
    """Where dim ``dim`` of a view's input goes: the output dim that starts at the same offset
    and either equals it, is its outer factor (a split into heads), or merges it with the dims
    after it; None when the view mixes it with earlier dims."""
    prefix = math.prod(before[:dim])
    running = 1
    for d, size in enumerate(after):
        if running == prefix and size != 1:
            whole = before[dim]
            merges = [math.prod(before[dim : dim + j]) for j in range(1, len(before) - dim + 1)]
            return d if size in merges or (whole % size == 0 and whole > size) else None
        running *= size
        if running > prefix:
            return None
    return None


def matmul_operands(node: torch.fx.Node, name: str) -> tuple[Any, Any, Any]:
    args = node.args
    if name == "linear":
        return args[0], args[1], (args[2] if len(args) > 2 else node.kwargs.get("bias"))
    if name == "addmm":
        return args[1], args[2], args[0]
    return args[0], args[1], None


def is_plain_matmul(node: torch.fx.Node, name: str) -> bool:
    """No beta/alpha scaling (addmm), a 1-d bias, a weight of two dims."""
    if name == "addmm":
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        bias = shape(node.args[0])
        return beta == 1 and alpha == 1 and bias is not None and len(bias) == 1
    if name == "linear":
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return bias is None or len(shape(bias) or ()) == 1
    return True


def fused_blocks(node: torch.fx.Node) -> int:
    """How many equal parts a split of the output's last dim cuts it into (a fused QKV projection),
    following views that keep the last dim; 1 when it is not split."""
    features = (shape(node) or (0,))[-1]
    value = node
    while len(value.users) == 1:
        user = next(iter(value.users))
        name = op_name(user)
        if name in VIEWS and (shape(user) or (0,))[-1] == features:
            value = user
            continue
        if name in ("split", "split_with_sizes"):
            ndim = len(shape(value))
            dim = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
            parts = len(outputs(user))
            sizes = user.args[1]
            sizes = [sizes] * parts if isinstance(sizes, int) else list(sizes)
            if dim % ndim == ndim - 1 and parts > 1 and len(set(sizes)) == 1 and sizes[0] * parts == features:
                return parts
        return 1
    return 1
