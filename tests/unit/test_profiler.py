"""Tests of the profiler (partita.cost.profiler) and its cache (partita.cost.cache).

Timings are never asserted (shared machines are noisy); what is checked is the shape and sign
of every array, the invariants the calibration guarantees by construction, the saved-tensor
accounting against a whole-graph measurement, and the cache's hits and misses.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import partita
from partita.cost import cache, profiler
from partita.cost.profiler import profile
from partita.errors import InputError

_ARRAYS = (
    "forward_s",
    "backward_s",
    "backward_weight_s",
    "activation_bytes",
    "output_bytes",
    "cut_bytes",
    "param_bytes",
    "param_trainable",
)


def _gpt2(seq_len: int = 32):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        use_cache=False,
        attn_implementation="eager",
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (8, seq_len))
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    return model, partita.capture(model, kwargs=kwargs), kwargs


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


@pytest.fixture(scope="module")
def gpt2_table(gpt2):
    return profile(gpt2[1], microbatch_size=4)


def _mlp(device: str = "cpu"):
    with torch.device(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return model, partita.capture(model, (x,), loss_fn=torch.nn.functional.cross_entropy, target=y), x, y


@pytest.fixture(scope="module")
def mlp():
    return _mlp()


def _check_table(table, graph, microbatch_size):
    n, p = graph.num_nodes, len(graph.parameters)
    shapes = {
        "forward_s": n,
        "backward_s": n,
        "backward_weight_s": n,
        "activation_bytes": n,
        "output_bytes": n,
        "cut_bytes": n + 1,
        "param_bytes": p,
        "param_trainable": p,
    }
    for name, length in shapes.items():
        array = np.asarray(getattr(table, name))
        assert array.shape == (length,), name
        assert np.all(np.isfinite(array.astype(float))) and np.all(array >= 0), name
    assert len(table.param_names) == len(table.param_uses) == p
    assert table.source == "measured" and table.device == "cpu" and table.microbatch_size == microbatch_size
    assert np.all(table.backward_weight_s <= table.backward_s)
    assert table.forward_s.sum() > 0 and table.backward_s.sum() > 0


def test_gpt2_arrays_have_the_right_shapes_and_signs(gpt2, gpt2_table):
    _check_table(gpt2_table, gpt2[1], 4)


def test_mlp_with_user_inputs_repeated_to_a_larger_microbatch(mlp):
    model, graph, x, y = mlp
    table = profile(graph, ((x,), {}, y), microbatch_size=16)
    _check_table(table, graph, 16)
    # Linear layers have a weight-gradient part; GELU and the loss have none.
    weighted = [n.index for n in graph.nodes if n.params]
    assert all(table.backward_weight_s[i] > 0 for i in weighted)
    assert all(table.backward_weight_s[n.index] == 0 for n in graph.nodes if not n.params)


def test_views_save_nothing(gpt2, gpt2_table):
    views = [n.index for n in gpt2[1].nodes if n.is_view]
    assert views and np.all(gpt2_table.activation_bytes[views] == 0)


def _saved_bytes_of_whole_graph(graph, kwargs) -> int:
    """Bytes of the unique storages the plain module saves for backward, parameters excluded."""
    gm = graph.graph_module
    seen = {(t.device, t.untyped_storage().data_ptr()) for t in [*gm.parameters(), *gm.buffers()]}
    total = [0]

    def pack(t):
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total[0] += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = graph.loss((), kwargs)  # kept alive so that no storage is freed and reused
    assert loss.requires_grad
    return total[0]


def test_activation_bytes_add_up_to_the_whole_graph(gpt2, gpt2_table):
    _, graph, kwargs = gpt2
    microbatch = {k: v[:4] for k, v in kwargs.items()}
    whole_bytes = _saved_bytes_of_whole_graph(graph, microbatch)
    # Each storage is charged once, to its first saver: the sum matches within 10%.
    assert gpt2_table.activation_bytes.sum() == pytest.approx(whole_bytes, rel=0.10)


def test_calibrated_sums_equal_the_measured_whole_step(gpt2_table):
    calibration = gpt2_table.calibration
    assert gpt2_table.forward_s.sum() == pytest.approx(calibration["whole_forward_s"], rel=1e-9)
    step_s = gpt2_table.forward_s.sum() + gpt2_table.backward_s.sum()
    assert step_s == pytest.approx(calibration["whole_step_s"], rel=1e-9)
    assert calibration["forward_scale"] > 0 and calibration["backward_scale"] > 0


@pytest.mark.slow  # captures and profiles Llama
def test_llama_with_a_higher_order_op():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        use_cache=False,
        attn_implementation="eager",
    )
    ids = torch.randint(0, 256, (4, 16))
    graph = partita.capture(LlamaForCausalLM(config), kwargs={"input_ids": ids, "labels": ids.clone()})
    higher_order = [n.index for n in graph.nodes if n.is_higher_order]
    assert higher_order
    table = profile(graph, microbatch_size=2)
    _check_table(table, graph, 2)
    assert np.all(table.forward_s[higher_order] > 0)


def test_profiling_leaves_the_model_as_it_was(mlp):
    model, graph, x, y = mlp
    rng_state = torch.get_rng_state()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile(graph, microbatch_size=4)
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cache_returns_an_identical_table_without_profiling(gpt2, tmp_path, monkeypatch):
    graph = gpt2[1]
    first = profile(graph, microbatch_size=4, cache_dir=tmp_path)
    monkeypatch.setattr(profiler, "_measure", _must_not_measure)
    second = profile(graph, microbatch_size=4, cache_dir=tmp_path)
    for name in _ARRAYS:
        a, b = getattr(first, name), getattr(second, name)
        assert np.array_equal(a, b) and a.dtype == b.dtype, name
    assert second.param_names == first.param_names
    assert all(np.array_equal(a, b) for a, b in zip(first.param_uses, second.param_uses))
    assert dict(second.calibration) == dict(first.calibration)
    assert (second.microbatch_size, second.device, second.source) == (first.microbatch_size, first.device, first.source)
    names = os.listdir(tmp_path)  # one entry, and no temporary file left behind
    assert len(names) == 2 and all(n.startswith("costs-") and n.endswith((".json", ".npz")) for n in names)


def _must_not_measure(*args, **kwargs):
    raise AssertionError("profiled although the cache holds the table")


def test_cache_misses_for_another_sequence_length_or_microbatch(gpt2, tmp_path, monkeypatch):
    profile(gpt2[1], microbatch_size=4, cache_dir=tmp_path)
    shorter = _gpt2(seq_len=16)[1]
    assert shorter.fingerprint != gpt2[1].fingerprint
    monkeypatch.setattr(profiler, "_measure", _must_not_measure)
    with pytest.raises(AssertionError, match="profiled although"):
        profile(shorter, microbatch_size=4, cache_dir=tmp_path)
    with pytest.raises(AssertionError, match="profiled although"):
        profile(gpt2[1], microbatch_size=2, cache_dir=tmp_path)


def test_nothing_is_written_without_a_cache_dir(mlp, monkeypatch):
    def no_store(*args, **kwargs):
        raise AssertionError("wrote a cache entry without cache_dir")

    monkeypatch.setattr(cache, "store", no_store)
    profile(mlp[1], microbatch_size=4)


def test_a_model_on_the_meta_device_is_refused():
    _, graph, _, _ = _mlp(device="meta")
    with pytest.raises(InputError, match="meta device.*analytic"):
        profile(graph, microbatch_size=4)


def test_inputs_that_do_not_match_the_capture_are_refused(gpt2):
    with pytest.raises(InputError, match=r"structure.*missing \[\"\[1\]\['labels'\]\"\].*Pass the same args"):
        profile(gpt2[1], ((), {"input_ids": gpt2[2]["input_ids"]}, None), microbatch_size=4)
