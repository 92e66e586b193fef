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
draw from it), apart from training's. Training batches come with their ``DataPosition``: the epoch
and the samples of it consumed, which checkpoints keep. A resumed run continues at that position,
with the step size it runs now: it reads and drops an iterable's batches before it (cutting the
batch it falls in), a dataset skips the rows before it by index, each step's collation seeded by
its step. Resumed with another global batch, it so trains every sample once, as an unsplit loop
reading the data in order would; without a position (checkpoints of earlier partita) it drops the
steps done, at the step size it runs now.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from partita.capturing import exported_call_inputs
from partita.errors import CaptureError, InputError, ModelSpecError
from partita.runtime.batch_values import check_batch_dtypes, check_batch_values
from partita.runtime.stages import narrow_batch
from partita.runtime.variants import (
    captured_shapes,
    check_within_plan,
    input_shapes,
    recaptured,
    unsupported_shapes_message,
)
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
    if isinstance(source, Iterator):  # has __next__: iterating it again continues (or ends), never restarts
        raise ModelSpecError(
            f"{what} is a one-shot iterator ({type(source).__name__}: iterating it again yields nothing), but "
            "partita reads the data once per epoch: give a list, a DataLoader, or a function that returns a new "
            "iterator each time (data=make_batches, with def make_batches(): yield ...)"
        )
    if _is_rows(source) or callable(source) or _is_iterable(source):
        return
    raise ModelSpecError(
        f"{what} is a {type(source).__name__}, which partita cannot read batches from: give a DataLoader or "
        "another iterable of batches, a function returning an iterator of batches, or a dataset of rows "
        "(__len__ and __getitem__) with a collate_fn"
    )


@dataclass(frozen=True)
class DataPosition:
    """Where training stands in its data source: ``sample`` samples of epoch ``epoch`` (0-based)
    consumed -- trained on, or dropped as an epoch's tail. ``as_dict`` / ``from_dict`` for checkpoints."""

    epoch: int = 0
    sample: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample}

    @classmethod
    def from_dict(cls, data: Any) -> DataPosition | None:
        if not isinstance(data, dict) or not all(isinstance(data.get(k), int) for k in ("epoch", "sample")):
            return None
        return cls(data["epoch"], data["sample"])


class StepBatches:
    """The step batches of a run (an endless iterator of ``(args, kwargs, target)``); ``position``
    is where the data source stands after the last batch given (None without a source)."""

    def __init__(self, batches: Iterator[tuple[Batch, DataPosition | None]], position: DataPosition | None):
        self._batches, self.position = batches, position

    def __iter__(self) -> StepBatches:
        return self

    def __next__(self) -> Batch:
        batch, self.position = next(self._batches)
        return batch


def training_batches(
    example,
    graph: OpGraph,
    batch_size: int,
    *,
    start_step: int = 0,
    position: DataPosition | None = None,
    seed: int = 0,
    note: Note = print,
) -> StepBatches:
    """The step batches of steps ``start_step + 1, start_step + 2, ...``: from the data source at
    ``position`` (None: after ``start_step`` steps of ``batch_size``), or a zoo model's, or the
    example's repeated."""
    if getattr(example, "data", None) is not None:
        start = _start_position(example, start_step, position, batch_size, note)
        return StepBatches(
            _source_batches(
                example, graph, "data", batch_size, seed=seed, start_step=start_step, start=start, note=note
            ),
            start,
        )
    make_batch = example.make_batch or repeating_batches(example, graph)
    return StepBatches(((make_batch(batch_size, step), None) for step in itertools.count(start_step)), None)


