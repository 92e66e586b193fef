"""A row-parallel matmul and its reduce-scatter, computed in chunks so that the transfers overlap it.

Under sequence parallelism each device of a tensor-parallel group holds the partial product
``x @ w`` of every token and keeps its own tokens of the group's sum (a reduce-scatter); backward
all-gathers the output gradient's tokens and forms both operand gradients from it. Run as they
are, the collective waits for the whole matmul and the matmul for the whole collective. Cut by
destination token block instead (Wang et al., "Overlap Communication with Dependent Computation
via Decomposition in Large Deep Learning Models", ASPLOS 2023; torch's ``fused_matmul_reduce_scatter``
for async tensor parallelism, Transformer Engine's ring exchange), each of the ``t - 1`` ring steps
sends one block while the next block's matmul runs:

forward     rank ``r`` computes the partial product of block ``r - 1`` first, sends it right, and
            at step ``k`` adds the partial it received to its own of block ``r - 1 - k``: after
            ``t - 1`` steps it holds the sum of its own block (the reduce-scatter's result).
backward    the output gradient's blocks travel around the ring (an all-gather); while one is in
            flight the device multiplies the one it holds into its rows of the input gradient.
            The weight gradient is one matmul of the gathered gradient after the ring.

Its adjoint, a column-parallel matmul fused with the all-gather of its input (``all_gather_matmul``),
runs the other way round: every rank's tokens of ``x`` travel around the ring while the device
multiplies the block it holds into its rows of the product. (Its backward needs no blocks:
``partita.runtime.tensor_parallel_ops.all_gather_matmul``.)

The same products and sums as the two ops (the partials summed in ring order). The op
(``partita.runtime.tensor_parallel_ops.matmul_reduce_scatter``) computes this way only blocks
large enough to gain (``partita.cost.collective_matmul.decomposes``, the rule the cost model
applies). Blocks are the block layout of ``partita.runtime.tensor_parallel_ops``: rank ``c``'s
tokens are part ``c`` of each of ``blocks`` blocks of ``dim``.

Zero-bubble schedules compute a stage's input gradients and its weight gradients in two passes
(``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``), each
running this op's backward with the other operand's gradient unused: the backward computes only
what the autograd engine will use (``needed_gradients``), so neither pass multiplies twice. The
input pass keeps the gathered gradient for the weight pass, as those schedules keep an unfused
matmul's output gradient between the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "all_gather_matmul",
    "gather_gradient",
    "matmul",
    "matmul_into",
    "matmul_reduce_scatter",
    "needed_gradients",
    "weight_gradient",
]


def matmul(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x @ weight`` (``weight.T`` when ``transposed``: ``linear``'s ``(out, in)`` weight)."""
    return torch.matmul(x, weight.t() if transposed else weight)


