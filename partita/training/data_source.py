"""The batches `partita train` feeds its steps and evaluations, from the model's data.

Where they come from:
- a zoo model: its deterministic ``make_batch(batch_size, step)``; held-out batches are
  ``make_batch`` at steps from EVAL_FIRST_STEP on, which no run reaches (the same synthetic task,
  other draws);
- a factory that returns ``"data"`` (and ``"eval_data"``, see partita.cli.model_spec): those sources;
- a factory without data: its example batch, tiled to the step's size (``repeating_batches``).

Glossary:
    source      a factory's ``data`` or ``eval_data``: a map-style dataset of rows (anything with
                ``__len__`` and ``__getitem__`` but a list or tuple, e.g. ``datasets.Dataset``) that
                ``collate_fn`` turns into batches; an iterable of batches (DataLoader, list, ...);
                or a function returning a fresh iterator of batches.
    batch       one item of an iterable source, shaped like the factory's inputs (+ target).
    step batch  the samples of one optimizer step, ``plan.global_batch_size * accumulation``; every
                rank is given the same step batch (the Trainer takes its slice).
    epoch       one pass over the source. The next one iterates it again (or calls it again): a
                DataLoader reshuffles if, and as, it shuffles.

Re-batching: an iterable's batches are joined and cut along each input's batch dim into step
batches, so the source's batch size need not be the step's (a batch of exactly a step's size
passes unchanged, whatever its sequence length). Joined batches must agree on every other dim.
The samples left at the end of an epoch (fewer than a step) are dropped, with one note; so are
the rows at the end of a dataset. A dataset's rows are read in order: shuffle it yourself.

Same batches on every rank and after a resume: a source runs with its own stream of torch's RNG,
seeded from ``--seed`` (a DataLoader shuffling without a generator, a collator masking at random
draw from it), apart from training's. A resumed run reads and drops an iterable's batches of the
steps already done; a dataset skips their rows by index, each step's collation seeded by its step.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from partita.capturing import exported_call_inputs
from partita.errors import InputError, ModelSpecError
from partita.training.batch_layout import Batch, Layout, Rebatcher, batch_dims, unflatten_batch
from partita.types import OpGraph

Note = Callable[[str], None]

EVAL_FIRST_STEP = 2**31  # zoo models' held-out batches: make_batch at steps from here on
_STREAMS = {"data": 1, "eval_data": 2}  # the RNG stream of each source (per seed)


def check_source(source: Any, what: str, collate_fn: Callable | None = None) -> None:
    """ModelSpecError unless ``source`` is a dataset of rows, an iterable or a callable (and
    ``collate_fn``, when given, has rows to collate)."""
    if collate_fn is not None and not _is_rows(source):
        raise ModelSpecError(
            f"{what} is a {type(source).__name__}, which yields batches, and a collate_fn was given: collate_fn is "
            "for datasets of rows (a DataLoader takes its own collate_fn=); drop one of them"
        )
    if _is_rows(source) or callable(source) or _is_iterable(source):
        return
    raise ModelSpecError(
        f"{what} is a {type(source).__name__}, which partita cannot read batches from: give a DataLoader or "
        "another iterable of batches, a function returning an iterator of batches, or a dataset of rows "
        "(__len__ and __getitem__) with a collate_fn"
    )


def training_batches(
    example, graph: OpGraph, batch_size: int, *, start_step: int = 0, seed: int = 0, note: Note = print
) -> Iterator[Batch]:
    """The step batches of steps ``start_step + 1, start_step + 2, ...`` (an endless iterator)."""
    if getattr(example, "data", None) is not None:
        return _source_batches(example, graph, "data", batch_size, seed=seed, start_step=start_step, note=note)
    make_batch = example.make_batch or repeating_batches(example, graph)
    return (make_batch(batch_size, step) for step in itertools.count(start_step))


def eval_batches(
    example, graph: OpGraph, batch_size: int, count: int, *, seed: int = 0, note: Note = print
) -> list[Batch]:
    """The held-out batches every evaluation averages over: the first ``count`` step batches of the
    factory's ``eval_data`` (all of them, with a note, when it holds fewer), or a zoo model's."""
    if getattr(example, "eval_data", None) is not None:
        batches = list(
            itertools.islice(
                _source_batches(example, graph, "eval_data", batch_size, seed=seed, epochs=1, note=note), count
            )
        )
        if len(batches) < count:
            note(f"eval_data holds {len(batches)} batches of {batch_size} samples: evaluating on those, not {count}")
        return batches
    check_held_out(example)
    return [example.make_batch(batch_size, EVAL_FIRST_STEP + i) for i in range(count)]


def check_held_out(example) -> None:
    """InputError unless the example has held-out data: a factory's eval_data, or a zoo model's."""
    if getattr(example, "eval_data", None) is None and example.make_batch is None:
        raise InputError(
            f"--eval-every needs held-out data, and {example.name} gives none: return it from the factory as "
            '{"model": ..., "inputs": ..., "data": ..., "eval_data": held_out_loader}, or drop --eval-every'
        )


def check_first_batch(example, graph: OpGraph) -> None:
    """Read the first batch of each of the factory's sources and check its structure against the
    graph (InputError naming the batch), so that a wrong one fails before any process starts."""
    for key in ("data", "eval_data"):
        source = getattr(example, key, None)
        if source is None:
            continue
        layout = Layout(example, graph)
        rng = _OwnRng(0, key)
        if _is_rows(source):
            if len(source):
                with rng.active():
                    batch = _collate(example)([source[0]])
                layout.flat(batch, f"row 0 of {key}, collated")
            continue
        with rng.active():
            first = next(iter(_fresh(source)), None)
        if first is not None:
            layout.flat(first, f"batch 0 of {key}")


def repeating_batches(example, graph: OpGraph) -> Callable[[int, int], Batch]:
    """``make_batch(batch_size, step)`` for an example without a data source: its own inputs (and
    target), tiled along each graph input's batch dim and cut to ``batch_size``; the same every step."""
    call = exported_call_inputs(example.args, example.kwargs, example.target, graph.has_loss_fn)
    flat, spec = pytree.tree_flatten(call)
    if len(flat) != len(graph.inputs):
        raise InputError(
            f"{example.name}: its example inputs have {len(flat)} leaves but the graph was captured "
            f"with {len(graph.inputs)}: capture the model from the factory's own inputs"
        )
    dims = batch_dims(graph)

    def make_batch(batch_size: int, step: int) -> Batch:
        return unflatten_batch(graph, [_tiled(x, dim, batch_size) for x, dim in zip(flat, dims)], spec)

    return make_batch


