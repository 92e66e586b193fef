"""Autograd-aware collectives that the tensor-parallel (Megatron-style) rewrite inserts into stage graphs.

Every function takes plain local tensors and the tensor-parallel ``group``, and is a plain
module-level function, so that a rewritten FX graph calls it as a ``call_function`` target. The
group may be a ``ProcessGroup`` or its ``group_name`` (a ``str``): FX prints a node's arguments
as Python source when it builds a ``GraphModule``, and a ``ProcessGroup`` has no source form, so a
graph holds either the name or a ``get_attr`` node that reads the group from the module.

Compiled blocks (``partita.runtime.compiled_segments``) run each of these eagerly
(``torch.compiler.disable``): dynamo cannot trace their process groups and asynchronous
collectives, so a block of a tensor-parallel stage compiles in pieces around them.

On the ``meta`` device nothing communicates: the functions return results of the right shape and
dtype (shape propagation runs them there). ``scatter_to_group`` and ``gather_from_group`` still ask
the group its size and this rank's index; the others do not touch the group on ``meta``.

Glossary
--------
group        the tensor-parallel ranks; ``rank`` is this rank's index in it, ``degree`` its size.
f / g        Megatron's pair: ``copy_to_group`` (f) before a column-parallel matmul, whose
             backward sums the input gradient over the group, and ``reduce_from_group`` (g) after
             a row-parallel matmul, whose forward sums the partial outputs.
block layout a split ``dim`` viewed as ``blocks`` equal blocks (a fused QKV projection's query, key
             and value); rank ``r`` holds part ``r`` of every block, in block order. Example, a
             ``dim`` of size 12, ``blocks=3``, 2 ranks: the blocks are 0-3, 4-7 and 8-11; rank 0
             holds 0 1 4 5 8 9, rank 1 holds 2 3 6 7 10 11. ``blocks=1`` is the plain r-th chunk.
vocab range  the rows (embedding) or columns (logits) ``[vocab_start, vocab_start + V_local)`` of
             the full vocabulary that this rank holds; the ranges of the group tile the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup, ReduceOp

from partita.cost.collective_matmul import block_of, column_block_of, decomposes
from partita.errors import InputError
from partita.runtime import collective_matmul

__all__ = [
    "copy_to_group",
    "reduce_from_group",
    "scatter_to_group",
    "gather_from_group",
    "reduce_scatter_to_group",
    "matmul_reduce_scatter",
    "gather_for_column",
    "all_gather_matmul",
    "vocab_parallel_embedding",
    "vocab_parallel_cross_entropy",
]

Group = ProcessGroup | str

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2  # aten's integer codes (torch.nn._reduction)


# ----------------------------------------------------------------------------- public functions


@torch.compiler.disable
def copy_to_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's f: forward the identity; backward all-reduce (SUM) the gradient over ``group``."""
    return _CopyToGroup.apply(x, group)


