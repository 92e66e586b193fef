"""The plan's compute precision as the stages run it.

``bf16`` (``Plan.precision``): the parameters stay fp32 -- the master weights the optimizer
updates, the checkpoints keep under the model's names -- and every stage runs its graph under
``torch.autocast(device, bfloat16)``, exactly as the unsplit model trains under the same
autocast policy: matrix products in bf16, reductions, norms and the loss in fp32, gradients of
the parameters in fp32 and reduced in fp32. Stages sharded with FSDP2 gather their weights in bf16
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, as torchtitan does): half
the gather traffic and half the gathered copy. Such a stage then reads every weight rounded to
bf16, also in the ops autocast keeps in fp32 (norms, the embedding's lookup, added biases): its
reference is unsplit training whose forwards read the weights cast to bf16 under the same autocast
(tests/dist/test_sharding.py), the gradients flowing back to the fp32 master weights. A norm is fed
its weight in its input's dtype (``align_norm_weights``: the CPU's kernels refuse a bf16 weight
beside an fp32 input).

Weight copies: autocast casts each fp32 weight to bf16 where an op reads it, and the op saves that
copy for its backward. Autocast caches the casts of leaf tensors until the outermost autocast
region exits; with one region per stage forward, that drops them at the end of each forward, and
every micro-batch in flight holds its own bf16 copy of the stage's weights (a GPT layer of hidden
size 20,480 at tensor-parallel degree 8: 1.3 GB, twice what it keeps of one sample of 2,048 tokens
without recomputation). ``step_context`` holds one region open over the whole step, so the
micro-batches of a stage that keeps its activations share one copy, cast once per step (the weights do not change before the optimizer step, after the region). The
values are the same casts, so the numbers are bit for bit those of a cast per micro-batch. A
recomputing stage casts without the cache: its forward saves nothing, and its recomputation,
which torch may run on another thread (the autograd engine's, on GPUs), holds one copy at a time.

Boundary tensors: the activations a stage sends (fp32 tensors on the autograd path) travel in
bf16 -- half the bytes, as the planner's cost model counts them -- and so do their gradients
on the way back. Tensors without gradients (masks, ids, labels) travel as they are: a mask's
``finfo(float32).min`` does not survive bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from partita.runtime.stages import StageModule
from partita.types import Precision

__all__ = ["FP32", "Compute", "align_norm_weights", "drop_dtype_assertions"]


@dataclass(frozen=True)
class Compute:
    """How this rank's stages compute: the plan's ``precision`` on a device of ``device_type``."""

    precision: Precision = Precision.FP32
    device_type: str = "cpu"

    @property
    def low(self) -> torch.dtype | None:
        """The autocast dtype, None in fp32."""
        return torch.bfloat16 if self.precision is Precision.BF16 else None

    def context(self, recomputes: bool = False) -> contextlib.AbstractContextManager:
        """Where a stage's forward (and its recomputation) runs. A stage that keeps its activations
        takes autocast's cached weight casts (one bf16 copy of each weight per step, inside
        ``step_context``); a recomputing stage (``recomputes``) casts afresh in each forward and
        recomputation, so that no copy outlives the micro-batch that reads it."""
        if self.low is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.low, cache_enabled=not recomputes)

    def step_context(self) -> contextlib.AbstractContextManager:
        """Around a training step's forwards and backwards (module docstring, "Weight copies"): an
        autocast region that casts nothing itself but keeps autocast's cache of weight casts alive
        until the step ends, where torch would drop it at the end of every forward."""
        if self.low is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.low, enabled=False)

    def boundary(self, t: Any) -> Any:
        """A tensor a stage sends to the next one: activations in the compute dtype."""
        if self.low is not None and isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.requires_grad:
            return t.to(self.low)
        return t

    def fsdp_policy(self) -> Any:
        """FSDP2's MixedPrecisionPolicy for a sharded stage: parameters gathered in the compute dtype
        (bf16: half the traffic and half the gathered copy, as torchtitan gathers; fp32 otherwise),
        gradients reduced in fp32; inputs left as they come (see the module docstring)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.low, reduce_dtype=torch.float32, cast_forward_inputs=False)


def drop_dtype_assertions(stages: Iterable[StageModule]) -> None:
    """Remove export's ``aten._assert_tensor_metadata`` checks from the stages' graphs: they pin the
    dtypes of the captured (fp32) run, which autocast changes by design."""
    for stage in stages:
        graph = stage.graph_module.graph
        found = [n for n in graph.nodes if n.op == "call_function" and n.target is _ASSERT_METADATA]
        for node in found:
            graph.erase_node(node)
        if found:
            stage.graph_module.recompile()


def align_norm_weights(stages: Iterable[StageModule]) -> None:
    """In the graphs of stages that gather bf16 weights (sharded stages of a bf16 plan), feed a
    norm its weight and bias in its input's dtype: the CPU's layer and group norms refuse bf16
    weights beside an fp32 input (a float input straight from the data), and the cast makes no
    difference elsewhere (CUDA's autocast runs norms in fp32 anyway, on the same bf16-rounded
    values)."""
    for stage in stages:
        graph = stage.graph_module.graph
        changed = False
        for node in list(graph.nodes):
            positions = _NORM_WEIGHTS.get(node.target) if node.op == "call_function" else None
            if positions is None:
                continue
            x = node.args[0]
            args = list(node.args)
            for position in positions:
                if position < len(args) and isinstance(args[position], torch.fx.Node):
                    with graph.inserting_before(node):
                        args[position] = graph.call_function(_as_dtype_of, (args[position], x))
                    changed = True
            node.args = tuple(args)
        if changed:
            stage.graph_module.recompile()


def _as_dtype_of(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return weight if weight.dtype == x.dtype else weight.to(x.dtype)


_NORM_WEIGHTS = {
    torch.ops.aten.layer_norm.default: (2, 3),  # (input, normalized_shape, weight, bias, eps, cudnn)
    torch.ops.aten.group_norm.default: (2, 3),  # (input, num_groups, weight, bias, eps, cudnn)
}
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default

FP32 = Compute()  # full precision: no autocast, boundaries as they are (the device type is then unused)