# ----------------------------------------------------------------------------- sources


def _source_batches(
    example, graph, key: str, batch_size: int, *, seed: int, start_step: int = 0, epochs: int | None = None, note: Note
) -> Iterator[Batch]:
    source, layout = getattr(example, key), Layout(example, graph)
    if _is_rows(source):
        flats = _row_steps(source, _collate(example), layout, batch_size, seed, key, start_step, epochs, note)
    else:
        flats = _iterable_steps(source, layout, batch_size, _OwnRng(seed, key), key, epochs, note)
        if start_step:
            note(f"resuming: reading and dropping the {key}'s batches of the {start_step} steps done")
            flats = itertools.islice(flats, start_step, None)
    return (layout.unflatten(flat) for flat in flats)


def _row_steps(dataset, collate, layout, batch_size, seed, key, start_step, epochs, note) -> Iterator[list]:
    """Step ``s`` (0-based) collates rows ``[i * B, (i + 1) * B)``, ``i = s mod (len // B)``."""
    num_rows = len(dataset)
    per_epoch = num_rows // batch_size
    if per_epoch == 0:
        raise InputError(
            f"{key} holds {num_rows} rows, fewer than the {batch_size} samples of one step: give more rows "
            "or a smaller --global-batch"
        )
    if num_rows % batch_size:
        note(
            f"{key}: the last {num_rows % batch_size} of its {num_rows} rows make no whole step of {batch_size}: dropped every epoch"
        )
    for step in itertools.count(start_step):
        if epochs is not None and step >= epochs * per_epoch:
            return
        first = (step % per_epoch) * batch_size
        where = f"rows {first}-{first + batch_size - 1} of {key}, collated"
        with _OwnRng(seed, key, step).active():
            flat = layout.flat(collate(_rows(dataset, range(first, first + batch_size))), where)
        size = layout.size(flat, where)
        if size != batch_size:
            raise InputError(f"{where}: collate_fn returned {size} samples for {batch_size} rows: return one per row")
        yield flat


