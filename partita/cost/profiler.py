"""Measure what every node of a captured graph costs on the local device.

The only module of partita that runs kernels for costs: it runs the captured graph on the real
parameters and one micro-batch and returns a CostTable with ``source="measured"``.

Method:
1. Recording run: interpret the graph once with grad enabled. A ``saved_tensors_hooks`` pack
   hook charges every tensor saved for backward to the node that is running; a storage counts
   once, at its first saver, so per-node bytes add up to the whole graph's. Each autograd node
   an FX node creates is *claimed* by it.
2. Weight-gradient share of nodes with trainable parameters: re-run the node alone and time
   gradients w.r.t. its parameters only (W) and its inputs only (B); share = W / (W + B).
3. ``warmup + repeats`` rounds of: an interpreted forward timing every call_function; the
   recorded graph's backward (``retain_graph``) with pre/post hooks timing every claimed
   autograd node -- the real backward in context, since isolated per-node backward runs
   under-count it (FACTS.md); the plain graph module's forward and forward+backward. Medians.
4. Calibration: scale per-node forward (backward) times so that they sum to the plain module's
   forward (step minus forward); the factors go into ``CostTable.calibration``.

Precision: the graph runs as captured (fp32), so a measured table is an fp32 table
(``CostTable.precision == "fp32"``). Plans in bf16 are costed analytically instead
(``partita.planning.context``). Measuring under ``torch.autocast`` is not done: it would time
autocast's per-op casts and the ops it keeps in fp32, which need not be what the runtime runs,
and bf16 matmuls on most CPUs are not faster than fp32 ones.

Activation bytes exclude parameters and buffers (parameter memory) and their views (same
storage); a saved *copy* of a parameter (a cast to bf16) is per-micro-batch memory and counts,
as do saved graph inputs (token ids kept by an embedding).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx
import torch.utils._pytree as pytree

from partita.capturing import check_flat_inputs
from partita.cost import cache
from partita.cost.recompute import selective_arrays
from partita.cost.table import block_bytes, cut_bytes, output_bytes, param_arrays
from partita.errors import InputError
from partita.types import CostTable, OpGraph
from partita.types.devices import get_device, known_devices

__all__ = ["profile"]

_PROGRESS_MIN_NODES = 500  # below this many nodes profiling is quick: no bar by default


def profile(
    graph: OpGraph,
    inputs: tuple[tuple, dict, Any] | None = None,
    *,
    microbatch_size: int,
    device: str | torch.device | None = None,
    repeats: int = 5,
    warmup: int = 2,
    cache_dir: str | os.PathLike | None = None,
    progress: bool | None = None,
) -> CostTable:
    """Measure per-node costs of ``graph`` at ``microbatch_size`` on ``device``.

    Args:
        graph: a captured graph whose model holds real weights (not on ``meta``).
        inputs: example ``(args, kwargs, target)`` at any batch size; each batch-dim tensor is
            cut or repeated along its batch dim to ``microbatch_size``. None: synthesized from
            the graph's input shapes (see ``microbatch_inputs``).
        device: where to run; default and required: the device that holds the parameters.
        repeats, warmup: timed and untimed runs per measurement; medians are reported.
        cache_dir: when given, reuse a table measured before with the same key (see
            ``partita.cost.cache``) and store new ones there. Nothing is written otherwise.
        progress: show a tqdm bar; default only on a terminal for graphs of > 500 nodes.

    The model's parameters, gradients, buffers and the global RNG state are left as they were.
    """
    if microbatch_size < 1 or repeats < 1 or warmup < 0:
        raise InputError(
            f"microbatch_size={microbatch_size}, repeats={repeats}, warmup={warmup}: "
            "need microbatch_size >= 1, repeats >= 1 and warmup >= 0"
        )
    run_device = _resolve_device(graph.graph_module, device)
    key, key_parts = (None, None)
    if cache_dir is not None:
        key, key_parts = cache.cache_key(graph, microbatch_size, run_device, repeats=repeats, warmup=warmup)
        cached = cache.load(cache_dir, key)
        if cached is not None:
            return cached
    if progress is None:
        progress = sys.stderr.isatty() and graph.num_nodes > _PROGRESS_MIN_NODES
    with _preserved_state(graph.graph_module, run_device):
        flat_inputs = microbatch_inputs(graph, inputs, microbatch_size, run_device)
        measured = _measure(graph, flat_inputs, run_device, repeats, warmup, progress)
    table = _build_table(graph, measured, microbatch_size, run_device, repeats, warmup)
    if cache_dir is not None:
        cache.store(cache_dir, key, table, key_parts)
    return table


# ----------------------------------------------------------------------------- orchestration


@dataclass
class _Measured:
    """Raw medians of one profiling session, before calibration."""

    forward_s: np.ndarray  # (n,) in-context forward time per node
    backward_s: np.ndarray  # (n,) in-context backward time per node
    weight_share: np.ndarray  # (n,) W / (W + B) of the node's backward; 0 without trainable params
    activation_bytes: np.ndarray  # (n,) bytes saved for backward, first saver of a storage pays
    whole_forward_s: float  # the plain graph module's forward
    whole_step_s: float  # the plain graph module's forward + backward


def _measure(
    graph: OpGraph, flat_inputs: list, device: torch.device, repeats: int, warmup: int, progress: bool
) -> _Measured:
    gm = graph.graph_module
    params = [p for p in gm.parameters() if p.requires_grad]
    from tqdm.auto import tqdm  # only needed here; keeps `import partita` light

    with tqdm(
        total=graph.num_nodes * (1 + warmup + repeats), desc="profiling", unit="node", disable=not progress
    ) as bar:
        recorder = _NodeInterpreter(gm, device, keep_values=True, bar=bar)
        try:
            activation_bytes, owners = _record(recorder, flat_inputs, gm)
            loss = recorder.env[recorder.fx_nodes[graph.loss_node]]
            weight_share = _weight_shares(recorder, device, repeats, warmup)
            runs, flat = [], flat_module(gm)
            with _BackwardTimer(owners, graph.num_nodes, device) as backward_timer:
                # Interleaved, so that a change in machine load (shared machines) hits the per-node
                # and the whole-graph measurements alike and cancels out in the calibration.
                for i in range(warmup + repeats):
                    forward_s = _time_forward(gm, flat_inputs, device, bar)
                    backward_s = backward_timer.run(loss, params)
                    whole_forward_s, whole_step_s = _time_whole(graph, flat, flat_inputs, params, device)
                    if i >= warmup:
                        runs.append((forward_s, backward_s, whole_forward_s, whole_step_s))
        finally:
            # The recorded values' autograd graph holds _record's pack hook (every saved tensor
            # keeps its hooks), and the hook holds the recorder, whose ``env`` holds the values:
            # a cycle through C++ that Python's collector cannot see. Emptying ``env`` breaks it;
            # before, every profiled graph's activations and parameters stayed allocated (on a
            # GPU, until nothing more fit).
            recorder.env.clear()
    medians = [np.median([run[k] for run in runs], axis=0) for k in range(4)]
    return _Measured(medians[0], medians[1], weight_share, activation_bytes, float(medians[2]), float(medians[3]))


def _build_table(
    graph: OpGraph, m: _Measured, microbatch_size: int, device: torch.device, repeats: int, warmup: int
) -> CostTable:
    """Calibrate the raw medians against the whole-graph timings and assemble the table."""
    # Per-node timings miss the work between nodes (autograd engine scheduling, gradient
    # accumulation of multi-use tensors, Python glue); scaling spreads it over the nodes in
    # proportion to their own time, so the sums equal what a real step takes.
    raw_forward_sum_s, raw_backward_sum_s = float(m.forward_s.sum()), float(m.backward_s.sum())
    forward_scale = m.whole_forward_s / raw_forward_sum_s if raw_forward_sum_s > 0 else 1.0
    whole_backward_s = max(m.whole_step_s - m.whole_forward_s, 0.0)
    backward_scale = whole_backward_s / raw_backward_sum_s if raw_backward_sum_s > 0 else 1.0
    forward_s = m.forward_s * forward_scale
    backward_s = m.backward_s * backward_scale
    names, param_bytes, trainable, uses = param_arrays(graph)
    selective = selective_arrays(graph, microbatch_size, forward_s, measured_activation_bytes=m.activation_bytes)
    return CostTable(
        microbatch_size=microbatch_size,
        device=device_name(device),
        source="measured",
        forward_s=forward_s,
        backward_s=backward_s,
        backward_weight_s=backward_s * m.weight_share,
        activation_bytes=m.activation_bytes,
        output_bytes=np.asarray(output_bytes(graph, microbatch_size)),
        cut_bytes=np.asarray(cut_bytes(graph, microbatch_size)),
        **block_bytes(graph, microbatch_size)._asdict(),
        param_names=tuple(names),
        param_bytes=np.asarray(param_bytes),
        param_trainable=np.asarray(trainable),
        param_uses=tuple(np.asarray(u, dtype=np.int64) for u in uses),
        calibration=dict(
            forward_scale=forward_scale,
            backward_scale=backward_scale,
            whole_forward_s=m.whole_forward_s,
            whole_step_s=m.whole_step_s,
            repeats=float(repeats),
            warmup=float(warmup),
            num_threads=float(torch.get_num_threads()),
        ),
        **selective._asdict(),
    )


# ----------------------------------------------------------------------------- interpreting


def _now(device: torch.device) -> float:
    """Wall time after the device finished its queued work (CUDA kernels are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _NodeInterpreter(torch.fx.Interpreter):
    """Runs the graph node by node, timing each call_function (the call only: the generated
    code of a real stage has no interpreter overhead). ``running`` is the position in
    ``OpGraph.nodes`` of the node being run, for hooks to know whom to charge. A higher-order op
    (Llama's ``wrap_with_set_grad_enabled``) runs its nested graph within one call: one node.
    """

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, *, keep_values: bool = False, bar: Any = None):
        super().__init__(gm, garbage_collect_values=not keep_values)
        self.device, self.bar = device, bar
        self.fx_nodes = [n for n in gm.graph.nodes if n.op == "call_function"]  # OpGraph.nodes order
        self.position = {n: i for i, n in enumerate(self.fx_nodes)}
        self.forward_s = np.zeros(len(self.position))
        self.running = -1
        self.on_result: Callable[[int, Any], None] | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op != "call_function":
            return super().run_node(n)
        self.running = self.position[n]
        result = super().run_node(n)
        if self.on_result is not None:
            self.on_result(self.running, result)
        if self.bar is not None:
            self.bar.update()
        return result

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        start_s = _now(self.device)
        result = super().call_function(target, args, kwargs)
        self.forward_s[self.running] = _now(self.device) - start_s
        return result


