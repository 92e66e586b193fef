"""Loss normalisation over the global batch (partita.capturing.normalizer, partita.runtime.loss_scaling),
in one process: the stages of a plan run every slice (micro-batch) in turn, and the summed
gradients must equal full-batch training's, whatever each slice's count of valid labels.

The multi-process runs (1F1B, data parallel, GPT-2) are in tests/dist/test_exact_losses.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import partita
from partita.capturing.normalizer import TermKind, analyse_loss
from partita.errors import InputError
from partita.planning.manual import manual_plan
from partita.runtime.loss_scaling import LossScaling
from partita.runtime.stages import flatten_inputs, narrow_batch, run_sequential, split_graph

BATCH, SEQ, VOCAB = 8, 6, 11


class TinyLM(torch.nn.Module):
    """Embedding, a causal mixing layer, a head; loss: cross-entropy over shifted labels, -100 ignored."""

    def __init__(self, kind: str = "ce"):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB)
        self.register_buffer("class_weight", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, input_ids, labels, mask):
        h = self.embed(input_ids)
        h = h + torch.tanh(self.mix(torch.cumsum(h, dim=1) / 4.0))
        logits = self.head(h)[:, :-1].reshape(-1, VOCAB)
        target = labels[:, 1:].reshape(-1)
        k = self.kind
        if k == "ce":
            return F.cross_entropy(logits, target)
        if k == "ce-mean":  # HF-style loss.mean() over a 0-dim loss
            return F.cross_entropy(logits, target).mean()
        if k == "nll-weighted-smoothed":
            return F.cross_entropy(logits, target, weight=self.class_weight, label_smoothing=0.1)
        if k == "nll":
            return F.nll_loss(F.log_softmax(logits, -1), target, ignore_index=-100)
        per_token = logits.logsumexp(-1).reshape(-1, SEQ - 1)
        m = mask[:, 1:]
        if k == "masked":
            return (per_token * m).sum() / m.sum()
        if k == "masked-reciprocal":
            return (per_token * m).sum() * (1.0 / m.sum().clamp(min=1.0))
        if k == "sum":
            return (per_token * m).sum()
        if k == "numel":
            return per_token.sum() / per_token.numel()
        if k == "mse":
            return F.mse_loss(per_token, torch.zeros_like(per_token))
        if k == "combo":
            return (
                0.5 * F.cross_entropy(logits, target)
                + (per_token * m).sum() / m.sum()
                + 0.01 * (self.head.weight**2).sum()
                + 0.1 * per_token.mean()
            )
        if k == "squared":
            return F.cross_entropy(logits, target) ** 2
        raise AssertionError(k)


def padded_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample i has a different number of valid labels (the rest -100), 0 of them in sample 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.tensor([6, 2, 5, 0, 1, 6, 3, 4])[:BATCH]
    valid = torch.arange(SEQ)[None, :] < lengths[:, None]
    labels = torch.where(valid, ids, torch.full_like(ids, -100))
    return ids, labels, valid.float()


def _capture(kind: str):
    model = TinyLM(kind)
    ids, labels, mask = padded_batch()
    graph = partita.capture(model, (ids, labels, mask))
    return model, graph, (ids, labels, mask)


def _sliced_grads(model, graph, batch, num_stages: int, num_slices: int, cut: int | None = None):
    """Every slice through every stage in this process, as the trainer's schedule would, with
    LossScaling applied; returns (reported loss, gradients scaled as the trainer scales them, scaling)."""
    n = graph.num_nodes
    cuts = [0, cut if cut is not None else n // 2, n] if num_stages == 2 else [0, n]
    plan = manual_plan(
        graph,
        cuts,
        schedule="1f1b" if num_stages == 2 else "gpipe",
        num_rank_groups=num_stages,
        num_microbatches=num_slices,
        global_batch_size=BATCH,
    )
    stages = split_graph(graph, plan.boundaries)
    scaling = LossScaling(graph, plan, stages, stages, torch.device("cpu"))
    flat = flatten_inputs(graph, batch)
    scaling.update(flat)
    size = BATCH // num_slices
    losses = []
    for i in range(num_slices):
        loss = run_sequential(stages, narrow_batch(graph, flat, i * size, size))
        loss.backward()
        losses.append(loss.detach())
    grads = {name: p.grad * scaling.grad_scale for name, p in model.named_parameters()}
    return float(scaling.reported_loss(losses)), grads, scaling


def _reference(model, batch):
    ref = copy.deepcopy(model)
    loss = ref(*batch)
    loss.backward()
    return float(loss.detach()), {name: p.grad for name, p in ref.named_parameters()}


def test_the_loss_structures_of_the_zoo_and_of_hand_written_losses():
    kinds = {
        "ce": [TermKind.COUNT_MEAN],
        "nll": [TermKind.COUNT_MEAN],
        "masked": [TermKind.SUM],
        "sum": [TermKind.SUM],
        "mse": [TermKind.MEAN],
        "combo": [TermKind.COUNT_MEAN, TermKind.SUM, TermKind.CONSTANT, TermKind.MEAN],
    }
    for kind, expected in kinds.items():
        structure = analyse_loss(_capture(kind)[1])
        assert structure.recognised, (kind, structure.describe())
        assert sorted(t.kind.value for t in structure.terms) == sorted(k.value for k in expected), structure.describe()
    assert len(analyse_loss(_capture("masked")[1]).factors) == 1
    assert analyse_loss(_capture("mse")[1]).averages_equal_counts
    squared = analyse_loss(_capture("squared")[1])
    assert not squared.recognised and squared.unknown.op == "aten.pow.Tensor_Scalar"
    assert "test_loss_scaling.py" in squared.unknown.source


@pytest.mark.parametrize(
    "kind",
    ["ce", "ce-mean", "nll", "nll-weighted-smoothed", "masked", "masked-reciprocal", "sum", "numel", "mse", "combo"],
)
@pytest.mark.parametrize("num_stages,num_slices", [(2, 4), (1, 2), (2, 8)])
def test_slices_sum_to_the_full_batch_gradient(kind, num_stages, num_slices):
    """Micro-batches holding 0 to 22 valid labels: the step equals full-batch training (an
    all-ignored slice included: its loss is 0, not NaN)."""
    model, graph, batch = _capture(kind)
    ref_loss, ref_grads = _reference(model, batch)
    loss, grads, scaling = _sliced_grads(model, graph, batch, num_stages, num_slices)
    assert scaling.warning is None
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{kind}: gradient of {name}")


def test_the_slices_mean_is_wrong_for_padded_labels_without_global_normalisation():
    """The failure this module prevents: averaging per-slice means of a padded batch."""
    model, graph, batch = _capture("ce")
    _, ref_grads = _reference(model, batch)
    flat = flatten_inputs(graph, batch)
    stages = split_graph(graph, [0, graph.num_nodes])
    for i in range(4):
        run_sequential(stages, narrow_batch(graph, flat, 2 * i, 2)).backward()
    diff = max(float((p.grad / 4 - ref_grads[n]).abs().max()) for n, p in model.named_parameters())
    assert diff > 1e-3


def test_a_squared_batch_mean_couples_samples_and_a_split_of_it_is_refused():
    """(mean cross-entropy)^2 is no sum of per-sample terms: splitting the batch would train another loss."""
    model, graph, batch = _capture("squared")
    with pytest.raises(InputError, match=r"pow.*statistic of the whole batch.*one micro-batch and one replica"):
        _sliced_grads(model, graph, batch, 2, 4)


def test_one_slice_needs_nothing():
    model, graph, batch = _capture("squared")
    _, _, scaling = _sliced_grads(model, graph, batch, 1, 1)
    assert scaling.warning is None and not scaling.normalised and scaling.grad_scale == 1.0


def test_a_cut_between_the_parts_of_the_loss_rewrites_the_stage_that_computes_each():
    """combo's cross-entropy is computed before the cut, its masked mean after it."""
    model, graph, batch = _capture("combo")
    ce = next(n.index for n in graph.nodes if n.target == "aten.cross_entropy_loss.default")
    ref_loss, ref_grads = _reference(model, batch)
    loss, grads, scaling = _sliced_grads(model, graph, batch, 2, 4, cut=ce + 1)
    assert scaling.normalised
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)


