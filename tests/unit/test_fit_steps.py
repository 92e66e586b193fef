"""``partita.fit`` called again on a trainer that has trained (issue 54, item 4): its FitResult
numbers its steps from where the trainer stood (``losses[i]`` is step ``first_step + i``), as the
skipped steps, the evaluations and the metrics log do. Run in this process on a 1-rank gloo group."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import partita
from partita.errors import InputError
from partita.training.metrics import METRICS_FILE

BATCH, WIDTH, CLASSES, STEPS, NAN_STEP = 8, 16, 4, 6, 5


def _trainer(seed: int = 0) -> partita.Trainer:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(WIDTH, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    x, y = _data()[0]
    graph = partita.capture(model, (x,), loss_fn=nn.functional.cross_entropy, target=y)
    plan = partita.manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=2, global_batch_size=BATCH
    )
    return partita.Trainer(
        model, plan, graph=graph, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), on_nonfinite="skip"
    )


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch per step; step NAN_STEP's input is NaN (its update is skipped)."""
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(STEPS)
    ]
    x, y = batches[NAN_STEP - 1]
    batches[NAN_STEP - 1] = (torch.full_like(x, float("nan")), y)
    return batches


def _fit(trainer: partita.Trainer, num_steps: int, log_dir) -> partita.FitResult:
    held_out = _data()[:1]
    return partita.fit(
        trainer,
        _data(),
        num_steps=num_steps,
        eval_data=held_out,
        eval_batches=1,
        eval_every=3,
        log_dir=str(log_dir),
        progress=False,
    )


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, abs=1e-6) for x, y in zip(a, b)
    )


@pytest.mark.filterwarnings("ignore:step 5. non-finite:RuntimeWarning")
def test_a_second_fit_numbers_its_steps_from_where_the_trainer_stood(one_rank, tmp_path):
    whole = _fit(_trainer(), STEPS, tmp_path / "whole")
    trainer = _trainer()
    first = _fit(trainer, 3, tmp_path / "parts")
    second = _fit(trainer, STEPS, tmp_path / "parts")

    assert (whole.first_step, first.first_step, second.first_step) == (1, 1, 4)
    assert len(second.losses) == 3 and second.resumed_from is None  # continued, not resumed
    assert second.skipped_steps == whole.skipped_steps == [NAN_STEP]
    assert math.isnan(second.losses[NAN_STEP - second.first_step])
    for part in (first, second):  # losses[i] is step first_step + i, as in the uninterrupted run
        offset = part.first_step - whole.first_step
        assert _same(part.losses, whole.losses[offset : offset + len(part.losses)])
    assert [step for step, _ in first.eval_losses] == [3] and [step for step, _ in second.eval_losses] == [6]
    assert second.eval_losses[0][1] == pytest.approx(whole.eval_losses[-1][1], abs=1e-6)

    lines = [json.loads(line) for line in (tmp_path / "parts" / METRICS_FILE).read_text().splitlines()]
    assert [line["step"] for line in lines if "loss" in line] == list(range(1, STEPS + 1))  # each step once
    assert [line["step"] for line in lines if "eval_loss" in line] == [3, 6]


def test_a_second_fit_with_no_step_left_is_refused_saying_num_steps_counts_every_step(one_rank, tmp_path):
    trainer = _trainer()
    _fit(trainer, 3, tmp_path / "first")
    with pytest.raises(InputError, match=r"num_steps=3 counts every step of this trainer, which has taken 3"):
        _fit(trainer, 3, tmp_path / "second")
