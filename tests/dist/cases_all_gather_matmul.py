"""Rank-side case of ``test_tensor_parallel_ops``: the column-parallel matmul fused with its input's
all-gather (``partita::all_gather_matmul``, every block counted as large enough) against the two
ops it replaces, and as those two ops (these blocks are below the thresholds).

Each check is a ``(label, got, want)`` triple, compared by the test process."""

from __future__ import annotations

import contextlib
import functools

import torch

F64 = torch.float64


def case_all_gather_matmul(group, rank: int, degree: int) -> list:
    import partita.cost.collective_matmul as collective_costs

    default = (collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES)
    out = []
    try:
        for ring in (True, False):
            collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES = (0, 0) if ring else default
            checks = _checks(group, degree, ring) + _zero_bubble_passes(group, degree, ring)
            out += [(f"{'ring' if ring else 'whole'}: {label}", got, want) for label, got, want in checks]
    finally:
        collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES = default
    return out


def _layer(group):
    from partita.runtime import tensor_parallel_ops as ops

    def layer(x, weight):  # recomputed around the kept fused op
        return torch.tanh(ops.all_gather_matmul(torch.sin(x), weight, False, 0, 1, group))

    return layer


def _checks(group, degree: int, ring: bool) -> list:
    """Forward and both operand gradients (``mm`` and ``linear`` weights, tokens on dim 0 or 1 in
    blocks), under bf16 autocast, and under selective recomputation: the policy keeps its output,
    so the recomputation neither gathers nor multiplies again, and the gradients stay the same."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from partita.runtime import collective_matmul
    from partita.runtime import tensor_parallel_ops as ops
    from partita.runtime.pipeline import selective_policy

    g = torch.Generator().manual_seed(7)
    out = []
    for transposed, dim, blocks in [(False, 0, 1), (True, 1, 2), (False, 1, 3)]:
        tag = f"transposed={transposed} dim={dim} blocks={blocks}"
        shape = [4, 5, 3]
        shape[dim] = blocks * 2  # this rank's tokens: 2 of each block
        x = torch.randn(shape, generator=g, dtype=F64)
        weight = torch.randn((7, 3) if transposed else (3, 7), generator=g, dtype=F64)  # this rank's columns
        out_shape = [*shape[:-1], 7]
        out_shape[dim] *= degree
        upstream = torch.randn(out_shape, generator=g, dtype=F64)

        ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = ops.gather_for_column(ref_x, dim, blocks, group) @ (ref_w.T if transposed else ref_w)
        (ref * upstream).sum().backward()
        fused_x, fused_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with counting_matmuls() as apart:
            fused = ops.all_gather_matmul(fused_x, fused_w, transposed, dim, blocks, group)
        (fused * upstream).sum().backward()
        out += [(f"fused {tag}", fused.detach(), ref.detach())]
        # around the ring a block's product is written in place where its rows are contiguous (tokens
        # on dim 0, one block: the blocks of a micro-batch of one sequence), else formed apart
        in_place = ring and dim == 0 and blocks == 1
        out += [(f"fused {tag} products apart in forward", len(apart), 0 if in_place else degree if ring else 1)]
        out += [(f"fused {tag} input gradient", fused_x.grad, ref_x.grad)]
        out += [(f"fused {tag} weight gradient", fused_w.grad, ref_w.grad)]

    x, weight = torch.randn(2, 3, 5, generator=g), torch.randn(5, 4, generator=g)
    upstream = torch.randn(2 * degree, 3, 4, generator=g, dtype=torch.bfloat16)
    grads = []
    for fused in (False, True):
        leaf_x, leaf_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                y = ops.all_gather_matmul(leaf_x, leaf_w, False, 0, 1, group)
            else:
                y = ops.gather_for_column(leaf_x, 0, 1, group) @ leaf_w
        (y * upstream).sum().backward()
        grads.append((y.detach(), leaf_x.grad, leaf_w.grad))
    out += [("autocast: output dtype", grads[1][0].dtype, torch.bfloat16)]
    out += [(f"autocast: {what}", mine, ref) for what, mine, ref in zip(("output", "x grad", "w grad"), *grads[::-1])]

    forward_runs = []
    matmul, matmul_into = collective_matmul.matmul, collective_matmul.matmul_into

    def counted(a, b, transposed):
        if a.shape[-1] == 3:  # the forward's products (the backward's multiply the 4-wide gradient)
            forward_runs.append(1)
        return matmul(a, b, transposed)

    def counted_into(into, a, b, transposed):  # these rows are contiguous: written in place, no matmul
        if a.shape[-1] == 3:
            forward_runs.append(1)
        return matmul_into(into, a, b, transposed)

    layer = _layer(group)
    x, weight = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    layer(ref_x, ref_w).sum().backward()
    sel_x, sel_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    collective_matmul.matmul, collective_matmul.matmul_into = counted, counted_into
    try:
        loss = checkpoint(layer, sel_x, sel_w, use_reentrant=False, context_fn=contexts).sum()
        in_forward = len(forward_runs)
        loss.backward()
    finally:
        collective_matmul.matmul, collective_matmul.matmul_into = matmul, matmul_into
    # around the ring: one product per rank's block, and the recomputation takes the op's output
    # from the cache without entering it; whole, the recomputation runs the Python again (its
    # ``mm`` is the policy's, cached at dispatch) and the all-gather
    return out + [
        ("selective: products in forward", in_forward, degree if ring else 1),
        ("selective: none again in backward", len(forward_runs), degree if ring else 2),
        ("selective: input gradient", sel_x.grad, ref_x.grad),
        ("selective: weight gradient", sel_w.grad, ref_w.grad),
    ]


@contextlib.contextmanager
def counting_matmuls():
    """The calls of ``partita.runtime.collective_matmul.matmul`` (products formed apart, not written in
    place) while the context is open, as a list that grows by one per call."""
    from partita.runtime import collective_matmul

    calls, matmul = [], collective_matmul.matmul

    def counted(*args):
        calls.append(1)
        return matmul(*args)

    collective_matmul.matmul = counted
    try:
        yield calls
    finally:
        collective_matmul.matmul = matmul


def _zero_bubble_passes(group, degree: int, ring: bool) -> list:
    """What each backward pass runs, in order. One whole backward: around the ring the kept tokens
    are all-gathered while the input gradient's product is formed, which is reduce-scattered while
    the weight gradient is formed (waited for after it). A zero-bubble schedule's two passes: the
    input pass gathers the kept tokens once and waits for the input gradient's reduce-scatter, the
    weight pass forms the weight gradient from them without communicating. Whole (two ops), the
    matmul kept the gathered input: neither pass gathers, the input pass reduce-scatters. Every way
    the gradients of one whole backward."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from partita.runtime import collective_matmul
    from partita.runtime import tensor_parallel_ops as ops

    g = torch.Generator().manual_seed(8)
    layer = _layer(group)
    x, weight = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    ref_x, ref_w = x.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    layer(ref_x, ref_w).sum().backward()
    one_x, one_w = x.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    zb_x, zb_w = x.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    one_loss, zb_loss = layer(one_x, one_w).sum(), layer(zb_x, zb_w).sum()  # the forwards, not recorded
    events = []
    originals = collective_matmul.weight_gradient, ops._start_gathering, ops._start_reduce_scatter

    def weight_gradient(*args):
        events.append("weight gradient")
        return originals[0](*args)

    def gather(*args):
        events.append("all-gather of the kept tokens")
        return originals[1](*args)

    def reduce_scatter(*args):
        events.append("reduce-scatter started")
        finish = originals[2](*args)

        def waited():
            events.append("reduce-scatter waited")
            return finish()

        return waited

    collective_matmul.weight_gradient, ops._start_gathering, ops._start_reduce_scatter = (
        weight_gradient,
        gather,
        reduce_scatter,
    )
    try:
        one_loss.backward()
        events.append("one backward done")
        _, param_groups = stage_backward_input([zb_loss], None, [zb_x], iter([zb_w]))
        events.append("input pass done")
        stage_backward_weight(iter([zb_w]), param_groups)
    finally:
        collective_matmul.weight_gradient, ops._start_gathering, ops._start_reduce_scatter = originals
    scattered = ["reduce-scatter started", "reduce-scatter waited"]
    if ring:
        gathered = "all-gather of the kept tokens"
        together = [gathered, "reduce-scatter started", "weight gradient", "reduce-scatter waited"]
        want = [*together, "one backward done", gathered, *scattered, "input pass done", "weight gradient"]
    else:  # the all-gather's backward reduce-scatters; an aten matmul forms both gradients
        want = [*scattered, "one backward done", *scattered, "input pass done"]
    return [
        ("backward passes: what each runs, in order", events, want),
        ("one backward: input gradient", one_x.grad, ref_x.grad),
        ("one backward: weight gradient", one_w.grad, ref_w.grad),
        ("zero bubble: input gradient", zb_x.grad, ref_x.grad),
        ("zero bubble: weight gradient", zb_w.grad, ref_w.grad),
    ]
