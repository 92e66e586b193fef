"""`partita train` on the user's data (issue 15): data sources, --lr-schedule, --accumulate,
--eval-every and --log-dir, checked in this process.

The data-source tests read batches through partita.training.data_source against small captured
graphs; the training tests run ``train_loop.train`` on a 1-rank process group (the multi-rank
runs through the command line are tests/dist/test_cli_data.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import re
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import partita
from partita.cli.main import main
from partita.cli.model_spec import FactoryExample, _as_example
from partita.cli.train_loop import TrainConfig, check_train_config, train
from partita.errors import InputError, ModelSpecError
from partita.planning.manual import manual_plan
from partita.training.data_source import EVAL_FIRST_STEP, check_first_batch, eval_batches, training_batches
from partita.training.lr_schedule import check_lr_schedule, lr_at, lr_scheduler_factory
from partita.training.metrics import MetricsWriter

CLI = importlib.import_module("partita.cli.main")
LAUNCH = importlib.import_module("partita.runtime.launch")
OWN_DATA = "examples/own_data.py"


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(32, 8), nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embed(tokens).mean(dim=1))  # (B, 3)


def _samples(n: int, seed: int = 0, seq_len: int = 5):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (n, seq_len), generator=gen)
    return tokens, tokens[:, 0] % 3


def _example(**fields) -> FactoryExample:
    tokens, labels = _samples(4)
    base = {"model": Classifier(), "inputs": (tokens,), "loss_fn": nn.functional.cross_entropy, "target": labels}
    return _as_example("test.py:factory", base | fields)


def _keyword_example(**fields) -> FactoryExample:
    tokens, labels = _samples(4)
    base = {"model": Classifier(), "inputs": {"tokens": tokens}, "loss_fn": nn.functional.cross_entropy}
    return _as_example("test.py:factory", base | {"target": labels} | fields)


def _graph(example):
    return partita.capture(example.model, example.args, example.kwargs, loss_fn=example.loss_fn, target=example.target)


@pytest.fixture(scope="module")
def positional():
    ex = _example()
    return ex, _graph(ex)


@pytest.fixture(scope="module")
def keyword():
    ex = _keyword_example()
    return ex, _graph(ex)


def _take(example, graph, batch_size, count, **kw):
    notes = []
    batches = training_batches(example, graph, batch_size, note=notes.append, **kw)
    return list(itertools.islice(batches, count)), notes


def _with(example, **fields):
    return dataclasses.replace(example, **fields)


# ----------------------------------------------------------------------------- the factory's contract


def test_a_factory_dict_gives_the_model_inputs_loss_and_sources():
    loader = DataLoader(TensorDataset(*_samples(8)), batch_size=4)
    ex = _example(data=loader, eval_data=[(_samples(4)[0], _samples(4)[1])])
    assert ex.args[0].shape == (4, 5) and ex.kwargs == {} and ex.data is loader and len(ex.eval_data) == 1
    assert ex.loss_fn is nn.functional.cross_entropy and ex.make_batch is None
    old = _as_example("f.py:f", (Classifier(), (_samples(4)[0],)))  # the tuple forms still work
    assert old.data is None and old.loss_fn is None


def test_a_wrong_factory_dict_is_a_model_spec_error():
    with pytest.raises(ModelSpecError, match=r"unknown keys \['dataset'\]: the keys are model, inputs"):
        _example(dataset=[1])
    with pytest.raises(ModelSpecError, match="a loss_fn without a target"):
        _as_example("f.py:f", {"model": Classifier(), "inputs": (_samples(4)[0],), "loss_fn": nn.functional.mse_loss})
    with pytest.raises(ModelSpecError, match="without 'inputs'"):
        _as_example("f.py:f", {"model": Classifier()})
    with pytest.raises(ModelSpecError, match=r"the 'data' of the factory .* is a int, which partita cannot read"):
        _example(data=3)
    with pytest.raises(ModelSpecError, match=r"is a DataLoader, which yields batches, and a collate_fn was given"):
        _example(data=DataLoader(TensorDataset(*_samples(8))), collate_fn=lambda rows: rows)


# ----------------------------------------------------------------------------- batches from sources


def test_loader_batches_are_joined_and_cut_into_step_batches_epoch_after_epoch(positional):
    ex, graph = positional
    tokens, labels = _samples(20)
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=6)  # 6, 6, 6, 2 per epoch
    batches, notes = _take(_with(ex, data=loader), graph, 8, 5)
    # epoch 1: samples 0-7, 8-15; 16-19 left over (dropped); epoch 2 starts again at sample 0
    starts = [0, 8, 0, 8, 0]
    for (args, kwargs, target), start in zip(batches, starts):
        assert torch.equal(args[0], tokens[start : start + 8]) and torch.equal(target, labels[start : start + 8])
        assert kwargs == {}
    assert notes == [
        "data: the last 4 samples of each epoch make no whole step of 8: dropped (a DataLoader with "
        "drop_last=True, or a multiple of 8 samples, uses all)"
    ]


def test_batches_of_a_step_pass_unchanged_whatever_their_length(positional):
    ex, graph = positional
    lengths = [7, 3, 5]
    data = [_samples(4, seed=i, seq_len=n) for i, n in enumerate(lengths)]
    batches, notes = _take(_with(ex, data=data), graph, 4, 4)
    assert [b[0][0].shape[1] for b in batches] == [7, 3, 5, 7] and notes == []
    assert batches[1][0][0] is data[1][0]


def test_batches_that_cannot_be_joined_name_the_input_and_the_fix(positional):
    ex, graph = positional
    data = [_samples(2, seq_len=7), _samples(2, seq_len=3)]
    with pytest.raises(
        InputError,
        match=r"batch 0 of data \(epoch 1\) and batch 1 of data \(epoch 1\) cannot be joined into one step of 4 "
        r"samples: args\[0\] has the shapes \(2, 7\), \(2, 3\)\. Give batches of exactly 4 samples",
    ):
        _take(_with(ex, data=data), graph, 4, 1)


def test_a_batch_of_the_wrong_structure_is_named(positional, keyword):
    ex, graph = positional
    tokens, labels = _samples(4)
    with pytest.raises(
        InputError,
        match=r"batch 0 of data \(epoch 1\) is a list of 1 items, but the model takes 1 positional input\(s\) and a loss target: give each batch as a tuple of 2",
    ):
        _take(_with(ex, data=[[tokens]]), graph, 4, 1)
    with pytest.raises(
        InputError, match=r"args\[0\] has 1 dims \(5,\), but the model was captured with 2 .*not single samples"
    ):
        _take(_with(ex, data=list(zip(tokens, labels))), graph, 4, 1)  # samples, not batches
    ex, graph = keyword
    with pytest.raises(
        InputError,
        match=r"has the keys \['text', 'tokens'\], but the model takes \['tokens'\] and \"target\"; missing: \['target'\]; not model inputs: \['text'\]",
    ):
        _take(_with(ex, data=[{"tokens": tokens, "text": ["a"] * 4}]), graph, 4, 1)
    with pytest.raises(InputError, match=r"batch 0 of data"):
        check_first_batch(_with(ex, data=[{"tokens": tokens}]), graph)  # before launch, in the planning process


def test_too_little_data_and_one_shot_iterators_are_errors(positional):
    ex, graph = positional
    with pytest.raises(InputError, match="data holds 3 samples, fewer than the 4 samples of one step"):
        _take(_with(ex, data=[_samples(3)]), graph, 4, 1)
    one_shot = iter([_samples(4)])
    with pytest.raises(
        InputError, match=r"data ended after epoch 1 and yields no batch when iterated again: it is a one-shot iterator"
    ):
        _take(_with(ex, data=one_shot), graph, 4, 2)
    calls = []

    def fresh():  # a function returning a new iterator: called once per epoch
        calls.append(1)
        yield _samples(4)

    batches, _ = _take(_with(ex, data=fresh), graph, 4, 3)
    assert len(batches) == 3 and len(calls) == 3


def test_rows_are_collated_in_order_and_a_resume_skips_them_by_index(keyword):
    ex, graph = keyword
    tokens, labels = _samples(10)
    rows = [{"tokens": t, "label": y} for t, y in zip(tokens, labels)]

    class Rows:  # duck-typed like datasets.Dataset: __len__ and __getitem__ giving dicts
        reads = 0

        def __len__(self):
            return len(rows)

        def __getitem__(self, i):
            Rows.reads += 1
            return rows[i]

    def collate(batch):
        noise = torch.rand(())  # randomness in a collator: its own stream, seeded per step
        return {
            "tokens": torch.stack([r["tokens"] for r in batch]),
            "target": torch.stack([r["label"] for r in batch]) + 0 * noise.long(),
        }

    source = _with(ex, data=Rows(), collate_fn=collate)
    batches, notes = _take(source, graph, 4, 5)
    assert [torch.equal(b[1]["tokens"], tokens[s : s + 4]) for b, s in zip(batches, [0, 4, 0, 4, 0])] == [True] * 5
    assert notes == ["data: the last 2 of its 10 rows make no whole step of 4: dropped every epoch"]
    Rows.reads = 0
    resumed, _ = _take(source, graph, 4, 2, start_step=3)
    assert Rows.reads == 8  # only the rows of steps 4 and 5
    assert all(torch.equal(a[1]["tokens"], b[1]["tokens"]) for a, b in zip(resumed, batches[3:]))


def test_every_rank_and_a_resumed_run_read_the_same_shuffled_batches(positional):
    """A DataLoader shuffling without a generator draws from the source's own RNG stream: not
    from training's (whatever it did before), and a resume replays it."""
    ex, graph = positional
    tokens, labels = _samples(16)

    def loader():
        return DataLoader(TensorDataset(tokens, labels), batch_size=4, shuffle=True)

    torch.manual_seed(1)
    first, _ = _take(_with(ex, data=loader()), graph, 4, 6, seed=3)
    torch.manual_seed(2)
    torch.rand(100)
    again, _ = _take(_with(ex, data=loader()), graph, 4, 6, seed=3)
    resumed, notes = _take(_with(ex, data=loader()), graph, 4, 2, seed=3, start_step=4)
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(first, again))
    assert all(torch.equal(a[0][0], b[0][0]) for a, b in zip(first[4:], resumed))
    assert not torch.equal(first[0][0][0], first[4][0][0])  # epoch 2 reshuffled
    assert notes == ["resuming: reading and dropping the data's batches of the 4 steps done"]
    other, _ = _take(_with(ex, data=loader()), graph, 4, 1, seed=4)
    assert not torch.equal(other[0][0][0], first[0][0][0])  # another --seed, another order


