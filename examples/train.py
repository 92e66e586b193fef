"""A complete partita training script, as a torch user writes one.

    torchrun --standalone --nproc-per-node 2 examples/train.py --steps 60 --out runs/train
    python examples/train.py --devices 1 --steps 60          # one device: no torchrun needed

Every process runs all of it: the same model (seeded), the same data. ``partita.Cluster.local``
measures this machine and ``partita.plan`` searches on rank 0 only, and every rank gets the same
plan; the Trainer captures the model from the example batch, and ``partita.fit`` trains it on the
DataLoader -- global batches, evaluation, TensorBoard/JSON metrics, checkpoints, resume
(``--resume`` continues from the latest checkpoint in ``--out``/checkpoints). CI runs this
script under ``torchrun --nproc-per-node 2`` (tests/dist/test_cli_data_runs.py).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import partita

VOCAB, CLASSES, SEQ_LEN = 512, 10, 32


class Classifier(nn.Module):
    """Embedding -> residual MLP blocks -> mean over the sequence -> class logits."""

    def __init__(self, hidden: int = 64, num_blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(num_blocks)
        )
        self.head = nn.Linear(hidden, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, H)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=1))  # (B, classes)


def dataset(num_samples: int, seed: int) -> TensorDataset:
    """Sequences of class ``c`` draw most of their tokens from the c-th tenth of the vocabulary: a
    rule the model learns in a few dozen steps."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (num_samples,), generator=g)
    width = VOCAB // CLASSES
    tokens = labels[:, None] * width + torch.randint(0, width, (num_samples, SEQ_LEN), generator=g)
    noise = torch.rand(num_samples, SEQ_LEN, generator=g) < 0.3  # 30% of the tokens anywhere
    tokens = torch.where(noise, torch.randint(0, VOCAB, (num_samples, SEQ_LEN), generator=g), tokens)
    return TensorDataset(tokens, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--out", default="runs/train", help="checkpoints, metrics and the plan go here")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)  # the same initial weights on every rank
    model = Classifier()
    loader = DataLoader(
        dataset(4096, seed=1), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2)
    )  # every rank shuffles alike
    held_out = DataLoader(dataset(256, seed=3), batch_size=64)
    tokens, labels = next(iter(loader))  # an example batch: what partita captures and plans with

    loss_fn = nn.functional.cross_entropy
    plan = partita.plan(
        model,
        (tokens,),
        loss_fn=loss_fn,
        target=labels,
        cluster=partita.Cluster.local(num_devices=args.devices),
        global_batch_size=args.global_batch,
    )
    trainer = partita.Trainer(
        model,
        plan,
        args=(tokens,),
        loss_fn=loss_fn,
        target=labels,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        max_grad_norm=1.0,
    )
    rank = trainer.topology.rank
    if rank == 0:
        print(plan.summary())
        os.makedirs(args.out, exist_ok=True)
        plan.save(os.path.join(args.out, "plan.json"))
    result = partita.fit(
        trainer,
        loader,
        num_steps=args.steps,
        eval_data=held_out,
        eval_every=max(1, args.steps // 3),
        checkpoint_dir=os.path.join(args.out, "checkpoints"),
        checkpoint_every=max(1, args.steps // 2),
        resume=args.resume,
        log_dir=os.path.join(args.out, "logs"),
    )
    if rank == 0:
        summary = {"first_step": result.first_step, "losses": result.losses, "eval_losses": result.eval_losses}
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(summary, f)
        if result.losses:
            print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over steps {result.first_step}-{args.steps}")


if __name__ == "__main__":
    main()
