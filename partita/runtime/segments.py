"""A stage run block by block: its graph cut into segments (``partita.types.segments``), each run as
a unit.

Glossary
--------
segment     nodes of one stage's chain: those before its first whole block, each whole block,
            those after its last whole block (``stage_segments``). The stage's graph -- after the
            loss and tensor-parallel rewrites, which see it whole -- is cut into one FX submodule
            per segment (``torch.fx.passes.split_module``); values cross between them in-process,
            so nothing is copied or cast at a cut.
block unit  a whole block's container in the stage's module tree (``model.layers.3``: the
            canonical path of its weights), turned into a ``BlockUnit`` so that its segment can
            run as the unit's forward. A sharded stage makes each its own FSDP2 unit
            (``partita.runtime.sharding``): FSDP2's hooks then gather that block's weights for its
            forward and backward alone, and reduce-scatter its gradients as its backward ends.

Recomputation (``Recompute``) checkpoints every segment on its own (non-reentrant
``torch.utils.checkpoint``; selective with the op policy of ``partita.runtime.pipeline``): the
stage keeps each segment's input (a block's input, as Megatron-LM's and torchtitan's full
recomputation do) and rebuilds one segment at a time in backward. The weights are read inside the
checkpointed function, so a recomputation reads the weights FSDP2 gathered again for the backward.
A stage without a whole block is one segment, and runs as before: whole, checkpointed whole.
``StagePlan.recompute_blocks`` checkpoints only the segments of the stage's first that many whole
blocks, and keeps every tensor of the others (Megatron-LM's "recompute N layers").

A plan that compiles its blocks (``Plan.compile``) runs every segment through ``torch.compile``,
compiled once per distinct structure and checkpointed inside the compiled region
(``partita.runtime.compiled_segments``).

Exactness: the segments chained run the stage's graph node for node (split_module keeps the
order), and checkpointing restores the RNG and autocast state of each segment's forward.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import checkpoint

from partita.errors import InputError
from partita.runtime.compiled_segments import CompiledSegments
from partita.runtime.stages import ORIGIN
from partita.types import OpGraph, Recompute, Sharding, StagePlan
from partita.types.segments import Segment, stage_segments, whole_blocks

__all__ = [
    "BlockUnit",
    "SegmentedStage",
    "block_containers",
    "check_recompute_blocks",
    "runs_by_block",
    "segment_stage",
]


class BlockUnit(nn.Module):
    """A whole block's container whose forward runs that block's segment: ``unit(fn, *values)``
    returns ``fn(*values)``, inside the unit's forward hooks (FSDP2's gathers and reduce-scatters).
    The segment comes as an argument, not as state: a graph captured at other shapes runs its own
    segment through the same container (``StageModule.hold_tensors_of``)."""

    def forward(self, fn: Callable[..., Any], *values: Any) -> Any:
        return fn(*values)


def block_containers(stage: nn.Module, graph: OpGraph) -> dict[str, nn.Module]:
    """Module path -> the container of each whole block of ``stage`` (a StageModule) that can run
    as a unit: its weights are registered under that path of the stage's tree, and no other
    segment of the stage reads them. Each is made a ``BlockUnit`` (its class changed in place: the
    plain container modules ``StageModule`` builds keep every registration, which the stage's
    slots point into)."""
    spec = stage.spec
    segments = stage_segments(graph, spec.node_start, spec.node_stop)
    reads = [{name for node in graph.nodes[s.start : s.stop] for name in node.params} for s in segments]
    found: dict[str, nn.Module] = {}
    for k, segment in enumerate(segments):
        if segment.block is None:
            continue
        path = segment.block.module_path
        try:
            container = stage.get_submodule(path)
        except AttributeError:
            continue  # the block reads no weight
        names = {f"{path}.{name}" for name, _ in [*container.named_parameters(), *container.named_buffers()]}
        elsewhere = set().union(*(r for j, r in enumerate(reads) if j != k))
        if not names or names & elsewhere or type(container) not in (nn.Module, BlockUnit):
            continue
        container.__class__ = BlockUnit
        found[path] = container
    return found


class SegmentedStage:
    """One stage's graph cut into its segments (see the module docstring); ``run`` runs them."""

    def __init__(self, stage: nn.Module, graph: OpGraph, *, compiled: bool = False):
        spec = stage.spec
        self.segments: tuple[Segment, ...] = stage_segments(graph, spec.node_start, spec.node_stop)
        self.split = split_module(
            stage.graph_module,
            None,
            _segment_of_nodes(stage, graph, self.segments).__getitem__,
            keep_original_order=False,  # segments in dependency order: an inserted node may join a later one
        )
        placeholders = [n for n in self.split.graph.nodes if n.op == "placeholder"]
        self.param_nodes = dict(zip(placeholders, spec.param_names))  # the stage's weights, first
        self.value_nodes = placeholders[len(spec.param_names) :]
        self.compiled: CompiledSegments | None = None
        if compiled:
            self.compiled = CompiledSegments([getattr(self.split, f"submod_{k}") for k in range(self.num_segments)])

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    def run(
        self,
        slots: Callable[[], dict[str, torch.Tensor]],
        inputs: Sequence[Any],
        *,
        recompute: Recompute = Recompute.NONE,
        recompute_blocks: int | None = None,
        units: nn.Module | None = None,
        context_fn: Callable[[], Any] | None = None,
        compiled: bool = True,
    ) -> Any:
        """The stage's outputs for ``inputs`` (received values, then graph inputs). ``slots()`` gives
        the weights the stage reads at the moment it is called (inside a unit: the gathered ones).
        ``units``: the stage module whose block units the block segments run through (None: called
        directly, as outside the runner's forward). ``recompute``: every segment checkpointed, with
        ``context_fn`` for selective recomputation; ``recompute_blocks``: only the segments of the
        first that many whole blocks (None: every segment). ``compiled=False`` runs a stage of
        compiled blocks eagerly (a pass that only finds shapes, which would compile for nothing)."""
        checkpointed = self.recomputed(recompute, recompute_blocks)
        env: dict[torch.fx.Node, Any] = dict(zip(self.value_nodes, inputs, strict=True))
        for node in self.split.graph.nodes:
            if node.op == "call_module":
                env[node] = self._call(node, env, slots, checkpointed, recompute, units, context_fn, compiled)
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env[n])
            elif node.op == "get_attr":  # a constant or a loss-scaling value that several segments read
                env[node] = _attribute(self.split, str(node.target))
            elif node.op != "placeholder":
                raise AssertionError(f"unexpected node {node.format_node()} in a split stage")
        raise AssertionError("a split stage without an output")

    def recomputed(self, recompute: Recompute, recompute_blocks: int | None) -> frozenset[int]:
        """The segments checkpointed at ``recompute`` (see ``run``). InputError when the stage holds
        fewer whole blocks than ``recompute_blocks``."""
        if recompute is Recompute.NONE:
            return frozenset()
        if recompute_blocks is None:
            return frozenset(range(self.num_segments))
        blocks = [k for k, s in enumerate(self.segments) if s.block is not None]
        if recompute_blocks > len(blocks):
            raise InputError(
                f"recompute_blocks={recompute_blocks}, but the stage of nodes {self.segments[0].start}.."
                f"{self.segments[-1].stop} holds {len(blocks)} whole block(s): give at most {len(blocks)}, "
                "or leave it out to recompute every segment"
            )
        return frozenset(blocks[:recompute_blocks])

    def _call(self, node, env, slots, checkpointed, recompute, units, context_fn, compiled) -> Any:
        k = int(str(node.target).rsplit("_", 1)[1])
        submodule = getattr(self.split, str(node.target))
        names = [self.param_nodes.get(a) for a in node.args]  # None: a value, not a weight
        values = [env[a] if isinstance(a, torch.fx.Node) else a for a, n in zip(node.args, names) if n is None]

        def body(*given: Any) -> Any:
            weights = slots()
            it = iter(given)
            return submodule(*(weights[n] if n is not None else next(it) for n in names))

        run = body
        if self.compiled is not None and compiled:  # the checkpoint, if any, inside the compiled region
            level = recompute if k in checkpointed else Recompute.NONE

            def run(*given: Any) -> Any:
                weights = slots()
                it = iter(given)
                args = [weights[n] if n is not None else next(it) for n in names]
                return self.compiled.call(k, submodule, args, level, context_fn)

        elif k in checkpointed:
            kwargs = {} if recompute is Recompute.FULL or context_fn is None else {"context_fn": context_fn}

            def run(*given: Any) -> Any:
                return checkpoint(body, *given, use_reentrant=False, **kwargs)

        unit = self._unit(units, self.segments[k].block)
        return unit(run, *values) if unit is not None else run(*values)

    @staticmethod
    def _unit(units: nn.Module | None, block: Any) -> BlockUnit | None:
        if units is None or block is None:
            return None
        try:
            unit = units.get_submodule(block.module_path)
        except AttributeError:  # the block reads no weight of its own
            return None
        return unit if isinstance(unit, BlockUnit) else None


