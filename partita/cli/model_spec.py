"""Resolve a MODEL argument of the command line: a zoo name or ``path/to/file.py:factory``.

A factory is called with no arguments and returns either ``(model, inputs)`` — the model then
returns its own loss, as HF models do with ``labels=`` — or ``(model, inputs, loss_fn, target)``.
``inputs`` is a dict of keyword arguments or a tuple of positional arguments.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import torch

from partita.errors import ModelSpecError
from partita.examples import Example, build


def load_model(
    spec: str,
    *,
    batch_size: int = 8,
    seq_len: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    data_device: str | None = None,
) -> Example:
    """The model, its example inputs and loss for ``spec``.

    ``device="auto"`` builds a zoo model on ``meta`` (no weights) when its weights would take
    more than a quarter of this machine's memory, and on the CPU otherwise. ``seed`` fixes a zoo
    model's weights and data; a factory is called with torch's RNG seeded with it (and restored
    afterwards), so that every process of a job builds the same model. ``data_device`` (zoo
    models) puts the batches elsewhere than the model.
    """
    if is_factory_spec(spec):
        return _load_factory(spec, seed)
    if device != "auto":
        return build(spec, batch_size=batch_size, seq_len=seq_len, device=device, seed=seed, data_device=data_device)
    on_meta = build(spec, batch_size=batch_size, seq_len=seq_len, device="meta", seed=seed)
    weight_bytes = sum(p.numel() * p.element_size() for p in on_meta.model.parameters())
    if weight_bytes > _memory_bytes() // 4:
        return on_meta
    return build(spec, batch_size=batch_size, seq_len=seq_len, device="cpu", seed=seed)


def is_factory_spec(spec: str) -> bool:
    """Whether MODEL is ``path/to/file.py:factory`` (else a zoo name)."""
    return ":" in spec and spec.split(":", 1)[0].endswith(".py")


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _load_factory(spec: str, seed: int = 0) -> Example:
    path, _, factory_name = spec.rpartition(":")
    if not os.path.isfile(path):
        raise ModelSpecError(
            f"model file {path!r} (from MODEL {spec!r}) does not exist: give an existing path/to/file.py:factory"
        )
    module_name = f"_partita_user_{abs(hash(os.path.abspath(path)))}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ModelSpecError(
            f"{path} has no callable {factory_name!r}: define `def {factory_name}(): return model, inputs`"
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        result = factory()
    return _as_example(spec, result)


def _as_example(spec: str, result: Any) -> Example:
    usage = (
        "return (model, inputs) or (model, inputs, loss_fn, target), with inputs a dict of keyword "
        "arguments or a tuple of positional arguments"
    )
    if not isinstance(result, tuple) or len(result) not in (2, 4):
        raise ModelSpecError(f"the factory of {spec!r} returned {type(result).__name__}: {usage}")
    model, inputs = result[0], result[1]
    loss_fn, target = (result[2], result[3]) if len(result) == 4 else (None, None)
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"the factory of {spec!r} returned a {type(model).__name__} as the model: {usage}")
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise ModelSpecError(f"the factory of {spec!r} returned inputs of type {type(inputs).__name__}: {usage}")
    return Example(name=spec, model=model, args=args, kwargs=kwargs, loss_fn=loss_fn, target=target, make_batch=None)
