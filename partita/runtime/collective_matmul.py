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
            flight the device multiplies the one it holds, into its rows of the input gradient
            and into the weight gradient.

The same products and sums as the two ops (the weight gradient summed block by block, the
partials in ring order). Blocks are the block layout of ``partita.runtime.tensor_parallel_ops``:
rank ``c``'s tokens are part ``c`` of each of ``blocks`` blocks of ``dim``.

Zero-bubble schedules compute a stage's input gradients and its weight gradients in two passes
(``torch.distributed.pipelining``'s ``stage_backward_input`` / ``stage_backward_weight``), each
running this op's backward with the other operand's gradient unused: the backward computes only
what the autograd engine will use (``needed_gradients``), so neither pass multiplies twice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["matmul", "matmul_reduce_scatter", "matmul_reduce_scatter_backward", "needed_gradients"]


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


def matmul_reduce_scatter_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    transposed: bool,
    dim: int,
    blocks: int,
    group: ProcessGroup,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(input gradient, weight gradient) of ``matmul_reduce_scatter`` from this rank's tokens of the
    output gradient, ``None`` where ``needs`` says the gradient is not wanted (``needed_gradients``).

    The input gradient's rows are formed block by block while the next block travels. The weight
    gradient, with the input gradient, is one matmul of the gathered gradient after the ring (the
    same sums as the unfused op); alone (a zero-bubble schedule's weight pass) it is summed block by
    block as the blocks arrive, in float32 for bfloat16 and float16 blocks."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    parts = _parts(x, dim, blocks, degree)
    right, left = _neighbours(group, rank, degree)
    grad_x = torch.empty_like(x) if needs[0] else None
    held = grad.unflatten(dim, (blocks, -1)).contiguous()  # (..., blocks, part, ..., out): block ``rank``
    gathered = None
    if needs[0] and needs[1]:
        gathered = held.new_empty((*x.shape[:-1], held.shape[-1]))
    grad_weight = None
    for k in range(degree):
        source = rank - k  # whose tokens ``held`` is
        requests = []
        if k < degree - 1:
            received = torch.empty_like(held)
            requests = _exchange(held, received, right, left, group)
        if grad_x is not None:
            _parts(grad_x, dim, blocks, degree)(source).copy_(torch.matmul(held, weight if transposed else weight.t()))
        if gathered is not None:
            _parts(gathered, dim, blocks, degree)(source).copy_(held)
        elif needs[1]:
            block = _weight_gradient(held, parts(source), transposed)
            summed = torch.promote_types(block.dtype, torch.float32)
            grad_weight = block.to(summed) if grad_weight is None else grad_weight.add_(block)
        for request in requests:
            request.wait()
        if k < degree - 1:
            held = received
    if gathered is not None:
        grad_weight = _weight_gradient(gathered, x, transposed)
    elif grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_x, grad_weight


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


def _parts(x: torch.Tensor, dim: int, blocks: int, degree: int) -> Callable[[int], torch.Tensor]:
    """rank -> that rank's tokens of the whole ``x``, as a view ``(..., blocks, part, ...)``."""
    viewed = x.unflatten(dim, (blocks, degree, -1))
    return lambda rank: viewed.select(dim + 1, rank % degree)


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The weight's gradient from the output gradient ``grad`` and the input ``x`` of the same tokens."""
    rows, inputs = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return rows.t().mm(inputs) if transposed else inputs.t().mm(rows)


def _neighbours(group: ProcessGroup, rank: int, degree: int) -> tuple[int, int]:
    """The global ranks after and before ``rank`` in the group's ring."""
    return dist.get_global_rank(group, (rank + 1) % degree), dist.get_global_rank(group, (rank - 1) % degree)


def _exchange(
    sent: torch.Tensor, received: torch.Tensor, right: int, left: int, group: ProcessGroup
) -> list[dist.Work]:
    """Start sending ``sent`` to ``right`` and receiving ``received`` from ``left``."""
    operations = [dist.P2POp(dist.isend, sent, right, group), dist.P2POp(dist.irecv, received, left, group)]
    return dist.batch_isend_irecv(operations)
