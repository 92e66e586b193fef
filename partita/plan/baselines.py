"""The splits other tools make, as Plans, for side-by-side comparison.

- ``uniform``: equal numbers of repeated layers per stage (torchtitan's default split; the
  layers before the first and after the last go with the first and last stage).
- ``parameters``: equal parameter bytes per stage (DeepSpeed PipelineModule's
  ``partition_method="parameters"``).
- ``equal_flops``: equal forward FLOPs per stage.

A baseline only chooses the stage boundaries: the rest of the configuration (rank groups,
replicas, micro-batches, schedule) is the one it is compared against, and recomputation is
switched on for a stage only when it would not fit otherwise. Boundaries snap to the chain's
legal cut positions.
"""

from __future__ import annotations

import numpy as np

from partita.plan.chain import layer_boundaries
from partita.types import OpGraph

BASELINES = ("uniform", "parameters", "equal_flops")


def baseline_boundaries(method: str, graph: OpGraph, legal: np.ndarray, num_stages: int) -> list[int] | None:
    """Node-position boundaries (first 0, last num_nodes) of ``method`` for ``num_stages`` stages;
    None when the method cannot make that many non-empty stages."""
    n = graph.num_nodes
    if method == "uniform":
        starts = layer_boundaries(graph)
        if len(starts) < num_stages:
            return None
        # Stage s starts at layer round(s * L / S); stage 0 also takes everything before layer 0.
        picks = [starts[(s * len(starts)) // num_stages] for s in range(1, num_stages)]
        return _snap([0, *picks, n], legal)
    if method == "parameters":
        weights = _first_use_param_bytes(graph)
    elif method == "equal_flops":
        weights = np.array([node.flops for node in graph.nodes], dtype=np.float64)
    else:
        raise ValueError(f"unknown baseline {method!r}: use one of {', '.join(BASELINES)}")
    return _balanced_cuts(weights, legal, num_stages)


def _first_use_param_bytes(graph: OpGraph) -> np.ndarray:
    """Each parameter's bytes at the first node that reads it (as DeepSpeed counts a layer's parameters)."""
    weights = np.zeros(graph.num_nodes)
    seen: set[str] = set()
    for node in graph.nodes:
        for name in node.params:
            if name not in seen:
                seen.add(name)
                weights[node.index] += graph.parameters[name].num_bytes
    return weights


def _balanced_cuts(weights: np.ndarray, legal: np.ndarray, num_stages: int) -> list[int] | None:
    """Legal cuts nearest to where the cumulative weight crosses s/S of the total."""
    n = len(weights)
    cumulative = np.concatenate([[0.0], np.cumsum(weights)])
    total = cumulative[-1] or 1.0
    legal_positions = np.flatnonzero(legal[: n + 1])
    cuts = [0]
    for s in range(1, num_stages):
        goal = total * s / num_stages
        options = legal_positions[(legal_positions > cuts[-1]) & (legal_positions < n)]
        if len(options) == 0:
            return None
        cuts.append(int(options[np.argmin(np.abs(cumulative[options] - goal))]))
    cuts.append(n)
    return cuts if all(a < b for a, b in zip(cuts, cuts[1:])) else None


def _snap(cuts: list[int], legal: np.ndarray) -> list[int] | None:
    """Move each inner cut to the nearest legal position after the previous cut."""
    n = cuts[-1]
    legal_positions = np.flatnonzero(legal[: n + 1])
    snapped = [0]
    for c in cuts[1:-1]:
        options = legal_positions[(legal_positions > snapped[-1]) & (legal_positions < n)]
        if len(options) == 0:
            return None
        snapped.append(int(options[np.argmin(np.abs(options - c))]))
    snapped.append(n)
    return snapped if all(a < b for a, b in zip(snapped, snapped[1:])) else None
