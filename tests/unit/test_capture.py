"""capture(): the captured training computation equals the eager model, and failures are explained."""

import pytest
import torch
import torch.nn.functional as F

import partita
from partita import examples
from partita.errors import CaptureError, InputError

FAMILIES = ["gpt2", "bert", "llama", "t5", "vit", "mlp", "cnn"]


def _eager_loss(ex, args=None, kwargs=None, target=None):
    args = ex.args if args is None else args
    kwargs = ex.kwargs if kwargs is None else kwargs
    target = ex.target if target is None else target
    out = ex.model(*args, **kwargs)
    return ex.loss_fn(out, target) if ex.loss_fn is not None else out.loss


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_captured_graph_matches_eager_loss_and_gradients(family):
    ex = examples.build(family, batch_size=4)
    before = {n: (p, p.detach().clone()) for n, p in ex.model.named_parameters()}
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)

    # The original parameters are neither copied nor modified.
    graph_params = {id(p) for p in graph.graph_module.parameters()}
    for name, (param, snapshot) in before.items():
        assert id(param) in graph_params, name
        assert torch.equal(param.detach(), snapshot), name

    loss = graph.loss(ex.args, ex.kwargs, ex.target)
    loss.backward()
    captured = _grads(ex.model)
    ex.model.zero_grad(set_to_none=True)
    reference = _eager_loss(ex)
    reference.backward()
    expected = _grads(ex.model)

    assert abs(loss.item() - reference.item()) <= 1e-6
    assert captured.keys() == expected.keys() and expected
    for name in expected:
        assert (captured[name] - expected[name]).abs().max().item() <= 1e-6, name


