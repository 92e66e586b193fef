"""Compiled blocks: each segment of a stage (``partita.runtime.segments``) run through
``torch.compile`` (inductor), compiled once per distinct structure and reused by its repeats.

Glossary
--------
structure   a segment's graph with its node names left out: the operations in order, their
            targets, their constant arguments and which earlier value each reads. The weights are
            placeholders of a segment's graph (the stage reads them and passes them in), so the
            32 decoder layers of a Llama share one structure, and one compiled function runs all
            of them with each layer's weights.
signature   what one compiled function is specialised to: the structure, the recomputation it
            runs under (none, full, selective: the checkpoint is traced inside the compiled
            region, as torchtitan orders them), and the shapes, dtypes, strides and gradient
            flags of its inputs, the grad mode and the autocast state. Each signature gets its
            own function object (its own code object, where dynamo keeps its cache), so dynamo
            compiles each once and never meets a guard that fails, and so never reaches its
            recompilation limit, past which it would run eagerly without a word: a batch padded
            to another length (``partita.runtime.variants``) is another signature, compiled once,
            and the number of compilations is bounded by the shapes the plan admits.
buffers     the compiled backward never reuses the forward's saved tensors as its scratch
            (``donated_buffer=False``): the zero-bubble schedule runs each backward in two passes
            over one graph.
pieces      a segment is compiled whole (``fullgraph=True``); one holding an operation dynamo
            cannot trace (tensor parallelism's asynchronous collectives) is compiled in pieces
            around it, with a RuntimeWarning naming the cause (once per cause). A segment inductor
            fails to compile is a ``CompileError`` naming it and how to run without compiling.

Exactness: inductor computes the same operations in another order inside a fused kernel, so the
numbers equal eager execution to rounding (fp32: about 1e-7 relative), not bit for bit.
Operations that draw random numbers (dropout) take eager's generator (``fallback_random``), so a
compiled run draws the same masks as the unsplit eager model.

The compiled functions live for the process (``_COMPILED``): the configurations of one launch
that share a model share its compiled blocks, and inductor's on-disk cache serves later launches.
"""

from __future__ import annotations

import time
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import checkpoint

from partita.errors import CompileError
from partita.types import Recompute

__all__ = ["CompiledSegments", "compile_seconds", "compiled_count", "structure_of"]

_OPTIONS = {"fallback_random": True}  # dropout draws eager's numbers (module docstring)

# signature -> compiled function, for the whole process
_COMPILED: dict[tuple, Callable[..., Any]] = {}
_SECONDS: list[float] = []  # the first call of each compiled function: tracing and compiling
_PIECES_REASONS: set[str] = set()  # why a segment was compiled in pieces (warned once each)


def _without_donated_buffers():
    """Compile without donating the forward's saved buffers to the backward: the zero-bubble
    schedule's input-gradient pass keeps the graph for its weight pass (``retain_graph=True``),
    which a backward with donated buffers refuses."""
    return torch._functorch.config.patch(donated_buffer=False)


def compiled_count() -> int:
    """How many compiled functions this process has made (one per signature)."""
    return len(_COMPILED)


def compile_seconds() -> float:
    """The seconds this process spent in the first call of its compiled functions (dynamo's
    tracing, inductor's compilation or its cache, and that first run)."""
    return sum(_SECONDS)


def structure_of(graph_module: torch.fx.GraphModule) -> tuple:
    """The structure of a segment's graph (module docstring): equal for two graphs that compute
    the same function of their placeholders."""
    index: dict[torch.fx.Node, int] = {}
    items = []
    for i, node in enumerate(graph_module.graph.nodes):
        index[node] = i
        args = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: ("%", index[n]))
        items.append((node.op, "" if node.op == "placeholder" else _target_name(node.target), repr(args)))
    return tuple(items)


def _target_name(target: Any) -> str:
    if isinstance(target, str):  # get_attr and call_module: an attribute path of the segment
        return target
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', str(target))}"


class CompiledSegments:
    """The compiled functions of one stage's segments: ``call(k, submodule, args, ...)`` runs
    segment ``k`` compiled, checkpointed inside the compiled region when it recomputes."""

    def __init__(self, submodules: Sequence[torch.fx.GraphModule]):
        self._structures = [structure_of(m) for m in submodules]

    def call(
        self,
        k: int,
        submodule: torch.fx.GraphModule,
        args: Sequence[Any],
        recompute: Recompute,
        context_fn: Callable[[], Any] | None,
    ) -> Any:
        """Segment ``k`` (``submodule``) on ``args`` (its weights and values, in its placeholders'
        order), recomputed in backward at ``recompute`` (NONE: not checkpointed)."""
        level = Recompute.FULL if recompute is Recompute.SELECTIVE and context_fn is None else recompute
        signature = (self._structures[k], level, _inputs_signature(args))
        fn = _COMPILED.get(signature)
        if fn is not None:
            return fn(*args)
        start = time.perf_counter()
        try:
            fn = _COMPILED[signature] = _compile(submodule, level, context_fn, whole=True)
            with _without_donated_buffers():
                out = fn(*args)
        except torch._dynamo.exc.Unsupported as e:  # e.g. a collective dynamo cannot trace
            reason = str(e).splitlines()[0]
            if reason not in _PIECES_REASONS:
                _PIECES_REASONS.add(reason)
                warnings.warn(
                    f"segment {k} of a stage ({len(submodule.graph.nodes)} nodes) is compiled in pieces, its "
                    f"operations run eagerly where torch.compile cannot trace them: {reason}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            fn = _COMPILED[signature] = _compile(submodule, level, context_fn, whole=False)
            with _without_donated_buffers():
                out = fn(*args)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            del _COMPILED[signature]
            raise CompileError(
                f"segment {k} of a stage ({len(submodule.graph.nodes)} nodes) failed to compile: "
                f"{str(e).splitlines()[0]}; run the plan without compiled blocks (PlanOptions(compile=False), "
                "partita train --no-compile)"
            ) from e
        _SECONDS.append(time.perf_counter() - start)
        return out


def _inputs_signature(args: Sequence[Any]) -> tuple:
    autocast = (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.cuda.is_available() and torch.is_autocast_enabled("cuda"),
    )
    return (
        torch.is_grad_enabled(),
        autocast,
        tuple(
            (tuple(a.shape), a.stride(), a.dtype, a.device, a.requires_grad) if isinstance(a, torch.Tensor) else repr(a)
            for a in args
        ),
    )


def _compile(
    submodule: torch.fx.GraphModule, level: Recompute, context_fn: Callable[[], Any] | None, *, whole: bool
) -> Callable:
    if level is Recompute.NONE:
        run: Callable[..., Any] = submodule
    else:
        kwargs = {} if level is Recompute.FULL else {"context_fn": context_fn}

        def checkpointed(*args: Any) -> Any:
            return checkpoint(submodule, *args, use_reentrant=False, **kwargs)

        run = _fresh(checkpointed)
    return torch.compile(run, fullgraph=whole, dynamic=False, options=_OPTIONS)


def _fresh(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with a code object of its own: dynamo keeps its compiled graphs and their guards on
    the code object, so functions made from one ``def`` would otherwise share them (and recompile
    on each other's closure until dynamo's recompilation limit)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
