"""Matrices over the stages of a block chain: entry [j, i] is a statistic of blocks [j, i).

The search evaluates every candidate stage at once: a (K+1, K+1) matrix per total, from the K
blocks' values (``partita.planning.chain.BlockCosts.stage_totals``). Entries with i <= j are not
stages; callers mask them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["range_last", "range_max", "range_sums"]


def range_sums(values: Sequence[float]) -> np.ndarray:
    """out[j, i]: the sum of values[j:i] (negative below the diagonal: callers mask j >= i)."""
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])
    return prefix[None, :] - prefix[:, None]


def range_last(values: Sequence[float]) -> np.ndarray:
    """out[j, i]: the last non-zero value among values[j:i] (0 if none, and where i <= j)."""
    v = np.asarray(values, dtype=np.float64)
    k = len(v)
    # last[i]: position of the last non-zero value before i (-1: none); the range [j, i) has one iff last >= j
    positions = np.where(v != 0, np.arange(k), -1)
    last = np.concatenate([[-1], np.maximum.accumulate(positions)]) if k else np.array([-1])
    j = np.arange(k + 1)[:, None]
    inside = (last[None, :] >= j) & (j < np.arange(k + 1)[None, :])
    return np.where(inside, v[np.maximum(last, 0)][None, :] if k else 0.0, 0.0)


def range_max(values: Sequence[float]) -> np.ndarray:
    """out[j, i]: the largest of values[j:i] (0 where i <= j)."""
    v = np.asarray(values, dtype=np.float64)
    k = len(v)
    out = np.zeros((k + 1, k + 1))
    for j in range(k):
        out[j, j + 1 :] = np.maximum.accumulate(v[j:])
    return out
