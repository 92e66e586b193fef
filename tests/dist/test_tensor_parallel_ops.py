"""The tensor-parallel collectives (partita.runtime.tensor_parallel_ops) on 2 and 4 gloo ranks: every
op's forward and input gradients equal the unsplit computation's, on the meta device they give the
right shapes without communicating, and they run as call_function targets of a GraphModule.

This file also holds the ranks' side (``job_ops``, a job of the shared launches, dist_launch.py): one
job per world size runs every case on every tensor-parallel group (all ranks, and on 4 ranks also
groups of 2, where a rank's index in its group is not its global rank). Each case returns
``(label, got, want)`` triples; the test process compares them, so a failure lists every mismatch of
the case at once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cases_all_gather_matmul import case_all_gather_matmul, counting_matmuls
from dist_launch import Job

TIMEOUT_S = 120
F64 = torch.float64
TOLERANCE = {  # keyed by the wanted value's dtype
    torch.float64: dict(rtol=1e-9, atol=1e-9),
    torch.float32: dict(rtol=1e-6, atol=1e-6),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5),  # one bf16 rounding of the same float32 gradient
}
VOCAB_SIZES = {2: [6, 5], 4: [3, 2, 4, 3]}  # rows (embedding) or columns (logits) per rank: uneven on purpose


# ----------------------------------------------------------------------------- rank-side cases


def case_copy_and_reduce(group, rank: int, degree: int) -> list:
    """f and g alone, then as Megatron's MLP: reduce(gelu(copy(x) @ W1_r.T) @ W2_r.T)."""
    from partita.runtime import tensor_parallel_ops as ops

    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g, dtype=F64)
    upstreams = torch.randn(degree, 3, 4, generator=g, dtype=F64)  # a different gradient on each rank
    leaf = x.clone().requires_grad_()
    y = ops.copy_to_group(leaf, group)
    (y * upstreams[rank]).sum().backward()
    out = [("copy forward", y.detach(), x), ("copy backward sums the ranks' gradients", leaf.grad, upstreams.sum(0))]

    parts, upstream = torch.randn(degree, 3, 4, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    leaf = parts[rank].clone().requires_grad_()
    y = ops.reduce_from_group(leaf, group)
    (y * upstream).sum().backward()
    out += [("reduce forward", y.detach(), parts.sum(0)), ("reduce leaves its input", leaf.detach(), parts[rank])]
    out.append(("reduce backward", leaf.grad, upstream))

    hidden = 4 * degree
    full = [torch.randn(*shape, generator=g, dtype=F64) for shape in [(5, 6), (hidden, 6), (6, hidden)]]
    upstream = torch.randn(5, 6, generator=g, dtype=F64)
    ref_x, ref_w1, ref_w2 = (t.clone().requires_grad_() for t in full)
    ref = F.gelu(ref_x @ ref_w1.T) @ ref_w2.T  # (5, 6)
    (ref * upstream).sum().backward()
    mine = slice(rank * 4, (rank + 1) * 4)  # hidden units: rows of W1 (column-parallel), columns of W2 (row-parallel)
    x_, w1, w2 = (t.clone().requires_grad_() for t in (full[0], full[1][mine], full[2][:, mine]))
    y = ops.reduce_from_group(F.gelu(ops.copy_to_group(x_, group) @ w1.T) @ w2.T, group)
    (y * upstream).sum().backward()
    return out + [
        ("mlp forward", y.detach(), ref.detach()),
        ("mlp input gradient", x_.grad, ref_x.grad),
        ("mlp W1 gradient", w1.grad, ref_w1.grad[mine]),
        ("mlp W2 gradient", w2.grad, ref_w2.grad[:, mine]),
    ]


def block_index(size: int, blocks: int, degree: int, rank: int) -> torch.Tensor:
    """The indices along a split dim that ``rank`` holds in the block layout, written out one by one."""
    block, part = size // blocks, size // (blocks * degree)
    return torch.tensor([b * block + rank * part + j for b in range(blocks) for j in range(part)])


def case_scatter_gather(group, rank: int, degree: int) -> list:
    from partita.runtime import tensor_parallel_ops as ops

    g = torch.Generator().manual_seed(2)
    out = []
    for dim, blocks in [(0, 1), (1, 3), (-1, 3), (-1, 1)]:
        shape = [2, 3, 5]
        shape[dim] = blocks * degree * 2
        full, upstream = torch.randn(shape, generator=g, dtype=F64), torch.randn(shape, generator=g, dtype=F64)
        index = block_index(shape[dim], blocks, degree, rank)
        tag = f"dim={dim} blocks={blocks}"

        leaf = full.clone().requires_grad_()
        part = ops.scatter_to_group(leaf, dim, blocks, group)
        (part * upstream.index_select(dim, index)).sum().backward()
        out += [(f"scatter {tag}", part.detach(), full.index_select(dim, index))]
        out += [(f"scatter {tag} is contiguous", part.is_contiguous(), True)]
        out += [(f"scatter {tag} backward gathers", leaf.grad, upstream)]

        leaf = full.index_select(dim, index).requires_grad_()
        whole = ops.gather_from_group(leaf, dim, blocks, group)
        (whole * upstream).sum().backward()
        out += [
            (f"gather {tag}", whole.detach(), full),
            (f"gather {tag} backward", leaf.grad, upstream.index_select(dim, index)),
        ]
        round_trip = ops.gather_from_group(ops.scatter_to_group(full, dim, blocks, group), dim, blocks, group)
        out += [(f"gather(scatter) {tag}", round_trip, full)]
    return out


def case_matmul_reduce_scatter(group, rank: int, degree: int) -> list:
    """``_matmul_reduce_scatter_checks`` computed block by block around the ring (every block counts
    as large enough) and whole (these blocks are below the thresholds)."""
    import partita.cost.collective_matmul as collective_costs

    default = (collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES)
    out = []
    try:
        for ring in (True, False):
            collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES = (0, 0) if ring else default
            checks = _matmul_reduce_scatter_checks(group, rank, degree, ring)
            out += [(f"{'ring' if ring else 'whole'}: {label}", got, want) for label, got, want in checks]
    finally:
        collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES = default
    return out


def _matmul_reduce_scatter_checks(group, rank: int, degree: int, ring: bool) -> list:
    """The fused row-parallel matmul + reduce-scatter against the two ops it replaces (forward and both
    operand gradients, ``mm`` and ``linear`` weights, tokens on dim 0 or 1 in blocks), and under
    selective recomputation: the policy keeps its output, so backward neither multiplies nor
    communicates again, and the gradients stay those of the unchecked run."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from partita.runtime import collective_matmul
    from partita.runtime import tensor_parallel_ops as ops
    from partita.runtime.pipeline import selective_policy

    g = torch.Generator().manual_seed(6)
    out = []
    for transposed, dim, blocks in [(False, 0, 1), (True, 1, 2), (False, 1, 3)]:
        tag = f"transposed={transposed} dim={dim} blocks={blocks}"
        shape = [4, 5, 3]
        shape[dim] = blocks * degree * 2
        x = torch.randn(shape, generator=g, dtype=F64)  # this rank's features of the contraction
        weight = torch.randn((7, 3) if transposed else (3, 7), generator=g, dtype=F64)
        out_shape = [*shape[:-1], 7]
        out_shape[dim] //= degree
        upstream = torch.randn(out_shape, generator=g, dtype=F64)

        ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        ref = ops.reduce_scatter_to_group(ref_x @ (ref_w.T if transposed else ref_w), dim, blocks, group)
        (ref * upstream).sum().backward()
        fused_x, fused_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with counting_matmuls() as apart:
            fused = ops.matmul_reduce_scatter(fused_x, fused_w, transposed, dim, blocks, group)
            in_forward = len(apart)
            (fused * upstream).sum().backward()
        out += [(f"fused {tag}", fused.detach(), ref.detach())]
        # around the ring a block's input gradient is written in place where its rows are contiguous
        # (tokens on dim 0, one block: the blocks of a micro-batch of one sequence), else formed apart
        in_place = ring and dim == 0 and blocks == 1
        out += [(f"fused {tag} products apart (forward, backward)", (in_forward, len(apart) - in_forward),
                 (degree if ring else 1, degree if ring and not in_place else 0))]
        out += [(f"fused {tag} input gradient", fused_x.grad, ref_x.grad)]
        out += [(f"fused {tag} weight gradient", fused_w.grad, ref_w.grad)]

    # under bf16 autocast: both operands cast as autocast casts mm's (the gradients reach the fp32 leaves)
    x, weight = torch.randn(2 * degree, 3, 5, generator=g), torch.randn(5, 4, generator=g)
    upstream = torch.randn(2, 3, 4, generator=g, dtype=torch.bfloat16)
    grads = []
    for fused in (False, True):
        leaf_x, leaf_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                y = ops.matmul_reduce_scatter(leaf_x, leaf_w, False, 0, 1, group)
            else:
                y = ops.reduce_scatter_to_group(leaf_x @ leaf_w, 0, 1, group)
        (y * upstream).sum().backward()
        grads.append((y.detach(), leaf_x.grad, leaf_w.grad))
    out += [("autocast: output dtype", grads[1][0].dtype, torch.bfloat16)]
    out += [(f"autocast: {what}", mine, ref) for what, mine, ref in zip(("output", "x grad", "w grad"), *grads[::-1])]

    runs = []
    matmul = collective_matmul.matmul

    def counted(*args):
        runs.append(1)
        return matmul(*args)

    def layer(x, weight):  # recomputed around the kept fused op
        return torch.tanh(ops.matmul_reduce_scatter(torch.sin(x), weight, False, 0, 1, group))

    x, weight = torch.randn(2 * degree, 3, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    layer(ref_x, ref_w).sum().backward()
    sel_x, sel_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)
    collective_matmul.matmul = counted
    try:
        loss = checkpoint(layer, sel_x, sel_w, use_reentrant=False, context_fn=contexts).sum()
        forward_runs = len(runs)
        loss.backward()
    finally:
        collective_matmul.matmul = matmul
    runs_in_forward = degree if ring else 1  # one matmul per block of the ring
    out += [
        ("selective: runs in forward", forward_runs, runs_in_forward),
        ("selective: not again in backward", len(runs), runs_in_forward),
    ]
    out += [
        ("selective: input gradient", sel_x.grad, ref_x.grad),
        ("selective: weight gradient", sel_w.grad, ref_w.grad),
    ]
    return out + _zero_bubble_passes(group, degree, layer, g, ring)


def _zero_bubble_passes(group, degree: int, layer, g: torch.Generator, ring: bool) -> list:
    """The fused op under a zero-bubble schedule's two backward passes (torch.distributed.pipelining's
    ``stage_backward_input`` then ``stage_backward_weight``): the input pass gathers the gradient once
    and forms the input gradient, the weight pass forms the weight gradient from what the input pass
    kept, without communicating; together the gradients of one whole backward."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from partita.runtime import collective_matmul

    x, weight = torch.randn(2 * degree, 3, generator=g, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)
    ref_x, ref_w = x.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    layer(ref_x, ref_w).sum().backward()
    zb_x, zb_w = x.clone().requires_grad_(), torch.nn.Parameter(weight.clone())
    events = []
    originals = collective_matmul.gather_gradient, collective_matmul.weight_gradient

    def gather(*args):
        events.append(("gather", "with the input gradient" if args[2] is not None else "alone"))
        return originals[0](*args)

    def weight_gradient(*args):
        events.append(("weight gradient",))
        return originals[1](*args)

    collective_matmul.gather_gradient, collective_matmul.weight_gradient = gather, weight_gradient
    try:
        _, param_groups = stage_backward_input([layer(zb_x, zb_w).sum()], None, [zb_x], iter([zb_w]))
        events.append(("input pass done",))
        stage_backward_weight(iter([zb_w]), param_groups)
    finally:
        collective_matmul.gather_gradient, collective_matmul.weight_gradient = originals
    gathered = [("gather", "with the input gradient")] if ring else []  # whole: one all-gather
    want = [*gathered, ("input pass done",), ("weight gradient",)]
    return [
        ("zero bubble: what each pass runs", events, want),
        ("zero bubble: input gradient", zb_x.grad, ref_x.grad),
        ("zero bubble: weight gradient", zb_w.grad, ref_w.grad),
    ]


