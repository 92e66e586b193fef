"""The trainer's job-level checks that need no process group: plan digests, option validation,
timeout detection (the multi-process behaviour is in tests/dist/test_exact_losses.py)."""

from __future__ import annotations

import datetime

import pytest
import torch

import partita
from partita.errors import CollectiveTimeoutError, InputError
from partita.planning.manual import manual_plan
from partita.runtime.plan_digest import plan_digest
from partita.runtime.process_groups import timeout_of
from partita.runtime.progress import Progress, is_timeout


def _plan(graph, cut: int):
    return manual_plan(
        graph, [0, cut, graph.num_nodes], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=8
    )


def test_the_plan_digest_tells_plans_apart_and_survives_a_round_trip(mlp):
    from partita.types.plan_file import plan_from_json, plan_to_json

    _, graph = mlp
    a, b = _plan(graph, 3), _plan(graph, 5)
    assert plan_digest(a) == plan_digest(_plan(graph, 3)) == plan_digest(plan_from_json(plan_to_json(a)))
    assert plan_digest(a) != plan_digest(b)


def test_timeouts_and_seeds_are_validated_before_anything_starts(mlp):
    ex, graph = mlp
    assert timeout_of(None) is None and timeout_of(2) == datetime.timedelta(seconds=2)
    for bad in (0, -1, True, "5"):
        with pytest.raises(InputError, match="collective_timeout_s"):
            timeout_of(bad)
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match="seed must be a non-negative int"):
            partita.Trainer(ex.model, _plan(graph, 3), graph=graph, optimizer=torch.optim.SGD, seed=bad)


def test_timed_out_waits_are_told_from_other_errors():
    assert is_timeout(
        RuntimeError(
            "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
        )
    )
    assert is_timeout(RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)"))
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:3987"))
    assert not is_timeout(ValueError("timed out"))


def test_a_timeout_error_without_store_still_names_the_step_and_the_rank():
    progress = Progress(rank=3, world_size=4, enabled=False)
    error = progress.timeout_error(
        RuntimeError("Timed out waiting 5000ms for recv operation to complete"),
        step=7,
        doing="the all-reduce of the loss",
        stages="stage 1",
        timeout_s=5,
    )
    assert isinstance(error, CollectiveTimeoutError) and isinstance(error, TimeoutError)
    assert (error.step, error.rank, error.behind) == (7, 3, ())
    assert str(error).startswith("step 7: rank 3 (stage 1) waited more than 5 s in the all-reduce of the loss")
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert (copy.step, copy.rank, str(copy)) == (7, 3, str(error))
