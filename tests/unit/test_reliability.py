"""Reliability pieces that need no process group: which checkpoint a restarted run resumes from,
the errors for incomplete checkpoints, restart detection, the non-finite policy and its message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from partita.cli.train_loop import TrainConfig, check_train_config
from partita.errors import InputError
from partita.runtime.checkpoint import load_into_model
from partita.runtime.checkpoint_dir import METADATA_FILE, checkpoint_path, is_complete, latest_checkpoint
from partita.runtime.launch import restart_count
from partita.runtime.numerics import NonFinite, NonFinitePolicy, describe


def _checkpoint(directory, step: int, *, metadata: bool = True, suffix: str = "") -> str:
    """A directory shaped like a DCP checkpoint (contents are not read by the code under test)."""
    path = Path(checkpoint_path(str(directory), step) + suffix)
    path.mkdir()
    (path / "__0_0.distcp").write_bytes(b"data")
    if metadata:
        (path / METADATA_FILE).write_bytes(b"meta")
    return str(path)


def test_latest_checkpoint_skips_partial_writes_and_directories_without_metadata(tmp_path):
    assert latest_checkpoint(str(tmp_path / "absent")) is None
    assert latest_checkpoint(str(tmp_path)) is None
    complete = _checkpoint(tmp_path, 6)
    _checkpoint(tmp_path, 3)
    _checkpoint(tmp_path, 9, metadata=False)  # data files written, metadata never
    _checkpoint(tmp_path, 12, suffix=".partial")  # killed before the rename
    (tmp_path / "step-000015.old").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert latest_checkpoint(str(tmp_path)) == complete
    assert is_complete(complete)
    assert not is_complete(checkpoint_path(str(tmp_path), 9))
    assert not is_complete(checkpoint_path(str(tmp_path), 12) + ".partial")


def test_loading_an_incomplete_checkpoint_says_why_and_what_to_do(tmp_path):
    model = torch.nn.Linear(2, 2)
    missing_metadata = _checkpoint(tmp_path, 9, metadata=False)
    with pytest.raises(InputError, match=r"step-000009'.*lacks DCP's \.metadata.*latest_checkpoint"):
        load_into_model(model, missing_metadata)
    partial = _checkpoint(tmp_path, 12, suffix=".partial")
    with pytest.raises(InputError, match=r"step-000012\.partial' is an unfinished.*latest_checkpoint"):
        load_into_model(model, partial)
    with pytest.raises(InputError, match=r"step-000012'.*only a \.partial directory.*latest_checkpoint"):
        load_into_model(model, checkpoint_path(str(tmp_path), 12))


def test_restart_count_comes_from_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restart_count() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert restart_count() == 2
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "two")
    with pytest.raises(InputError, match="TORCHELASTIC_RESTART_COUNT='two' is not an integer.*unset it"):
        restart_count()


def test_nonfinite_policy_is_checked_up_front():
    assert NonFinitePolicy.parse("skip") is NonFinitePolicy.SKIP
    with pytest.raises(InputError, match=r"on_nonfinite='ignore' is not one of 'raise', 'skip'"):
        NonFinitePolicy.parse("ignore")
    with pytest.raises(InputError, match="on_nonfinite='ignore'"):
        check_train_config(TrainConfig(steps=1, on_nonfinite="ignore"))


def test_nonfinite_message_names_replica_samples_and_merges_holders_of_a_parameter():
    findings = [
        NonFinite("loss", "inf", (3,), rank=7, microbatch_index=1, replica=1, first_sample=10, num_samples=2),
        *[NonFinite("gradient", "nan", (0,), rank=r, parameter="wte.weight") for r in (0, 6)],
        NonFinite("gradient", "nan", (3,), rank=7, parameter="wte.weight"),
    ]
    text = describe(findings, step=5, replicas=2, policy=NonFinitePolicy.RAISE)
    assert text.startswith(
        "step 5: non-finite loss: micro-batch 1 of replica 1 (samples 10-11 of the global batch) "
        "gave inf on stage 3, the last stage (rank 7). The gradients of 1 parameter(s) are "
        "non-finite too."
    ), text
    grads_only = describe(findings[1:], step=5, replicas=2, policy=NonFinitePolicy.SKIP)
    assert grads_only == (
        "step 5: non-finite gradients (the loss is finite) in 1 parameter(s): wte.weight (nan; "
        "stage 0, 3, rank 0, 6, 7). The optimizer step was skipped: weights, optimizer state and "
        "LR schedule are unchanged."
    )


def test_train_command_accepts_the_reliability_options():
    from partita.cli import build_parser

    args = build_parser().parse_args(
        ["train", "gpt2", "--on-nonfinite", "skip", "--losses-out", "l.json", "--seed", "3", "--max-restarts", "2"]
    )
    assert (args.on_nonfinite, args.losses_out, args.seed, args.max_restarts) == ("skip", "l.json", 3, 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "gpt2", "--on-nonfinite", "ignore"])
