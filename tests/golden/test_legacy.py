"""Files written by an earlier partita still load: a plan file and a checkpoint that main wrote at
commit f167c30, before the Python API and Trainer changes (tests/golden/legacy/make_legacy.py says
how). The plan file loads against the same model's graph; the checkpoint (written on 2 ranks under
that plan) loads into the plain model and into a Trainer of today under another plan."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from legacy_model import BATCH, batches, build

import partita
from partita.types.plan_file import executed_part

LEGACY = Path(__file__).with_name("legacy")


def _graph():
    model, loss_fn = build()
    x, y = batches()[0]
    return model, partita.capture(model, (x,), loss_fn=loss_fn, target=y)


def test_a_plan_file_of_earlier_partita_loads_and_executes_what_it_did():
    _, graph = _graph()
    plan = partita.Plan.load(str(LEGACY / "plan.json"), graph=graph)
    n = graph.num_nodes
    today = partita.manual_plan(
        graph, [0, n // 2, n], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=BATCH
    )
    assert executed_part(plan) == executed_part(today)


def test_a_checkpoint_of_earlier_partita_loads_into_the_plain_model():
    model, _ = build()
    partita.load_into_model(model, str(LEGACY / "checkpoint"))
    expected = torch.load(LEGACY / "state.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_a_checkpoint_of_earlier_partita_resumes_a_trainer_of_today_under_another_plan(one_rank):
    model, graph = _graph()
    plan = partita.manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=2, global_batch_size=BATCH
    )
    trainer = partita.Trainer(model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    trainer.load_checkpoint(str(LEGACY / "checkpoint"))
    assert trainer.num_steps == 2
    expected = torch.load(LEGACY / "state.pt")
    state = trainer.gather_state_dict()
    assert set(state) == set(expected)
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key
    x, y = batches()[2]
    loss = trainer.step(x, target=y)
    assert trainer.num_steps == 3
    # The optimizer state came with it: step 3 is unsplit training's third AdamW step.
    reference, loss_fn = build()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for x, y in batches()[:3]:
        optimizer.zero_grad()
        ref_loss = loss_fn(reference(x), y)
        ref_loss.backward()
        optimizer.step()
    assert loss == pytest.approx(ref_loss.item(), abs=1e-6)
    state = trainer.gather_state_dict()
    for key, value in reference.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-6), key
