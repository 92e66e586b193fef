"""Tensor parallelism at run time, the graph side: insert the collectives of a stage's layout into its
FX graph (``rewrite_stage``), and run a rewritten stage on whole boundary values (``run_whole``).

The functions the rewritten graphs call (``copy_in``, ``reduce_out``, ``gather_tokens``, ...) are
module-level, so that a graph holds them as ``call_function`` targets; each takes the group as its
``TensorParallel.key`` (an int) and wraps an autograd-aware collective of ``tensor_parallel_ops``.
``partita.runtime.tensor_parallel`` has the layouts, the weights' parts and the trainer's part.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from partita.capturing.sequence_parallel import broadcast_only
from partita.capturing.tensor_parallel import TensorParallelAnalysis
from partita.capturing.tensor_parallel_graph import matmul_operands, tensor_positions
from partita.runtime import tensor_parallel_ops as ops
from partita.runtime.stages import StageModule
from partita.runtime.tensor_parallel import TensorParallel, process_group

__all__ = ["partial_gradients", "rewrite_stage", "run_whole"]

aten = torch.ops.aten


# ----------------------------------------------------------------------------- graph rewriting


def copy_in(x: torch.Tensor, key: int) -> torch.Tensor:
    return ops.copy_to_group(x, process_group(key))


def reduce_out(x: torch.Tensor, key: int) -> torch.Tensor:
    return ops.reduce_from_group(x, process_group(key))


def scatter_in(x: torch.Tensor, dim: int, blocks: int, key: int) -> torch.Tensor:
    return ops.scatter_to_group(x, dim, blocks, process_group(key))


def embedding(weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, key: int) -> torch.Tensor:
    group = process_group(key)
    start = dist.get_rank(group) * weight.shape[0] if weight.device.type != "meta" else 0
    return ops.vocab_parallel_embedding(weight, ids, start, padding_idx, group)


def cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, reduction: int, ignore_index: int, classes: int, key: int
) -> Any:
    group = process_group(key)
    start = dist.get_rank(group) * logits.shape[-1] if logits.device.type != "meta" else 0
    held = min(logits.shape[-1], max(classes - start, 0))  # a padded last part: the real columns only
    if held < logits.shape[-1]:
        logits = logits.narrow(-1, 0, held)
    return ops.vocab_parallel_cross_entropy(logits, target, start, reduction, ignore_index, group)


def scatter_tokens(x: torch.Tensor, dim: int, inner: int, key: int) -> torch.Tensor:
    """This rank's tokens of a whole ``x`` (``TokenSplit``: dim ``dim`` viewed as ``(-1, inner)``)."""
    return ops.scatter_to_group(x, dim, x.shape[dim] // inner, process_group(key))


def gather_tokens(x: torch.Tensor, dim: int, inner: int, key: int) -> torch.Tensor:
    """The whole of a token-split ``x``, for a consumer that computes whole (backward: this rank's part)."""
    group = process_group(key)
    return ops.gather_from_group(x, dim, x.shape[dim] * dist.get_world_size(group) // inner, group)


def gather_column(x: torch.Tensor, dim: int, inner: int, key: int) -> torch.Tensor:
    """The whole of a token-split ``x`` for column-parallel matmuls (backward: reduce-scatter)."""
    group = process_group(key)
    return ops.gather_for_column(x, dim, x.shape[dim] * dist.get_world_size(group) // inner, group)


def reduce_scatter_out(x: torch.Tensor, dim: int, inner: int, key: int) -> torch.Tensor:
    """This rank's tokens of the sum of the group's partial ``x`` (a row-parallel matmul's output)."""
    return ops.reduce_scatter_to_group(x, dim, x.shape[dim] // inner, process_group(key))


def matmul_reduce_scatter_out(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, inner: int, key: int
) -> torch.Tensor:
    """``reduce_scatter_out`` of the row-parallel ``x @ weight`` (``weight.T``: ``transposed``), as one op
    (``ops.matmul_reduce_scatter``: what selective recomputation keeps is this rank's tokens)."""
    return ops.matmul_reduce_scatter(x, weight, transposed, dim, x.shape[dim] // inner, process_group(key))


def gather_matmul_out(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, dim: int, inner: int, key: int
) -> torch.Tensor:
    """The column-parallel ``gather_column(x) @ weight`` (``weight.T``: ``transposed``), one op where its
    blocks are large enough (``ops.all_gather_matmul``: it then keeps this rank's tokens of ``x``)."""
    group = process_group(key)
    blocks = x.shape[dim] * dist.get_world_size(group) // inner
    return ops.all_gather_matmul(x, weight, transposed, dim, blocks, group)


def embedding_scattered(
    weight: torch.Tensor, ids: torch.Tensor, padding_idx: int, dim: int, inner: int, key: int
) -> torch.Tensor:
    """A vocab-parallel embedding whose output is reduce-scattered by token (not all-reduced)."""
    group = process_group(key)
    start = dist.get_rank(group) * weight.shape[0] if weight.device.type != "meta" else 0
    partial = ops.vocab_parallel_embedding_partial(weight, ids, start, padding_idx)
    return reduce_scatter_out(partial, dim, inner, key)


def run_whole(tp: TensorParallel, stage: StageModule, received: Sequence[Any], graph_inputs: Sequence[Any]) -> Any:
    """Run a rewritten ``stage`` on whole boundary values and return whole ones: its received values
    that travel in part sliced to this rank's, the outputs sent in part gathered whole. What
    ``stage_metadata`` needs, which runs every stage in sequence (this rank's rewritten ones among
    the others, whole) and records the whole shapes (``TensorParallel.boundary_shapes`` makes
    the parts')."""
    k = stage.spec.index
    arriving = tp.sent_in_part(k - 1) if k > 0 else {}
    received = [
        scatter_tokens(x, split.dim, split.inner, tp.key) if (split := arriving.get(name)) is not None else x
        for name, x in zip(stage.spec.input_names, received)
    ]
    out = stage(*received, *graph_inputs)
    if stage.spec.is_last:
        return out
    leaving = tp.sent_in_part(k)
    return tuple(
        gather_tokens(x, split.dim, split.inner, tp.key) if (split := leaving.get(name)) is not None else x
        for name, x in zip(stage.spec.output_names, out)
    )


def partial_gradients(stages: Sequence[StageModule], tp: TensorParallel) -> frozenset[str]:
    """The trainable parameters (canonical names) that every use in ``stages`` (this rank's) reads
    broadcast over the tokens of a sequence-parallel value (``broadcast_only``: norms' weights and
    biases, row-parallel matmuls' biases, added to their reduce-scattered sums). ``rewrite_stage``
    then leaves their gradients as each rank's tokens' part, which the trainer sums over the group
    once per step (``GradientSync.sum_over``), not per micro-batch. Read before the rewrite."""
    if not tp.sequence_parallel:
        return frozenset()
    partial: dict[str, bool] = {}
    for stage in stages:
        analysis = tp.analyses.get(stage.spec.index)
        if analysis is None or not _rewritten(analysis, sequence_parallel=True) or analysis.sequence is None:
            for name in stage.spec.param_names:
                partial[name] = False
            continue
        placeholders = _parameter_placeholders(stage)
        found = broadcast_only(placeholders, analysis.sequence, also=_row_biases(stage, analysis))
        trainable = {name for name, p in stage.named_parameters() if p.requires_grad}
        for node, name in placeholders.items():
            partial[name] = partial.get(name, True) and node.name in found and name in trainable
    return frozenset(name for name, is_partial in partial.items() if is_partial)


def _rewritten(analysis: TensorParallelAnalysis, sequence_parallel: bool) -> bool:
    """Whether a stage's graph gets collectives: it splits a weight, or, under sequence parallelism,
    a value by token. A stage that splits no weight (a head over a vocabulary left whole, after a
    cut just before the final norm) still takes its part of a value it receives split, and gathers
    it whole for what runs whole."""
    sequence = analysis.sequence if sequence_parallel else None
    return not analysis.layout.is_trivial or (sequence is not None and not sequence.is_trivial)


def rewrite_stage(stage: StageModule, tp: TensorParallel, partial: frozenset[str] = frozenset()) -> None:
    """Insert the collectives of the stage's layout into its graph (in place, recompiled), and those
    of its sequence parallelism (``TensorParallelAnalysis.sequence``) where the plan has it. Under
    sequence parallelism each row-parallel matmul runs fused with its reduce-scatter
    (``matmul_reduce_scatter_out``), and a column-parallel matmul that alone reads a value with the
    all-gather of that value (``gather_matmul_out``): the transfers overlap the matmul, and
    selective recomputation keeps the token parts and runs neither again. The gradients of the
    parameters named in ``partial`` (``partial_gradients``) are left as this rank's part."""
    analysis = tp.analyses[stage.spec.index]
    if not _rewritten(analysis, tp.sequence_parallel):
        return
    sequence = analysis.sequence if tp.sequence_parallel else None
    gm = stage.graph_module
    g = gm.graph
    nodes = {n.name: n for n in g.nodes}
    key = tp.key
    fused = sequence.fused_columns if sequence is not None else {}
    left_partial = {node.name for node, name in _parameter_placeholders(stage).items() if name in partial}
    for name in sorted(analysis.copies):
        x = nodes[name]
        columns = [u for u in x.users if analysis.kinds.get(u.name) == "column"]
        split = sequence.column_gathers.get(name) if sequence is not None else None
        if name in fused:  # gathered by its one matmul
            _column(g, nodes[fused[name]], key, split)
            continue
        with g.inserting_after(x):  # the input of column-parallel matmuls: copied, or gathered by token
            if split is None:
                copied = g.call_function(copy_in, (x, key))
            else:
                copied = g.call_function(gather_column, (x, split.dim, split.inner, key))
        for user in columns:
            user.replace_input_with(x, copied)
    for (name, position), (dim, blocks) in analysis.scatters.items():
        node = nodes[name]
        value = _operand(node, position)
        with g.inserting_before(node):
            part = g.call_function(scatter_in, (value, dim, blocks, key))
        _set_operand(node, position, part)
    for name, (position, element) in analysis.resized.items():
        node = nodes[name]
        node.update_arg(position, _divided(node.args[position], element, tp.degree))
    for name, kind in analysis.kinds.items():
        node = nodes[name]
        split = sequence.sources.get(name) if sequence is not None else None
        if kind == "row":
            _row(g, node, key, split, left_partial)
        elif kind == "vocab_embedding":
            padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            if split is None:  # looked up where held and all-reduced: the output is whole
                node.target, node.args, node.kwargs = embedding, (node.args[0], node.args[1], padding, key), {}
            else:  # reduce-scattered: this rank's tokens
                args = (node.args[0], node.args[1], padding, split.dim, split.inner, key)
                node.target, node.args, node.kwargs = embedding_scattered, args, {}
        elif kind == "vocab_cross_entropy":
            args = list(node.args) + [None] * (6 - len(node.args))
            reduction = args[3] if args[3] is not None else node.kwargs.get("reduction", 1)
            ignore = args[4] if args[4] is not None else node.kwargs.get("ignore_index", -100)
            classes = analysis.vocab[name]
            node.target, node.args, node.kwargs = cross_entropy, (args[0], args[1], reduction, ignore, classes, key), {}
    if sequence is not None:
        k = stage.spec.index
        received_in_part = set(tp.sent_in_part(k - 1)) if k > 0 else set()
        sent = tp.sent_in_part(k)
        positions = {i for i, name in enumerate(stage.spec.output_names) if name in sent}
        _rewrite_sequence(g, nodes, sequence, key, tp.degree, received_in_part, positions, left_partial)
    sharded = set(analysis.states) | (set(sequence.states) if sequence is not None else set())
    for node in list(g.nodes):  # shape assertions of split values would name the whole sizes
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_tensor_metadata.default":
            if isinstance(node.args[0], torch.fx.Node) and node.args[0].name in sharded:
                g.erase_node(node)
    g.lint()
    gm.recompile()


def _rewrite_sequence(
    g: torch.fx.Graph,
    nodes: dict,
    sequence: Any,
    key: int,
    degree: int,
    received_in_part: set[str],
    sent_in_part: set[int],
    left_partial: set[str],
) -> None:
    """Sequence parallelism's part of ``rewrite_stage`` besides the row-parallel outputs, embeddings and
    column inputs: received values taken in part (those in ``received_in_part`` arrive so), whole
    operands sliced to this rank's tokens or (broadcast over them) their gradients summed (but for
    the parameters ``left_partial``, by placeholder name), views resized, outputs gathered whole
    (except those at the positions ``sent_in_part``, sent as they are)."""
    for name, split in sequence.sources.items():
        node = nodes[name]
        if node.op != "placeholder" or name in received_in_part:
            continue
        users = list(node.users)
        with g.inserting_after(node):  # stage graphs interleave received placeholders with their wrappers
            part = g.call_function(scatter_tokens, (node, split.dim, split.inner, key))
        for user in users:
            user.replace_input_with(node, part)
    for (name, position), split in sequence.scatters.items():
        node = nodes[name]
        with g.inserting_before(node):
            part = g.call_function(scatter_tokens, (_operand(node, position), split.dim, split.inner, key))
        _set_operand(node, position, part)
    for name, position in sorted(sequence.broadcasts):
        node = nodes[name]
        if getattr(_operand(node, position), "name", None) in left_partial:
            continue
        with g.inserting_before(node):
            summed = g.call_function(copy_in, (_operand(node, position), key))
        _set_operand(node, position, summed)
    for name, dim in sequence.resized.items():
        node = nodes[name]
        sizes = list(node.args[1])
        sizes[dim] //= degree
        node.update_arg(1, sizes)
    gathered: dict[torch.fx.Node, torch.fx.Node] = {}  # one gather per value, whatever its whole consumers

    def whole_of(value: torch.fx.Node, split: Any) -> torch.fx.Node:
        if value not in gathered:
            with g.inserting_after(value):
                gathered[value] = g.call_function(gather_tokens, (value, split.dim, split.inner, key))
        return gathered[value]

    for (name, position), split in sequence.gathers.items():
        node = nodes[name]
        _set_operand(node, position, whole_of(_operand(node, position), split))
    output = next(n for n in g.nodes if n.op == "output")
    kept_in_part = {output.args[0][i].name for i in sent_in_part}  # boundary_tensor wrappers
    for name, split in sequence.whole_gathers.items():
        if name not in kept_in_part:
            output.replace_input_with(nodes[name], whole_of(nodes[name], split))


def _row(g: torch.fx.Graph, node: torch.fx.Node, key: int, split: Any = None, left_partial: Any = ()) -> None:
    """Row-parallel matmul: the partial products are summed over the group, then the bias added.
    With sequence parallelism (``split``, a ``TokenSplit``) the matmul and the reduce-scatter of its
    sum by token are one node (``matmul_reduce_scatter_out``), and the bias's gradient, each rank's
    tokens' part, is summed over the group: here, unless it is a parameter left partial (by
    placeholder name, ``left_partial``), summed once per step."""
    name = getattr(node.target, "overloadpacket", None).__name__
    bias = None
    if name == "linear":
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        node.args, node.kwargs = (node.args[0], node.args[1]), {}
    elif name == "addmm":
        bias = node.args[0]
        node.target, node.args, node.kwargs = aten.mm.default, (node.args[1], node.args[2]), {}
    if split is not None:  # a token dim of the product: x's, which has the same leading dims
        node.target, node.args = matmul_reduce_scatter_out, (*node.args, name == "linear", split.dim, split.inner, key)
        reduced = node
    else:
        with g.inserting_after(node):
            reduced = g.call_function(reduce_out, (node, key))
    out = reduced
    if bias is not None:
        after = reduced
        if split is not None and getattr(bias, "name", None) not in left_partial:
            with g.inserting_after(reduced):
                bias = after = g.call_function(copy_in, (bias, key))
        with g.inserting_after(after):
            out = g.call_function(aten.add.Tensor, (reduced, bias))
    if out is not node:
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not reduced and user is not out)


def _column(g: torch.fx.Graph, node: torch.fx.Node, key: int, split: Any) -> None:
    """Column-parallel matmul on this rank's tokens of its input: the all-gather and the matmul are
    one node (``gather_matmul_out``), its (split) bias added after."""
    name = getattr(node.target, "overloadpacket", None).__name__
    x, weight, bias = matmul_operands(node, name)
    node.target, node.kwargs = gather_matmul_out, {}
    node.args = (x, weight, name == "linear", split.dim, split.inner, key)
    if bias is not None:
        with g.inserting_after(node):
            out = g.call_function(aten.add.Tensor, (node, bias))
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)


def _row_biases(stage: StageModule, analysis: Any) -> set[tuple[str, int]]:
    """(node, argument position) of the biases of the stage's row-parallel matmuls whose sums are
    reduce-scattered by token (sequence parallelism's sources): added to each rank's tokens."""
    found = set()
    for node in stage.graph_module.graph.nodes:
        if analysis.kinds.get(node.name) == "row" and node.name in analysis.sequence.sources:
            bias = matmul_operands(node, getattr(node.target, "overloadpacket", None).__name__)[2]
            found |= {(node.name, p) for p, v in tensor_positions(node) if bias is not None and v is bias}
    return found


def _parameter_placeholders(stage: StageModule) -> dict[torch.fx.Node, str]:
    """The stage graph's placeholders of its parameters and buffers -> their canonical names (the
    first placeholders, in ``spec.param_names`` order)."""
    placeholders = [n for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, stage.spec.param_names))


def _operand(node: torch.fx.Node, position: int) -> Any:
    if position < len(node.args):
        return node.args[position]
    return list(node.kwargs.values())[position - len(node.args)]


def _set_operand(node: torch.fx.Node, position: int, value: Any) -> None:
    if position < len(node.args):
        node.update_arg(position, value)
    else:
        node.update_kwarg(list(node.kwargs)[position - len(node.args)], value)


def _divided(value: Any, element: int | None, degree: int) -> Any:
    """A size argument over the group: divided, rounded up (a padded last part)."""
    if element is None:
        return -(-value // degree) if isinstance(value, int) else [-(-v // degree) for v in value]
    sizes = list(value)
    sizes[element] = -(-sizes[element] // degree)
    return sizes