@torch.compiler.disable
def reduce_from_group(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Megatron's g: forward all-reduce (SUM) a copy of ``x`` over ``group`` (``x`` is left as it is);
    backward the identity."""
    return _ReduceFromGroup.apply(x, group)


@torch.compiler.disable
def scatter_to_group(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """This rank's part of the full ``x`` along ``dim`` in the block layout (contiguous); backward
    all-gathers the gradient parts into the full gradient. ``x.shape[dim]`` must divide by
    ``blocks * degree``."""
    return _ScatterToGroup.apply(x, dim, blocks, group)


@torch.compiler.disable
def gather_from_group(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """The full tensor from every rank's part ``x`` along ``dim`` in the block layout (all-gather);
    backward keeps this rank's part of the gradient. The inverse of ``scatter_to_group``."""
    return _GatherFromGroup.apply(x, dim, blocks, group)


@torch.compiler.disable
def reduce_scatter_to_group(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """Sequence parallelism's reduce-scatter: this rank's part (block layout along ``dim``) of the sum
    of every rank's ``x``; backward all-gathers the gradient parts. Where tensor parallelism
    all-reduces a row-parallel matmul's partial output, sequence parallelism keeps one part of it."""
    return _ReduceScatterToGroup.apply(x, dim, blocks, group)


@torch.compiler.disable
def matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group: Group
) -> torch.Tensor:
    """``reduce_scatter_to_group(x @ (weight.T if transposed else weight), dim, blocks, group)`` as one
    dispatched op, ``partita::matmul_reduce_scatter``: a row-parallel matmul under sequence
    parallelism (``transposed``: ``linear``'s ``(out, in)`` weight; else ``mm``/``matmul``'s ``(in, out)``).

    Selective recomputation keeps the outputs of the ops its policy names, as dispatched
    (``partita.capturing.recompute``). Kept as two ops, the matmul's output is the group's whole
    partial product (``degree`` times what this rank ends with) and the reduce-scatter runs again
    in the recomputation; kept as one, the cache holds this rank's tokens of the sum, and the
    recomputation neither multiplies nor communicates. Under autocast both operands are cast to
    bfloat16 before the op (``torch.library.register_autocast``: afresh, without autocast's cache
    of weight casts, as the runtime's recomputing stages cast). The same products and sums as the
    two ops. Where its token blocks are large enough (``partita.cost.collective_matmul.decomposes``,
    the cost model's rule) they are computed one at a time with the ring's transfers in between
    (``partita.runtime.collective_matmul``), and the backward all-gathers the output gradient the
    same way; else the op multiplies whole, then reduce-scatters. It forms the operand gradients
    the autograd engine will use.

    The weight enters through a view: the engine can then say whether it will use the weight's
    gradient (of a leaf it cannot, under ``torch.autograd.grad``), which a zero-bubble schedule's
    input-gradient pass does not."""
    name = group if isinstance(group, str) else group.group_name
    weight = weight.view_as(weight) if weight.requires_grad else weight
    return torch.ops.partita.matmul_reduce_scatter(x, weight, transposed, _normalized_dim(dim, x), blocks, name)


@torch.compiler.disable
def gather_for_column(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """Sequence parallelism's all-gather before a column-parallel matmul: the full tensor from every
    rank's part ``x`` (block layout along ``dim``); backward reduce-scatters the gradient, since each
    rank's matmul gives a partial gradient of the whole input (``copy_to_group``'s all-reduce, kept
    in part)."""
    return _GatherForColumn.apply(x, dim, blocks, group)


@torch.compiler.disable
def all_gather_matmul(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group: Group
) -> torch.Tensor:
    """``gather_for_column(x, dim, blocks, group) @ (weight.T if transposed else weight)``: a
    column-parallel matmul under sequence parallelism, the adjoint of ``matmul_reduce_scatter``
    (``x`` this rank's tokens; the product has every token and this rank's output features).

    Where its token blocks are large enough (``partita.cost.collective_matmul.decomposes``) it is
    one dispatched op, ``partita::all_gather_matmul``: the forward multiplies each rank's block
    while the next travels around the ring (``partita.runtime.collective_matmul``); it keeps only
    this rank's tokens of ``x`` for backward, as Megatron-LM's sequence parallelism does
    (``1 / degree`` of the gathered copy), and its backward starts their all-gather for the weight
    gradient, forms the input gradient's product meanwhile, then reduce-scatters it while the weight
    gradient is formed (Megatron's overlaps; a zero-bubble input pass, which forms no weight
    gradient, waits for it). Selective recomputation keeps its output and runs neither the matmul nor
    the all-gather again. Cast under autocast, weight view and zero-bubble passes as
    ``matmul_reduce_scatter``'s: the input pass keeps the gathered ``x`` for the weight pass.
    Smaller blocks run as the two ops (the all-gather, then the matmul keeping the gathered copy):
    their collectives are latency-bound, so gathering again in backward would cost as much as in
    forward."""
    name = group if isinstance(group, str) else group.group_name
    dim = _normalized_dim(dim, x)
    if not _column_decomposes(x, weight, transposed, name):
        return collective_matmul.matmul(gather_for_column(x, dim, blocks, group), weight, transposed)
    weight = weight.view_as(weight) if weight.requires_grad else weight
    return torch.ops.partita.all_gather_matmul(x, weight, transposed, dim, blocks, name)


def vocab_parallel_embedding(
    weight_local: torch.Tensor, ids: torch.Tensor, vocab_start: int, padding_idx: int | None, group: Group
) -> torch.Tensor:
    """``F.embedding(full_weight, ids, padding_idx)`` from the rows ``[vocab_start, vocab_start +
    weight_local.shape[0])`` that this rank holds: each rank looks up its own ids, zeros the others,
    and the outputs are all-reduced (SUM). ``weight_local`` gets exactly its rows' gradient; the
    ``padding_idx`` row (a global index; ``None`` or -1, aten's default, mean none) gets none."""
    return reduce_from_group(vocab_parallel_embedding_partial(weight_local, ids, vocab_start, padding_idx), group)


def vocab_parallel_embedding_partial(
    weight_local: torch.Tensor, ids: torch.Tensor, vocab_start: int, padding_idx: int | None
) -> torch.Tensor:
    """``vocab_parallel_embedding`` before its all-reduce: this rank's rows looked up, the others'
    zero (sequence parallelism reduce-scatters it instead of all-reducing)."""
    num_local = weight_local.shape[0]
    elsewhere = (ids < vocab_start) | (ids >= vocab_start + num_local)  # (*ids.shape)
    local_ids = (ids - vocab_start).masked_fill(elsewhere, 0)  # row 0 stands in; its output is zeroed
    out = F.embedding(local_ids, weight_local, padding_idx=_local_padding_idx(padding_idx, vocab_start, num_local))
    # masked_fill's backward zeros those positions' gradients, so row 0 receives nothing from them
    return out.masked_fill(elsewhere.unsqueeze(-1), 0)  # (*ids.shape, C)


@torch.compiler.disable
def vocab_parallel_cross_entropy(
    logits_local: torch.Tensor, target: torch.Tensor, vocab_start: int, reduction: int, ignore_index: int, group: Group
) -> torch.Tensor:
    """``aten.cross_entropy_loss(full_logits, target, None, reduction, ignore_index, 0.0)`` from this
    rank's columns ``[vocab_start, vocab_start + V_local)`` of the logits, never gathered.

    ``logits_local`` is ``(N, V_local)`` (also ``(V_local,)`` or ``(N, V_local, d1, ...)``: the
    class dim is 1 as in aten), ``target`` holds global class ids, ``reduction`` is aten's integer
    (0 none, 1 mean over the non-ignored targets, 2 sum). Computed in float32, or float64 for
    float64 logits (the dtype autocast gives cross-entropy), and returned in that dtype; the
    gradient is cast back to the logits' dtype. Ignored targets give loss 0 and no gradient; with
    every target ignored the mean is NaN, as in torch. Three values per row are all-reduced: the
    row's max (MAX), then its sum of exponentials and its target logit (SUM, one call)."""
    if reduction not in (REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM):
        raise InputError(f"reduction={reduction!r} is not one of aten's codes: use 0 (none), 1 (mean) or 2 (sum)")
    if logits_local.dim() == 1:  # (V_local,) with a scalar target
        logits_rows = logits_local.unsqueeze(0)
    else:  # (N, V_local, d1, ...) -> (N * d1 * ..., V_local)
        logits_rows = logits_local.movedim(1, -1).reshape(-1, logits_local.shape[1])
    loss = _VocabParallelCrossEntropy.apply(logits_rows, target.reshape(-1), vocab_start, ignore_index, group)  # (M,)
    if reduction == REDUCTION_NONE:
        return loss.reshape(target.shape)
    if reduction == REDUCTION_SUM:
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()  # 0 / 0 = NaN when every target is ignored, as in aten


# ----------------------------------------------------------------------------- autograd functions


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce_copy(grad, ReduceOp.SUM, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return _all_reduce_copy(x, ReduceOp.SUM, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _ScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
        ctx.layout = (_normalized_dim(dim, x), blocks, group)
        return _local_part(x, *ctx.layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _gather_parts(grad, *ctx.layout), None, None, None


class _GatherFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
        ctx.layout = (_normalized_dim(dim, x), blocks, group)
        return _gather_parts(x, *ctx.layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _local_part(grad, *ctx.layout), None, None, None


class _ReduceScatterToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
        ctx.layout = (_normalized_dim(dim, x), blocks, group)
        return _reduce_scatter_parts(x, *ctx.layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _gather_parts(grad, *ctx.layout), None, None, None


class _GatherForColumn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
        ctx.layout = (_normalized_dim(dim, x), blocks, group)
        return _gather_parts(x, *ctx.layout)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_parts(grad, *ctx.layout), None, None, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row losses ``log(sum_v exp(z_v)) - z_target`` over the whole vocabulary, 0 where ignored.

    The backward is ``(softmax_local - onehot_local) * grad``. It saves the logits (in their own
    dtype) and the rows' log-sum-exp and recomputes the softmax, rather than keeping an
    ``(M, V_local)`` float32 softmax alive from forward to backward.
    """

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int, group: Group
    ) -> torch.Tensor:
        z = logits.to(_compute_dtype(logits))  # (M, V_local)
        valid = target != ignore_index  # (M,)
        local_target = target - vocab_start
        here = valid & (local_target >= 0) & (local_target < z.shape[1])  # the target column is on this rank
        local_target = local_target.masked_fill(~here, 0)

        row_max = _all_reduce_copy(z.amax(dim=1), ReduceOp.MAX, group)  # (M,) the global max, for stability
        shifted = z - row_max.unsqueeze(1)
        target_logit = shifted.gather(1, local_target.unsqueeze(1)).squeeze(1).masked_fill(~here, 0)
        sums = _all_reduce_copy(torch.stack([shifted.exp().sum(dim=1), target_logit]), ReduceOp.SUM, group)  # (2, M)
        log_sum_exp = sums[0].log()

        ctx.save_for_backward(logits, row_max + log_sum_exp, local_target, here, valid)
        return (log_sum_exp - sums[1]).masked_fill(~valid, 0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, log_sum_exp, local_target, here, valid = ctx.saved_tensors
        softmax = (logits.to(log_sum_exp.dtype) - log_sum_exp.unsqueeze(1)).exp()  # (M, V_local)
        softmax.scatter_add_(1, local_target.unsqueeze(1), -here.to(softmax.dtype).unsqueeze(1))  # - onehot
        # where, not a product: a mean over zero targets sends an infinite grad_loss to ignored rows
        grad_rows = torch.where(valid, grad_loss, 0).unsqueeze(1)  # (M, 1)
        return (softmax * grad_rows).to(logits.dtype), None, None, None, None


# ----------------------------------------------------------------------------- the fused custom op


@torch.library.custom_op("partita::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group_name: str
) -> torch.Tensor:
    if not _decomposes(x, weight, transposed, group_name):  # whole, then reduce-scattered
        return _reduce_scatter_parts(collective_matmul.matmul(x, weight, transposed), dim, blocks, group_name)
    return collective_matmul.matmul_reduce_scatter(x, weight, transposed, dim, blocks, _process_group(group_name))


@_matmul_reduce_scatter.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group_name: str) -> torch.Tensor:
    product = collective_matmul.matmul(x, weight, transposed)
    shape = list(product.shape)
    shape[dim] //= dist.get_world_size(_process_group(group_name))
    return product.new_empty(shape)


def _matmul_reduce_scatter_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    x, weight, transposed, dim, blocks, group_name = inputs
    ctx.save_for_backward(x, weight)
    ctx.transposed, ctx.layout = transposed, (dim, blocks, group_name)


def _matmul_reduce_scatter_backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    needs_x, needs_weight = collective_matmul.needed_gradients(ctx, 2)
    dim, blocks, group_name = ctx.layout
    grad_x = None
    gathered = getattr(ctx, "gathered", None)  # kept by a zero-bubble input pass for its weight pass
    if gathered is None and (needs_x or needs_weight):
        if _decomposes(x, weight, ctx.transposed, group_name):
            group = _process_group(group_name)
            gathered, grad_x = collective_matmul.gather_gradient(
                grad, x, weight if needs_x else None, ctx.transposed, dim, blocks, group
            )
        else:  # all-gathered whole (a group of one: the identity)
            gathered = _gather_parts(grad, dim, blocks, group_name)
            grad_x = gathered.matmul(weight if ctx.transposed else weight.t()) if needs_x else None
    grad_weight = _weight_pass(
        ctx, needs_weight, gathered, lambda g: collective_matmul.weight_gradient(g, x, ctx.transposed)
    )
    return grad_x, grad_weight, None, None, None, None


def _weight_pass(
    ctx, needs_weight: bool, gathered: torch.Tensor | None, weight_gradient: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor | None:
    """The weight's gradient from what the backward ``gathered``, where this pass forms it; else None,
    keeping ``gathered`` for the later pass that will (a zero-bubble schedule's weight pass)."""
    if needs_weight:
        ctx.gathered = None
        return weight_gradient(gathered)
    if ctx.needs_input_grad[1]:
        ctx.gathered = gathered
    return None


def _decomposes(x: torch.Tensor, weight: torch.Tensor, transposed: bool, group_name: str) -> bool:
    """Whether the op runs block by block around the ring (``partita.cost.collective_matmul.decomposes``,
    the cost model's rule): in a group of several, with blocks large enough."""
    if not _communicates(x, group_name):
        return False
    degree = dist.get_world_size(_process_group(group_name))
    out_features = weight.shape[0 if transposed else 1]
    return bool(decomposes(*block_of(tuple(x.shape), out_features, degree, x.element_size())))


_matmul_reduce_scatter.register_autograd(_matmul_reduce_scatter_backward, setup_context=_matmul_reduce_scatter_context)
for _device_type in ("cpu", "cuda"):
    torch.library.register_autocast("partita::matmul_reduce_scatter", _device_type, torch.bfloat16)


@torch.library.custom_op("partita::all_gather_matmul", mutates_args=())
def _all_gather_matmul(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group_name: str
) -> torch.Tensor:
    return collective_matmul.all_gather_matmul(x, weight, transposed, dim, blocks, _process_group(group_name))


@_all_gather_matmul.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group_name: str) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] *= dist.get_world_size(_process_group(group_name))
    return collective_matmul.matmul(x.new_empty(shape), weight, transposed)


def _all_gather_matmul_backward(ctx, grad: torch.Tensor):
    x, weight = ctx.saved_tensors
    needs_x, needs_weight = collective_matmul.needed_gradients(ctx, 2)
    dim, blocks, group_name = ctx.layout
    grad_x = None
    gathered = getattr(ctx, "gathered", None)  # kept by a zero-bubble input pass for its weight pass
    gathering = None
    if gathered is None and ctx.needs_input_grad[1]:  # the weight gradient's, now or later
        gathering = _start_gathering(x, dim, blocks, group_name)
    scattering = None
    if needs_x:  # while the kept tokens are gathered; reduce-scattered while the weight gradient is formed
        product = collective_matmul.matmul(grad, weight, not ctx.transposed)
        scattering = _start_reduce_scatter(product, dim, blocks, group_name)
    if gathering is not None:
        gathered = gathering()
    grad_weight = _weight_pass(
        ctx, needs_weight, gathered, lambda g: collective_matmul.weight_gradient(grad, g, ctx.transposed)
    )
    if scattering is not None:
        grad_x = scattering()
    return grad_x, grad_weight, None, None, None, None


def _column_decomposes(x: torch.Tensor, weight: torch.Tensor, transposed: bool, group_name: str) -> bool:
    """Whether the column-parallel matmul runs block by block around the ring (the cost model's
    rule), on ``x`` as the matmul will read it: in autocast's dtype where autocast is on."""
    if not _communicates(x, group_name):
        return False
    out_features = weight.shape[0 if transposed else 1]
    element_size = x.element_size()
    if torch.is_autocast_enabled(x.device.type) and x.is_floating_point():
        element_size = torch.empty((), dtype=torch.get_autocast_dtype(x.device.type)).element_size()
    return bool(decomposes(*column_block_of(tuple(x.shape), out_features, element_size)))


_all_gather_matmul.register_autograd(_all_gather_matmul_backward, setup_context=_matmul_reduce_scatter_context)
for _device_type in ("cpu", "cuda"):
    torch.library.register_autocast("partita::all_gather_matmul", _device_type, torch.bfloat16)


# ----------------------------------------------------------------------------- helpers


def _process_group(group: Group) -> ProcessGroup:
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group)
    return group


def _communicates(x: torch.Tensor, group: Group) -> bool:
    """Whether ``x`` goes through a collective: not on meta (shape propagation), not in a group of one."""
    return x.device.type != "meta" and dist.get_world_size(_process_group(group)) > 1


def _all_reduce_copy(x: torch.Tensor, op: ReduceOp, group: Group) -> torch.Tensor:
    """A contiguous copy of ``x`` all-reduced with ``op``; ``x`` itself is never written."""
    out = x.clone(memory_format=torch.contiguous_format)
    if _communicates(x, group):
        dist.all_reduce(out, op=op, group=_process_group(group))
    return out


def _normalized_dim(dim: int, x: torch.Tensor) -> int:
    if not -x.dim() <= dim < x.dim():
        raise InputError(f"dim={dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def _local_part(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """Part ``rank`` of each of the ``blocks`` blocks of ``x`` along ``dim``, concatenated (contiguous)."""
    pg = _process_group(group)
    degree, rank = dist.get_world_size(pg), dist.get_rank(pg)
    size = x.shape[dim]
    if blocks < 1 or size % (blocks * degree):
        raise InputError(
            f"cannot split dim {dim} of size {size} (shape {tuple(x.shape)}) into {blocks} block(s) over "
            f"{degree} ranks: the size must be a multiple of blocks * ranks = {blocks * degree}"
        )
    parts = x.unflatten(dim, (blocks, degree, size // (blocks * degree)))  # (..., blocks, degree, part, ...)
    # a copy even where a view would do: a custom Function's output that views its input cannot be
    # modified in place later, and the rewritten graph may do that
    return parts.select(dim + 1, rank).flatten(dim, dim + 1).clone(memory_format=torch.contiguous_format)


def _gather_parts(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """The full tensor from every rank's ``_local_part`` ``x``: all-gather, then interleave the blocks."""
    return _start_gathering(x, dim, blocks, group)()


def _start_gathering(x: torch.Tensor, dim: int, blocks: int, group: Group) -> Callable[[], torch.Tensor]:
    """Start ``_gather_parts`` (the all-gather runs while the caller computes); call the result for
    the full tensor."""
    pg = _process_group(group)
    degree = dist.get_world_size(pg)
    if x.shape[dim] % blocks:
        raise InputError(f"a local part of size {x.shape[dim]} along dim {dim} does not hold {blocks} equal blocks")
    x = x.contiguous()
    parts = [x] if degree == 1 else [torch.empty_like(x) for _ in range(degree)]
    work = dist.all_gather(parts, x, group=pg, async_op=True) if _communicates(x, group) else None

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        # each part (..., blocks * part, ...) -> (..., blocks, part, ...), stacked as (..., blocks, degree, part, ...)
        stacked = torch.stack([p.unflatten(dim, (blocks, -1)) for p in parts], dim=dim + 1)
        return stacked.flatten(dim, dim + 2)

    return finish


def _reduce_scatter_parts(x: torch.Tensor, dim: int, blocks: int, group: Group) -> torch.Tensor:
    """This rank's ``_local_part`` of the sum of every rank's full ``x`` (one reduce-scatter)."""
    return _start_reduce_scatter(x, dim, blocks, group)()


def _start_reduce_scatter(x: torch.Tensor, dim: int, blocks: int, group: Group) -> Callable[[], torch.Tensor]:
    """Start ``_reduce_scatter_parts`` (the reduce-scatter runs while the caller computes); call the
    result for this rank's part of the sum."""
    if not _communicates(x, group):  # meta, or a group of one: the sum is ``x`` itself
        part = _local_part(x, dim, blocks, group)
        return lambda: part
    pg = _process_group(group)
    degree = dist.get_world_size(pg)
    size = x.shape[dim]
    if blocks < 1 or size % (blocks * degree):
        raise InputError(
            f"cannot reduce-scatter dim {dim} of size {size} (shape {tuple(x.shape)}) in {blocks} block(s) over "
            f"{degree} ranks: the size must be a multiple of blocks * ranks = {blocks * degree}"
        )
    parts = x.unflatten(dim, (blocks, degree, size // (blocks * degree)))  # (..., blocks, degree, part, ...)
    stacked = parts.movedim(dim + 1, 0).contiguous()  # (degree, ..., blocks, part, ...): rank r's part r-th
    out = torch.empty_like(stacked[0])
    work = dist.reduce_scatter_tensor(out.view(-1), stacked.view(-1), group=pg, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        return out.flatten(dim, dim + 1)

    return finish


def _local_padding_idx(padding_idx: int | None, vocab_start: int, num_local: int) -> int | None:
    """The global ``padding_idx`` as an index into this rank's rows, or None when it is not one of them."""
    if padding_idx is None or padding_idx == -1:
        return None
    if padding_idx < 0:
        raise InputError(
            f"padding_idx={padding_idx} is negative: give the global row index (non-negative), or None or -1 for none"
        )
    local = padding_idx - vocab_start
    return local if 0 <= local < num_local else None


def _compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float32 for half and bfloat16 logits (as autocast computes cross-entropy), float64 for float64."""
    return torch.promote_types(logits.dtype, torch.float32)
