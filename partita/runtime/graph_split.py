"""Which nodes each pipeline stage runs, and which values cross from stage to stage.

This module only analyses the captured FX graph; ``stages.py`` turns the result into modules.

Glossary
--------
boundaries      cut positions in node-index space: ``[0, 120, 250, n]`` makes the stages
                ``[0, 120)``, ``[120, 250)`` and ``[250, n)`` of ``OpGraph.nodes``.
index stage     the stage a node belongs to by its position.
run stage       the stage that executes a node. It is the index stage, except:
                * ``getitem`` on a multi-output node (``split``, a higher-order op returning a
                  tuple) runs where that node runs, so that only tensors cross stages, not lists;
                * assertions (``_assert_tensor_metadata``, ...) run where their last input is
                  made, so that a check never forces a tensor to be sent.
live            the nodes the loss depends on, plus nodes with side effects (in-place buffer
                updates such as BatchNorm's ``num_batches_tracked.add_``). Other nodes (HF logits
                returned beside the loss) are dropped: the last stage returns the loss only.
boundary value  a tensor made in an earlier stage and read in a later one. Stage ``s`` sends
                every boundary value that any stage after ``s`` reads, so a value skipping
                stages is relayed through them. Graph inputs are never sent: every rank has the
                whole batch, so each stage reads the inputs it needs directly.
re-made         a non-tensor value (a SymInt from ``aten.sym_size.int``, an int) read across a
                cut is not sent (it cannot be, and SymInts must not leave their graph): the
                nodes producing it are re-run in the reading stage, from graph inputs,
                parameters and tensors that stage receives anyway.
alias family    a tensor made by a node (its root) and the views and in-place results sharing its
                memory. When a node writes into a family in place (T5 builds its decoder inputs
                with ``new_zeros``, then ``copy_`` into a slice of it), its members must stay one
                memory in every stage: a member read across a cut is re-made in the reading stage
                from the root, which is sent instead (views are re-run, in-place results stand
                for their target). Views of families nobody writes into are sent as they are
                (as contiguous copies, see ``stages.py``).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx
import torch.utils._pytree as pytree

from partita.errors import InputError
from partita.types import OpGraph


@dataclass(frozen=True)
class StageSpec:
    """What one stage computes and exchanges; all names are FX node names of the captured graph.

    A stage module's forward takes ``*inputs`` = the boundary values ``input_names`` (sent by
    stage ``index - 1``, in this order) followed by the graph inputs ``graph_input_indices``
    (positions in the flat graph inputs, increasing). It returns the tuple ``output_names``
    (sent to stage ``index + 1``, relayed values included), or on the last stage the loss alone.
    """

    index: int
    num_stages: int
    node_start: int  # first node position of the stage's range in OpGraph.nodes
    node_stop: int  # one past the last
    input_names: tuple[str, ...]
    graph_input_indices: tuple[int, ...]
    graph_input_names: tuple[str, ...]
    output_names: tuple[str, ...]  # on the last stage: (name of the loss node,)
    param_names: tuple[str, ...]  # canonical names of the parameters and buffers it reads
    recomputed_names: tuple[str, ...] = ()  # nodes of earlier stages re-made here (non-tensor values, views)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def relayed_names(self) -> tuple[str, ...]:
        """Boundary values this stage only passes on (received and sent)."""
        received = set(self.input_names)
        return tuple(name for name in self.output_names if name in received) if not self.is_last else ()


@dataclass(frozen=True, eq=False)
class StageContents:
    """A StageSpec plus the FX nodes (of ``graph.graph_module``) that the stage runs, in order."""

    spec: StageSpec
    nodes: tuple[torch.fx.Node, ...]  # re-made nodes first, then the stage's own
    inputs: tuple[torch.fx.Node, ...]  # the boundary values received, as producer nodes
    outputs: tuple[torch.fx.Node, ...]  # the values returned (the loss node on the last stage)
    reused: Mapping[torch.fx.Node, torch.fx.Node]  # re-made in-place nodes -> the input they stand for


def check_boundaries(boundaries: Sequence[int], num_nodes: int) -> tuple[int, ...]:
    """Boundaries as a tuple of ints; InputError naming the bad value otherwise."""
    cuts = tuple(boundaries)
    hint = f"give cut positions like [0, {num_nodes // 2}, {num_nodes}]: strictly increasing, from 0 to num_nodes={num_nodes}"
    for c in cuts:
        if isinstance(c, bool) or not isinstance(c, int):
            raise InputError(f"boundary {c!r} is not an int (boundaries={list(cuts)}): {hint}")
    if len(cuts) < 2:
        raise InputError(f"boundaries={list(cuts)} make no stage: {hint}")
    if cuts[0] != 0:
        raise InputError(f"the first boundary must be 0, got {cuts[0]} (boundaries={list(cuts)}): {hint}")
    if cuts[-1] != num_nodes:
        raise InputError(f"the last boundary must be num_nodes={num_nodes}, got {cuts[-1]}: {hint}")
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            raise InputError(
                f"boundary {b} follows {a}: boundaries must be strictly increasing (no empty stage); {hint}"
            )
    return cuts


def plan_stages(graph: OpGraph, boundaries: Sequence[int]) -> list[StageContents]:
    """Decide, for each stage, the nodes it runs and the values it receives and sends."""
    cuts = check_boundaries(boundaries, graph.num_nodes)
    ops = call_function_nodes(graph)
    loss = ops[graph.loss_node]
    live = _live_nodes(ops, loss)
    run_stage = _run_stages(ops, live, cuts)
    written = _written_roots(ops, live)
    num_stages = len(cuts) - 1
    own = [[n for n in ops if run_stage.get(n) == s] for s in range(num_stages)]
    reads = [_cross_stage_reads(own[s], run_stage, s, written) for s in range(num_stages)]
    if run_stage[loss] < num_stages - 1:  # cuts after the loss: the last stage only passes it on
        reads[-1][0].append(loss)
    outputs = _stage_outputs([tensors for tensors, _ in reads], run_stage, num_stages, loss)
    position = {n: i for i, n in enumerate(ops)}
    result = []
    for s in range(num_stages):
        received = outputs[s - 1] if s > 0 else []
        remade, reused = _remake_closure(reads[s][1], set(received), s, position)
        result.append(_contents(graph, s, cuts, remade + own[s], received, outputs[s], remade, reused))
    _check_input_writes(graph, ops, run_stage, result)
    return result


def call_function_nodes(graph: OpGraph) -> list[torch.fx.Node]:
    """The FX nodes behind ``graph.nodes``, by position."""
    ops = [n for n in graph.graph_module.graph.nodes if n.op == "call_function"]
    others = [
        n for n in graph.graph_module.graph.nodes if n.op not in ("call_function", "placeholder", "get_attr", "output")
    ]
    assert not others, f"unexpected FX node kinds in an exported graph: {[(n.op, n.name) for n in others]}"
    assert [n.name for n in ops] == [n.name for n in graph.nodes], "OpGraph.nodes out of step with its graph_module"
    return ops


def value_kind(node: torch.fx.Node) -> str:
    """'tensor', 'container' (a list/tuple holding tensors) or 'other' (SymInt, int, None, ...)."""
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) or value is None and "val" not in node.meta:
        return "tensor"
    if isinstance(value, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(value)):
        return "container"
    return "other"


def _is_assertion(node: torch.fx.Node) -> bool:
    name = str(node.target)
    return "_assert" in name or "sym_constrain_range" in name


def _live_nodes(ops: list[torch.fx.Node], loss: torch.fx.Node) -> set[torch.fx.Node]:
    """Ancestors of the loss and of side-effecting nodes; assertions only when what they check is live.

    Side-effecting: impure ops (in-place writes such as BatchNorm's running statistics) and
    higher-order ops whose body writes into one of its inputs (``with torch.no_grad():
    self.ema.mul_(0.9).add_(x.mean())`` becomes a ``wrap_with_set_grad_enabled`` without users).
    """
    roots = [loss] + [n for n in ops if (n.is_impure() or _body_writes_inputs(n)) and not _is_assertion(n)]
    live: set[torch.fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(a for a in node.all_input_nodes if a.op == "call_function")
    checks = [
        n for n in ops if _is_assertion(n) and all(a in live for a in n.all_input_nodes if a.op == "call_function")
    ]
    return live | set(checks)


def _body_writes_inputs(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a higher-order op whose body (or a body nested in it) writes in place
    into one of the body's inputs: buffers or tensors of the outer graph."""
    if not isinstance(node.target, torch._ops.HigherOrderOperator):
        return False
    owner = node.graph.owning_module
    for arg in node.args:
        if not (isinstance(arg, torch.fx.Node) and arg.op == "get_attr" and owner is not None):
            continue
        body = owner
        for atom in str(arg.target).split("."):
            body = getattr(body, atom, None)
        if not isinstance(body, torch.fx.GraphModule):
            continue
        for inner in body.graph.nodes:
            if inner.op != "call_function":
                continue
            if any(alias_root(t).op == "placeholder" for t in _written_inputs(inner)) or _body_writes_inputs(inner):
                return True
    return False


def _run_stages(ops: list[torch.fx.Node], live: set[torch.fx.Node], cuts: tuple[int, ...]) -> dict[torch.fx.Node, int]:
    """The run stage of every live node (see the glossary)."""
    run_stage: dict[torch.fx.Node, int] = {}
    for i, node in enumerate(ops):
        if node not in live:
            continue
        producers = [a for a in node.all_input_nodes if a.op == "call_function"]
        if node.target is operator.getitem and producers and value_kind(producers[0]) == "container":
            run_stage[node] = run_stage[producers[0]]
        elif _is_assertion(node) and not node.users and producers:
            run_stage[node] = max(run_stage[a] for a in producers)
        else:
            run_stage[node] = bisect.bisect_right(cuts, i) - 1
    return run_stage


def _cross_stage_reads(nodes: list[torch.fx.Node], run_stage: dict, s: int, written: set) -> tuple[list, list]:
    """What ``nodes`` read from earlier stages: (tensors to receive, nodes to re-make here), in first-read order.

    Non-tensor values and members of written alias families are re-made; a family's root is
    received instead of the member.
    """
    tensors: dict[torch.fx.Node, None] = {}
    remake: dict[torch.fx.Node, None] = {}
    for node in nodes:
        for a in node.all_input_nodes:
            if a.op != "call_function" or run_stage[a] == s:
                continue
            kind = value_kind(a)
            if kind == "container":
                raise InputError(
                    f"node {node.name} ({node.target}) in stage {s} reads the list/tuple {a.name} made in stage "
                    f"{run_stage[a]}; only tensors can cross stages: move the cut so both are in one stage"
                )
            root = alias_root(a)
            if kind == "other" or root is not a and root in written:
                remake[a] = None
                if kind == "tensor" and root.op == "call_function":
                    tensors[root] = None
            else:
                tensors[a] = None
    return list(tensors), list(remake)


def _stage_outputs(needs: list[list], run_stage: dict, num_stages: int, loss: torch.fx.Node) -> list[list]:
    """Per stage, the boundary values it sends: those read later and made at or before it."""
    outputs: list[list] = [[] for _ in range(num_stages)]
    outputs[-1] = [loss]
    later: set[torch.fx.Node] = set()
    for s in range(num_stages - 2, -1, -1):
        later |= set(needs[s + 1])
        outputs[s] = [v for v in later if run_stage[v] <= s]
    order = {n: i for i, n in enumerate(run_stage)}  # run_stage was filled in topological order
    return [sorted(values, key=order.__getitem__) for values in outputs]


def _remake_closure(values: list, received: set, s: int, position: dict) -> tuple[list, dict]:
    """The nodes stage ``s`` re-runs to re-make ``values``, in graph order, and the in-place nodes
    among them that stand for the tensor they wrote into (node -> that input; not re-run)."""
    chain: set[torch.fx.Node] = set()
    reused: dict[torch.fx.Node, torch.fx.Node] = {}
    stack = list(values)
    while stack:
        node = stack.pop()
        if node in chain:
            continue
        chain.add(node)
        parent = alias_parent(node)
        if parent is not None and _writes_in_place(node):
            reused[node] = parent
        for a in [parent] if node in reused else node.all_input_nodes:
            if a.op != "call_function" or a in received:
                continue
            if value_kind(a) == "other" or a is parent:
                stack.append(a)
                continue
            raise InputError(
                f"stage {s} must re-make {node.name} ({node.target}), a non-tensor value or a view of a tensor "
                f"written in place, but it is computed from the tensor {a.name} of an earlier stage, which "
                f"stage {s} does not receive. Move the cut so that {node.name} and its readers are in one stage"
            )
    return sorted(chain, key=position.__getitem__), reused


def alias_parent(node: torch.fx.Node) -> torch.fx.Node | None:
    """The input whose memory ``node``'s output shares (views, in-place ops, getitem of a view list)."""
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        container = node.args[0]
        return container if isinstance(container, torch.fx.Node) and alias_parent(container) is not None else None
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.returns[0].alias_info is None:
        return None
    for i, arg in enumerate(schema.arguments):  # aten ops alias one argument, ``self``
        if arg.alias_info is not None:
            value = node.args[i] if i < len(node.args) and not arg.kwarg_only else node.kwargs.get(arg.name)
            return value if isinstance(value, torch.fx.Node) else None
    return None


def alias_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node that made the memory ``node``'s output lives in."""
    while (parent := alias_parent(node)) is not None:
        node = parent
    return node


def _writes_in_place(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(
        schema and schema.returns and schema.returns[0].alias_info is not None and schema.returns[0].alias_info.is_write
    )


def _written_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs ``node`` writes into (``self`` of ``copy_``, ``masked_fill_``, ...)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    values = [
        node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    return [v for v in values if isinstance(v, torch.fx.Node)]


def written_in_place(ops: Sequence[torch.fx.Node]) -> set[torch.fx.Node]:
    """Every node whose memory one of ``ops`` writes into in place: the written inputs and the
    views they are made from, up to each family's root."""
    found = set()
    for node in ops:
        for target in _written_inputs(node):
            while target is not None:
                found.add(target)
                target = alias_parent(target)
    return found


def _written_roots(ops: list[torch.fx.Node], live: set) -> set[torch.fx.Node]:
    """Roots of the alias families that some live node writes into."""
    return {alias_root(a) for n in ops if n in live for a in _written_inputs(n)}


def _check_input_writes(graph: OpGraph, ops: list, run_stage: dict, stages: list[StageContents]) -> None:
    """A graph input written in place in stage m must not be read by a later stage (it reads its own copy)."""
    placeholders = [n for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
    for node in ops:
        for root in map(alias_root, _written_inputs(node) if node in run_stage else []):
            if root.op != "placeholder":
                continue
            j = placeholders.index(root)
            later = [c.spec.index for c in stages if c.spec.index > run_stage[node] and j in c.spec.graph_input_indices]
            if later:
                raise InputError(
                    f"the model writes into its input {root.name} in place (node {node.name}, {node.target}) in stage "
                    f"{run_stage[node]}, and stages {later} read that input too: each stage has its own copy of the "
                    "batch, so they would not see the change. Move the cuts so no stage after the write reads it"
                )


def _contents(
    graph: OpGraph, s: int, cuts: tuple, nodes: list, received: list, sent: list, remade: list, reused: dict
) -> StageContents:
    """Collect the graph inputs and parameters that ``nodes`` read into a StageContents."""
    placeholders = [n for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
    read = {a for n in nodes if n not in reused for a in n.all_input_nodes}
    graph_inputs = tuple(j for j, p in enumerate(placeholders) if p in read)
    held = {graph.attr_to_param[a.target] for a in read if a.op == "get_attr" and a.target in graph.attr_to_param}
    spec = StageSpec(
        index=s,
        num_stages=len(cuts) - 1,
        node_start=cuts[s],
        node_stop=cuts[s + 1],
        input_names=tuple(n.name for n in received),
        graph_input_indices=graph_inputs,
        graph_input_names=tuple(placeholders[j].name for j in graph_inputs),
        output_names=tuple(n.name for n in sent),
        param_names=tuple(name for name in graph.parameters if name in held),
        recomputed_names=tuple(n.name for n in remade),
    )
    return StageContents(spec=spec, nodes=tuple(nodes), inputs=tuple(received), outputs=tuple(sent), reused=reused)
