"""A loss that couples the samples of a batch (``OpGraph.couples_samples``) needs the whole batch.

Every split of such a batch (micro-batches, data-parallel replicas) would train another loss. The
planner plans one micro-batch on one replica per stage for it (``partita.planning.context``); the
runtime and manual plans check it here (``check_whole_batch``), with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.errors import InputError
from partita.types.graph import OpGraph

__all__ = ["batch_dims_words", "check_coupled_batch_size", "check_whole_batch", "coupling_words"]


def check_whole_batch(graph: OpGraph, num_microbatches: int, replicas: Sequence[int]) -> None:
    """InputError when a plan would split the batch of a graph whose loss couples samples
    (``num_microbatches`` > 1, or a stage with several replicas): for plans not made by the
    search (manual plans, plan files), before training."""
    if graph.couples_samples is None or (num_microbatches == 1 and all(r == 1 for r in replicas)):
        return
    why, rewrite = coupling_words(graph)
    raise InputError(
        f"the plan splits every step's batch into {num_microbatches} micro-batches on "
        f"{max(replicas, default=1)} replicas, but {why}: use one micro-batch and one replica per "
        f"stage, or {rewrite}"
    )


def check_coupled_batch_size(graph: OpGraph, global_batch_size: int) -> None:
    """InputError when the samples mix along the batch dims capture found (not declared), the global
    batch differs from the batch the example had there, and another dim of the inputs has exactly
    the global batch: the sign of a batch taken from the wrong dim (a sequence-first ``(S, B, E)``
    input whose attention mixes its dim 0), which would otherwise surface only at the first step
    as a batch of the wrong size. A loss that really couples its batch (CLIP) captured at another
    batch size than it trains is left alone unless another dim has the global batch's size; declaring
    ``batch_dims`` says which it is."""
    coupling = graph.couples_samples
    if coupling is None or coupling.declared or global_batch_size == graph.batch_size:
        return
    others = [
        (g.path, d)
        for g in graph.inputs
        if g.tensor is not None and g.tensor.batch_dim is not None
        for d, size in enumerate(g.tensor.shape)
        if d != g.tensor.batch_dim and size == global_batch_size
    ]
    if not others:
        return
    suggestion = ", ".join(f"{path!r}: {d}" for path, d in others)
    raise InputError(
        f"the global batch is {global_batch_size} samples, but capture took {batch_dims_words(graph)} for the batch "
        f"({graph.batch_size} in the example), and the samples mix along it: {coupling.describe()}. "
        f"{', '.join(f'{path} dim {d}' for path, d in others)} has {global_batch_size}: if the samples lie "
        f"there (a sequence-first input), capture with batch_dims={{{suggestion}}}; if the loss does couple "
        f"the whole batch, declare its dims with batch_dims= to plan it at another size"
    )


def batch_dims_words(graph: OpGraph) -> str:
    """The batch dim of every batched input, for messages: "args[0] dim 0 and target dim 0"."""
    dims = [f"{g.path} dim {g.tensor.batch_dim}" for g in graph.inputs if g.tensor and g.tensor.batch_dim is not None]
    return " and ".join(dims) if dims else "no dim"


def coupling_words(graph: OpGraph) -> tuple[str, str]:
    """(why splitting the batch of ``graph`` trains another loss, how to rewrite the loss): the
    words of every error and warning about a loss that couples samples."""
    why = (
        f"the loss couples the samples of the batch: {graph.couples_samples.describe()}, so every sample's loss "
        "depends on the other samples of the same batch, and splitting the batch would train another loss"
    )
    rewrite = (
        "rewrite the loss so that each sample's term depends on that sample alone (e.g. gather the "
        "embeddings of the whole batch before the similarity matrix), or keep the whole batch together"
    )
    return why, rewrite