def _record(recorder: _NodeInterpreter, flat_inputs: list, gm: torch.fx.GraphModule) -> tuple[np.ndarray, dict]:
    """One forward with grad: saved bytes per node and the autograd nodes each FX node created."""
    activation_bytes = np.zeros(len(recorder.position), dtype=np.int64)
    # Parameter storages are parameter memory; seeding `seen` with them excludes them (and
    # their views, which share the storage) from activation bytes.
    seen = {_storage_key(t) for t in (*gm.parameters(), *gm.buffers())}
    owners: dict[Any, int] = {}  # autograd node -> position of the FX node that created it

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in seen:  # every tensor stays alive during the run, so keys are never reused
            seen.add(key)
            activation_bytes[recorder.running] += t.untyped_storage().nbytes()
        # Detached: a node that saves its own output (softmax, tanh) would otherwise hold a tensor
        # whose grad_fn is that node, a cycle through C++ that outlives the run (see _measure).
        return t.detach()

    def claim(position: int, result: Any) -> None:
        # Autograd nodes reachable from this node's outputs and not claimed by an earlier FX
        # node were created by this one (composite ops such as matmul create several).
        stack = [t.grad_fn for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in owners:
                continue
            owners[fn] = position
            stack.extend(next_fn for next_fn, _ in fn.next_functions if next_fn is not None)

    recorder.on_result = claim
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        recorder.run(*flat_inputs, enable_io_processing=False)
    recorder.on_result = None
    return activation_bytes, owners


def _storage_key(t: torch.Tensor) -> tuple:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return ("tensor", id(t))


# ----------------------------------------------------------------------------- timing


class _BackwardTimer:
    """Times every node's backward inside the real backward of the recorded graph: pre/post hooks
    on each autograd node charge its time to the FX node that created it. ``autograd.grad`` (not
    ``backward``) leaves the parameters' ``.grad`` untouched."""

    def __init__(self, owners: dict, num_nodes: int, device: torch.device):
        self.owners, self.device = owners, device
        self.backward_s = np.zeros(num_nodes)
        self.handles: list = []

    def __enter__(self) -> _BackwardTimer:
        for fn, position in self.owners.items():
            if type(fn).__name__ != "AccumulateGrad":  # not run by autograd.grad w.r.t. params
                self.handles += self._hooks(fn, position)
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def run(self, loss: torch.Tensor, params: list) -> np.ndarray:
        self.backward_s[:] = 0.0
        if loss.requires_grad and params:
            torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        return self.backward_s.copy()

    def _hooks(self, fn: Any, position: int) -> list:
        start_s = [0.0]

        def before(grad_outputs: Any) -> None:
            start_s[0] = _now(self.device)

        def after(grad_inputs: Any, grad_outputs: Any) -> None:
            self.backward_s[position] += _now(self.device) - start_s[0]

        return [fn.register_prehook(before), fn.register_hook(after)]


def _time_forward(gm: torch.fx.GraphModule, flat_inputs: list, device: torch.device, bar: Any) -> np.ndarray:
    """Per-node forward time of one interpreted run with grad enabled (as in training)."""
    interpreter = _NodeInterpreter(gm, device, bar=bar)
    with torch.enable_grad():
        interpreter.run(*flat_inputs, enable_io_processing=False)
    return interpreter.forward_s


def _weight_shares(recorder: _NodeInterpreter, device: torch.device, repeats: int, warmup: int) -> np.ndarray:
    """W / (W + B) per node with trainable parameters, from isolated re-runs on recorded inputs.
    In the real backward one autograd node computes both parts (AddmmBackward), so the split
    needs separate runs; only the ratio is used, the total comes from the real backward."""
    shares = np.zeros(len(recorder.position))
    for fx_node, position in recorder.position.items():
        params = [recorder.env[a] for a in fx_node.all_input_nodes if a.op == "get_attr"]
        params = [p for p in params if isinstance(p, torch.Tensor) and p.requires_grad and p.is_leaf]
        if params:
            shares[position] = _weight_share(fx_node, recorder.env, params, device, repeats, warmup)
    return shares


def _weight_share(
    fx_node: torch.fx.Node, env: dict, params: list, device: torch.device, repeats: int, warmup: int
) -> float:
    inputs: list[torch.Tensor] = []

    def fresh_leaf(t: Any) -> Any:
        # A new leaf cuts the history, so the gradient stops at this node's own inputs.
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t = t.detach().requires_grad_()
            inputs.append(t)
        return t

    def feed(a: torch.fx.Node) -> Any:
        return env[a] if a.op == "get_attr" else pytree.tree_map(fresh_leaf, env[a])

    args = torch.fx.node.map_arg(fx_node.args, feed)
    kwargs = torch.fx.node.map_arg(fx_node.kwargs, feed)
    try:
        with torch.enable_grad():
            result = fx_node.target(*args, **kwargs)
    except RuntimeError:
        # Some ops refuse fresh leaves (in-place ops on an input that requires grad): without a
        # measurement, assume W and B cost the same, as they do for a matmul.
        return 0.5 if inputs else 1.0
    outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs:
        return 0.0
    grad_outputs = [torch.randn_like(t) for t in outputs]

    def grads_of(wrt: list) -> Callable[[], Any]:
        return lambda: torch.autograd.grad(outputs, wrt, grad_outputs, retain_graph=True, allow_unused=True)

    weight_s = _median_s(grads_of(params), device, repeats, warmup)
    input_s = _median_s(grads_of(inputs), device, repeats, warmup) if inputs else 0.0
    return weight_s / (weight_s + input_s) if weight_s + input_s > 0 else 0.0


def _median_s(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> float:
    times_s = []
    for i in range(warmup + repeats):
        start_s = _now(device)
        fn()
        if i >= warmup:
            times_s.append(_now(device) - start_s)
    return float(np.median(times_s))


def flat_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` without its pytree input/output handling: called with the flat inputs, returns the
    flat outputs, as a stage module runs (the exported module checks and flattens its inputs on
    every call, a fixed cost that no stage pays and that would be spread over the nodes)."""
    graph = torch.fx.Graph()  # a node-by-node copy: no pytree codegen (deep-copying it trips torch's LeafSpec warning)
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _time_whole(
    graph: OpGraph, flat: torch.fx.GraphModule, flat_inputs: list, params: list, device: torch.device
) -> tuple[float, float]:
    """(forward, forward + backward) of the whole graph as one flat module: what a stage runs."""
    start_s = _now(device)
    with torch.enable_grad():
        loss = flat(*flat_inputs)[graph.loss_output_index]
    forward_end_s = _now(device)
    if loss.requires_grad and params:
        torch.autograd.grad(loss, params, allow_unused=True)
    return forward_end_s - start_s, _now(device) - start_s


# ----------------------------------------------------------------------------- inputs


def microbatch_inputs(
    graph: OpGraph, inputs: tuple[tuple, dict, Any] | None, microbatch_size: int, device: torch.device
) -> list:
    """Flat inputs in placeholder order, each batch-dim tensor cut or repeated to the micro-batch.

    Without ``inputs``, tensors are synthesized from their recorded shape and dtype: floats
    uniform in [0, 1), booleans True and integers 1. One is a valid index for every embedding
    and every class count >= 2, and means "attend" in an attention mask; the costs of the ops
    here do not depend on the values. Pass real inputs when some do (data-dependent shapes).
    """
    if not graph.dynamic_batch and microbatch_size != graph.batch_size:
        raise InputError(
            f"the graph was captured with a static batch size of {graph.batch_size} and cannot run "
            f"at microbatch_size={microbatch_size}: capture with dynamic_batch=True, or profile at "
            f"microbatch_size={graph.batch_size}"
        )
    leaves = _synthesized_leaves(graph) if inputs is None else _user_leaves(graph, inputs)
    flat = []
    for leaf, info in zip(leaves, graph.inputs):
        if isinstance(leaf, torch.Tensor):
            dim = info.tensor.batch_dim if info.tensor is not None else None
            if dim is not None and leaf.shape[dim] != microbatch_size:
                # Cycle through the example rows: cuts when there are more, repeats when fewer.
                rows = torch.arange(microbatch_size, device=leaf.device) % leaf.shape[dim]
                leaf = leaf.index_select(dim, rows)
            leaf = leaf.detach().to(device)
        flat.append(leaf)
    return flat


def _synthesized_leaves(graph: OpGraph) -> list:
    leaves = []
    for info in graph.inputs:
        if info.tensor is None:
            if info.consumers:
                raise InputError(
                    f"graph input {info.path} is not a tensor and cannot be synthesized: pass "
                    "profile(graph, inputs=(args, kwargs, target)) with the example inputs"
                )
            leaves.append(None)
            continue
        dtype = getattr(torch, info.tensor.dtype)
        if dtype.is_floating_point or dtype.is_complex:
            leaves.append(torch.rand(info.tensor.shape, dtype=dtype))
        else:
            leaves.append(torch.ones(info.tensor.shape, dtype=dtype))
    return leaves


def _user_leaves(graph: OpGraph, inputs: Any) -> list:
    """The leaves of the user's ``(args, kwargs, target)`` in the order of the graph's placeholders."""
    if not (isinstance(inputs, (tuple, list)) and len(inputs) == 3):
        raise InputError(f"inputs must be a tuple (args, kwargs, target), got {type(inputs).__name__}")
    args, kwargs, target = inputs
    if target is not None and not graph.has_loss_fn:
        raise InputError("inputs has a target but the graph was captured without loss_fn: pass target=None")
    user_tree = (
        ((tuple(args), dict(kwargs or {}), target), {}) if graph.has_loss_fn else (tuple(args), dict(kwargs or {}))
    )
    given = {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(user_tree)[0]}
    # Match by key path rather than position, so that keyword order does not matter.
    in_spec = graph.exported_program.call_spec.in_spec
    skeleton = pytree.tree_unflatten([None] * in_spec.num_leaves, in_spec)
    expected = [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(skeleton)[0]]
    missing, extra = [k for k in expected if k not in given], sorted(set(given) - set(expected))
    if missing or extra or len(expected) != len(graph.inputs):
        raise InputError(
            f"inputs do not have the structure the graph was captured with: missing {missing}, "
            f"unexpected {extra}. Pass the same args/kwargs (and target) as to partita.capture"
        )
    leaves = [given[k] for k in expected]
    check_flat_inputs(graph, leaves)  # None where a tensor was captured, or the reverse
    return leaves


# ----------------------------------------------------------------------------- devices and state


def _resolve_device(gm: torch.fx.GraphModule, device: str | torch.device | None) -> torch.device:
    """The device holding the parameters; a different ``device`` is refused (we never move a model)."""
    tensors = [*gm.parameters(), *gm.buffers()]
    if any(t.is_meta for t in tensors):
        raise InputError(
            "the model's parameters are on the meta device (no weights), so its kernels cannot be "
            "timed: use analytic costs instead (partita.cost.analytic.analytic_costs(graph, "
            "device_spec, microbatch_size)), or build the model with real weights to profile it"
        )
    held = sorted({str(t.device) for t in tensors})
    if len(held) > 1:
        raise InputError(f"the model's parameters are spread over devices {held}: move the whole model to one device")
    model_device = torch.device(held[0]) if held else torch.device("cpu")
    if device is None:
        return model_device
    wanted = torch.device(device)
    if wanted.type == "cuda" and wanted.index is None:
        wanted = torch.device("cuda", torch.cuda.current_device())
    if wanted != model_device:
        raise InputError(
            f"profile(device={str(device)!r}) but the model's parameters are on {model_device}: "
            f"move the model first (model.to({str(wanted)!r})) or pass device={str(model_device)!r}"
        )
    return wanted


def device_name(device: torch.device) -> str:
    """ "cpu", or the catalog name of the GPU ("NVIDIA H100 80GB HBM3" -> "h100"), else its name in lower case."""
    if device.type != "cuda":
        return device.type
    words = torch.cuda.get_device_name(device).lower().replace("_", " ").split()
    words = [w for w in words if w not in ("nvidia", "tesla", "geforce", "amd", "instinct")]
    known = set(known_devices())
    for k in range(len(words), 0, -1):  # the longest leading run of words the catalog knows
        if "-".join(words[:k]) in known:
            return get_device("-".join(words[:k])).name
    return "-".join(words) or "cuda"


@contextlib.contextmanager
def _preserved_state(gm: torch.fx.GraphModule, device: torch.device) -> Iterator[None]:
    """Seeds the RNG (same random inputs and dropout masks every call), then restores the
    caller's RNG state and the model's buffers (batch-norm statistics) afterwards."""
    buffers = [(b, b.detach().clone()) for b in gm.buffers()]
    with torch.random.fork_rng(devices=[device.index] if device.type == "cuda" else []):
        # Seed only the generators fork_rng restores (torch.manual_seed would reseed every GPU).
        torch.random.default_generator.manual_seed(0)
        if device.type == "cuda":
            torch.cuda.manual_seed(0)
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
