"""A model of your own with its own data, for `partita train`: a factory that returns a dict.

    partita train examples/own_data.py:build --nproc 2 --global-batch 32 --steps 40 \\
        --lr-schedule cosine --warmup-steps 4 --eval-every 10 --log-dir runs/own_data
    partita train examples/own_data.py:build_rows --nproc 2 --global-batch 32 --steps 40

Besides the model and an example batch (what partita captures and plans with), the dict gives
the data to train on and held-out data to evaluate on:

- ``build``: ``torch.utils.data.DataLoader``s. A batch is shaped like ``inputs`` plus the target
  (here a tuple ``(tokens, labels)``, as a DataLoader over ``TensorDataset(tokens, labels)`` yields).
  partita joins or cuts the loader's batches into global batches (here 16-sample batches, two per
  step of 32), and iterates the loader again at its end (a new epoch, reshuffled by its seeded
  generator); the samples at the end of an epoch that make no whole step are dropped, with a note.
- ``build_rows``: a map-style dataset of rows (``__len__`` and ``__getitem__``; a Hugging Face
  ``datasets.Dataset`` works the same) and a ``collate_fn`` that makes a batch of rows, padded
  to its longest row (so every batch has its own length). With keyword inputs a batch is a
  dict of the inputs' names plus ``"target"`` for the loss. Rows are read in order, a step's
  worth at a time; the rows at the end that make no whole step are dropped, with a note.

Every process of the job reads the same batches in the same order, and ``--resume`` continues
with the batches an uninterrupted run would have trained on.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB, CLASSES, SEQ_LEN = 512, 10, 32


class TinyClassifier(nn.Module):
    """Embedding -> a few residual MLP blocks -> mean over the sequence -> class logits."""

    def __init__(self, hidden: int = 64, num_blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(num_blocks)
        )
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, H)
        for block in self.blocks:
            x = x + block(x)
        if mask is None:
            return self.head(x.mean(dim=1))  # (B, classes)
        mean = (x * mask.unsqueeze(-1)).sum(dim=1) / mask.sum(dim=1, keepdim=True)  # (B, H): over real tokens
        return self.head(mean)


def samples(num_samples: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token sequences and their labels: the class is the first token mod CLASSES (learnable)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (num_samples, SEQ_LEN), generator=generator)  # (N, T)
    return tokens, tokens[:, 0] % CLASSES  # (N, T), (N,)


def build():
    tokens, labels = samples(1000, seed=0)
    held_out = samples(128, seed=1)
    shuffle = torch.Generator().manual_seed(0)  # the same order in every process of the job
    return {
        "model": TinyClassifier(),
        "inputs": (tokens[:8],),
        "loss_fn": nn.functional.cross_entropy,
        "target": labels[:8],
        "data": DataLoader(TensorDataset(tokens, labels), batch_size=16, shuffle=True, generator=shuffle),
        "eval_data": DataLoader(TensorDataset(*held_out), batch_size=32),
    }


class Rows:
    """A map-style dataset of token sequences of different lengths: row ``i`` is a dict, as a
    Hugging Face ``datasets.Dataset`` gives."""

    def __init__(self, num_rows: int, seed: int):
        tokens, self.labels = samples(num_rows, seed)
        lengths = torch.randint(4, SEQ_LEN + 1, (num_rows,), generator=torch.Generator().manual_seed(seed))
        self.tokens = [t[:n] for t, n in zip(tokens, lengths.tolist())]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return {"tokens": self.tokens[index], "label": self.labels[index]}


def collate(rows: list[dict]) -> dict:
    """Rows -> one batch padded to its longest row: the model's keyword inputs and the loss's ``"target"``."""
    longest = max(len(r["tokens"]) for r in rows)
    tokens = torch.zeros(len(rows), longest, dtype=torch.long)  # (B, T), padded with id 0
    mask = torch.zeros(len(rows), longest)  # (B, T): 1 at real tokens
    for i, row in enumerate(rows):
        tokens[i, : len(row["tokens"])] = row["tokens"]
        mask[i, : len(row["tokens"])] = 1
    return {"tokens": tokens, "mask": mask, "target": torch.stack([r["label"] for r in rows])}


def build_rows():
    rows = Rows(1000, seed=0)
    example = collate([{"tokens": torch.zeros(SEQ_LEN, dtype=torch.long), "label": torch.tensor(0)}] * 8)
    return {
        "model": TinyClassifier(),
        # the example batch at the longest length: the plan is made for it, shorter batches run as they come
        "inputs": {"tokens": example["tokens"], "mask": example["mask"]},
        "loss_fn": nn.functional.cross_entropy,
        "target": example["target"],
        "data": rows,
        "eval_data": Rows(128, seed=1),
        "collate_fn": collate,
    }
