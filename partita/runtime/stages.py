"""Split a captured OpGraph into pipeline stage modules that train exactly like the whole model.

``split_graph(graph, boundaries)`` returns one ``StageModule`` per stage. Each holds an FX
GraphModule for its nodes and the model's OWN parameters and buffers (the same objects, not
copies), registered under their canonical names: ``stage.named_parameters()`` yields
``"transformer.wte.weight"``, so optimizers, tied-weight syncs and checkpoints use the original
names. A tied parameter read by two stages is registered in both; in one process both stages
accumulate into the same ``.grad``, which then equals the unsplit model's gradient.

Calling convention (see ``StageSpec``)::

    outputs = stage(*received, *stage.graph_inputs(flat_inputs))

``received`` are the previous stage's outputs; ``flat_inputs`` are the flat graph inputs of the
whole batch or micro-batch (``flatten_inputs``). The last stage returns the scalar loss.

What crosses a cut (why: gloo sends only contiguous tensors, and torch.distributed.pipelining
detaches stage inputs in place; how: see ``graph_split``):
- only tensors. SymInts and other non-tensor values are re-made in the stage that reads them;
  lists/tuples from multi-output ops are unpacked in the stage that makes them.
- outputs are fresh contiguous tensors: views (``x.view(...)``, ``x.transpose(...)``), relayed
  inputs and non-contiguous results are cloned to contiguous memory, because gloo only sends
  contiguous tensors and a view cannot be detached in place (ZBV schedules do that). The
  exception: a view of a tensor that something writes into in place is not sent but re-made
  from that tensor, so that the write reaches every alias, as in the unsplit model.
- input gradients are contiguous: every floating-point received tensor passes through
  ``_ContiguousGrad`` (identity forward, ``grad.contiguous()`` backward), since those gradients are
  sent back to the previous stage.
- nothing the loss does not need: the last stage returns the loss alone (HF logits are dropped).

Known limit: a stage that writes in place into a received tensor that requires grad fails in a
real pipeline (it is a leaf there); no model tried so far does that (T5 writes into int ids).

Higher-order ops (Llama's ``wrap_with_set_grad_enabled``) keep their body: the nested
GraphModule is registered on the stage's GraphModule under its original ``get_attr`` name, as are
constants lifted by export (T5's ``lifted_tensor_0``, as non-persistent buffers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch import nn

from partita.capturing import flatten_call_inputs
from partita.errors import InputError
from partita.runtime.graph_split import StageContents, StageSpec, check_boundaries, plan_stages, written_in_place
from partita.types import OpGraph
from partita.types.graph import graph_memo

# node.meta key: the OpGraph node a stage graph's node was copied from (``partita.runtime.segments``
# cuts a stage into segments by it)
ORIGIN = "partita_index"

__all__ = [
    "StageModule",
    "StageSpec",
    "batch_of",
    "check_boundaries",
    "flatten_inputs",
    "meta_microbatch",
    "narrow_batch",
    "run_sequential",
    "split_graph",
]

# The attribute of StageModule holding its GraphModule; no model may use it as a top-level name.
_GRAPH_ATTR = "graph_module"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (it is sent to the previous stage)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    """Stage input wrapper (an FX call_function target): see ``_ContiguousGrad``."""
    return _ContiguousGrad.apply(x)


def boundary_tensor(x: torch.Tensor) -> torch.Tensor:
    """A stage output that can be sent: ``x`` itself if it owns contiguous memory, else a contiguous
    clone; in a compiled block (which cannot ask whether a value is a view) always a clone."""
    if torch.compiler.is_compiling() or x._is_view() or not x.is_contiguous():
        return x.clone(memory_format=torch.contiguous_format)
    return x


class StageModule(nn.Module):
    """One pipeline stage: ``forward(*received, *graph_inputs)`` -> tuple of boundary tensors, or the loss.

    Attributes:
        spec: the StageSpec (node range, input/output value names, canonical parameter names).
        graph_module: the stage's FX GraphModule. Its placeholders are the stage's parameters
            and buffers (in ``spec.param_names`` order, filled in by ``forward``), then the
            received boundary values, then the graph inputs it reads.
    """

    def __init__(
        self,
        spec: StageSpec,
        graph_module: torch.fx.GraphModule,
        tensors: dict[str, torch.Tensor],
        non_persistent: set[str],
    ):
        super().__init__()
        # The stage's graph cut into segments run one by one (``partita.runtime.segments``), once
        # the plan asks a stage to run by block; None: the graph runs whole. Kept out of the module
        # tree (its submodules hold no weights of their own).
        self.__dict__["segmented"] = None
        if any(name.split(".")[0] == _GRAPH_ATTR for name in tensors):
            raise InputError(
                f"the model has a top-level attribute named {_GRAPH_ATTR!r}, which stage modules reserve: rename it"
            )
        self.spec = spec
        self.graph_module = graph_module
        # (dict, key) per parameter: forward reads the current entry, so .to() and load_state_dict() apply.
        # Set before the model's names are registered, which may shadow (never break) ``spec``.
        self._slots: list[tuple[dict, str]] = []
        for name in spec.param_names:
            self._slots.append(_register_tensor(self, name, tensors[name], name in non_persistent))

    @property
    def graph_input_indices(self) -> tuple[int, ...]:
        """Positions, in the flat graph inputs, of the inputs this stage reads directly."""
        return self.spec.graph_input_indices

    def graph_inputs(self, flat_inputs: Sequence[Any]) -> tuple:
        """The flat graph inputs this stage reads, picked from all of them (``flatten_inputs``)."""
        return tuple(flat_inputs[j] for j in self.spec.graph_input_indices)

    def forward(self, *inputs: Any) -> Any:
        expected = len(self.spec.input_names) + len(self.spec.graph_input_indices)
        if len(inputs) != expected:
            raise InputError(
                f"stage {self.spec.index} takes {expected} inputs ({len(self.spec.input_names)} received from the "
                f"previous stage, then graph inputs {list(self.spec.graph_input_names)}), got {len(inputs)}"
            )
        segmented = self.__dict__.get("segmented")
        if segmented is not None:  # outside a runner (shapes, metadata): eagerly, never compiled
            return segmented.run(self.state_tensors, inputs, compiled=False)
        tensors = [slots[key] for slots, key in self._slots]
        return self.graph_module(*tensors, *inputs)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Canonical name -> the parameter or buffer this stage reads under it."""
        return {name: slots[key] for (slots, key), name in zip(self._slots, self.spec.param_names)}

    def rebind(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Read ``tensors[name]`` for the parameters and buffers named there (registered in their
        place: tensor parallelism gives a stage this rank's part of a weight)."""
        for (slots, key), name in zip(self._slots, self.spec.param_names):
            if name in tensors:
                slots[key] = tensors[name]

    def hold_tensors_of(self, planned: StageModule) -> None:
        """Hold ``planned``'s parameters and buffers in place of this stage's own: the very
        containers they are registered in, so that whatever replaces them there later -- FSDP2
        registering the gathered parameters for a forward and the shards after it, a
        tensor-parallel part -- is what this stage reads and ``parameters()`` yields too. For a
        graph captured again at other shapes or in eval mode (partita.runtime.variants), which
        reads only tensors ``planned`` holds."""
        extra = set(self.spec.param_names) - set(planned.spec.param_names)
        assert not extra, f"stage {self.spec.index} reads {sorted(extra)[:3]}, which the planned stage does not hold"
        for name in [n for n in self._modules if n != _GRAPH_ATTR]:
            del self._modules[name]
        for name, module in planned._modules.items():
            if name != _GRAPH_ATTR:
                self._modules[name] = module
        self.__dict__["_parameters"] = planned._parameters
        self.__dict__["_buffers"] = planned._buffers
        self.__dict__["_non_persistent_buffers_set"] = planned._non_persistent_buffers_set
        self._slots = [_registered_slot(self, name) for name in self.spec.param_names]

    def extra_repr(self) -> str:
        s = self.spec
        return (
            f"stage={s.index}/{s.num_stages}, nodes=[{s.node_start}, {s.node_stop}), "
            f"inputs={len(s.input_names)}+{len(s.graph_input_indices)}, outputs={len(s.output_names)}"
        )


def state_of(stages: Sequence[StageModule]) -> dict[str, torch.Tensor]:
    """Canonical name -> the tensor the ``stages`` read under it (``StageModule.state_tensors``, merged)."""
    return {name: t for stage in stages for name, t in stage.state_tensors().items()}


def split_graph(graph: OpGraph, boundaries: Sequence[int]) -> list[StageModule]:
    """Stage modules for the node ranges ``[boundaries[s], boundaries[s + 1])`` of ``graph.nodes``.

    ``boundaries`` must be strictly increasing from 0 to ``graph.num_nodes`` (InputError
    otherwise). Chained (``run_sequential``), the stages give the loss and gradients of the
    unsplit model.
    """
    check_boundaries(boundaries, graph.num_nodes)
    return [_build_stage(graph, contents) for contents in plan_stages(graph, boundaries)]


def run_sequential(stages: Sequence[StageModule], flat_inputs: Sequence[Any]) -> torch.Tensor:
    """Run the stages one after another in this process and return the loss (a reference run)."""
    received: tuple = ()
    for stage in stages:
        received = stage(*received, *stage.graph_inputs(flat_inputs))
    return received


def flatten_inputs(graph: OpGraph, args: tuple = (), kwargs: dict | None = None, target: Any = None) -> list:
    """The flat graph inputs for the user's ``(args, kwargs[, target])``, in placeholder order.

    The structure must be the captured one (same positional arguments and keyword names); keyword
    order does not matter. Tensors may have another batch size when the graph has a dynamic batch.
    A tensor where the model was captured with None (an attention mask), None where it was
    captured with a tensor, or another value of a non-tensor input is an InputError
    (``partita.capturing.flatten_call_inputs``).
    """
    return flatten_call_inputs(graph, args, kwargs, target)


def narrow_batch(graph: OpGraph, flat: Sequence[Any], start: int, length: int) -> list:
    """Samples ``[start, start + length)`` of every flat graph input with a batch dim (views);
    inputs without one (and non-tensors) unchanged."""
    out = []
    for info, x in zip(graph.inputs, flat):
        dim = info.tensor.batch_dim if info.tensor is not None else None
        out.append(x.narrow(dim, start, length) if dim is not None and isinstance(x, torch.Tensor) else x)
    return out


def batch_of(graph: OpGraph, flat: Sequence[Any]) -> int:
    """The batch size of flat graph inputs (their sizes along their batch dims); InputError when
    they disagree or none has a batch dim."""
    sizes = {
        x.shape[info.tensor.batch_dim]
        for info, x in zip(graph.inputs, flat)
        if info.tensor is not None and info.tensor.batch_dim is not None and isinstance(x, torch.Tensor)
    }
    if len(sizes) != 1:
        raise InputError(
            f"the inputs disagree on the batch size (sizes along their batch dims: {sorted(sizes)})"
            if sizes
            else "no input has a batch dimension: the trainer cannot split the batch"
        )
    return sizes.pop()


def meta_microbatch(graph: OpGraph, microbatch_size: int) -> list:
    """Flat graph inputs of one micro-batch as meta tensors, from the captured shapes."""
    flat = []
    for info in graph.inputs:
        t = info.tensor
        if t is None:  # a constant of the captured graph (int, bool, None): no stage reads it
            flat.append(None)
            continue
        shape = [microbatch_size if d == t.batch_dim else s for d, s in enumerate(t.shape)]
        flat.append(torch.empty(shape, dtype=getattr(torch, t.dtype), device="meta"))
    return flat


# ----------------------------------------------------------------------------- building


def _build_stage(graph: OpGraph, contents: StageContents) -> StageModule:
    """Copy the stage's nodes into a new FX graph and wrap it with the model's own tensors."""
    fx_graph, attrs = _stage_fx_graph(graph, contents)
    source = graph.graph_module
    gm = torch.fx.GraphModule(
        {target: _resolve(source, target) for target in attrs}, fx_graph, class_name=f"Stage{contents.spec.index}"
    )
    for target in attrs:  # constants lifted by export: buffers that move with .to() but are not checkpointed
        owner_path, _, leaf = target.rpartition(".")
        owner = gm.get_submodule(owner_path)
        if leaf in owner._buffers:
            owner._non_persistent_buffers_set.add(leaf)
    targets = _canonical_targets(graph)
    tensors = {name: _resolve(source, targets[name]) for name in contents.spec.param_names}
    non_persistent = {name for name in tensors if _is_non_persistent(source, targets[name])}
    return StageModule(contents.spec, gm, tensors, non_persistent)


def _stage_fx_graph(graph: OpGraph, contents: StageContents) -> tuple[torch.fx.Graph, list[str]]:
    """The stage's FX graph, and the non-parameter get_attr targets it needs (HOP bodies, constants)."""
    spec, g = contents.spec, torch.fx.Graph()
    params, env = _placeholders(g, graph, contents)
    attrs: list[str] = []

    def lookup(node: torch.fx.Node) -> torch.fx.Node:
        if node not in env:  # only get_attr nodes are added on first use
            assert node.op == "get_attr", f"stage {spec.index}: {node.name} is read but not available"
            canonical = graph.attr_to_param.get(node.target)
            if canonical is None:
                attrs.append(node.target)
            env[node] = params[canonical] if canonical is not None else g.node_copy(node)
        return env[node]

    index_of = _node_indices(graph)
    for node in contents.nodes:
        reused = contents.reused.get(node)
        env[node] = env[reused] if reused is not None else g.node_copy(node, lookup)
        if reused is None and node.name in index_of:  # where it came from: segments cut by it
            env[node].meta[ORIGIN] = index_of[node.name]
    if spec.is_last:
        g.output(env[contents.outputs[0]])
    else:
        g.output(tuple(g.call_function(boundary_tensor, (env[v],)) for v in contents.outputs))
    g.lint()
    return g, attrs


@graph_memo
def _node_indices(graph: OpGraph) -> dict[str, int]:
    return {node.name: node.index for node in graph.nodes}


def _placeholders(g: torch.fx.Graph, graph: OpGraph, contents: StageContents) -> tuple[dict, dict]:
    """Add the stage's placeholders: parameters, received values, graph inputs (in this order).

    Returns canonical name -> parameter placeholder, and original node -> the stage node standing
    for it. Received floating-point tensors go through ``contiguous_grad``; those that the stage
    writes into in place (a residual ``hidden += x`` right after the cut) are then cloned, since
    autograd forbids in-place writes into a custom Function's output and into a received leaf.
    """
    params = {name: _placeholder(g, name.replace(".", "_")) for name in contents.spec.param_names}
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    written = written_in_place(contents.nodes)
    for node in contents.inputs:
        received = _placeholder(g, node.name)
        received.meta = dict(node.meta)
        value = node.meta.get("val")
        floating = isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex)
        env[node] = g.call_function(contiguous_grad, (received,)) if floating else received
        if floating and node in written:
            env[node] = g.call_function(torch.ops.aten.clone.default, (env[node],))
    placeholders = [n for n in graph.graph_module.graph.nodes if n.op == "placeholder"]
    for j in contents.spec.graph_input_indices:
        env[placeholders[j]] = g.node_copy(placeholders[j])
    return params, env


def _placeholder(g: torch.fx.Graph, name: str) -> torch.fx.Node:
    """A placeholder whose argument name is its node name (FX may change ``name``: CamelCase, clashes)."""
    node = g.placeholder(name)
    node.target = node.name
    return node


def _register_tensor(root: nn.Module, name: str, tensor: torch.Tensor, non_persistent: bool) -> tuple[dict, str]:
    """Register ``tensor`` at the dotted ``name`` under ``root``, creating plain container modules.

    The module dicts are written directly: names are the model's own, and must not be refused
    because the stage happens to have an attribute of that name.
    """
    *path, leaf = name.split(".")
    module = root
    for atom in path:
        if atom not in module._modules:
            module._modules[atom] = nn.Module()
        module = module._modules[atom]
    if isinstance(tensor, nn.Parameter):
        module._parameters[leaf] = tensor
        return module._parameters, leaf
    module._buffers[leaf] = tensor
    if non_persistent:
        module._non_persistent_buffers_set.add(leaf)
    return module._buffers, leaf


def _registered_slot(root: nn.Module, name: str) -> tuple[dict, str]:
    """The (dict, key) under which the tensor at the dotted ``name`` is registered below ``root``."""
    *path, leaf = name.split(".")
    module = root
    for atom in path:
        module = module._modules[atom]
    return (module._parameters if leaf in module._parameters else module._buffers), leaf


def _canonical_targets(graph: OpGraph) -> dict[str, str]:
    """Canonical parameter name -> one get_attr target of the captured module that reads it."""
    targets: dict[str, str] = {}
    for target, name in graph.attr_to_param.items():
        targets.setdefault(name, target)
    return targets


def _resolve(module: nn.Module, target: str) -> Any:
    value: Any = module
    for atom in target.split("."):
        value = getattr(value, atom)
    return value


def _is_non_persistent(module: nn.Module, target: str) -> bool:
    owner_path, _, leaf = target.rpartition(".")
    owner = _resolve(module, owner_path) if owner_path else module
    return leaf in getattr(owner, "_non_persistent_buffers_set", ())