def test_held_out_batches(positional):
    ex, graph = positional
    notes = []
    held_out = eval_batches(
        _with(ex, eval_data=[_samples(4, seed=s) for s in range(3)]), graph, 4, 5, note=notes.append
    )
    assert len(held_out) == 3 and notes == ["eval_data holds 3 batches of 4 samples: evaluating on those, not 5"]
    with pytest.raises(
        InputError,
        match='--eval-every needs held-out data, and test.py:factory gives none: return it from the factory as {"model"',
    ):
        eval_batches(ex, graph, 4, 2)
    zoo = partita.examples.build("mlp", batch_size=4)
    batches = eval_batches(zoo, _graph(zoo), 4, 2)
    expected = zoo.make_batch(4, EVAL_FIRST_STEP + 1)
    assert torch.equal(batches[1][0][0], expected[0][0]) and torch.equal(batches[1][2], expected[2])


# ----------------------------------------------------------------------------- --lr-schedule


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear"])
def test_lr_per_step_matches_the_closed_form(schedule):
    lr, steps, warmup, min_lr = 0.1, 10, 3, 0.01 if schedule != "constant" else 0.0
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = lr_scheduler_factory(schedule, lr=lr, steps=steps, warmup_steps=warmup, min_lr=min_lr)(optimizer)
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    for s, value in enumerate(seen, start=1):
        if s <= warmup:
            expected = lr * s / warmup
        elif schedule == "cosine":
            expected = min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup)))
        elif schedule == "linear":
            expected = lr - (lr - min_lr) * (s - warmup) / (steps - warmup)
        else:
            expected = lr
        assert value == pytest.approx(expected, rel=1e-12, abs=1e-15), s
        assert lr_at(s, lr=lr, schedule=schedule, steps=steps, warmup_steps=warmup, min_lr=min_lr) == pytest.approx(
            value
        )
    assert seen[warmup - 1] == pytest.approx(lr) and seen[-1] == pytest.approx(min_lr if schedule != "constant" else lr)
    assert lr_scheduler_factory("constant", lr=lr, steps=steps) is None  # today's behaviour: no scheduler


