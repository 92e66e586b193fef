"""`partita train --log-dir DIR`: per-step metrics as TensorBoard scalars and as JSON lines.

Written by rank 0 only. ``DIR/metrics.jsonl`` holds one JSON object per line:

    {"step": 3, "loss": 2.31, "lr": 0.003, "grad_norm": 0.84, "step_s": 0.051, "samples_per_s": 313.7}
    {"step": 10, "eval_loss": 2.05, "eval_batches": 4}

(``step`` 1-based; ``grad_norm`` is null without clipping, a non-finite loss is null). TensorBoard
gets the same numbers as ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/step_s``,
``train/samples_per_s`` and ``eval/loss``. Without the ``tensorboard`` package the JSON lines are
still written, and one note says how to get the TensorBoard files (``pip install tensorboard``).

After a resume from step ``k``, the lines and TensorBoard events of later steps (written by the
interrupted run after its last checkpoint, and now trained again) are dropped, so the log holds
each step once.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

METRICS_FILE = "metrics.jsonl"
TRAIN_TAGS = ("loss", "lr", "grad_norm", "step_s", "samples_per_s")


class MetricsWriter:
    def __init__(self, log_dir: str, *, resumed_from: int | None = None, note: Callable[[str], None] = print):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, METRICS_FILE)
        if resumed_from is not None:
            _keep_steps_up_to(self.path, resumed_from)
        else:
            open(self.path, "w").close()
        self.board = None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            note(f"--log-dir: writing {self.path} only; TensorBoard files need `pip install tensorboard`")
        else:
            self.board = SummaryWriter(log_dir, purge_step=None if resumed_from is None else resumed_from + 1)

    def train_step(
        self, step: int, *, loss: float, lr: float, grad_norm: float | None, step_s: float, samples_per_s: float
    ) -> None:
        values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "step_s": step_s, "samples_per_s": samples_per_s}
        self._line({"step": step, **values})
        if self.board is not None:
            for tag, value in values.items():
                if value is not None:
                    self.board.add_scalar(f"train/{tag}", value, step)

    def evaluation(self, step: int, *, loss: float, num_batches: int) -> None:
        self._line({"step": step, "eval_loss": loss, "eval_batches": num_batches})
        if self.board is not None:
            self.board.add_scalar("eval/loss", loss, step)

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    def _line(self, record: dict) -> None:
        finite = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(finite) + "\n")


def _keep_steps_up_to(path: str, last_step: int) -> None:
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= last_step]
    with open(path, "w") as f:
        f.writelines(kept)