def test_gpt2_with_padded_labels():
    pytest.importorskip("transformers")
    from partita import examples

    ex = examples.build("gpt2", batch_size=BATCH, seq_len=16)
    labels = ex.kwargs["labels"].clone()
    for i in range(BATCH):
        labels[i, 16 - 2 * i :] = -100  # 16, 14, ..., 2 valid labels
    kwargs = {**ex.kwargs, "labels": labels}
    graph = partita.capture(ex.model, (), kwargs)
    ref = copy.deepcopy(ex.model)
    ref(**kwargs).loss.backward()
    plan = manual_plan(
        graph,
        [0, graph.num_nodes // 2, graph.num_nodes],
        schedule="1f1b",
        num_rank_groups=2,
        num_microbatches=4,
        global_batch_size=BATCH,
    )
    stages = split_graph(graph, plan.boundaries)
    scaling = LossScaling(graph, plan, stages, stages, torch.device("cpu"))
    flat = flatten_inputs(graph, (), kwargs)
    scaling.update(flat)
    for i in range(4):
        run_sequential(stages, narrow_batch(graph, flat, 2 * i, 2)).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in ex.model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-7)


def _shared_grads(model, graph, batch, shares: tuple[int, ...], num_microbatches: int, cut: int | None = None):
    """Every replica of a plan whose replicas take unequal ``shares`` of each micro-batch, run in
    turn in this process (each replica its own stages, rewritten for it): its slices through the
    stages, gradients summed over replicas and scaled as the trainer does."""
    n = graph.num_nodes
    cuts = [0, n] if cut is None else [0, cut, n]
    groups = len(cuts) - 1
    plan = manual_plan(
        graph,
        cuts,
        schedule="gpipe",
        num_rank_groups=groups,
        replicas=(len(shares),) * groups,
        num_microbatches=num_microbatches,
        global_batch_size=BATCH,
        replica_samples=[shares] * groups,
    )
    flat = flatten_inputs(graph, batch)
    b = BATCH // num_microbatches
    losses, scale, warnings = [], None, set()
    for replica, size in enumerate(shares):
        stages = split_graph(graph, plan.boundaries)
        scaling = LossScaling(graph, plan, stages, stages, torch.device("cpu"), replica=replica)
        scaling.update(flat)
        first = sum(shares[:replica])
        mine = []
        for i in range(num_microbatches):
            loss = run_sequential(stages, narrow_batch(graph, flat, i * b + first, size))
            loss.backward()
            mine.append(loss.detach())
        losses.append(scaling.reported_loss(mine))  # this replica's part of the full-batch loss
        scale = scaling.grad_scale
        warnings.add(scaling.warning)
    grads = {name: p.grad * scale for name, p in model.named_parameters()}
    return float(sum(losses)), grads, warnings


