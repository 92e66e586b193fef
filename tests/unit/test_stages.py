"""Stage builder: split captured graphs at arbitrary cuts and check loss and gradients are unchanged.

Every comparison runs at a micro-batch size (3) other than the captured one (4): the graphs are
exported with a dynamic batch dimension. ``run_detached`` imitates a real pipeline in one process
(each stage gets fresh leaf copies of what it receives, gradients are handed back stage by stage),
so aliasing between stages, non-contiguous boundaries and lost gradients would show.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import partita
from partita.errors import InputError
from partita.runtime.stages import StageModule, flatten_inputs, run_sequential, split_graph

transformers = pytest.importorskip("transformers")

CAPTURE_BATCH, RUN_BATCH, SEQ, VOCAB = 4, 3, 16, 256


def _token_batch(batch: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(4, VOCAB, (batch, SEQ), generator=g),
        "labels": torch.randint(4, VOCAB, (batch, SEQ), generator=g),
    }


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=64,
            use_cache=False,
            attn_implementation="eager",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        )
    )


def _bert() -> nn.Module:
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
    )


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            use_cache=False,
            attn_implementation="eager",
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
        )
    )


def _t5() -> nn.Module:
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            num_layers=2,
            d_model=64,
            d_kv=16,
            num_heads=4,
            d_ff=128,
            vocab_size=VOCAB,
            dropout_rate=0.0,
            use_cache=False,
            tie_word_embeddings=True,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
            attn_implementation="eager",
        )
    )


class _Case:
    """A model, its captured graph, a batch at RUN_BATCH and the unsplit eager loss and gradients."""

    def __init__(self, model: nn.Module, args: tuple, kwargs: dict, target, loss_fn, run_batch: tuple):
        self.model = model
        self.graph = partita.capture(model, args, kwargs, loss_fn=loss_fn, target=target)
        run_args, run_kwargs, run_target = run_batch
        self.flat = flatten_inputs(self.graph, run_args, run_kwargs, run_target)
        model.zero_grad()
        out = model(*run_args, **(run_kwargs or {}))
        loss = loss_fn(out, run_target) if loss_fn else out.loss
        loss.backward()
        self.loss = loss.detach()
        self.grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        assert self.grads, "the reference run produced no gradient"
        model.zero_grad()


def _hf_case(build) -> _Case:
    torch.manual_seed(0)
    model = build()
    return _Case(model, (), _token_batch(CAPTURE_BATCH, 1), None, None, ((), _token_batch(RUN_BATCH, 2), None))


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in [(8, 32), (32, 32), (32, 32)])
        self.head = nn.Linear(32, 5)

    def forward(self, x):  # (B, 8) -> (B, 5)
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def _mlp_case() -> _Case:
    torch.manual_seed(0)
    x, y = torch.randn(CAPTURE_BATCH, 8), torch.randint(0, 5, (CAPTURE_BATCH,))
    run = ((torch.randn(RUN_BATCH, 8),), None, torch.randint(0, 5, (RUN_BATCH,)))
    return _Case(_MLP(), (x,), None, y, F.cross_entropy, run)


_BUILDERS = {
    "gpt2": lambda: _hf_case(_gpt2),
    "bert": lambda: _hf_case(_bert),
    "llama": lambda: _hf_case(_llama),
    "t5": lambda: _hf_case(_t5),
    "mlp": _mlp_case,
}


@pytest.fixture(scope="module")
def cases():
    built: dict[str, _Case] = {}

    def get(name: str) -> _Case:
        if name not in built:
            built[name] = _BUILDERS[name]()
        return built[name]

    return get


# ----------------------------------------------------------------------------- helpers


def _equal_cuts(num_nodes: int, num_stages: int) -> list[int]:
    return [num_nodes * s // num_stages for s in range(num_stages + 1)]


def _random_cuts(num_nodes: int, num_stages: int, seed: int) -> list[int]:
    inner = sorted(random.Random(seed).sample(range(1, num_nodes), num_stages - 1))
    return [0, *inner, num_nodes]


def run_detached(stages: list[StageModule], flat_inputs: list) -> torch.Tensor:
    """Run like a pipeline: stage inputs are fresh leaves, backward goes stage by stage.

    Input gradients come from ``autograd.grad`` (as zero-bubble schedules compute them), which,
    unlike ``.grad``, keeps whatever memory layout autograd produced.
    """
    received: tuple = ()
    runs = []
    for stage in stages:
        inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in received)
        out = stage(*inputs, *stage.graph_inputs(flat_inputs))
        runs.append((inputs, out))
        if not stage.spec.is_last:
            assert isinstance(out, tuple) and len(out) == len(stage.spec.output_names)
            for name, t in zip(stage.spec.output_names, out):
                assert isinstance(t, torch.Tensor) and t.is_contiguous() and not t._is_view(), (stage.spec.index, name)
            received = out
    loss = runs[-1][1]
    outputs, grad_outputs = [loss], [None]
    for s in range(len(stages) - 1, -1, -1):
        inputs = runs[s][0]
        wanted = [x for x in inputs if x.requires_grad]
        input_grads = (
            torch.autograd.grad(outputs, wanted, grad_outputs, retain_graph=True, allow_unused=True) if wanted else ()
        )
        assert all(g is None or g.is_contiguous() for g in input_grads), f"stage {s} input gradient not contiguous"
        if outputs:
            torch.autograd.backward(outputs, grad_outputs)  # the parameters' gradients
        grads = dict(zip(map(id, wanted), input_grads))
        pairs = [(o, grads.get(id(x))) for o, x in zip(runs[s - 1][1], inputs)] if s > 0 else []
        outputs, grad_outputs = [o for o, g in pairs if g is not None], [g for _, g in pairs if g is not None]
    return loss


def _check_against_reference(case: _Case, cuts: list[int], runner=run_sequential) -> list[StageModule]:
    stages = split_graph(case.graph, cuts)
    case.model.zero_grad()
    loss = runner(stages, case.flat)
    if runner is run_sequential:
        loss.backward()
    assert loss.dim() == 0
    assert (loss.detach() - case.loss).abs().item() <= 1e-6, cuts
    for name, p in case.model.named_parameters():
        if name in case.grads:
            assert p.grad is not None, (cuts, name)
            diff = (p.grad - case.grads[name]).abs().max().item()
            assert diff <= 1e-6, (cuts, name, diff)
    case.model.zero_grad()
    return stages


# ----------------------------------------------------------------------------- tests


MODELS = ["gpt2", "bert", "llama", "t5", "mlp"]


@pytest.mark.parametrize("name", MODELS)
def test_equal_and_random_cuts_reproduce_loss_and_gradients(cases, name):
    case = cases(name)
    n = case.graph.num_nodes
    for cuts in (_equal_cuts(n, 2), _equal_cuts(n, 4), [0, n - 1, n]):
        _check_against_reference(case, cuts)
    for seed in range(2):
        num_stages = min(4, n)
        _check_against_reference(case, _random_cuts(n, num_stages, seed), runner=run_detached)
        _check_against_reference(case, _random_cuts(n, 2, 10 + seed), runner=run_detached)


@pytest.mark.parametrize("name", MODELS)
def test_stages_hold_the_models_own_tensors_where_read(cases, name):
    case = cases(name)
    n = case.graph.num_nodes
    model_tensors = dict(case.model.named_parameters()) | dict(case.model.named_buffers())
    for cuts in (_equal_cuts(n, 4), _random_cuts(n, 3, 7)):
        stages = split_graph(case.graph, cuts)
        for stage in stages:
            spec = stage.spec
            read = {p for i in range(spec.node_start, spec.node_stop) for p in case.graph.nodes[i].params}
            assert set(spec.param_names) == read, (cuts, spec.index)
            held = dict(stage.named_parameters()) | {
                k: b for k, b in stage.named_buffers() if not k.startswith("graph_module.")
            }
            assert set(held) == read
            for canonical, tensor in held.items():
                assert tensor is model_tensors[canonical], canonical  # the same object, not a copy


def test_tied_embedding_is_held_by_first_and_last_stage(cases):
    case = cases("gpt2")
    stages = _check_against_reference(case, _equal_cuts(case.graph.num_nodes, 4))
    holders = [s.spec.index for s in stages if "transformer.wte.weight" in s.spec.param_names]
    assert holders == [0, 3]
    assert all("lm_head.weight" not in s.spec.param_names for s in stages)
    assert stages[0].get_parameter("transformer.wte.weight") is stages[3].get_parameter("transformer.wte.weight")


def test_symints_are_recomputed_not_sent(cases):
    case = cases("gpt2")
    stages = split_graph(case.graph, _equal_cuts(case.graph.num_nodes, 4))
    symbolic = {n.name for n in case.graph.graph_module.graph.nodes if isinstance(n.meta.get("val"), torch.SymInt)}
    assert symbolic
    for stage in stages:
        assert not symbolic & set(stage.spec.output_names)
    assert any(symbolic & set(s.spec.recomputed_names) for s in stages[1:])


def test_llama_higher_order_op_keeps_its_body(cases):
    case = cases("llama")
    hop = next(n for n in case.graph.nodes if n.is_higher_order)
    stages = _check_against_reference(case, [0, hop.index, hop.index + 1, case.graph.num_nodes], runner=run_detached)
    bodies = [name for name, m in stages[1].graph_module.named_children() if isinstance(m, torch.fx.GraphModule)]
    assert bodies, "the higher-order op's body was not copied into its stage"


def test_in_place_write_into_a_view_across_a_cut(cases):
    """T5 builds decoder inputs with new_zeros, then copy_ into a slice of it: cut between slice and copy_."""
    case = cases("t5")
    copy_node = next(n for n in case.graph.nodes if n.target == "aten.copy_.default")
    stages = _check_against_reference(case, [0, copy_node.index, case.graph.num_nodes], runner=run_detached)
    assert stages[1].spec.recomputed_names, "the written view should be re-made from its base"


def test_buffers_and_in_place_updates_batchnorm():
    class CNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 5)

        def forward(self, x):  # (B, 3, 8, 8) -> (B, 5)
            return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))

    torch.manual_seed(0)
    model = CNN()
    x, y = torch.randn(CAPTURE_BATCH, 3, 8, 8), torch.randint(0, 5, (CAPTURE_BATCH,))
    graph = partita.capture(model, (x,), loss_fn=F.cross_entropy, target=y)
    for cut in range(1, graph.num_nodes):
        reference, split_model = copy.deepcopy(model), model
        F.cross_entropy(reference(x), y).backward()
        stages = split_graph(graph, [0, cut, graph.num_nodes])
        run_sequential(stages, flatten_inputs(graph, (x,), None, y)).backward()
        for (name, a), b in zip(reference.state_dict().items(), split_model.state_dict().values()):
            assert torch.allclose(a.float(), b.float(), atol=1e-6, rtol=0), (cut, name)
        for (name, a), b in zip(reference.named_parameters(), split_model.parameters()):
            assert (a.grad - b.grad).abs().max().item() <= 1e-6, (cut, name)
        model.zero_grad()


@pytest.mark.parametrize(
    "bad", [[], [0], [1, 10], [0, 5], [0, 5, 5, 10], [0, 7, 3, 10], [0, 2.5, 10], [0, 11], [0, True, 10]]
)
def test_bad_boundaries_raise_input_error(cases, bad):
    graph = cases("mlp").graph
    n = graph.num_nodes
    cuts = [n if c == 10 else c for c in bad]  # 10 stands for num_nodes
    cuts = [n + 1 if c == 11 else c for c in cuts]
    with pytest.raises(InputError) as info:
        split_graph(graph, cuts)
    assert "boundar" in str(info.value)


def test_flatten_inputs_follows_the_captured_structure(cases):
    case = cases("gpt2")
    batch = _token_batch(RUN_BATCH, 5)
    flat = flatten_inputs(case.graph, (), {"labels": batch["labels"], "input_ids": batch["input_ids"]})
    assert flat[0] is batch["input_ids"] and flat[1] is batch["labels"]
    with pytest.raises(InputError):
        flatten_inputs(case.graph, (), {"input_ids": batch["input_ids"]})
    with pytest.raises(InputError):
        flatten_inputs(case.graph, (), batch, target=batch["labels"])
    mlp = cases("mlp")
    x, y = torch.randn(2, 8), torch.zeros(2, dtype=torch.long)
    assert [t is v for t, v in zip(flatten_inputs(mlp.graph, (x,), None, y), (x, y))] == [True, True]


def test_stage_forward_checks_its_input_count(cases):
    case = cases("mlp")
    stages = split_graph(case.graph, [0, 2, case.graph.num_nodes])
    with pytest.raises(InputError):
        stages[1]()


def test_nodes_after_the_loss_are_dropped_and_the_loss_relayed():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)

        def forward(self, x, y):  # the loss, then a value computed from it that training ignores
            loss = F.mse_loss(self.proj(x), y)
            return {"loss": loss, "twice": loss * 2}

    torch.manual_seed(0)
    model = Net()
    x, y = torch.randn(CAPTURE_BATCH, 6), torch.randn(CAPTURE_BATCH, 6)
    graph = partita.capture(model, (x, y))
    n = graph.num_nodes
    assert graph.loss_node < n - 1
    expected = model(x[:RUN_BATCH], y[:RUN_BATCH])["loss"]
    for cuts in ([0, graph.loss_node + 1, n], [0, 1, graph.loss_node + 1, n]):
        stages = split_graph(graph, cuts)
        assert stages[-1].spec.input_names == (graph.nodes[graph.loss_node].name,)
        assert stages[-1].spec.param_names == ()
        loss = run_detached(stages, flatten_inputs(graph, (x[:RUN_BATCH], y[:RUN_BATCH])))
        assert (loss - expected).abs().item() <= 1e-6


class _InPlaceResidual(nn.Module):
    """A block that adds its residual in place into a layer's output (HF ResNet's ``hidden += residual``)."""

    def __init__(self):
        super().__init__()
        self.inner, self.head = nn.Linear(8, 8), nn.Linear(8, 5)

    def forward(self, x):  # (B, 8) -> (B, 5)
        hidden = self.inner(x)
        hidden += x
        return self.head(torch.relu(hidden))


def test_stage_input_written_in_place_right_after_a_cut():
    torch.manual_seed(0)
    x, y = torch.randn(CAPTURE_BATCH, 8, requires_grad=False), torch.randint(0, 5, (CAPTURE_BATCH,))
    run = ((torch.randn(RUN_BATCH, 8),), None, torch.randint(0, 5, (RUN_BATCH,)))
    case = _Case(_InPlaceResidual(), (x,), None, y, F.cross_entropy, run)
    add_ = next(n for n in case.graph.nodes if n.target == "aten.add_.Tensor")
    _check_against_reference(case, [0, add_.index, case.graph.num_nodes], runner=run_detached)
