"""How a data source's batches map to the graph's flat inputs, and how they are joined and cut
into step batches (partita.training.data_source reads the sources; this module shapes their batches).

A batch is shaped like the factory's inputs (partita.cli.model_spec): a dict of the inputs'
keywords, plus ``"target"`` with a loss_fn; or a tuple of the positional inputs, plus the target
last. Its tensors have the dims they had at capture, the batch dim among them (a source that
yields single samples is refused, not read as batches of their first dim).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree

from partita.errors import InputError
from partita.runtime.stages import flatten_inputs, narrow_batch
from partita.types import OpGraph

Batch = tuple[tuple, dict, Any]  # (args, kwargs, target): what Trainer.step is called with


class Layout:
    """How a source's batch maps to the graph's flat inputs and back: the factory's inputs' structure."""

    def __init__(self, example, graph: OpGraph):
        self.graph, self.dims = graph, batch_dims(graph)
        self.keys = list(example.kwargs) if example.kwargs else None
        self.none_keys = {k for k, v in (example.kwargs or {}).items() if v is None}
        self.num_args = len(example.args)
        self.with_target = graph.has_loss_fn

    def flat(self, batch: Any, where: str) -> list:
        args, kwargs, target = self._call(batch, where)
        try:
            flat = flatten_inputs(self.graph, args, kwargs, target)
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
        for info, x in zip(self.graph.inputs, flat):
            if info.tensor is not None and isinstance(x, torch.Tensor) and x.dim() != len(info.tensor.shape):
                raise InputError(
                    f"{where}: {info.path} has {x.dim()} dims {tuple(x.shape)}, but the model was captured with "
                    f"{len(info.tensor.shape)} {info.tensor.shape}: a source yields batches, not single samples "
                    "(wrap a dataset of samples in a DataLoader, or give it with a collate_fn)"
                )
        return flat

    def size(self, flat: list, where: str) -> int:
        sizes = {x.shape[d] for x, d in zip(flat, self.dims) if d is not None and isinstance(x, torch.Tensor)}
        if len(sizes) != 1:
            raise InputError(
                f"{where}: its inputs disagree on the batch size (sizes along their batch dims: {sorted(sizes)})"
            )
        return sizes.pop()

    def unflatten(self, flat: list) -> Batch:
        return unflatten_batch(self.graph, flat, self.graph.exported_program.call_spec.in_spec)

    def _call(self, batch: Any, where: str) -> Batch:
        if self.keys is not None:
            return self._keyword_call(batch, where)
        if isinstance(batch, torch.Tensor) and self.num_args == 1 and not self.with_target:
            return (batch,), {}, None
        expected = self.num_args + self.with_target
        if not isinstance(batch, (tuple, list)) or len(batch) != expected:
            shape = f"a {type(batch).__name__}" + (
                f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else ""
            )
            raise InputError(
                f"{where} is {shape}, but the model takes {self.num_args} positional input(s)"
                + (" and a loss target" if self.with_target else "")
                + f": give each batch as a tuple of {expected}, the factory's inputs"
                + (" then the target" if self.with_target else "")
            )
        items = tuple(batch)
        return (items[: self.num_args], {}, items[-1]) if self.with_target else (items, {}, None)

    def _keyword_call(self, batch: Any, where: str) -> Batch:
        target_text = ' and "target"' if self.with_target else ""
        if not isinstance(batch, Mapping):
            raise InputError(
                f"{where} is a {type(batch).__name__}, but the model takes keyword inputs: give each batch as a dict "
                f"of {self.keys}{target_text}"
            )
        kwargs = {k: None for k in self.none_keys} | dict(batch)
        target = kwargs.pop("target", None) if self.with_target else None
        missing = sorted(set(self.keys) - set(kwargs)) + (["target"] if self.with_target and target is None else [])
        unknown = sorted(set(kwargs) - set(self.keys))
        if missing or unknown:
            raise InputError(
                f"{where} has the keys {sorted(batch)}, but the model takes {self.keys}{target_text}"
                + (f"; missing: {missing}" if missing else "")
                + (f"; not model inputs: {unknown} (drop them in the collate_fn)" if unknown else "")
            )
        return (), kwargs, target


def batch_dims(graph: OpGraph) -> list[int | None]:
    return [info.tensor.batch_dim if info.tensor is not None else None for info in graph.inputs]


def unflatten_batch(graph: OpGraph, flat: list, spec) -> Batch:
    call = pytree.tree_unflatten(flat, spec)
    if graph.has_loss_fn:
        (args, kwargs, target), _ = call
        return args, kwargs, target
    args, kwargs = call
    return args, kwargs, None


class Rebatcher:
    """Joins flat batches and cuts them into step batches of exactly ``batch_size`` samples."""

    def __init__(self, layout: Layout, batch_size: int):
        self.layout, self.batch_size = layout, batch_size
        self.pending: list[tuple[list, str]] = []
        self.pending_samples = 0

    def add(self, flat: list, where: str) -> Iterator[list]:
        size = self.layout.size(flat, where)
        if size == self.batch_size and not self.pending:
            yield flat  # the common case: the source gives whole steps, unchanged
            return
        self.pending.append((flat, where))
        self.pending_samples += size
        while self.pending_samples >= self.batch_size:
            joined = self._joined()
            rest = self.pending_samples - self.batch_size
            graph = self.layout.graph
            yield narrow_batch(graph, joined, 0, self.batch_size)
            self.pending = [(narrow_batch(graph, joined, self.batch_size, rest), where)] if rest else []
            self.pending_samples = rest

    def clear(self) -> None:
        self.pending, self.pending_samples = [], 0

    def _joined(self) -> list:
        if len(self.pending) == 1:
            return self.pending[0][0]
        joined = []
        for j, (info, dim) in enumerate(zip(self.layout.graph.inputs, self.layout.dims)):
            pieces = [flat[j] for flat, _ in self.pending]
            if dim is None or not isinstance(pieces[0], torch.Tensor):
                joined.append(pieces[0])  # flatten_inputs checked non-tensors; tensors without a batch dim:
                if any(isinstance(p, torch.Tensor) and not torch.equal(p, pieces[0]) for p in pieces[1:]):
                    raise InputError(self._cannot_join(info.path, "differs between them and has no batch dim"))
                continue
            try:
                joined.append(torch.cat(pieces, dim=dim))
            except RuntimeError:
                shapes = ", ".join(str(tuple(p.shape)) for p in pieces)
                raise InputError(self._cannot_join(info.path, f"has the shapes {shapes}")) from None
        return joined

    def _cannot_join(self, path: str, why: str) -> str:
        wheres = " and ".join(where for _, where in self.pending)
        return (
            f"{wheres} cannot be joined into one step of {self.batch_size} samples: {path} {why}. Give "
            f"batches of exactly {self.batch_size} samples (DataLoader(batch_size={self.batch_size})), which pass "
            "unchanged, or pad every batch to one length"
        )
