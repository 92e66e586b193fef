"""A loss that couples the samples of a batch (``OpGraph.couples_samples``) needs the whole batch.

Every split of such a batch (micro-batches, data-parallel replicas) would train another loss. The
planner plans one micro-batch on one replica per stage for it (``partita.planning.context``); the
runtime and manual plans check it here (``check_whole_batch``), with the same words.
"""

from __future__ import annotations

from collections.abc import Sequence

from partita.errors import InputError
from partita.types.graph import OpGraph

__all__ = ["check_whole_batch", "coupling_words"]


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
