"""Resolve a MODEL argument of the command line: a zoo name or ``path/to/file.py:factory``.

A factory is called with no arguments (torch's RNG seeded with ``--seed``; its file's folder on
``sys.path``, so that it may import modules beside it) and returns one of:

- ``(model, inputs)``: the model returns its own loss, as HF models do with ``labels=``;
- ``(model, inputs, loss_fn, target)``: the loss is ``loss_fn(model(*inputs), target)``;
- a dict with the same names, and the data to train on::

      {"model": model, "inputs": inputs,            # required
       "loss_fn": loss_fn, "target": target,        # optional, both or neither
       "data": train_source, "eval_data": held_out, # optional: what `partita train` reads
       "collate_fn": collate}                       # optional: for sources that are datasets of rows

``inputs`` is a dict of keyword arguments or a tuple of positional arguments: the example batch
the model is captured and planned with. A source (``data``, ``eval_data``) is a
``torch.utils.data.DataLoader`` or any iterable of batches, a function returning a fresh
iterator of batches, or a map-style dataset of rows (``__len__`` and ``__getitem__``, such as a
Hugging Face ``datasets.Dataset``) that ``collate_fn`` (default torch's ``default_collate``) turns
into batches. A batch is shaped like ``inputs``: a dict of the same keywords, or a tuple of the
same positional arguments; with a ``loss_fn`` it also holds the target, as the key ``"target"``
of a dict or the last item of a tuple (what a DataLoader over ``TensorDataset(x, y)`` yields).
How `partita train` reads sources (re-batching, epochs, resumes): partita.training.data_source.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from partita.errors import ModelSpecError
from partita.examples import Example, build
from partita.training.data_source import check_source


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
    _put_folder_on_path(path)
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


def _put_folder_on_path(path: str) -> None:
    """The factory file's folder first on ``sys.path``, as ``python file.py`` puts it: the file may
    import its sibling modules (``from tiny import Model``)."""
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)


@dataclass(frozen=True)
class FactoryExample(Example):
    """A factory's model and example batch, with the sources it gave (None when it gave none)."""

    data: Any = None
    eval_data: Any = None
    collate_fn: Callable | None = None


FACTORY_KEYS = ("model", "inputs", "loss_fn", "target", "data", "eval_data", "collate_fn")
_USAGE = (
    "return (model, inputs), (model, inputs, loss_fn, target) or a dict "
    '{"model": ..., "inputs": ..., "loss_fn": ..., "target": ..., "data": ..., "eval_data": ...}, '
    "with inputs a dict of keyword arguments or a tuple of positional arguments"
)


def _as_example(spec: str, result: Any) -> FactoryExample:
    fields = _factory_fields(spec, result)
    model, inputs = fields.get("model"), fields.get("inputs")
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"the factory of {spec!r} returned a {type(model).__name__} as the model: {_USAGE}")
    if isinstance(inputs, dict):
        args, kwargs = (), inputs
    elif isinstance(inputs, (tuple, list)):
        args, kwargs = tuple(inputs), {}
    else:
        raise ModelSpecError(f"the factory of {spec!r} returned inputs of type {type(inputs).__name__}: {_USAGE}")
    collate_fn = fields.get("collate_fn")
    if collate_fn is not None and not callable(collate_fn):
        raise ModelSpecError(
            f"the factory of {spec!r} returned a {type(collate_fn).__name__} as collate_fn: give a function"
        )
    for key in ("data", "eval_data"):
        if fields.get(key) is not None:
            check_source(fields[key], f"the {key!r} of the factory of {spec!r}", collate_fn)
    return FactoryExample(
        name=spec,
        model=model,
        args=args,
        kwargs=kwargs,
        loss_fn=fields.get("loss_fn"),
        target=fields.get("target"),
        make_batch=None,
        data=fields.get("data"),
        eval_data=fields.get("eval_data"),
        collate_fn=collate_fn,
    )


def _factory_fields(spec: str, result: Any) -> dict[str, Any]:
    """The factory's return value as a dict of FACTORY_KEYS."""
    if isinstance(result, tuple) and len(result) in (2, 4):
        return dict(zip(FACTORY_KEYS, result))
    if not isinstance(result, dict):
        raise ModelSpecError(f"the factory of {spec!r} returned {type(result).__name__}: {_USAGE}")
    unknown = sorted(set(result) - set(FACTORY_KEYS))
    if unknown:
        raise ModelSpecError(
            f"the factory of {spec!r} returned a dict with unknown keys {unknown}: the keys are {', '.join(FACTORY_KEYS)}"
        )
    for key in ("model", "inputs"):
        if key not in result:
            raise ModelSpecError(f"the factory of {spec!r} returned a dict without {key!r}: {_USAGE}")
    if (result.get("loss_fn") is None) != (result.get("target") is None):
        raise ModelSpecError(
            f"the factory of {spec!r} returned a loss_fn without a target or a target without a loss_fn: give both "
            "(the loss is loss_fn(model(inputs), target)) or neither (the model returns its own loss)"
        )
    return result
