"""Tests of the model zoo partita.examples: names, tiny builds, data, meta builds, learnability."""

from __future__ import annotations

import warnings

import pytest
import torch

from partita.errors import InputError, ModelSpecError
from partita.examples import Example, build, names, parse_name, sizes

FAMILIES = ["albert", "bert", "cnn", "gpt2", "llama", "mixtral", "mlp", "t5", "vit"]
HF_FAMILIES = ["albert", "bert", "gpt2", "llama", "mixtral", "t5", "vit"]


def loss_of(ex: Example, args: tuple, kwargs: dict, target) -> torch.Tensor:
    out = ex.model(*args, **kwargs)
    return out.loss if ex.loss_fn is None else ex.loss_fn(out, target)


def assert_same_structure_and_values(a, b) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_structure_and_values(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_structure_and_values(a[key], b[key])
    else:
        assert a == b


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------


def test_names_and_sizes():
    assert names() == FAMILIES
    assert sizes("gpt2") == ["tiny", "small", "124m", "355m", "774m", "xl", "13b", "gpt3-175b"]
    assert sizes("llama") == ["tiny", "small", "7b", "13b", "70b"]
    assert sizes("bert") == ["tiny", "small", "base", "large"]
    assert sizes("t5") == ["tiny", "small", "base", "large", "3b"]
    assert sizes("vit") == ["tiny", "small", "base", "large", "huge"]
    assert sizes("mlp") == ["tiny", "small", "large"]
    assert sizes("cnn") == ["tiny", "small"]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("gpt2", ("gpt2", "tiny")),
        ("gpt2-xl", ("gpt2", "xl")),
        ("llama-7b", ("llama", "7b")),
        ("gpt2-gpt3-175b", ("gpt2", "gpt3-175b")),
        ("GPT2-XL", ("gpt2", "xl")),
        ("mlp-small", ("mlp", "small")),
    ],
)
def test_parse_name(name, expected):
    assert parse_name(name) == expected


def test_unknown_family_lists_the_families():
    with pytest.raises(ModelSpecError) as info:
        parse_name("resnet-50")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert "resnet" in message and all(family in message for family in FAMILIES)
    with pytest.raises(ModelSpecError):
        build("nosuchmodel")
    with pytest.raises(ModelSpecError):
        sizes("nosuchmodel")


def test_unknown_size_lists_the_sizes():
    with pytest.raises(ModelSpecError) as info:
        build("llama-8b", device="meta")
    message = str(info.value)
    assert "8b" in message and all(size in message for size in sizes("llama"))


def test_invalid_arguments_raise_input_error():
    with pytest.raises(InputError):
        build("mlp", batch_size=0)
    with pytest.raises(InputError):
        build("mlp", seed=-1)


# ---------------------------------------------------------------------------------------------
# Tiny builds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_trains_one_step(family):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a zoo model must build and run without warnings
        ex = build(family, batch_size=8)
        loss = loss_of(ex, ex.args, ex.kwargs, ex.target)
    assert ex.name == f"{family}-tiny"
    assert ex.model.training
    assert sum(p.numel() for p in ex.model.parameters()) < 1_000_000
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    no_grad = [name for name, p in ex.model.named_parameters() if p.grad is None]
    assert no_grad == []
    if family in HF_FAMILIES:
        assert ex.loss_fn is None and ex.target is None and ex.args == ()
        assert "labels" in ex.kwargs
    else:
        assert ex.loss_fn is torch.nn.functional.cross_entropy and ex.kwargs == {}
        assert ex.target.dtype == torch.int64 and ex.target.shape == (8,)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_configs_are_eager_without_dropout_or_cache(family):
    model = build(family).model
    config = model.config
    assert config._attn_implementation == "eager"
    assert getattr(config, "use_cache", False) is False
    probs = {k: v for k, v in config.to_dict().items() if ("drop" in k) and isinstance(v, float)}
    assert probs and all(p == 0.0 for p in probs.values()), probs
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