def case_embedding(group, rank: int, degree: int) -> list:
    from partita.runtime import tensor_parallel_ops as ops

    sizes = VOCAB_SIZES[degree]
    vocab, start = sum(sizes), sum(sizes[:rank])
    rows = slice(start, start + sizes[rank])
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(vocab, 4, generator=g, dtype=F64)
    ids = torch.randint(0, vocab, (3, 7), generator=g)
    first_rank_row, last_rank_row = 1, vocab - 2  # local to rank 0, local to the last rank
    ids[0, :2] = torch.tensor([first_rank_row, last_rank_row])
    upstream = torch.randn(3, 7, 4, generator=g, dtype=F64)
    out = []
    for padding_idx in (None, -1, first_rank_row, last_rank_row):
        ref_weight = weight.clone().requires_grad_()
        ref = torch.ops.aten.embedding(ref_weight, ids, -1 if padding_idx is None else padding_idx)
        (ref * upstream).sum().backward()
        local = weight[rows].clone().requires_grad_()
        y = ops.vocab_parallel_embedding(local, ids, start, padding_idx, group)
        (y * upstream).sum().backward()
        out += [(f"embedding padding_idx={padding_idx}", y.detach(), ref.detach())]
        out += [(f"embedding padding_idx={padding_idx} gradient", local.grad, ref_weight.grad[rows])]
    return out