def _segment_of_nodes(stage: nn.Module, graph: OpGraph, segments: Sequence[Segment]) -> dict[torch.fx.Node, int]:
    """Each node of the stage's graph -> its segment. A node copied from the captured graph takes
    the segment its position falls in; a node a rewrite inserted (a collective, a bias added after
    it, a weight cast for a norm, a view re-made after a cut) takes the latest of its inputs'
    segments and of the segments whose captured nodes read the weights it reads, so that a block's
    weights are read inside its own segment (its FSDP2 unit gathers them for that segment alone).
    No node comes before an input's segment, so the segments run in order (split_module's
    topological order of them); a node copied from the captured graph never goes earlier than its
    position, so operations that draw random numbers (dropout) keep their order."""
    starts = [s.start for s in segments]
    at = lambda index: bisect.bisect_right(starts, index) - 1  # noqa: E731
    home: dict[str, int] = {}  # weight -> the segment of the first captured node of the stage that reads it
    for node in graph.nodes[stage.spec.node_start : stage.spec.node_stop]:
        for name in node.params:
            home.setdefault(name, at(node.index))
    placeholders = [n for n in stage.graph_module.graph.nodes if n.op == "placeholder"]
    weights = dict(zip(placeholders, stage.spec.param_names))
    where: dict[torch.fx.Node, int] = {}
    for node in stage.graph_module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inputs = [where[n] for n in node.all_input_nodes if n in where]
        origin = node.meta.get(ORIGIN)
        if origin is not None:
            where[node] = max([at(origin), *inputs])
        else:
            homes = [home[weights[n]] for n in node.all_input_nodes if n in weights and weights[n] in home]
            where[node] = max([*inputs, *homes], default=where[next(reversed(where))] if where else 0)
    return where


