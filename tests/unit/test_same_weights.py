"""The fingerprint that tells ranks' weights apart (partita/runtime/same_weights.py; the ranks'
side is tests/dist/test_shared_weights.py): equal tensors agree, any change of a value or of
the order of values shows, at every dtype."""

from __future__ import annotations

import pytest
import torch

from partita.runtime.same_weights import fingerprint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool, torch.uint8])
def test_equal_tensors_agree_and_a_changed_or_moved_value_does_not(dtype):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(33, 7, generator=g) * 5).to(dtype)
    assert fingerprint(t) == fingerprint(t.clone()) == fingerprint(t.t().contiguous().t())  # layout aside
    changed = t.clone().reshape(-1)
    changed[17] = changed[17] + 1 if dtype != torch.bool else ~changed[17]
    assert fingerprint(changed.reshape(t.shape)) != fingerprint(t)
    swapped = t.clone().reshape(-1)
    if swapped[3] != swapped[4]:
        swapped[[3, 4]] = swapped[[4, 3]]
        assert fingerprint(swapped.reshape(t.shape)) != fingerprint(t), "a permutation keeps the plain sum"


def test_a_tensor_larger_than_one_chunk_and_a_complex_one():
    big = torch.arange(5_000_000, dtype=torch.float32)
    other = big.clone()
    other[-1] += 1
    assert fingerprint(big) == fingerprint(big.clone()) != fingerprint(other)
    z = torch.randn(4, dtype=torch.complex64)
    assert fingerprint(z) == fingerprint(z.clone()) != fingerprint(z.conj_physical())
