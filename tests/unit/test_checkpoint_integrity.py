"""Checkpoint integrity (issue 15): every checkpoint holds a manifest of its files' sizes and
sha256; a truncated or byte-altered checkpoint is never loaded silently or as a raw DCP error:
loading it names the file, and resuming falls back to the previous intact checkpoint with a
warning naming the damaged one. Checkpoints without a manifest (earlier partita) still load,
with a warning.

Also the checks of a training run that need a Trainer (an LR scheduler whose step() needs a
metric; a batch with bad labels at a later step). Those run in this process on a 1-rank gloo
group (a HashStore: no ports, no torchrun).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import partita
from partita import examples
from partita.errors import InputError
from partita.runtime.checkpoint import load_into_model
from partita.runtime.checkpoint_dir import (
    MANIFEST_FILE,
    checkpoint_path,
    damage,
    latest_checkpoint,
)
from partita.runtime.materialize import save_seed


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def _data_file(path: str | Path) -> Path:
    return next(p for p in Path(path).iterdir() if p.suffix == ".distcp")


def _truncate(path: str | Path) -> Path:
    f = _data_file(path)
    os.truncate(f, f.stat().st_size // 2)
    return f


def _flip_a_byte(path: str | Path) -> Path:
    f = _data_file(path)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    return f


def _steps(directory: Path, count: int) -> list[str]:
    """``count`` checkpoint directories (DCP, keys ``model.<name>``) of different weights."""
    return [_save(checkpoint_path(str(directory), step), _model(step)) for step in range(1, count + 1)]


def _save(path: str, model: torch.nn.Module) -> str:
    save_seed(model, path)  # the same DCP layout and manifest as a training checkpoint, in one process
    return path


# ----------------------------------------------------------------------------- one process


def test_a_checkpoint_records_the_size_and_sha256_of_every_file(tmp_path):
    (path,) = _steps(tmp_path, 1)
    manifest = json.loads((Path(path) / MANIFEST_FILE).read_text())
    names = {p.name for p in Path(path).iterdir()} - {MANIFEST_FILE}
    assert set(manifest["files"]) == names and ".metadata" in names
    for name, entry in manifest["files"].items():
        assert entry["bytes"] == (Path(path) / name).stat().st_size and len(entry["sha256"]) == 64
    assert damage(path) is None


@pytest.mark.parametrize(
    "harm, why",
    [
        (_truncate, r"has \d+ bytes, its manifest says \d+: the file was cut short"),
        (_flip_a_byte, "has another sha256 than its manifest records"),
    ],
)
def test_latest_checkpoint_skips_a_damaged_one_and_names_it(tmp_path, harm, why):
    first, second = _steps(tmp_path, 2)
    bad = harm(second)
    with pytest.warns(UserWarning, match=rf"checkpoint '{second}' is damaged \({bad.name} {why}.*skipped"):
        assert latest_checkpoint(str(tmp_path)) == first
    assert latest_checkpoint(str(tmp_path), verify=False) == second


@pytest.mark.parametrize("harm, why", [(_truncate, "cut short"), (_flip_a_byte, "another sha256")])
def test_loading_a_damaged_checkpoint_names_the_file(tmp_path, harm, why):
    (path,) = _steps(tmp_path, 1)
    bad = harm(path)
    model = _model(5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError, match=rf"checkpoint '{path}' is damaged \({bad.name} .*{why}.*load an earlier"):
        load_into_model(model, path)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was read


def test_a_checkpoint_without_manifest_loads_with_a_warning_and_fails_readably(tmp_path):
    first, second = _steps(tmp_path, 2)
    for path in (first, second):
        (Path(path) / MANIFEST_FILE).unlink()
    model = _model(9)
    with pytest.warns(UserWarning, match=rf"'{second}' has no {MANIFEST_FILE}.*cannot be verified"):
        load_into_model(model, second)
    assert torch.equal(model[0].weight, _model(2)[0].weight)
    with pytest.warns(UserWarning, match="cannot be verified"):
        assert latest_checkpoint(str(tmp_path)) == second  # unverifiable, not damaged
    _truncate(second)
    with (
        pytest.warns(UserWarning, match="cannot be verified"),
        pytest.raises(InputError, match=rf"checkpoint '{second}' could not be read \(.*\): a file is cut short"),
    ):
        load_into_model(_model(), second)


def test_an_unreadable_manifest_is_damage(tmp_path):
    first, second = _steps(tmp_path, 2)
    (Path(second) / MANIFEST_FILE).write_text("{not json")
    with pytest.warns(UserWarning, match=rf"'{second}' is damaged \(the manifest .* is unreadable"):
        assert latest_checkpoint(str(tmp_path)) == first


def test_a_truncated_seed_is_refused_before_loading(tmp_path):
    from partita.runtime.materialize import materialize

    seed = _save(str(tmp_path / "seed"), _model())
    _truncate(seed)
    model = _model()
    with pytest.raises(InputError, match=r"seed checkpoint .* is damaged \(.*cut short\).*save_seed"):
        materialize(model, [], {"0.weight"}, torch.device("cpu"), seed)


# ----------------------------------------------------------------------------- a 1-rank process group


def _fresh(one_rank):
    """The MLP example as built (training changes its weights in place), its graph and a 1-rank plan."""
    from partita.planning.manual import manual_plan

    ex = examples.build("mlp", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    plan = manual_plan(
        graph, [0, graph.num_nodes], schedule="1f1b", num_rank_groups=1, num_microbatches=2, global_batch_size=8
    )
    return ex, graph, plan


def test_resume_falls_back_from_a_damaged_latest_checkpoint(one_rank, tmp_path, capsys):
    from partita.cli.train_loop import TrainConfig, train

    ex, graph, plan = _fresh(one_rank)
    ckpt = tmp_path / "ckpt"
    full = train(ex, plan, graph, TrainConfig(steps=4, checkpoint_dir=str(ckpt), checkpoint_every=1, progress=False))
    for step in range(1, 5):
        assert damage(checkpoint_path(str(ckpt), step)) is None
    bad = _truncate(checkpoint_path(str(ckpt), 4))
    _flip_a_byte(checkpoint_path(str(ckpt), 3))
    capsys.readouterr()
    ex, graph, plan = _fresh(one_rank)
    resumed = train(ex, plan, graph, TrainConfig(steps=4, checkpoint_dir=str(ckpt), resume=True, progress=False))
    out = capsys.readouterr()
    assert resumed.resumed_from == 2
    assert f"checkpoint '{checkpoint_path(str(ckpt), 4)}' is damaged ({bad.name} has" in out.err
    assert "step-000003' is damaged" in out.err and "another sha256" in out.err
    assert f"--resume: resuming from {checkpoint_path(str(ckpt), 2)} (step 2)" in out.out
    assert resumed.losses == pytest.approx(full.losses[2:], abs=1e-6)
    assert damage(checkpoint_path(str(ckpt), 4)) is None  # written again, intact


def test_trainer_load_checkpoint_refuses_a_damaged_one(one_rank, tmp_path):
    from partita.runtime.trainer import Trainer

    ex, graph, plan = _fresh(one_rank)
    trainer = Trainer(ex.model, plan, graph=graph, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    path = str(tmp_path / "step-000001")
    trainer.save_checkpoint(path)
    trainer.load_checkpoint(path)
    bad = _truncate(path)
    with pytest.raises(InputError, match=rf"checkpoint '{path}' is damaged \({bad.name} has .*cut short"):
        trainer.load_checkpoint(path)


def test_a_scheduler_whose_step_needs_a_metric_is_refused_at_construction(one_rank):
    from partita.runtime.trainer import Trainer

    ex, graph, plan = _fresh(one_rank)
    with pytest.raises(InputError, match=r"ReduceLROnPlateau, whose step\(\) needs metrics.*LambdaLR"):
        Trainer(
            ex.model,
            plan,
            graph=graph,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
            lr_scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau,
        )
    trainer = Trainer(
        ex.model,
        plan,
        graph=graph,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5),
    )
    args, kwargs, target = ex.make_batch(plan.global_batch_size, 0)
    trainer.step(*args, target=target, **kwargs)
    assert trainer.num_steps == 1


def test_a_bad_label_at_a_later_step_is_named_before_the_step(one_rank):
    import dataclasses

    from partita.cli.train_loop import TrainConfig, train

    ex, graph, plan = _fresh(one_rank)

    def make_batch(batch_size, step):
        args, kwargs, target = ex.make_batch(batch_size, step)
        return (args, kwargs, torch.full_like(target, 99)) if step == 1 else (args, kwargs, target)

    with pytest.raises(InputError, match=r"step 2: target holds label 99, but the loss scores 10 classes"):
        train(dataclasses.replace(ex, make_batch=make_batch), plan, graph, TrainConfig(steps=3, progress=False))
