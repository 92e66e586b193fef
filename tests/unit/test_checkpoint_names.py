"""A checkpoint loads only into the model it was written for (issue 54, item 3): the same parameter
and persistent buffer names, whatever the plan. One whose names are a superset or a subset of the
model's -- another model that shares some names -- is refused before anything is read, naming the
names on each side, by ``trainer.load_checkpoint``, ``partita.fit(resume=True)`` and
``load_into_model`` alike. Run in this process on a 1-rank gloo group (a HashStore: no torchrun)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import partita
from partita.errors import InputError
from partita.runtime.checkpoint import load_into_model
from partita.runtime.checkpoint_dir import checkpoint_path
from partita.runtime.materialize import save_seed

BATCH, WIDTH, CLASSES = 8, 16, 4


class _Net(nn.Module):
    """``depth`` hidden layers and a head: two depths share the names (and shapes) of the shallower."""

    def __init__(self, depth: int):
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(depth)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _model(depth: int, *, seed: int = 0) -> _Net:
    torch.manual_seed(seed)
    return _Net(depth)


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _trainer(model: nn.Module) -> partita.Trainer:
    x, y = _batch()
    graph = partita.capture(model, (x,), loss_fn=nn.functional.cross_entropy, target=y)
    plan = partita.manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=2, global_batch_size=BATCH
    )
    return partita.Trainer(model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))


def _trained_checkpoint(path: str, depth: int) -> str:
    trainer = _trainer(_model(depth))
    x, y = _batch(1)
    trainer.step(x, target=y)
    trainer.save_checkpoint(path)
    return path


def _snapshot(trainer: partita.Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.params.items()}


def test_a_checkpoint_of_a_larger_model_is_refused_naming_its_extra_names(one_rank, tmp_path):
    path = _trained_checkpoint(str(tmp_path / "step-000001"), depth=4)  # body.0-3, head
    trainer = _trainer(_model(2))  # body.0-1, head: the same names and shapes as the checkpoint's
    before = _snapshot(trainer)
    with pytest.raises(InputError) as raised:
        trainer.load_checkpoint(path)
    message = str(raised.value)
    assert message.startswith(f"checkpoint {path!r} was written for another model: ")
    assert (
        "it holds 4 parameters or buffers this model lacks (body.2.bias, body.2.weight, body.3.bias and 1 more)"
        in message
    )
    assert "lacks" in message and "this model has" not in message
    assert trainer.num_steps == 0
    assert all(torch.equal(before[name], p) for name, p in trainer.params.items())  # nothing was read


def test_a_checkpoint_of_a_smaller_model_is_refused_naming_the_names_it_lacks(one_rank, tmp_path):
    path = _trained_checkpoint(str(tmp_path / "step-000001"), depth=1)
    trainer = _trainer(_model(2))
    with pytest.raises(
        InputError, match=r"it lacks 2 parameters or buffers this model has \(body\.1\.bias, body\.1\.weight\)"
    ):
        trainer.load_checkpoint(path)
    assert trainer.num_steps == 0


def test_both_differences_are_named_at_once(one_rank, tmp_path):
    path = _trained_checkpoint(str(tmp_path / "step-000001"), depth=1)
    model = _model(1)
    model.out = model.head  # the same head, under another name
    del model.head
    model.forward = lambda x: model.out(model.body(x))
    with pytest.raises(
        InputError,
        match=r"holds 2 .* this model lacks \(head\.bias, head\.weight\), and it lacks 2 .* this model has \(out\.bias",
    ):
        _trainer(model).load_checkpoint(path)


def test_fit_refuses_to_resume_from_another_models_checkpoint(one_rank, tmp_path):
    ckpt = tmp_path / "ckpt"
    _trained_checkpoint(checkpoint_path(str(ckpt), 1), depth=2)
    trainer = _trainer(_model(1))
    data = [_batch(step) for step in range(4)]
    with pytest.raises(
        InputError, match=r"holds 2 parameters or buffers this model lacks \(body\.1\.bias, body\.1\.weight\)"
    ):
        partita.fit(trainer, data, num_steps=3, checkpoint_dir=str(ckpt), resume=True, progress=False)
    assert trainer.num_steps == 0


def test_the_same_model_under_its_own_names_still_loads(one_rank, tmp_path):
    path = _trained_checkpoint(str(tmp_path / "step-000001"), depth=2)
    trainer = _trainer(_model(2, seed=7))
    trainer.load_checkpoint(path)
    assert trainer.num_steps == 1


def test_load_into_model_refuses_another_models_checkpoint_and_reads_nothing(tmp_path):
    path = str(tmp_path / "seed")
    save_seed(_model(2, seed=1), path)
    smaller = _model(1, seed=2)
    before = {k: v.clone() for k, v in smaller.state_dict().items()}
    with pytest.raises(
        InputError, match=r"holds 2 parameters or buffers this model lacks \(body\.1\.bias, body\.1\.weight\)"
    ):
        load_into_model(smaller, path)
    assert all(torch.equal(before[k], v) for k, v in smaller.state_dict().items())
    with pytest.raises(
        InputError, match=r"lacks 2 parameters or buffers this model has \(body\.2\.bias, body\.2\.weight\)"
    ):
        load_into_model(_model(3), path)
    same = _model(2, seed=3)
    load_into_model(same, path)
    assert torch.equal(same.body[1].weight, _model(2, seed=1).body[1].weight)


def test_a_non_persistent_buffer_in_the_checkpoint_is_the_models_own(tmp_path):
    """A seed holds every buffer, non-persistent ones too (save_seed): the model has them, so they
    are no difference, though ``state_dict()`` leaves them out."""

    def with_buffer(seed: int) -> nn.Module:
        model = _model(1, seed=seed)
        model.register_buffer("mask", torch.full((WIDTH,), float(seed)), persistent=False)
        return model

    path = str(tmp_path / "seed")
    save_seed(with_buffer(1), path)
    model = with_buffer(2)
    load_into_model(model, path)
    assert torch.equal(model.head.weight, _model(1, seed=1).head.weight)


def test_a_seed_of_a_larger_model_is_refused_naming_what_it_holds_besides(tmp_path):
    """A seed checkpoint (init_from) of another model that shares this one's names is refused too."""
    from partita.runtime.materialize import materialize

    seed = str(tmp_path / "seed")
    save_seed(_model(4), seed)
    with torch.device("meta"):
        model = _Net(2)
    names = {name for name, _ in model.named_parameters()}
    with pytest.raises(InputError, match=r"holds \['model.body.2.bias'.*which the model has not.*another model"):
        materialize(model, [], names, torch.device("cpu"), seed)
    assert all(p.is_meta for p in model.parameters()), "nothing was allocated or read"
