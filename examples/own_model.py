"""A model of your own, for `partita plan` and `partita train`: a factory file.

    partita plan  examples/own_model.py:build --devices 4 --device-type h100 --global-batch 64
    partita train examples/own_model.py:build --nproc 2 --global-batch 16 --steps 20

The factory takes no arguments and returns ``(model, inputs)`` when the model returns its own
loss, or ``(model, inputs, loss_fn, target)`` as here; ``inputs`` is a tuple of positional
arguments or a dict of keyword arguments, with the batch along dim 0. partita captures the
model from these inputs, plans it, and trains it on this example batch repeated to the global
batch: a quick check that a model of yours splits and trains before you point it at real data
(a factory that returns a dict with a data source: examples/own_data.py).
"""

import torch
from torch import nn


class TinyClassifier(nn.Module):
    """Embedding -> a few residual MLP blocks -> mean over the sequence -> class logits."""

    def __init__(self, vocab: int = 512, hidden: int = 64, num_blocks: int = 4, num_classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(num_blocks)
        )
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, H)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=1))  # (B, classes)


def build():
    generator = torch.Generator().manual_seed(0)
    model = TinyClassifier()
    tokens = torch.randint(0, 512, (8, 32), generator=generator)  # a batch of 8 sequences of 32 tokens
    labels = tokens[:, 0] % 10  # a learnable rule: the class is the first token mod 10
    return model, (tokens,), nn.functional.cross_entropy, labels