def case_cross_entropy(group, rank: int, degree: int) -> list:
    from partita.runtime import tensor_parallel_ops as ops

    sizes = VOCAB_SIZES[degree]
    vocab, start = sum(sizes), sum(sizes[:rank])
    cols = slice(start, start + sizes[rank])
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(13, vocab, generator=g, dtype=F64)
    target = torch.randint(0, vocab, (13,), generator=g)
    target[[2, 5, 11]] = -100
    target[0] = 3
    logits_3d = torch.randn(4, vocab, 3, generator=g, dtype=F64)
    target_2d = torch.randint(0, vocab, (4, 3), generator=g)
    target_2d[1, 2] = -100
    everything_ignored = torch.full((13,), -100)
    runs = [
        (dtype, logits, target, reduction, -100)
        for dtype in (F64, torch.float32, torch.bfloat16)
        for reduction in (0, 1, 2)
    ]
    runs += [(torch.float32, 40 * logits, target, 1, -100)]  # exp would overflow without the max
    runs += [(F64, logits, target.masked_fill(target < 0, 4), 1, 3)]  # ignore_index a real class
    runs += [(F64, logits, everything_ignored, reduction, -100) for reduction in (0, 1, 2)]  # mean: NaN, no gradient
    runs += [(F64, logits_3d, target_2d, reduction, -100) for reduction in (0, 1)]  # (N, V, d1): class dim 1
    out = []
    for dtype, full, tgt, reduction, ignore_index in runs:
        tag = f"cross-entropy {dtype} {tuple(full.shape)} reduction={reduction} ignore_index={ignore_index}"
        if tgt is everything_ignored:
            tag += " all ignored"
        ref_logits = full.to(dtype, copy=True).requires_grad_()
        compute = torch.promote_types(dtype, torch.float32)  # autocast: cross-entropy in float32
        ref = torch.ops.aten.cross_entropy_loss(ref_logits.to(compute), tgt, None, reduction, ignore_index, 0.0)
        upstream = torch.randn(ref.shape, generator=g, dtype=compute)
        (ref * upstream).sum().backward()
        local = full[:, cols].to(dtype, copy=True).requires_grad_()
        loss = ops.vocab_parallel_cross_entropy(local, tgt, start, reduction, ignore_index, group)
        (loss * upstream).sum().backward()
        out += [(tag, loss.detach(), ref.detach()), (f"{tag} gradient", local.grad, ref_logits.grad[:, cols])]
    return out