def _iterable_steps(source, layout, batch_size, rng, key, epochs, note) -> Iterator[list]:
    """Step batches from an iterable source, epoch after epoch (or ``epochs`` of them)."""
    rebatch = Rebatcher(layout, batch_size)
    for epoch in itertools.count():
        if epochs is not None and epoch >= epochs:
            return
        with rng.active():
            batches = iter(_fresh(source))
        num_steps = num_samples = 0
        for index in itertools.count():
            with rng.active():
                batch = next(batches, _END)
            if batch is _END:
                break
            where = f"batch {index} of {key} (epoch {epoch + 1})"
            flat = layout.flat(batch, where)
            num_samples += layout.size(flat, where)
            for step_flat in rebatch.add(flat, where):
                num_steps += 1
                yield step_flat
        _check_epoch(key, epoch, num_steps, num_samples, batch_size)
        if rebatch.pending_samples and epoch == 0:
            note(
                f"{key}: the last {rebatch.pending_samples} samples of each epoch make no whole step of "
                f"{batch_size}: dropped (a DataLoader with drop_last=True, or a multiple of {batch_size} samples, uses all)"
            )
        rebatch.clear()


def _check_epoch(key: str, epoch: int, num_steps: int, num_samples: int, batch_size: int) -> None:
    if num_steps:
        return
    if epoch == 0:
        raise InputError(
            f"{key} holds {num_samples} samples, fewer than the {batch_size} samples of one step: give more data "
            "or a smaller --global-batch"
        )
    raise InputError(
        f"{key} ended after epoch 1 and yields no batch when iterated again: it is a one-shot iterator (a "
        "generator object?). Give a list, a DataLoader or a function that returns a new iterator of "
        "batches (def data(): yield ...), or train fewer --steps"
    )


_END = object()


def _fresh(source):
    """A new pass over ``source``: a callable is called for each epoch, an iterable iterated again."""
    if not _is_iterable(source) and callable(source):
        source = source()
    return source


def _is_rows(source: Any) -> bool:
    if isinstance(source, (list, tuple, dict, str, bytes, torch.Tensor, torch.utils.data.IterableDataset)):
        return False
    return (
        hasattr(source, "__len__")
        and hasattr(source, "__getitem__")
        and not isinstance(source, torch.utils.data.DataLoader)
    )


def _is_iterable(source: Any) -> bool:
    return hasattr(source, "__iter__") and not isinstance(source, (dict, str, bytes, torch.Tensor))


def _rows(dataset, indices: range) -> list:
    """``dataset``'s rows at ``indices``; at once where it can (``__getitems__``, as torch's DataLoader does)."""
    if hasattr(dataset, "__getitems__"):
        return list(dataset.__getitems__(list(indices)))
    return [dataset[i] for i in indices]


def _collate(example) -> Callable:
    return example.collate_fn or torch.utils.data.default_collate


class _OwnRng:
    """A source's own stream of torch's (CPU) RNG: ``active()`` swaps it in and back out."""

    def __init__(self, seed: int, key: str, step: int | None = None):
        parts = (seed, _STREAMS[key]) if step is None else (seed, _STREAMS[key], step + 1)
        mixed = 0
        for part in parts:
            mixed = (mixed * 1_000_003 + part) % 2**63
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mixed)
            self.state = torch.get_rng_state()

    @contextlib.contextmanager
    def active(self):
        outer = torch.get_rng_state()
        torch.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = torch.get_rng_state()
            torch.set_rng_state(outer)


def _tiled(x: Any, dim: int | None, batch_size: int) -> Any:
    if dim is None or not isinstance(x, torch.Tensor):
        return x
    copies = -(-batch_size // x.shape[dim])
    return torch.cat([x] * copies, dim=dim).narrow(dim, 0, batch_size).contiguous()