def _start_position(example, start_step: int, position: DataPosition | None, batch_size: int, note: Note):
    """The position a run starts at: the checkpoint's, else (none stored) ``start_step`` steps of
    ``batch_size`` -- for a dataset of rows by index; for an iterable None, read step by step."""
    if position is not None:
        if position != DataPosition():
            note(f"resuming at sample {position.sample} of epoch {position.epoch + 1} of the data")
        return position
    if not start_step or not _is_rows(example.data):
        return None
    per_epoch = max(1, len(example.data) // batch_size)
    return DataPosition(start_step // per_epoch, start_step % per_epoch * batch_size)


def eval_batches(
    example, graph: OpGraph, batch_size: int, count: int, *, seed: int = 0, note: Note = print
) -> list[Batch]:
    """The held-out batches every evaluation averages over: the first ``count`` step batches of the
    factory's ``eval_data`` (all of them, with a note, when it holds fewer), or a zoo model's."""
    if getattr(example, "eval_data", None) is not None:
        batches = [
            batch
            for batch, _ in itertools.islice(
                _source_batches(example, graph, "eval_data", batch_size, seed=seed, epochs=1, note=note), count
            )
        ]
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


def check_first_batch(example, graph: OpGraph, *, batch_size: int | None = None, held_out: bool = False) -> None:
    """Before launch, in one process: the first batch of each of the factory's sources, checked
    against the graph -- structure (keys), dtypes, shapes (the model is captured again at the
    batch's shapes when they differ from the example's, as the training processes will), ids and
    labels -- and, given the step's ``batch_size``, that ``data`` (and ``eval_data`` when
    ``held_out``: evaluations read it) holds one step. One InputError naming the batch, the input
    and the fix, before any process starts."""
    for key in ("data", "eval_data"):
        source = getattr(example, key, None)
        if source is None:
            continue
        layout = Layout(example, graph)
        size = batch_size if key == "data" or held_out else None
        first, where = _first_batch(example, layout, source, key, size)
        flat = layout.flat(first, where)
        check_batch_dtypes(graph, flat, where)
        check_batch_values(graph, flat, where)
        _check_batch_shapes(graph, layout, flat, where, training=key == "data")


def _first_batch(example, layout: Layout, source: Any, key: str, batch_size: int | None) -> tuple[Any, str]:
    """The first batch of ``source`` (a dataset's first row collated) and its name; InputError when
    it holds fewer than ``batch_size`` samples (an iterable's batches are read up to that many)."""
    rng = _OwnRng(0, key)
    if _is_rows(source):
        if batch_size is not None and len(source) < batch_size or not len(source):
            raise InputError(
                f"{key} holds {len(source)} rows, fewer than the {batch_size or 1} samples of one step: give more "
                "rows or a smaller --global-batch"
            )
        with rng.active():
            return _collate(example)([source[0]]), f"row 0 of {key}, collated"
    first, num_samples = None, 0
    with rng.active():
        for index, batch in enumerate(_fresh(source)):
            first = batch if first is None else first
            where = f"batch {index} of {key}"
            num_samples += layout.size(layout.flat(batch, where), where)
            if batch_size is None or num_samples >= batch_size:
                break
    if first is None or (batch_size is not None and num_samples < batch_size):
        raise InputError(
            f"{key} holds {num_samples} samples, fewer than the {batch_size or 1} samples of one step: give more "
            "data or a smaller --global-batch"
        )
    return first, f"batch 0 of {key}"


def _check_batch_shapes(graph: OpGraph, layout: Layout, flat: list, where: str, *, training: bool) -> None:
    """A batch whose shapes differ from the example's: no dim longer, and the model captured again
    at its shapes (in eval mode for held-out data), as the training processes will."""
    shapes = input_shapes(graph, flat)
    if shapes == captured_shapes(graph):
        return
    try:
        check_within_plan(graph, shapes)
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    args, kwargs, target = layout.unflatten(flat)
    samples = min(layout.size(flat, where), graph.batch_size)
    try:
        recaptured(graph, args, kwargs, target, samples=samples, training=training)
    except CaptureError as e:
        raise InputError(unsupported_shapes_message(graph, shapes, where, e)) from None


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
    example,
    graph,
    key: str,
    batch_size: int,
    *,
    seed: int,
    start_step: int = 0,
    start: DataPosition | None = None,
    epochs: int | None = None,
    note: Note,
) -> Iterator[tuple[Batch, DataPosition]]:
    """(step batch, the position after it) from the factory's source ``key``, from ``start`` (None:
    the beginning, after ``start_step`` steps read and dropped for an iterable)."""
    source, layout = getattr(example, key), Layout(example, graph)
    if _is_rows(source):
        steps = _row_steps(
            source, _collate(example), layout, batch_size, seed, key, start_step, start or DataPosition(), epochs, note
        )
    else:
        steps = _iterable_steps(source, layout, batch_size, _OwnRng(seed, key), key, epochs, note, start)
        if start_step and start is None:
            note(f"resuming: reading and dropping the {key}'s batches of the {start_step} steps done")
            steps = itertools.islice(steps, start_step, None)
    return ((layout.unflatten(flat), position) for flat, position in steps)


def _row_steps(dataset, collate, layout, batch_size, seed, key, start_step, start, epochs, note) -> Iterator[tuple]:
    """Step ``s`` (0-based, from ``start_step``) collates the next ``B`` rows from ``start``: rows
    ``[i * B, (i + 1) * B)``, ``i = s mod (len // B)``, when every step had ``B`` samples."""
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
    epoch, first = start.epoch, start.sample
    for step in itertools.count(start_step):
        if first + batch_size > num_rows:  # the epoch's tail: dropped
            epoch, first = epoch + 1, 0
        if epochs is not None and epoch >= epochs:
            return
        where = f"rows {first}-{first + batch_size - 1} of {key}, collated"
        with _OwnRng(seed, key, step).active():
            flat = layout.flat(collate(_rows(dataset, range(first, first + batch_size))), where)
        size = layout.size(flat, where)
        if size != batch_size:
            raise InputError(f"{where}: collate_fn returned {size} samples for {batch_size} rows: return one per row")
        first += batch_size
        yield flat, DataPosition(epoch, first)


def _iterable_steps(source, layout, batch_size, rng, key, epochs, note, start) -> Iterator[tuple]:
    """Step batches from an iterable source, epoch after epoch (or ``epochs`` of them), from
    ``start`` (None: the beginning): the epochs before it and its first samples are read and dropped."""
    rebatch = Rebatcher(layout, batch_size)
    start = start or DataPosition()
    for epoch in itertools.count():
        if epochs is not None and epoch >= epochs:
            return
        with rng.active():
            batches = iter(_fresh(source))
        skip = start.sample if epoch == start.epoch else 0
        consumed, num_steps, num_samples = skip, 0, 0
        for index in itertools.count():
            with rng.active():
                batch = next(batches, _END)
            if batch is _END:
                break
            where = f"batch {index} of {key} (epoch {epoch + 1})"
            flat = layout.flat(batch, where)
            size = layout.size(flat, where)
            num_samples += size
            if epoch < start.epoch or skip >= size:  # before the start: read (RNG streams advance), dropped
                skip -= min(skip, size)
                continue
            if skip:
                flat, skip = narrow_batch(layout.graph, flat, skip, size - skip), 0
            for step_flat in rebatch.add(flat, where):
                num_steps += 1
                consumed += batch_size
                yield step_flat, DataPosition(epoch, consumed)
        resumed = epoch < start.epoch or (epoch == start.epoch and start.sample > 0)
        if not (resumed and num_samples):  # an epoch resumed into had its steps in the earlier run
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
