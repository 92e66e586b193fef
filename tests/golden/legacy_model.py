"""The model and batches of the legacy files (tests/golden/legacy/): small, seeded, deterministic."""

import torch

BATCH = 8


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))  # fmt: skip
    return model, torch.nn.functional.cross_entropy


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(4)]
