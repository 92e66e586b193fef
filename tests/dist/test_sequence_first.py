"""partita.Trainer on gloo with a sequence-first encoder: micro-batches cut along batch dim 1.

``nn.TransformerEncoder`` with ``batch_first=False`` takes ``(S, B, E)``; capture finds batch dim 1
(tests/unit/test_batch_dims.py), and one SGD step of 2 stages x 2 micro-batches (1F1B, 2 ranks)
and of 2 stages x 2 replicas (GPipe, 4 ranks) equals unsplit full-batch training.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from dist_launch import Job

UNIT = Path(__file__).resolve().parents[1] / "unit"


def job_sequence_first(params: dict) -> dict:
    """Rank side (a job of the shared launches, dist_launch.py): one SGD step of ``params["schedule"]``
    over 2 stages x ``params["replicas"]`` replicas; rank 0 compares it with unsplit training."""
    sys.path.insert(0, str(UNIT))
    from test_batch_dims import SeqFirstClassifier

    import partita
    from partita.planning.manual import manual_plan

    torch.manual_seed(0)
    model = SeqFirstClassifier()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    src, y = torch.randn(6, 8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
    graph = partita.capture(model, (src,), loss_fn=F.cross_entropy, target=y)
    n = graph.num_nodes
    plan = manual_plan(
        graph,
        [0, n // 2, n],
        schedule=params["schedule"],
        num_rank_groups=2,
        replicas=params["replicas"],
        num_microbatches=2,
        global_batch_size=8,
        recompute=False,
    )
    trainer = partita.Trainer(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), graph=graph)
    loss = trainer.step(src, target=y)
    state = trainer.gather_state_dict()
    if int(os.environ["RANK"]) != 0:
        return {}
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_loss = F.cross_entropy(reference(src), y)
    ref_loss.backward()
    optimizer.step()
    diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    return {
        "loss": float(loss),
        "ref_loss": ref_loss.item(),
        "diff": diff,
        "dims": [i.tensor.batch_dim for i in graph.inputs],
    }


# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "two_ranks": Job("test_sequence_first:job_sequence_first", 2, 300, dict(schedule="1f1b", replicas=1)),
    "four_ranks": Job("test_sequence_first:job_sequence_first", 4, 300, dict(schedule="gpipe", replicas=2)),
}


@pytest.fixture(scope="module")
def two_ranks(launches):
    return launches.results_of(__name__, "two_ranks")


@pytest.fixture(scope="module")
def four_ranks(launches):
    return launches.results_of(__name__, "four_ranks")


@pytest.mark.slow
@pytest.mark.parametrize("schedule, replicas", [("1f1b", 1), ("gpipe", 2)])
def test_sequence_first_encoder_trains_exactly(two_ranks, four_ranks, schedule, replicas):
    result = {("1f1b", 1): two_ranks, ("gpipe", 2): four_ranks}[schedule, replicas][0]
    assert result["dims"] == [1, 0]
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-6
    assert result["diff"] <= 1e-6