def test_graph_runs_at_another_batch_size():
    ex = examples.build("gpt2", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    assert graph.dynamic_batch
    args, kwargs, target = ex.make_batch(6, 1)
    assert torch.allclose(graph.loss(args, kwargs), _eager_loss(ex, args, kwargs), atol=1e-6, rtol=0)


def test_graph_module_is_called_like_the_model():
    ex = examples.build("gpt2", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    out = graph.graph_module(*ex.args, **ex.kwargs)
    ref = ex.model(*ex.args, **ex.kwargs)
    assert torch.allclose(out.logits, ref.logits, atol=1e-6, rtol=0)
    assert torch.allclose(out.loss, ref.loss, atol=1e-6, rtol=0)


def test_nodes_are_topological_with_consistent_consumers():
    ex = examples.build("llama", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    for node in graph.nodes:
        assert all(i < node.index for i in node.inputs)
        for c in node.consumers:
            assert node.index in graph.nodes[c].inputs
    assert graph.nodes[graph.loss_node].outputs[0].shape == ()
    assert any(n.is_higher_order for n in graph.nodes)  # Llama's rotary embedding runs under no_grad
    assert any(n.module_path.startswith("model.layers.1") for n in graph.nodes)
    assert all(n.flops >= 0 and n.bytes_written >= 0 for n in graph.nodes)


def test_tied_parameters_are_one_parameter():
    ex = examples.build("gpt2", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    assert graph.parameters["transformer.wte.weight"].aliases == ("lm_head.weight",)
    assert "lm_head.weight" not in graph.parameters
    assert graph.num_parameters == sum(p.numel() for p in ex.model.parameters())  # parameters() dedups too
    readers = [n for n in graph.nodes if "transformer.wte.weight" in n.params]
    assert {n.target for n in readers} >= {"aten.embedding.default"}
    assert len(readers) >= 2  # the embedding and the LM head


def test_loss_fn_is_captured_with_original_names():
    ex = examples.build("mlp", batch_size=4)
    graph = partita.capture(ex.model, ex.args, loss_fn=ex.loss_fn, target=ex.target)
    names = {n for n, _ in ex.model.named_parameters()}
    assert set(graph.parameters) == names
    assert all(not n.module_path.startswith("model.") for n in graph.nodes if n.module_path)
    assert [g.path for g in graph.inputs] == ["args[0]", "target"]


@pytest.mark.slow  # three captures
def test_fingerprint_is_deterministic_and_shape_sensitive():
    a = examples.build("gpt2", batch_size=4, seq_len=16)
    b = examples.build("gpt2", batch_size=4, seq_len=16)
    c = examples.build("gpt2", batch_size=4, seq_len=24)
    fa, fb, fc = (partita.capture(e.model, e.args, e.kwargs).fingerprint for e in (a, b, c))
    assert fa == fb != fc


@pytest.mark.slow
def test_gpt2_xl_on_meta_is_captured_and_counted_right():
    ex = examples.build("gpt2-xl", batch_size=2, seq_len=1024, device="meta")
    graph = partita.capture(ex.model, ex.args, ex.kwargs)  # its time is in bench/plan_time.py
    true_params = 1_557_611_200
    assert abs(graph.num_parameters - true_params) / true_params < 0.01
    tokens, layers, hidden = 2 * 1024, 48, 1600
    expected = 2 * true_params * tokens + layers * 2 * 2 * 2 * 1024 * 1024 * hidden  # + QK^T and AV
    assert abs(graph.total_flops - expected) / expected < 0.05
    assert all(p.device.type == "meta" for p in ex.model.parameters())


# ----------------------------------------------------------------------------- errors


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        if y.sum() > 0:  # data-dependent branch
            return y.mean()
        return y.sum()


class _HostRoundTrip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.from_numpy(self.linear(x).detach().numpy()).sum()


class _Box:
    def __init__(self, t):
        self.t = t


class _ReturnsObject(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _Box(self.linear(x))


class _ReturnsNumber(torch.nn.Module):
    def forward(self, x):
        return 3


class _ReturnsLogits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def test_data_dependent_control_flow_names_the_line():
    with pytest.raises(CaptureError) as info:
        partita.capture(_DataDependent(), (torch.randn(3, 4),))
    message = str(info.value)
    assert "data-dependent" in message or "depends on the values" in message
    assert "if y.sum() > 0" in message and "test_capture.py" in message
    assert "torch.where" in message  # the fix


def test_host_round_trip_is_explained():
    with pytest.raises(CaptureError, match=r"(?s)\.numpy\(\).*fix: replace the host-side computation"):
        partita.capture(_HostRoundTrip(), (torch.randn(3, 4),))


def test_unpytreeable_output_is_explained():
    with pytest.raises(CaptureError, match="(?s)not a tensor.*register_pytree_node"):
        partita.capture(_ReturnsObject(), (torch.randn(3, 4),))


def test_hf_cache_output_suggests_use_cache_false():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32, use_cache=True))
    ids = torch.randint(0, 64, (2, 8))
    try:
        graph = partita.capture(model, kwargs={"input_ids": ids, "labels": ids.clone(), "use_cache": True})
    except CaptureError as e:
        assert "use_cache=False" in str(e)
    else:  # an export that handles the cache must still give the right loss
        assert torch.allclose(
            graph.loss((), {"input_ids": ids, "labels": ids.clone(), "use_cache": True}),
            model(input_ids=ids, labels=ids.clone()).loss,
            atol=1e-5,
        )


def test_model_returning_no_tensor():
    with pytest.raises(CaptureError, match="no tensor computed from its inputs.*loss_fn="):
        partita.capture(_ReturnsNumber(), (torch.randn(3, 4),))


def test_model_returning_no_loss():
    with pytest.raises(CaptureError, match=r"no scalar loss \(tensor outputs have shapes \(3, 4\)\).*loss_fn"):
        partita.capture(_ReturnsLogits(), (torch.randn(3, 4),))


def test_loss_that_is_not_a_scalar():
    per_sample = lambda out, y: F.cross_entropy(out, y, reduction="none")  # noqa: E731
    with pytest.raises(CaptureError, match=r"0-dim.*\(3,\).*mean"):
        partita.capture(_ReturnsLogits(), (torch.randn(3, 4),), loss_fn=per_sample, target=torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(
    "call, pattern",
    [
        (lambda: partita.capture(_ReturnsLogits, (torch.randn(3, 4),)), "nn.Module, got type: pass the module"),
        (
            lambda: partita.capture(_ReturnsLogits(), torch.randn(3, 4)),
            r"args must be a tuple.*got Tensor.*args=\(x,\)",
        ),
        (
            lambda: partita.capture(_ReturnsLogits(), (torch.randn(3, 4),), kwargs=[1]),
            "kwargs must be a dict.*got list",
        ),
        (
            lambda: partita.capture(_ReturnsLogits(), (torch.randn(3, 4),), target=torch.zeros(3)),
            "target was given but loss_fn is None: pass loss_fn=",
        ),
        (
            lambda: partita.capture(
                _ReturnsLogits(), (torch.randn(3, 4),), loss_fn=F.cross_entropy, target=torch.zeros(5, dtype=torch.long)
            ),
            r"disagree.*args\[0\].*target: \(?5.*batch",
        ),
        (lambda: partita.capture(_ReturnsLogits(), ("not a tensor",)), "contain no tensor: pass the tensors"),
    ],
)
def test_invalid_arguments(call, pattern):
    with pytest.raises(InputError, match=pattern):
        call()


class _NoGradSection(torch.nn.Module):
    """A `with torch.no_grad()` block in forward becomes a higher-order op in the exported graph."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        with torch.no_grad():
            gate = torch.cos(x * self.scale)
        return (self.linear(x) * gate).mean()


def test_higher_order_op_is_one_node_and_runs_exactly():
    model, x = _NoGradSection(), torch.randn(3, 4)
    graph = partita.capture(model, (x,))
    hops = [n for n in graph.nodes if n.is_higher_order]
    assert [n.target for n in hops] == ["wrap_with_set_grad_enabled"]
    assert hops[0].params == ("scale",)
    loss = graph.loss((x,))
    loss.backward()
    captured = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    reference = model(x)
    reference.backward()
    assert torch.equal(loss, reference)
    for name, p in model.named_parameters():
        assert torch.allclose(captured[name], p.grad, atol=1e-7, rtol=0)
