"""partita.Trainer on gloo with a sequence-first encoder: micro-batches cut along batch dim 1.

``nn.TransformerEncoder`` with ``batch_first=False`` takes ``(S, B, E)``; capture finds batch dim 1
(tests/unit/test_batch_dims.py), and one SGD step of 2 stages x 2 micro-batches (1F1B, 2 ranks)
and of 2 stages x 2 replicas (GPipe, 4 ranks) equals unsplit full-batch training.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

UNIT = Path(__file__).resolve().parents[1] / "unit"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, schedule: str, replicas: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    sys.path.insert(0, str(UNIT))
    import torch.distributed as dist
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
        schedule=schedule,
        num_rank_groups=2,
        replicas=replicas,
        num_microbatches=2,
        global_batch_size=8,
        recompute=False,
    )
    trainer = partita.Trainer(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), graph=graph)
    loss = trainer.step(src, target=y)
    state = trainer.gather_state_dict()
    if rank == 0:
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_loss = F.cross_entropy(reference(src), y)
        ref_loss.backward()
        optimizer.step()
        diff = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        torch.save(
            {
                "loss": float(loss),
                "ref_loss": ref_loss.item(),
                "diff": diff,
                "dims": [i.tensor.batch_dim for i in graph.inputs],
            },
            out,
        )
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("schedule, replicas", [("1f1b", 1), ("gpipe", 2)])
def test_sequence_first_encoder_trains_exactly(tmp_path, schedule, replicas):
    import torch.multiprocessing as mp

    out = str(tmp_path / "result.pt")
    mp.spawn(_worker, args=(2 * replicas, _free_port(), out, schedule, replicas), nprocs=2 * replicas)
    result = torch.load(out)
    assert result["dims"] == [1, 0]
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-6
    assert result["diff"] <= 1e-6