@pytest.mark.parametrize(
    "kind", ["ce", "nll-weighted-smoothed", "masked", "masked-reciprocal", "sum", "numel", "mse", "combo"]
)
@pytest.mark.parametrize("shares,num_microbatches", [((3, 1), 2), ((1, 2, 5), 1), ((6, 2), 1)])
def test_unequal_shares_weigh_each_slice_by_its_samples(kind, shares, num_microbatches):
    """Replicas of unequal speed run 3 and 1 (or 1, 2 and 5) samples of each micro-batch: means over
    a slice (mse, the numel mean, combo's mean and constant) are weighted by their samples, counts
    over the global batch need nothing; the step equals full-batch training."""
    model, graph, batch = _capture(kind)
    ref_loss, ref_grads = _reference(model, batch)
    loss, grads, warnings = _shared_grads(model, graph, batch, shares, num_microbatches)
    assert warnings == {None}
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{kind}: gradient of {name}")


def test_unequal_shares_with_the_loss_cut_in_two():
    """combo's cross-entropy before the cut, the rest after it; both stages with shares (3, 1)."""
    model, graph, batch = _capture("combo")
    ce = next(n.index for n in graph.nodes if n.target == "aten.cross_entropy_loss.default")
    ref_loss, ref_grads = _reference(model, batch)
    loss, grads, warnings = _shared_grads(model, graph, batch, (3, 1), 2, cut=ce + 1)
    assert warnings == {None}
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7)


def test_unequal_shares_without_weights_train_another_loss():
    """The failure the weights prevent: mse slices of 3 and 1 samples averaged alike."""
    model, graph, batch = _capture("mse")
    _, ref_grads = _reference(model, batch)
    flat = flatten_inputs(graph, batch)
    stages = split_graph(graph, [0, graph.num_nodes])
    for first, size in [(0, 3), (3, 1), (4, 3), (7, 1)]:
        run_sequential(stages, narrow_batch(graph, flat, first, size)).backward()
    diff = max(float((p.grad / 4 - ref_grads[n]).abs().max()) for n, p in model.named_parameters())
    assert diff > 1e-4
