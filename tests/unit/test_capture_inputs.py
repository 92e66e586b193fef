"""Capture leaves the model as it was; inputs that were None at capture; buffers updated under no_grad.

* An input that was None at capture (``attention_mask=None``) and is a tensor at step time, or the
  reverse, is an InputError naming the input and the fix (``flatten_inputs``, and ``partita.plan``
  before it profiles); so is another value of a non-tensor input baked into the graph.
* ``capture`` runs the model once: integer buffers (BatchNorm's ``num_batches_tracked``) and
  buffers updated in place (``running_mean``, an EMA) are restored.
* A buffer updated in place under ``torch.no_grad()`` (a higher-order op without users in the
  graph) keeps its update when the graph is split into stages.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partita
from partita.errors import InputError
from partita.runtime.stages import flatten_inputs, run_sequential, split_graph


class MaskedModel(nn.Module):
    """Token model whose loss changes with the attention mask (like HF's ``attention_mask=None``)."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 20)

    def forward(self, input_ids, labels, attention_mask=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _batch(batch: int = 4):
    torch.manual_seed(1)
    ids, labels = torch.randint(0, 20, (batch, 6)), torch.randint(0, 20, (batch, 6))
    mask = torch.ones(batch, 6, dtype=torch.long)
    mask[:, -2:] = 0
    return ids, labels, mask


def test_a_mask_given_at_step_time_to_a_graph_captured_without_one_is_refused():
    torch.manual_seed(0)
    model = MaskedModel()
    ids, labels, mask = _batch()
    graph = partita.capture(model, (), {"input_ids": ids, "labels": labels, "attention_mask": None})
    assert len(flatten_inputs(graph, (), {"input_ids": ids, "labels": labels, "attention_mask": None})) == 3
    with pytest.raises(InputError) as info:
        flatten_inputs(graph, (), {"input_ids": ids, "labels": labels, "attention_mask": mask})
    text = str(info.value)
    assert "kwargs['attention_mask'] was None when the model was captured" in text
    assert "would ignore the tensor" in text and "capture the model with this input given as a tensor" in text


def test_none_at_step_time_for_a_mask_captured_as_a_tensor_is_refused():
    torch.manual_seed(0)
    model = MaskedModel()
    ids, labels, mask = _batch()
    graph = partita.capture(model, (), {"input_ids": ids, "labels": labels, "attention_mask": mask})
    with pytest.raises(InputError) as info:
        flatten_inputs(graph, (), {"input_ids": ids, "labels": labels, "attention_mask": None})
    text = str(info.value)
    assert "kwargs['attention_mask'] was a tensor of shape (4, 6)" in text and "None is passed now" in text
    assert "capture the model with attention_mask=None" in text


def test_another_value_of_a_baked_in_constant_is_refused():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 3)

        def forward(self, x, y, temperature=1.0):
            return F.cross_entropy(self.proj(x) / temperature, y)

    graph = partita.capture(Scaled(), (torch.randn(4, 4), torch.randint(0, 3, (4,)), 0.5))
    flatten_inputs(graph, (torch.randn(2, 4), torch.randint(0, 3, (2,)), 0.5))
    with pytest.raises(InputError, match=r"args\[2\] was 0\.5 when the model was captured.*baked in.*2\.0 is passed"):
        flatten_inputs(graph, (torch.randn(2, 4), torch.randint(0, 3, (2,)), 2.0))


def test_plan_with_measured_costs_checks_the_inputs_first():
    torch.manual_seed(0)
    model = MaskedModel()
    ids, labels, mask = _batch()
    graph = partita.capture(model, (), {"input_ids": ids, "labels": labels, "attention_mask": None})
    with pytest.raises(InputError, match="attention_mask'] was None when the model was captured"):
        partita.plan(
            graph,
            (),
            {"input_ids": ids, "labels": labels, "attention_mask": mask},
            cluster=partita.Cluster(device="cpu", num_devices=2),
            global_batch_size=4,
            options=partita.PlanOptions(costs="measured"),
        )


# ----------------------------------------------------------------------------- the model is left as it was


class Counting(nn.Module):
    """BatchNorm (running statistics, num_batches_tracked), an in-place counter and an EMA."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 5)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        self.steps.add_(1)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.head(h)


def test_capture_restores_buffers():
    torch.manual_seed(0)
    model = Counting()
    model.bn.running_mean.fill_(0.25)
    before = {name: b.clone() for name, b in model.named_buffers()}
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 5, (4,))
    graph = partita.capture(model, (x,), loss_fn=F.cross_entropy, target=y)
    for name, b in model.named_buffers():
        assert torch.equal(b, before[name]), name
    assert model.bn.num_batches_tracked.item() == 0 and model.steps.item() == 0
    # the graph still updates them when it runs, as the model does
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y)
    graph.loss((x,), None, y)
    for (name, a), b in zip(reference.named_buffers(), model.buffers()):
        assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), name


def test_capture_of_a_batch_of_one_restores_buffers_too():
    torch.manual_seed(0)
    model = Counting()
    before = {name: b.clone() for name, b in model.named_buffers()}
    graph = partita.capture(model, (torch.randn(1, 3, 8, 8),), loss_fn=F.cross_entropy, target=torch.tensor([1]))
    assert graph.batch_size == 2 and graph.dynamic_batch
    assert all(torch.equal(b, before[name]) for name, b in model.named_buffers())


# ----------------------------------------------------------------------------- buffers updated under no_grad


class EMAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.register_buffer("ema", torch.zeros(()))
        self.register_buffer("ema_vec", torch.zeros(8))

    def forward(self, x):
        h = torch.relu(self.l1(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean())
        h = torch.relu(self.l2(h))
        with torch.no_grad():
            self.ema_vec.mul_(0.5).add_(h.mean(0))
        return self.l3(h)


def test_a_buffer_updated_under_no_grad_keeps_its_update_in_stages():
    torch.manual_seed(0)
    model = EMAModel()
    x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
    graph = partita.capture(model, (x,), loss_fn=F.cross_entropy, target=y)
    hops = [n for n in graph.nodes if n.is_higher_order]
    assert len(hops) == 2 and model.ema.item() == 0.0
    reference = copy.deepcopy(model)
    F.cross_entropy(reference(x), y).backward()
    for cut in range(1, graph.num_nodes):
        split = copy.deepcopy(model)
        split_graph_of = partita.capture(split, (x,), loss_fn=F.cross_entropy, target=y)
        stages = split_graph(split_graph_of, [0, cut, split_graph_of.num_nodes])
        assert any("ema" in name for s in stages for name in s.spec.param_names), cut
        run_sequential(stages, flatten_inputs(split_graph_of, (x,), None, y)).backward()
        for name in ("ema", "ema_vec"):
            assert torch.equal(getattr(split, name), getattr(reference, name)), (cut, name)
        for (name, a), b in zip(reference.named_parameters(), split.parameters()):
            assert (a.grad - b.grad).abs().max().item() <= 1e-6, (cut, name)
        # the stages hold the model's own buffer, so state_dict() (checkpoints) sees the update
        assert torch.equal(split.state_dict()["ema"], reference.state_dict()["ema"])
