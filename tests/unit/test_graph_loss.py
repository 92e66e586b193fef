"""``graph.loss`` checks its inputs as the Trainer checks a batch, and equals the eager loss."""

from __future__ import annotations

import pytest
import torch

import partita
from partita.errors import InputError


class Masked(torch.nn.Module):
    """A classifier whose optional mask zeroes features: captured with ``mask=None``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 3)

    def forward(self, x, mask=None):
        h = torch.tanh(self.a(x))
        if mask is not None:
            h = h * mask
        return self.b(h)


@pytest.fixture(scope="module")
def captured():
    torch.manual_seed(0)
    model = Masked()
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    graph = partita.capture(model, (x,), {"mask": None}, loss_fn=torch.nn.functional.cross_entropy, target=y)
    return model, graph, x, y


def test_graph_loss_equals_the_eager_loss_and_gradients(captured):
    model, graph, x, y = captured
    loss = graph.loss((x,), {"mask": None}, y)
    expected = torch.nn.functional.cross_entropy(model(x), y)
    assert torch.allclose(loss, expected)
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected.backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert torch.allclose(g, p.grad)
    model.zero_grad()


def test_graph_loss_refuses_a_tensor_where_none_was_captured(captured):
    _, graph, x, y = captured
    with pytest.raises(InputError, match=r"mask.*was None when the model was captured.*would ignore the tensor"):
        graph.loss((x,), {"mask": torch.ones(4, 16)}, y)


def test_graph_loss_refuses_another_structure_and_dtype(captured):
    _, graph, x, y = captured
    with pytest.raises(InputError, match=r"2 positional input\(s\) given, the example had 1"):
        graph.loss((x, x), {"mask": None}, y)
    with pytest.raises(InputError, match=r"target was a tensor of shape \(4,\) when the model was captured, but None"):
        graph.loss((x,), {"mask": None})
    with pytest.raises(InputError, match=r"graph.loss: .* is float64, but the model was captured with float32"):
        graph.loss((x.double(),), {"mask": None}, y)
