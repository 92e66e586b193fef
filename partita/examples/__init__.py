"""The model zoo: ready-to-train models with synthetic data, by name.

Used by the CLI (``partita plan gpt2-xl``), the tests and the benchmarks::

    ex = build("gpt2-tiny", batch_size=8)
    out = ex.model(*ex.args, **ex.kwargs)
    loss = out.loss if ex.loss_fn is None else ex.loss_fn(out, ex.target)
    args, kwargs, target = ex.make_batch(8, step=1)      # the next synthetic batch

A name is ``<family>`` (size ``tiny``) or ``<family>-<size>``: ``gpt2``, ``gpt2-xl``,
``llama-7b``, ``gpt2-gpt3-175b``. Families and their sizes:

    albert tiny base                                   AlbertForMaskedLM (one layer at every depth)
    bert   tiny small base large                       BertForMaskedLM
    cnn    tiny small                                  plain-torch ResNet
    gpt2   tiny small 124m 355m 774m xl 13b gpt3-175b  GPT2LMHeadModel
    llama  tiny small 7b 13b 70b                       LlamaForCausalLM
    mlp    tiny small large                            plain-torch Linear+GELU stack
    t5     tiny small base large 3b                    T5ForConditionalGeneration
    vit    tiny small base large huge                  ViTForImageClassification

``tiny`` models train in milliseconds (tests), ``small`` ones have a few million parameters
(CPU benchmarks), the published sizes have their real shapes and are meant to be built with
``device="meta"`` for planning: no weight memory is allocated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from partita.errors import InputError, ModelSpecError
from partita.examples import hf, plain

__all__ = ["Example", "build", "names", "parse_name", "sizes"]

DEFAULT_SIZE = "tiny"

# family -> the module that builds it; both modules offer SIZES, default_seq_len,
# build_model, batch_maker and loss_fn.
_MODULES = {family: hf for family in hf.SIZES} | {family: plain for family in plain.SIZES}


@dataclass(frozen=True)
class Example:
    """A model of the zoo with one example batch and a source of more batches.

    ``model`` is in train() mode. It is called as ``model(*args, **kwargs)``; when
    ``loss_fn`` is None the output carries its own ``.loss`` (Hugging Face models given
    ``labels=``) and ``target`` is None, else the loss is ``loss_fn(output, target)``.
    ``make_batch(batch_size, step)`` returns a fresh ``(args, kwargs, target)`` of the same
    structure, on the model's device, determined by ``(seed, step)``; the example inputs are
    ``make_batch(batch_size, 0)``.
    """

    name: str
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    target: Any
    make_batch: Callable[[int, int], tuple[tuple, dict, Any]]


def names() -> list[str]:
    """The model families, sorted: ``["albert", "bert", "cnn", "gpt2", "llama", "mixtral", "mlp", "t5", "vit"]``."""
    return sorted(_MODULES)


def sizes(family: str) -> list[str]:
    """The sizes of one family, smallest first (``tiny`` is always first)."""
    _check_family(family, family)
    return list(_MODULES[family].SIZES[family])


def parse_name(name: str) -> tuple[str, str]:
    """``(family, size)`` of a zoo name: ``"gpt2"`` -> ``("gpt2", "tiny")``,
    ``"llama-7b"`` -> ``("llama", "7b")``, ``"gpt2-gpt3-175b"`` -> ``("gpt2", "gpt3-175b")``.

    Raises ModelSpecError, naming the valid choices, for an unknown family or size.
    """
    family, _, size = name.strip().lower().partition("-")
    _check_family(family, name)
    size = size or DEFAULT_SIZE
    valid_sizes = sizes(family)
    if size not in valid_sizes:
        raise ModelSpecError(
            f"unknown size {size!r} in model name {name!r}: {family} comes in {', '.join(valid_sizes)} "
            f"(e.g. '{family}-{valid_sizes[-1]}'; '{family}' alone means '{family}-{DEFAULT_SIZE}')"
        )
    return family, size


def _check_family(family: str, name: str) -> None:
    if family not in _MODULES:
        raise ModelSpecError(
            f"unknown model family {family!r} in model name {name!r}: choose one of "
            f"{', '.join(names())}, optionally with a size such as 'gpt2-xl' (see partita.examples.sizes)"
        )


def build(
    name: str,
    *,
    batch_size: int = 8,
    seq_len: int | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    data_device: str | torch.device | None = None,
) -> Example:
    """Builds the zoo model ``name`` and its example batch ``make_batch(batch_size, 0)``.

    ``seq_len`` overrides the size's default sequence length (ignored by image and vector
    models). On ``device="meta"`` the model is built on meta and allocates nothing; on any
    other device it is built on the CPU and moved, so a seed gives the same weights on every
    device. Weights depend only on ``seed`` (the caller's global RNG is left untouched);
    floating-point parameters, buffers and inputs get ``dtype``. ``data_device`` puts the
    batches elsewhere than the model (default: with it), e.g. real CPU batches for a model
    built on meta whose ranks take their weights from a seed checkpoint.
    """
    family, size = parse_name(name)
    if batch_size < 1 or seed < 0 or (seq_len is not None and seq_len < 2):
        raise InputError(
            f"need batch_size >= 1, seed >= 0 and seq_len >= 2 (or None), got {batch_size=}, {seed=}, {seq_len=}"
        )
    module = _MODULES[family]
    seq_len = seq_len if seq_len is not None else module.default_seq_len(family, size)
    device = torch.device(device)
    model = _build_model(module, family, size, seq_len, device, seed).to(dtype=dtype).train()
    make_cpu_batch = module.batch_maker(family, size, seq_len, seed)
    data_device = device if data_device is None else torch.device(data_device)

    def make_batch(batch_size: int, step: int) -> tuple[tuple, dict, Any]:
        args, kwargs, target = make_cpu_batch(batch_size, step)
        return _to(args, data_device, dtype), _to(kwargs, data_device, dtype), _to(target, data_device, dtype)

    args, kwargs, target = make_batch(batch_size, 0)
    return Example(f"{family}-{size}", model, args, kwargs, module.loss_fn(family), target, make_batch)


def _build_model(
    module: ModuleType, family: str, size: str, seq_len: int | None, device: torch.device, seed: int
) -> torch.nn.Module:
    """Builds under a forked CPU RNG seeded with ``seed``, on meta or on the CPU then ``device``."""
    # An explicit CPU device context also beats a caller's `with torch.device("cuda")`,
    # which would otherwise change the initial weights.
    build_device = torch.device("meta") if device.type == "meta" else torch.device("cpu")
    with torch.random.fork_rng(devices=[]), build_device:
        # Only the CPU generator: weights are drawn on the CPU, and fork_rng restores only it.
        torch.default_generator.manual_seed(seed)
        model = module.build_model(family, size, seq_len)
    return model.to(device)


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Moves the tensors in a (nested) tuple/dict to ``device``; floating ones also to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, tuple):
        return tuple(_to(item, device, dtype) for item in value)
    if isinstance(value, dict):
        return {key: _to(item, device, dtype) for key, item in value.items()}
    return value
