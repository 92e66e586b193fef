"""`partita train` on a factory's own data (issue 15), end to end: 2 processes, 2 pipeline stages,
compared with unsplit training of the same model on the same batches in this process.

Two jobs of examples/own_data.py, each from a hand-made 2-stage 1F1B plan file (no planning), run
at once (their start-up, imports and capture, overlaps):

- ``loader``: ``build``, a shuffled DataLoader of 16-sample batches joined two by two into steps of
  32; cosine schedule with warm-up, an evaluation every 3 steps, ``--log-dir``;
- ``rows``: ``build_rows``, a dataset of rows of different lengths padded per batch by its
  collate_fn, ``--accumulate 2`` (a plan for 8 samples, steps of 16).

and, beside them, the example's own command as its docstring gives it (``shipped``: `partita train
examples/own_data.py:build_rows --nproc 2 --global-batch 32 --steps 40`, planned here: the planner
may shard the stage, and the batches come padded to their own lengths, 30 to 32) trains to the end,
every step equal to unsplit training.

Beside them, the Python user's way: ``partita.fit`` on ``build`` with the ``loader`` job's plan
file and settings (workers_python_api.job_fit_like_cli) must record the CLI's losses; and the
complete script examples/train.py trains under ``torchrun --nproc-per-node 2``.

That a resumed run reads the batches of an uninterrupted one (and epochs, reshuffles) is
tests/unit/test_cli_data.py's: train() on one rank, and the skipping of batches and rows.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from dist_launch import REPO, run_ranks

STEPS, LR, WARMUP = 6, 1e-2, 2
EXAMPLE_STEPS = 24
ROWS_STEPS, ROWS_BATCH = 4, 16
TOLERANCE = 1e-5
TIMEOUT_S = 480  # three jobs at once on a 2-core machine
SHIPPED = ["examples/own_data.py:build_rows", "--nproc", "2", "--global-batch", "32", "--steps", "40"]
SHIPPED_LR, SHIPPED_STEPS, SHIPPED_BATCH = 3e-3, 40, 32  # `partita train`'s default --lr


def _load(factory: str):
    from partita.cli.model_spec import load_model

    return load_model(f"examples/own_data.py:{factory}")  # seeded as `partita train` builds it (--seed 0)


def _plan(factory: str, global_batch: int, path: Path) -> Path:
    import partita
    from partita.planning.manual import manual_plan

    ex = _load(factory)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    n = graph.num_nodes
    plan = manual_plan(
        graph, [0, n // 2, n], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=global_batch
    )
    plan.save(str(path))
    return path


def _start(out: Path, name: str, factory: str, plan: Path, *options: str) -> subprocess.Popen:
    argv = [f"examples/own_data.py:{factory}", "--plan", str(plan), "--lr", str(LR), *options]
    return _launch(out, name, argv)


def _launch(out: Path, name: str, train_argv: list[str]) -> subprocess.Popen:
    """``partita train TRAIN_ARGV --losses-out OUT/NAME.json``, logging to OUT/NAME.log."""
    argv = [sys.executable, "-m", "partita.cli", "train", *train_argv, "--losses-out", str(out / f"{name}.json")]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log = open(out / f"{name}.log", "w")
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait(out: Path, name: str, proc: subprocess.Popen, deadline: float) -> None:
    try:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log = (out / f"{name}.log").read_text(errors="replace")
    assert proc.returncode == 0, f"{name} failed (exit {proc.returncode}):\n{log[-4000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli_data")
    loader_plan = _plan("build", 32, out / "loader-plan.json")
    rows_plan = _plan("build_rows", ROWS_BATCH // 2, out / "rows-plan.json")
    loader_options = ["--steps", str(STEPS), "--lr-schedule", "cosine", "--warmup-steps", str(WARMUP)]
    loader_options += ["--eval-every", "3", "--eval-batches", "2", "--log-dir", str(out / "logs")]
    rows_options = ["--steps", str(ROWS_STEPS), "--global-batch", str(ROWS_BATCH), "--accumulate", "2"]
    deadline = time.monotonic() + TIMEOUT_S
    shipped = _launch(out, "shipped", [*SHIPPED, "--plan-out", str(out / "shipped-plan.json")])
    loader = _start(out, "loader", "build", loader_plan, *loader_options)
    rows = _start(out, "rows", "build_rows", rows_plan, *rows_options)
    script = _start_example_script(out)
    with ThreadPoolExecutor(1) as pool:
        fit = pool.submit(
            run_ranks, "fit_like_cli", 2, out / "fit", timeout_s=TIMEOUT_S, workers=REPO / "tests" / "dist" /
            "workers_python_api.py", plan=str(loader_plan), lr=LR, steps=STEPS, warmup=WARMUP,
        )  # fmt: skip
        try:
            _wait(out, "rows", rows, deadline)
            _wait(out, "loader", loader, deadline)
            _wait(out, "shipped", shipped, deadline)
            _wait(out, "example", script, deadline)
        finally:
            for proc in (loader, rows, shipped, script):
                if proc.poll() is None:
                    proc.kill()
        (out / "fit.json").write_text(json.dumps(fit.result()))
    return out


def _start_example_script(out: Path) -> subprocess.Popen:
    """examples/train.py under torchrun, as its docstring says to run it."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["examples/train.py", "--steps", str(EXAMPLE_STEPS), "--out", str(out / "example")]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    log = open(out / "example.log", "w")
    return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _record(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


# ----------------------------------------------------------------------------- unsplit references


def _cosine_lr(step: int) -> float:
    if step <= WARMUP:
        return LR * step / WARMUP
    return LR * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def _unsplit(model, step_batches, loss_of, lrs, after_step=lambda step: None) -> list[float]:
    """AdamW at ``lrs[s]`` with `partita train`'s default clipping (global norm 1.0), full batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step, (batch, lr) in enumerate(zip(step_batches, lrs), start=1):
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        after_step(step)
    return losses


def _tokens_loss(model, batch):
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(model(tokens), labels)


@pytest.fixture(scope="module")
def loader_reference():
    """``build``'s loader read as the job reads it: two 16-sample batches per step, in the loader's
    seeded shuffled order; evaluations after steps 3 and 6 over the first two 32-sample held-out batches."""
    ex = _load("build")
    batches = iter(ex.data)
    steps = [tuple(torch.cat(pair) for pair in zip(next(batches), next(batches))) for _ in range(STEPS)]
    held_out = [batch for batch, _ in zip(ex.eval_data, range(2))]
    evals = []

    def evaluate(step: int) -> None:
        if step % 3 == 0:
            ex.model.eval()
            with torch.no_grad():
                evals.append(sum(_tokens_loss(ex.model, b).item() for b in held_out) / len(held_out))
            ex.model.train()

    lrs = [_cosine_lr(s) for s in range(1, STEPS + 1)]
    return _unsplit(ex.model, steps, _tokens_loss, lrs, evaluate), evals


def test_a_dataloader_trains_exactly_as_unsplit_training_on_the_same_batches(runs, loader_reference):
    record = _record(runs, "loader")
    losses, _ = loader_reference
    assert record["first_step"] == 1
    assert record["losses"] == pytest.approx(losses, abs=TOLERANCE)


def test_cosine_schedule_eval_losses_and_the_log_dir(runs, loader_reference):
    _, evals = loader_reference
    record = _record(runs, "loader")
    assert [e["step"] for e in record["eval_losses"]] == [3, 6]
    assert [e["loss"] for e in record["eval_losses"]] == pytest.approx(evals, abs=TOLERANCE)
    lines = [json.loads(line) for line in (runs / "logs" / "metrics.jsonl").read_text().splitlines()]
    train_lines = [line for line in lines if "loss" in line]
    assert [set(line) for line in train_lines] == [
        {"step", "loss", "lr", "grad_norm", "step_s", "samples_per_s"}
    ] * STEPS
    assert [line["lr"] for line in train_lines] == pytest.approx([_cosine_lr(s) for s in range(1, STEPS + 1)], rel=1e-9)
    assert [line["loss"] for line in train_lines] == pytest.approx(record["losses"], rel=1e-9)
    assert [line for line in lines if "eval_loss" in line] == [
        {"step": e["step"], "eval_loss": pytest.approx(e["loss"]), "eval_batches": 2} for e in record["eval_losses"]
    ]
    assert list((runs / "logs").glob("events.out.tfevents.*")), "no TensorBoard event file"


def _rows_reference() -> list[float]:
    """``build_rows``' rows in order, 16 per step, collated (padded to each batch's longest row)."""
    ex = _load("build_rows")
    steps = [
        ex.collate_fn([ex.data[i] for i in range(s * ROWS_BATCH, (s + 1) * ROWS_BATCH)]) for s in range(ROWS_STEPS)
    ]

    def loss_of(model, batch):
        return torch.nn.functional.cross_entropy(model(tokens=batch["tokens"], mask=batch["mask"]), batch["target"])

    assert len({b["tokens"].shape[1] for b in steps}) > 1, "the steps should have different lengths"
    return _unsplit(ex.model, steps, loss_of, [LR] * ROWS_STEPS)


def test_rows_of_different_lengths_collated_with_accumulation_equal_unsplit_training(runs):
    """--accumulate 2 (two pipeline rounds of 8 per optimizer step) equals one unsplit step on the 16 samples."""
    assert _record(runs, "rows")["losses"] == pytest.approx(_rows_reference(), abs=TOLERANCE)
    assert "rows make no whole step of 16: dropped every epoch" in (runs / "rows.log").read_text()


def test_partita_fit_records_the_losses_of_partita_train_on_the_same_factory_and_settings(runs):
    cli, (fit_rank0, fit_rank1) = _record(runs, "loader"), json.loads((runs / "fit.json").read_text())
    assert fit_rank0["first_step"] == cli["first_step"] == 1
    assert fit_rank0["losses"] == pytest.approx(cli["losses"], abs=1e-6)
    assert fit_rank1["losses"] == fit_rank0["losses"]
    assert [list(e) for e in fit_rank0["eval_losses"]] == [
        [e["step"], pytest.approx(e["loss"], abs=1e-6)] for e in cli["eval_losses"]
    ]


def test_the_example_script_trains_under_torchrun(runs):
    """examples/train.py: planned on rank 0 for 2 processes, trained by partita.fit, the loss falls."""
    record = json.loads((runs / "example" / "losses.json").read_text())
    assert record["first_step"] == 1 and len(record["losses"]) == EXAMPLE_STEPS
    first, last = sum(record["losses"][:4]) / 4, sum(record["losses"][-4:]) / 4
    assert last < 0.7 * first, record["losses"]
    assert (runs / "example" / "plan.json").exists() and list((runs / "example" / "checkpoints").iterdir())


def test_the_shipped_example_trains_to_the_end_like_unsplit_training(runs):
    """The run of examples/own_data.py's docstring, planned on this machine (its stage may be
    sharded: batches padded to another length then run through the same FSDP2 modules): all 40
    steps, each loss equal to unsplit training's on the same rows, 32 per step, epoch after epoch."""
    record = _record(runs, "shipped")
    assert record["first_step"] == 1 and len(record["losses"]) == SHIPPED_STEPS
    ex = _load("build_rows")
    per_epoch = len(ex.data) // SHIPPED_BATCH
    steps = [
        ex.collate_fn([ex.data[i] for i in range(s % per_epoch * SHIPPED_BATCH, (s % per_epoch + 1) * SHIPPED_BATCH)])
        for s in range(SHIPPED_STEPS)
    ]
    assert len({b["tokens"].shape[1] for b in steps}) > 1, "the steps should have different lengths"

    def loss_of(model, batch):
        return torch.nn.functional.cross_entropy(model(tokens=batch["tokens"], mask=batch["mask"]), batch["target"])

    expected = _unsplit(ex.model, steps, loss_of, [SHIPPED_LR] * SHIPPED_STEPS)  # each step's lr is set
    assert record["losses"] == pytest.approx(expected, abs=TOLERANCE)
    log = (runs / "shipped.log").read_text()
    assert f"train: step {SHIPPED_STEPS}/{SHIPPED_STEPS}" in log, log[-3000:]
