"""bf16 weight copies as the runtime makes them (partita/runtime/precision.py): the micro-batches of a
step share one autocast copy of each weight, with the same numbers as a cast per micro-batch."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from partita.runtime.precision import Compute
from partita.types import Precision

BF16 = Compute(Precision.BF16, "cpu")
MICROBATCHES = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


class _WeightCasts(TorchDispatchMode):
    """Counts the casts of ``weights`` (by shape) to bf16."""

    def __init__(self, weights: set) -> None:
        super().__init__()
        self.weights, self.count = weights, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") is torch.bfloat16:
            self.count += args[0].shape in self.weights
        return func(*args, **kwargs)


def _step(model: torch.nn.Module, step: contextlib.AbstractContextManager, recomputes: bool) -> tuple:
    """Every micro-batch's forward, then every backward (GPipe's order): the storages of the bf16
    weight copies the forwards saved for backward, how many casts of the weights ran, and the
    gradients."""
    weights = {p.shape for p in model.parameters() if p.dim() == 2}
    saved: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and t.dim() == 2 and (t.shape in weights or t.t().shape in weights):
            saved.add(t.untyped_storage().data_ptr())
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    batches = [torch.randn(8, 16, requires_grad=True) for _ in range(MICROBATCHES)]
    casts = _WeightCasts(weights)
    with step, casts, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        losses = []
        for x in batches:
            with BF16.context(recomputes=recomputes):
                out = checkpoint(model, x, use_reentrant=False) if recomputes else model(x)
            losses.append(out.float().square().mean())
        for loss in losses:
            loss.backward()
    return saved, casts.count, [p.grad.clone() for p in model.parameters()]


def test_micro_batches_of_a_step_share_one_bf16_copy_of_each_weight_with_the_same_numbers():
    model = _model()
    shared, casts, grads = _step(model, BF16.step_context(), recomputes=False)
    apart, apart_casts, reference = _step(model, contextlib.nullcontext(), recomputes=False)
    assert len(shared) == casts == 2, "one copy of each of the two weights for the whole step"
    assert len(apart) == apart_casts == 2 * MICROBATCHES, "without the step's region torch casts in every forward"
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))


def test_a_recomputing_stage_casts_afresh_in_each_forward_and_recomputation():
    model = _model()
    _, _, reference = _step(model, contextlib.nullcontext(), recomputes=False)
    _, casts, grads = _step(model, BF16.step_context(), recomputes=True)
    assert casts == 2 * 2 * MICROBATCHES  # no copy is held between a forward and its recomputation
    assert all(torch.equal(a, b) for a, b in zip(grads, reference, strict=True))


def test_fp32_plans_enter_no_autocast_region():
    fp32 = Compute(Precision.FP32, "cpu")
    with fp32.step_context(), fp32.context():
        assert not torch.is_autocast_enabled("cpu")