def matmul_reduce_scatter(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group: ProcessGroup
) -> torch.Tensor:
    """This rank's tokens of the sum over ``group`` of every rank's ``matmul(x, weight, transposed)``,
    the ring steps overlapping the block matmuls (module docstring). ``x`` holds every token; ``dim``
    (not the last) is split, in ``blocks`` blocks, over the group."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = _parts(x, dim, blocks, degree)
    right, left = _neighbours(group, rank, degree)
    held = matmul(parts(rank - 1), weight, transposed)
    for k in range(1, degree):
        received = torch.empty_like(held)
        requests = _exchange(held, received, right, left, group)
        partial = matmul(parts(rank - 1 - k), weight, transposed)  # while the held sum travels
        for request in requests:
            request.wait()
        held = received.add_(partial)
    return held.flatten(dim, dim + 1)  # (..., blocks, part, ...) -> this rank's tokens


def all_gather_matmul(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, blocks: int, group: ProcessGroup
) -> torch.Tensor:
    """``matmul(every rank's tokens of x, weight, transposed)``: ``x`` is this rank's tokens (block
    layout along ``dim``, not the last), which travel around the ring while the device multiplies
    the block it holds into its rows of the product (module docstring)."""
    degree = dist.get_world_size(group)
    out_features = weight.shape[0 if transposed else 1]
    shape = list(x.shape[:-1]) + [out_features]
    shape[dim] *= degree
    dtype = torch.promote_types(x.dtype, weight.dtype)
    product = x.new_empty(shape, dtype=dtype)
    rows = _parts(product, dim, blocks, degree)

    def multiply(source: int, held: torch.Tensor) -> None:
        matmul_into(rows(source), held, weight, transposed)

    _around_ring(x, dim, blocks, group, multiply)
    return product


def gather_gradient(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    transposed: bool,
    dim: int,
    blocks: int,
    group: ProcessGroup,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output gradient of every token, all-gathered around the ring from this rank's tokens
    ``grad``, and, with a ``weight``, the input gradient, whose rows each block forms while the next
    block travels: ``(gathered gradient, input gradient or None)``. The weight gradient is then one
    matmul of the gathered gradient (``weight_gradient``), the same sums as the unfused op's."""
    degree = dist.get_world_size(group)
    gathered = grad.new_empty((*x.shape[:-1], grad.shape[-1]))
    gathered_parts = _parts(gathered, dim, blocks, degree)
    grad_x = torch.empty_like(x) if weight is not None else None
    grad_x_parts = _parts(grad_x, dim, blocks, degree) if grad_x is not None else None

    def place(source: int, held: torch.Tensor) -> None:
        rows = gathered_parts(source)
        if rows.data_ptr() != held.data_ptr():  # else received in place
            rows.copy_(held)
        if grad_x_parts is not None:
            matmul_into(grad_x_parts(source), held, weight, not transposed)

    _around_ring(grad, dim, blocks, group, place, into=gathered_parts)
    return gathered, grad_x


def matmul_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> None:
    """``out[...] = matmul(x, weight, transposed)``: the product written in place where ``out`` is
    contiguous (a token block of a value whose dims before the tokens are all 1: a micro-batch of
    one sequence), else formed apart and copied in (the cost model's rule,
    ``partita.cost.collective_matmul``)."""
    if out.is_contiguous() and x.is_contiguous() and out.dtype == x.dtype == weight.dtype:
        rows = x.reshape(-1, x.shape[-1])
        torch.mm(rows, weight.t() if transposed else weight, out=out.view(-1, out.shape[-1]))
    else:
        out.copy_(matmul(x, weight, transposed))


def weight_gradient(grad: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight's gradient from the output gradient ``grad`` and the input ``x`` of the same tokens."""
    rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return rows.t().mm(inputs) if transposed else inputs.t().mm(rows)


def needed_gradients(ctx, count: int) -> tuple[bool, ...]:
    """Whether the autograd engine will use the gradient of each of the first ``count`` inputs of the
    node whose backward is running: ``ctx.needs_input_grad``, and, for an input that is not a leaf,
    whether the engine runs the node its gradient goes to (``torch._C._will_engine_execute_node``,
    as FSDP asks it; not answerable for a leaf under ``torch.autograd.grad``, taken as needed).
    Zero-bubble schedules ask for the input and the weight gradients in separate passes."""
    needed = []
    for i in range(count):
        node = ctx.next_functions[i][0] if ctx.needs_input_grad[i] else None
        if node is None:
            needed.append(False)
            continue
        try:
            needed.append(bool(torch._C._will_engine_execute_node(node)))
        except RuntimeError:  # a leaf's accumulator while torch.autograd.grad runs
            needed.append(True)
    return tuple(needed)


# ----------------------------------------------------------------------------- helpers


def _around_ring(
    local: torch.Tensor,
    dim: int,
    blocks: int,
    group: ProcessGroup,
    each: Callable[[int, torch.Tensor], None],
    into: Callable[[int], torch.Tensor] | None = None,
) -> None:
    """Pass every rank's tokens ``local`` (this rank's) around the ring: ``each(source, held)`` for the
    tokens of every rank ``source`` in turn, this rank's first, viewed ``(..., blocks, part, ...)``,
    while the next rank's travel. ``into(source)``: where to receive rank ``source``'s tokens, used
    where that view is contiguous (else a buffer of their own)."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    right, left = _neighbours(group, rank, degree)
    held = local.unflatten(dim, (blocks, -1)).contiguous()  # (..., blocks, part, ...): block ``rank``
    for k in range(degree):
        requests = []
        if k < degree - 1:
            received = into(rank - k - 1) if into is not None else None
            if received is None or not received.is_contiguous():
                received = torch.empty_like(held)
            requests = _exchange(held, received, right, left, group)
        each(rank - k, held)
        for request in requests:
            request.wait()
        if k < degree - 1:
            held = received


def _parts(x: torch.Tensor, dim: int, blocks: int, degree: int) -> Callable[[int], torch.Tensor]:
    """rank -> that rank's tokens of the whole ``x``, as a view ``(..., blocks, part, ...)``."""
    viewed = x.unflatten(dim, (blocks, degree, -1))
    return lambda rank: viewed.select(dim + 1, rank % degree)


def _neighbours(group: ProcessGroup, rank: int, degree: int) -> tuple[int, int]:
    """The global ranks after and before ``rank`` in the group's ring."""
    return dist.get_global_rank(group, (rank + 1) % degree), dist.get_global_rank(group, (rank - 1) % degree)


def _exchange(
    sent: torch.Tensor, received: torch.Tensor, right: int, left: int, group: ProcessGroup
) -> list[dist.Work]:
    """Start sending ``sent`` to ``right`` and receiving ``received`` from ``left``."""
    operations = [dist.P2POp(dist.isend, sent, right, group), dist.P2POp(dist.irecv, received, left, group)]
    return dist.batch_isend_irecv(operations)