def case_meta(group, rank: int, degree: int) -> list:
    """Shapes and dtypes of every op and its gradient on meta, with no collective called; user errors."""
    import torch.distributed as dist

    from partita.errors import InputError
    from partita.runtime import tensor_parallel_ops as ops

    called = []

    def counted(name, original):
        def collective(*args, **kwargs):
            called.append(name)
            return original(*args, **kwargs)

        return collective

    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor")}
    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        got, want = [], []

        def record(label, y, leaf, want_shape, want_grad_shape, want_dtype=F64):
            y.sum().backward()
            got.append((label, tuple(y.shape), y.dtype, y.device.type, tuple(leaf.grad.shape), leaf.grad.dtype))
            want.append((label, want_shape, want_dtype, "meta", want_grad_shape, leaf.dtype))

        meta = dict(device="meta", dtype=F64, requires_grad=True)
        x = torch.empty(3, 4, **meta)
        record("copy", ops.copy_to_group(x, group), x, (3, 4), (3, 4))
        x = torch.empty(3, 4, **meta)
        record("reduce", ops.reduce_from_group(x, group), x, (3, 4), (3, 4))
        x = torch.empty(2, 6 * degree, 5, **meta)
        record("scatter", ops.scatter_to_group(x, 1, 3, group), x, (2, 6, 5), (2, 6 * degree, 5))
        x = torch.empty(2, 6, 5, **meta)
        record("gather", ops.gather_from_group(x, -2, 3, group), x, (2, 6 * degree, 5), (2, 6, 5))
        x, weight = torch.empty(2, 6, 5, **meta), torch.empty(5, 4, **meta)
        record("all-gather matmul", ops.all_gather_matmul(x, weight, False, 1, 3, group), x, (2, 6 * degree, 4), (2, 6, 5))
        weight, ids = torch.empty(5, 4, **meta), torch.zeros(3, 7, dtype=torch.long, device="meta")
        record("embedding", ops.vocab_parallel_embedding(weight, ids, 5 * rank, 2, group), weight, (3, 7, 4), (5, 4))
        target = torch.zeros(13, dtype=torch.long, device="meta")
        for reduction, shape in [(0, (13,)), (1, ()), (2, ())]:
            logits = torch.empty(13, 5, device="meta", dtype=torch.bfloat16, requires_grad=True)
            loss = ops.vocab_parallel_cross_entropy(logits, target, 5 * rank, reduction, -100, group)
            record(f"cross-entropy reduction={reduction}", loss, logits, shape, (13, 5), torch.float32)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    out = [("meta shapes and dtypes", got, want), ("collectives called on meta", called, [])]

    def error(call) -> str:
        try:
            call()
        except InputError as e:
            return str(e)
        return "no InputError"

    indivisible = error(lambda: ops.scatter_to_group(torch.empty(2, 3 * degree + 1, device="meta"), 1, 3, group))
    out += [("scatter of an indivisible dim", "must be a multiple of blocks * ranks" in indivisible, True)]
    logits, target = torch.empty(2, 5, device="meta"), torch.zeros(2, dtype=torch.long, device="meta")
    reduction = error(lambda: ops.vocab_parallel_cross_entropy(logits, target, 0, 3, -100, group))
    out += [("unknown reduction", "use 0 (none), 1 (mean) or 2 (sum)" in reduction, True)]
    padding = error(lambda: ops.vocab_parallel_embedding(logits, target, 0, -2, group))
    return out + [("negative padding_idx", "padding_idx=-2 is negative" in padding, True)]