def _attribute(module: nn.Module, target: str) -> Any:
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def runs_by_block(stage_plan: StagePlan, *, compiled: bool = False) -> bool:
    """Whether a stage of the plan runs by block (when it holds whole blocks): its blocks are
    compiled (``compiled``: ``Plan.compile``), it recomputes, or FSDP2 shards it over its replicas.
    Otherwise running it whole is the same, with fewer calls."""
    sharded = stage_plan.sharding is not Sharding.REPLICATE and stage_plan.num_replicas > 1
    return compiled or sharded or Recompute.parse(stage_plan.recompute) is not Recompute.NONE


def check_recompute_blocks(stage_plan: StagePlan, graph: OpGraph) -> None:
    """InputError, before training, for a stage whose ``recompute_blocks`` it cannot run: more blocks
    than the stage holds whole, or blocks to recompute at no recomputation level."""
    n = stage_plan.recompute_blocks
    if n is None:
        return
    held = whole_blocks(graph, stage_plan.start, stage_plan.stop)
    if n > held:
        raise InputError(
            f"stage {stage_plan.index} has recompute_blocks={n}, but it holds {held} whole block(s) of the model "
            f"(nodes {stage_plan.start}..{stage_plan.stop}): give at most {held}, or leave it out (None) to "
            "recompute every segment"
        )


def segment_stage(stage: nn.Module, graph: OpGraph, *, compiled: bool = False) -> SegmentedStage | None:
    """The stage's SegmentedStage, or None when it holds no whole block and is not ``compiled``
    (it runs whole). A compiled stage without a whole block is one segment, compiled whole."""
    spec = stage.spec
    if len(stage_segments(graph, spec.node_start, spec.node_stop)) == 1 and not compiled:
        return None
    return SegmentedStage(stage, graph, compiled=compiled)
