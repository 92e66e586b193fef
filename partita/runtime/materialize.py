"""Ranks that allocate only what their stages read: models built on ``meta``, weights from a seed.

A model that does not fit one device cannot be built whole on every rank. Build it on the
``meta`` device instead (no memory), and give the Trainer a *seed checkpoint* of its initial
weights, written once by a process that can hold the model (``save_seed``: the host, or the
``partita train`` parent that planned it). Each rank then allocates the parameters and buffers
its stages read, on its own device, and reads their values from the seed: training starts from
exactly the weights the unsplit model would have, and no rank ever holds the whole model.

The seed is a torch.distributed.checkpoint directory keyed like training checkpoints
(``model.<canonical name>``), and also holds non-persistent buffers (rotary frequencies, masks:
a model built on meta has no values for them). Like training checkpoints it holds a manifest of
its files (checkpoint_dir.py); ``materialize`` checks their sizes (every rank reads the seed, so
it does not hash all of it on each).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from partita.capturing import canonical_names
from partita.errors import InputError
from partita.runtime.checkpoint_dir import PARTIAL_SUFFIX, damage, is_complete, write_manifest

__all__ = ["materialize", "meta_copies", "on_meta", "retarget_device", "save_seed", "single_process"]


def on_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` lives on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def meta_copies(value: Any) -> Any:
    """``value`` (tensors in nested tuples, lists, dicts) with every tensor replaced by a meta copy:
    example inputs to capture a model built on meta from."""
    return pytree.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, value)


def save_seed(model: nn.Module, path: str | os.PathLike) -> None:
    """Write every parameter and buffer of ``model`` (a real, not meta, model) to ``path`` as a
    seed checkpoint, in this process alone. Written to ``<path>.partial`` and renamed when complete."""
    if on_meta(model):
        raise InputError(
            "save_seed needs the model's real weights, but it is on the meta device: build it on a "
            "device that holds it (e.g. the host CPU) to write the seed"
        )
    path = os.fspath(path)
    partial = path + PARTIAL_SUFFIX
    shutil.rmtree(partial, ignore_errors=True)
    state = {f"model.{name}": t.detach() for name, t in _named_tensors(model).items()}
    with single_process():
        dcp.save(state, storage_writer=FileSystemWriter(partial), no_dist=True)
    write_manifest(partial)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(partial, path)


def materialize(
    model: nn.Module, modules: Iterable[nn.Module], names: set[str], device: torch.device, seed: str | os.PathLike
) -> None:
    """Give the tensors named ``names`` (canonical names) real storage on ``device``, filled from the
    seed checkpoint, everywhere they are registered: in ``model`` and in ``modules`` (stage modules,
    the captured graph module). A tied parameter stays one tensor. In this process alone."""
    seed = os.fspath(seed)
    if not is_complete(seed):
        raise InputError(
            f"init_from={seed!r} is not a complete seed checkpoint: write one with "
            "partita.runtime.materialize.save_seed(model, path) from the model built with real weights"
        )
    problem = damage(seed, checksums=False)
    if problem is not None:
        raise InputError(
            f"the seed checkpoint {seed!r} is damaged ({problem}): write it again with "
            "partita.runtime.materialize.save_seed(model, path)"
        )
    by_name = _named_tensors(model)
    unknown = sorted(names - set(by_name))
    if unknown:
        raise InputError(f"the stages read {unknown[:5]} but the model has no such parameters or buffers")
    fresh: dict[int, torch.Tensor] = {}
    for name in sorted(names):
        old = by_name[name]
        new = torch.empty_like(old, device=device)
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        fresh[id(old)] = new
    state = {f"model.{name}": fresh[id(by_name[name])].detach() for name in sorted(names)}
    stored = set(FileSystemReader(seed).read_metadata().state_dict_metadata)
    missing = sorted(k for k in state if k not in stored)
    extra = sorted(k for k in stored if k.startswith("model.") and k[len("model.") :] not in by_name)
    if missing or extra:
        lacks = f"lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else ""
        holds = f"holds {extra[:5]}{' ...' if len(extra) > 5 else ''}, which the model has not" if extra else ""
        raise InputError(
            f"the seed checkpoint {seed!r} {' and '.join(filter(None, (lacks, holds)))}: "
            "it was written for another model; write it again with save_seed from this model"
        )
    with single_process():
        dcp.load(state, storage_reader=FileSystemReader(seed), no_dist=True)
    for module in (m for root in (model, *modules) for m in root.modules()):
        for registry in (module._parameters, module._buffers):
            for key, t in registry.items():
                if t is not None and id(t) in fresh:
                    registry[key] = fresh[id(t)]


def retarget_device(gm: torch.fx.GraphModule, device: torch.device) -> None:
    """Make the operations of ``gm`` (and of the bodies of its higher-order ops) that name the
    ``meta`` device -- ``arange``, ``zeros``, ``to``, export's device assertions, called with the
    device of inputs that were meta at capture -- name ``device`` instead."""
    meta = torch.device("meta")

    def swap(value):
        return device if isinstance(value, torch.device) and value == meta else value

    for module in gm.modules():  # higher-order ops keep their bodies as submodules
        if not isinstance(module, torch.fx.GraphModule):
            continue
        changed = False
        for node in module.graph.nodes:
            args = torch.fx.node.map_aggregate(node.args, swap)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            module.recompile()


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when it runs without a process group: that
    is the intent here (``no_dist=True``), so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor, for every parameter and buffer (non-persistent ones included)."""
    canonical = canonical_names(model)
    return {canonical[id(t)]: t for t in (*model.parameters(), *model.buffers())}