def case_fx(group, rank: int, degree: int) -> list:
    """The ops as call_function targets of a GraphModule, the group given by name or by get_attr."""
    from torch import fx

    from partita.runtime import tensor_parallel_ops as ops

    graph = fx.Graph()
    x, logits, target = graph.placeholder("x"), graph.placeholder("logits"), graph.placeholder("target")
    name = group.group_name
    part = graph.call_function(ops.scatter_to_group, (x, 1, 3, name))
    whole = graph.call_function(ops.gather_from_group, (part, 1, 3, name))
    summed = graph.call_function(ops.reduce_from_group, (graph.call_function(ops.copy_to_group, (whole, name)), name))
    loss = graph.call_function(ops.vocab_parallel_cross_entropy, (logits, target, 2 * rank, 1, -100, name))
    graph.output((summed, loss))
    by_name = fx.GraphModule(torch.nn.Module(), graph)

    root = torch.nn.Module()
    root.tp_group = group
    graph = fx.Graph()
    x_node = graph.placeholder("x")
    graph.output(graph.call_function(ops.reduce_from_group, (x_node, graph.get_attr("tp_group"))))
    by_attr = fx.GraphModule(root, graph)

    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 6 * degree, generator=g, dtype=F64)
    logits, target = torch.randn(4, 2 * degree, generator=g, dtype=F64), torch.tensor([0, 1, -100, 2 * degree - 1])
    local = logits[:, 2 * rank : 2 * rank + 2]
    want_loss = torch.ops.aten.cross_entropy_loss(logits, target, None, 1, -100, 0.0)
    got_sum, got_loss = by_name(x, local, target)
    return [
        ("graph with group name: all ops", got_sum, degree * x),
        ("graph with group name: cross-entropy", got_loss, want_loss),
        ("graph with get_attr group", by_attr(x), degree * x),
    ]