@pytest.mark.parametrize(
    "family, tied", [("gpt2", "lm_head.weight"), ("bert", "cls.predictions.decoder.weight"), ("t5", "lm_head.weight")]
)
def test_tied_embeddings_are_one_parameter(family, tied):
    model = build(family, device="meta").model
    params = dict(model.named_parameters(remove_duplicate=False))
    assert any(params[tied] is p for name, p in params.items() if name != tied)


def test_seq_len_override_and_bound():
    ex = build("gpt2", batch_size=3, seq_len=16)
    assert ex.kwargs["input_ids"].shape == (3, 16)
    with pytest.raises(ModelSpecError, match=r"1024 positions \(n_positions\).*seq_len=4096.*seq_len <= 1024"):
        build("gpt2-xl", seq_len=4096, device="meta")


def test_dtype_applies_to_weights_and_float_inputs():
    ex = build("cnn", dtype=torch.bfloat16)
    assert {p.dtype for p in ex.model.parameters()} == {torch.bfloat16}
    assert ex.args[0].dtype == torch.bfloat16 and ex.target.dtype == torch.int64


def test_cnn_exports_non_strict():
    ex = build("cnn")
    module_names = dict(ex.model.named_modules())
    assert "blocks.1.conv1" in module_names and "head" in module_names
    exported = torch.export.export(ex.model, ex.args, strict=False)
    reference = build("cnn").model(*ex.args)  # same seed: same weights
    torch.testing.assert_close(exported.module()(*ex.args), reference)


# ---------------------------------------------------------------------------------------------
# Data and seeds
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_make_batch_is_deterministic_in_step(family):
    ex = build(family, batch_size=4, seed=3)
    assert_same_structure_and_values(ex.make_batch(4, 0), (ex.args, ex.kwargs, ex.target))
    assert_same_structure_and_values(ex.make_batch(4, 5), ex.make_batch(4, 5))
    first = torch.cat([t.flatten().float() for t in [*ex.make_batch(4, 1)[0], *ex.make_batch(4, 1)[1].values()]])
    second = torch.cat([t.flatten().float() for t in [*ex.make_batch(4, 2)[0], *ex.make_batch(4, 2)[1].values()]])
    assert not torch.equal(first, second)


def test_bert_masks_some_tokens_in_every_row():
    kwargs = build("bert", batch_size=16).kwargs
    masked = kwargs["labels"] != -100  # (B, T)
    assert masked.any(dim=1).all()
    assert 0.05 < masked.float().mean().item() < 0.3


def test_weights_depend_on_seed_only_and_global_rng_is_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build("gpt2", seed=1).model.state_dict()
    assert torch.equal(torch.rand(3), expected)
    b = build("gpt2", seed=1).model.state_dict()
    c = build("gpt2", seed=2).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["transformer.wte.weight"], c["transformer.wte.weight"])


def test_tiny_gpt2_learns_the_synthetic_data():
    ex = build("gpt2", batch_size=8)
    optimizer = torch.optim.Adam(ex.model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        loss = loss_of(ex, *ex.make_batch(8, step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------------------------------------
# Published sizes on meta
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, published_params",
    [("gpt2-xl", 1_557_611_200), ("llama-7b", 6_738_415_616), ("gpt2-gpt3-175b", 175_000_000_000)],
)
def test_published_sizes_build_on_meta(name, published_params):
    ex = build(name, device="meta")
    tensors = [*ex.model.parameters(), *ex.model.buffers(), *ex.kwargs.values()]
    assert all(t.device.type == "meta" for t in tensors)
    num_params = sum(p.numel() for p in ex.model.parameters())  # tied parameters counted once
    assert abs(num_params - published_params) / published_params < 0.01
    args, kwargs, target = ex.make_batch(2, 1)
    assert kwargs["input_ids"].device.type == "meta" and kwargs["input_ids"].shape[0] == 2