def test_bad_schedule_values_are_named():
    cases = [
        (
            dict(schedule="cosine", warmup_steps=10, min_lr=0.0),
            "--warmup-steps 10 leaves no step of --steps 10 for the cosine decay",
        ),
        (dict(schedule="constant", warmup_steps=11, min_lr=0.0), "--warmup-steps 11 is more than --steps 10"),
        (
            dict(schedule="constant", warmup_steps=0, min_lr=0.01),
            "--min-lr 0.01 has no effect with --lr-schedule constant",
        ),
        (dict(schedule="linear", warmup_steps=0, min_lr=0.5), r"--min-lr must be between 0 and --lr 0.1, got 0.5"),
        (dict(schedule="cosine", warmup_steps=-1, min_lr=0.0), "--warmup-steps must be >= 0, got -1"),
        (
            dict(schedule="step", warmup_steps=0, min_lr=0.0),
            "--lr-schedule 'step' is not one of constant, cosine, linear",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            check_lr_schedule(lr=0.1, steps=10, **kwargs)
    with pytest.raises(InputError, match="--accumulate must be >= 1"):
        check_train_config(TrainConfig(steps=5, accumulate=0))
    with pytest.raises(InputError, match="--eval-every 6 is more than --steps 5"):
        check_train_config(TrainConfig(steps=5, eval_every=6))
    with pytest.raises(InputError, match="--eval-batches must be >= 1, got 0"):
        check_train_config(TrainConfig(steps=5, eval_every=1, eval_batches=0))


# ----------------------------------------------------------------------------- flags, before launch


def _forbid(monkeypatch, *names):
    for name in names:

        def reached(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran before the bad flag was refused")

        monkeypatch.setattr(LAUNCH if name == "launch_local" else CLI, name, reached)


def test_bad_train_flags_are_refused_before_launch(monkeypatch, capsys):
    _forbid(monkeypatch, "_load", "_plan_for_training", "launch_local")
    cases = [
        (["--accumulate", "3"], "--accumulate 3 does not divide --global-batch 16: each of the 3 pipeline rounds"),
        (["--accumulate", "3"], "use --global-batch 15 or 18"),
        (["--accumulate", "0"], r"--accumulate must be >= 1 \(pipeline rounds per optimizer step\), got 0"),
        (
            ["--accumulate", "2", "--microbatches", "3"],
            r"the samples per round \(--global-batch / --accumulate 2\) 8 is not divisible by --microbatches 3",
        ),
        (["--lr-schedule", "cosine", "--warmup-steps", "30"], "--warmup-steps 30 leaves no step of --steps 30"),
        (["--min-lr", "1e-4"], "--min-lr 0.0001 has no effect with --lr-schedule constant"),
        (["--eval-every", "-1"], r"--eval-every must be >= 0 \(0: never\), got -1"),
        (["--eval-every", "5", "--eval-batches", "0"], "--eval-batches must be >= 1, got 0"),
        (["--eval-every", "5", "--init-from", "seed"], "--eval-every 5 with --init-from: .* needs its weights"),
    ]
    for flags, message in cases:
        assert main(["train", "mlp", *flags]) == 2
        err = capsys.readouterr().err
        assert re.search(message, err), (flags, err)
    with pytest.raises(SystemExit):
        main(["train", "mlp", "--lr-schedule", "step"])
    assert "invalid choice: 'step'" in capsys.readouterr().err


@pytest.mark.slow  # measures this machine first (a gloo probe in subprocesses)
def test_eval_every_without_held_out_data_is_refused_before_planning(monkeypatch, capsys):
    _forbid(monkeypatch, "launch_local")
    monkeypatch.setattr(partita, "plan", lambda *a, **k: (_ for _ in ()).throw(AssertionError("planned")))
    assert main(["train", "examples/own_model.py:build", "--eval-every", "5"]) == 2
    assert "--eval-every needs held-out data, and examples/own_model.py:build gives none" in capsys.readouterr().err


# ----------------------------------------------------------------------------- --log-dir


def test_metrics_go_to_jsonl_and_tensorboard_and_a_resume_drops_later_steps(tmp_path):
    pytest.importorskip("tensorboard")
    writer = MetricsWriter(str(tmp_path), note=pytest.fail)
    for step in (1, 2, 3):
        writer.train_step(step, loss=1.0 / step, lr=0.1, grad_norm=None, step_s=0.5, samples_per_s=32.0)
    writer.evaluation(2, loss=float("nan"), num_batches=4)
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 1, "loss": 1.0, "lr": 0.1, "grad_norm": None, "step_s": 0.5, "samples_per_s": 32.0}
    assert lines[3] == {"step": 2, "eval_loss": None, "eval_batches": 4}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "train/loss",
        "train/lr",
        "train/step_s",
        "train/samples_per_s",
        "eval/loss",
    }
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
    MetricsWriter(str(tmp_path), resumed_from=1, note=pytest.fail).close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_without_tensorboard_only_the_jsonl_is_written_with_one_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    notes = []
    writer = MetricsWriter(str(tmp_path), note=notes.append)
    writer.train_step(1, loss=2.0, lr=0.1, grad_norm=1.5, step_s=0.1, samples_per_s=10.0)
    writer.close()
    assert notes == [
        f"--log-dir: writing {tmp_path / 'metrics.jsonl'} only; TensorBoard files need `pip install tensorboard`"
    ]
    assert list(tmp_path.iterdir()) == [tmp_path / "metrics.jsonl"]


# ----------------------------------------------------------------------------- training on 1 rank


def _own_data(factory: str = "build"):
    from partita.cli.model_spec import load_model

    ex = load_model(f"{OWN_DATA}:{factory}")
    graph = _graph(ex)
    plan = manual_plan(
        graph, [0, graph.num_nodes], schedule="1f1b", num_rank_groups=1, num_microbatches=2, global_batch_size=16
    )
    return ex, graph, plan


def test_a_resumed_run_trains_on_the_batches_of_an_uninterrupted_one(one_rank, tmp_path):
    """examples/own_data.py's shuffled DataLoader (16-sample batches) under a cosine schedule: 6
    steps checkpointed every 3; a run interrupted after step 3 (its later checkpoint removed)
    resumes for steps 4-6 with the same batches and learning rates: the same losses."""
    import shutil

    from partita.runtime.checkpoint_dir import checkpoint_path

    ex, graph, plan = _own_data()
    ckpt = str(tmp_path / "ckpt")
    config = TrainConfig(
        steps=6, progress=False, lr_schedule="cosine", warmup_steps=2, lr=1e-2, checkpoint_dir=ckpt, checkpoint_every=3
    )
    full = train(ex, plan, graph, config)
    shutil.rmtree(checkpoint_path(ckpt, 6))
    ex, graph, plan = _own_data()
    resumed = train(ex, plan, graph, dataclasses.replace(config, resume=True))
    assert resumed.resumed_from == 3
    assert resumed.losses == pytest.approx(full.losses[3:], abs=1e-6)


def test_a_run_resumed_with_another_global_batch_trains_every_sample_once(one_rank, tmp_path):
    """examples/own_data.py's shuffled DataLoader: 3 steps of 16 samples checkpointed, then resumed
    with steps of 8 up to step 7 (issue 32): the resumed steps read samples 48-79 of the epoch, as an
    unsplit loop reading the data in order does -- not samples 24-55 again (3 steps x 8) -- and the
    parameters equal that loop's."""
    from partita.cli.model_spec import load_model
    from partita.runtime.checkpoint import load_into_model
    from partita.runtime.checkpoint_dir import checkpoint_path

    ckpt = str(tmp_path / "ckpt")
    # SGD: Adam's 1/(sqrt(v) + 1e-8) would turn summation-order noise of near-zero gradients into
    # parameter differences above the tolerance; the losses say the same with either
    config = TrainConfig(steps=3, progress=False, lr=0.1, optimizer="sgd", checkpoint_dir=ckpt)
    ex, graph, plan = _own_data()
    train(ex, plan, graph, config)
    ex, graph, _ = _own_data()
    small = manual_plan(
        graph, [0, graph.num_nodes], schedule="1f1b", num_rank_groups=1, num_microbatches=2, global_batch_size=8
    )
    resumed = train(ex, small, graph, dataclasses.replace(config, steps=7, resume=True))
    assert resumed.resumed_from == 3 and len(resumed.losses) == 4

    reference = load_model(f"{OWN_DATA}:build")  # the same seeded weights and loader
    tokens, labels = (torch.cat(parts) for parts in zip(*[batch for batch, _ in zip(reference.data, range(5))]))
    optimizer = torch.optim.SGD(reference.model.parameters(), lr=0.1)
    expected = []
    for first, size in [(0, 16), (16, 16), (32, 16), (48, 8), (56, 8), (64, 8), (72, 8)]:
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(reference.model(tokens[first : first + size]), labels[first : first + size])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.model.parameters(), 1.0)
        optimizer.step()
        expected.append(loss.item())
    assert resumed.losses == pytest.approx(expected[3:], abs=1e-5)
    trained = load_model(f"{OWN_DATA}:build").model
    load_into_model(trained, checkpoint_path(ckpt, 7))
    for (name, got), want in zip(trained.state_dict().items(), reference.model.state_dict().values()):
        assert (got - want).abs().max() <= 1e-5, (name, float((got - want).abs().max()))


def test_a_resume_with_nothing_left_to_train_is_refused(one_rank, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ex, graph, plan = _own_data()
    train(ex, plan, graph, TrainConfig(steps=2, progress=False, checkpoint_dir=ckpt))
    ex, graph, plan = _own_data()
    with pytest.raises(InputError, match=r"is at step 2, and --steps 2 would train nothing more"):
        train(ex, plan, graph, TrainConfig(steps=2, progress=False, checkpoint_dir=ckpt, resume=True))


def test_eval_every_averages_the_held_out_losses_and_changes_nothing(one_rank, tmp_path):
    ex, graph, plan = _own_data()
    config = dict(progress=False, lr=1e-2)
    evaluated = train(
        ex, plan, graph, TrainConfig(steps=4, eval_every=2, eval_batches=2, log_dir=str(tmp_path), **config)
    )
    ex, graph, plan = _own_data()
    plain = train(ex, plan, graph, TrainConfig(steps=4, **config))
    assert evaluated.losses == pytest.approx(plain.losses, abs=1e-7)  # evaluation changed no weight
    assert [step for step, _ in evaluated.eval_losses] == [2, 4]
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval_loss" in line] == [2, 4]