CASES = {
    "copy_and_reduce": case_copy_and_reduce,
    "scatter_gather": case_scatter_gather,
    "matmul_reduce_scatter": case_matmul_reduce_scatter,
    "all_gather_matmul": case_all_gather_matmul,
    "embedding": case_embedding,
    "cross_entropy": case_cross_entropy,
    "fx": case_fx,
}


def job_ops(params: dict) -> dict:
    """Every case on this rank's group of each size in ``params["degrees"]``: {(degree, case): triples};
    with ``params["meta"]``, the meta case on rank 0 too, as ``(degree, "meta")``."""
    import torch.distributed as dist

    world_size, global_rank = dist.get_world_size(), dist.get_rank()
    results = {}
    for degree in params["degrees"]:
        # every rank creates every group, in the same order
        groups = [dist.new_group(list(range(first, first + degree))) for first in range(0, world_size, degree)]
        group = groups[global_rank // degree]
        for name, case in CASES.items():
            results[degree, name] = case(group, dist.get_rank(group), degree)
        # on one rank of one job: meta runs no collective, and a process's first meta op costs ~2 s
        # (it imports torch._dynamo), which every rank would pay on the shared cores
        if params["meta"] and global_rank == 0:
            results[degree, "meta"] = case_meta(group, dist.get_rank(group), degree)
    return results


# ----------------------------------------------------------------------------- tests

CONFIGS = [(2, 2), (4, 4), (4, 2)]  # (world size, tensor-parallel degree)
# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "ranks2": Job("test_tensor_parallel_ops:job_ops", 2, TIMEOUT_S, dict(degrees=[2], meta=True)),
    "ranks4": Job("test_tensor_parallel_ops:job_ops", 4, TIMEOUT_S, dict(degrees=[4, 2], meta=False)),
}


@pytest.fixture(scope="module")
def ranks2(launches):
    return launches.results_of(__name__, "ranks2")


@pytest.fixture(scope="module")
def ranks4(launches):
    return launches.results_of(__name__, "ranks4")


def mismatches(triples: list, rank: int) -> list[str]:
    found = []
    for label, got, want in triples:
        if isinstance(want, torch.Tensor):
            try:
                torch.testing.assert_close(got, want, equal_nan=True, **TOLERANCE[want.dtype])
            except AssertionError as e:
                found.append(f"rank {rank}, {label}: {e}")
        elif got != want:
            found.append(f"rank {rank}, {label}: got {got!r}, want {want!r}")
    return found


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world_size,degree", CONFIGS, ids=[f"{w}ranks-tp{d}" for w, d in CONFIGS])
def test_matches_unsplit(ranks2, ranks4, world_size: int, degree: int, case: str):
    results = {2: ranks2, 4: ranks4}[world_size]
    found = [message for rank, result in enumerate(results) for message in mismatches(result[degree, case], rank)]
    assert not found, "\n".join(found)


def test_meta_device(ranks2):
    """Shapes and dtypes of every op and its gradient on meta, no collective called; the user errors."""
    found = mismatches(ranks2[0][2, "meta"], 0)
    assert not found, "\n".join(found)
