"""Weights that several stages of one rank read, and ranks that built other weights (issue 54, items 1-2).

- ALBERT (one layer's weights applied at every depth, a tied decoder) under every plan the planner
  returns for 2 ranks with each schedule (and micro-batch count) pinned, and under V and interleaved
  placements whose cuts fall inside the shared layer: two SGD steps equal unsplit training (loss and
  every parameter). The holders of a weight summed its gradient in one flattened all-reduce whose
  order was each rank's own: a rank whose stages read the shared weights in another order added
  one weight's gradient to another's (ZB-V, stages 0 and 3 on rank 0, 1 and 2 on rank 1).
- Ranks that seeded the model's construction differently: every rank trains from rank 0's weights
  (as DDP does), rank 0 warns once, and the losses are rank 0's model's, for data parallelism and a
  2-stage pipeline.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from dist_launch import Job

pytest.importorskip("transformers")

TOLERANCE = 1e-5
STEPS = 2
# pins of PlanOptions (schedule, micro-batches) for 2 h100s (analytic costs: the same plans every run)
PINS = [(schedule, m) for schedule in (None, "gpipe", "1f1b", "interleaved1f1b", "zbv") for m in (None, 4)]
# V and interleaved placements cut where the planner does not: fractions of the graph's nodes
MANUAL = [
    ("zbv", (0.25, 0.5, 0.75)),
    ("zbv", (0.37, 0.6, 0.73)),  # the cuts, inside the shared layer's repeats
    ("interleaved1f1b", (0.37, 0.6, 0.73)),
    ("interleaved1f1b", (0.2, 0.45, 0.8)),
    ("1f1b", (0.5,)),
]


def _planned(case) -> dict:
    """label -> plan: the planner's for each pin (distinct ones), then the manual placements."""
    import partita
    from workers import legal_cut

    cluster = partita.Cluster(device="h100", num_devices=2)
    plans: dict = {}
    for schedule, m in PINS:
        options = dict(
            optimizer="sgd", num_stages=2, costs="analytic", precision="fp32", num_microbatches=m, compile=False
        )
        options.update({"schedules": schedule} if schedule else {})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = partita.plan(case.graph, cluster=cluster, global_batch_size=8, options=partita.PlanOptions(**options))
        key = (plan.schedule.value, plan.boundaries, plan.num_microbatches)
        plans.setdefault(key, (f"planned {schedule or 'any'}/{m or 'any'}", plan))
    n = case.graph.num_nodes
    for schedule, fractions in MANUAL:
        cuts = sorted({legal_cut(case.graph, int(n * f)) for f in fractions})
        plan = partita.manual_plan(
            case.graph, [0, *cuts, n], schedule=schedule, num_rank_groups=2, num_microbatches=4, global_batch_size=8
        )
        plans.setdefault((schedule, plan.boundaries, 4), (f"manual {schedule} {fractions}", plan))
    return dict(plans.values())


def job_shared_weights(params: dict) -> dict:
    """Rank side: every plan of ``_planned`` for ALBERT, ``STEPS`` SGD steps; rank 0 compares with
    unsplit training."""
    import partita
    from workers import max_diff, reference_run, sgd, shared_case

    rank = int(os.environ["RANK"])
    case = shared_case("albert")
    ref_losses, ref_state = reference_run(case, sgd, STEPS)
    results = {}
    for label, plan in _planned(case).items():
        case.reset()
        trainer = partita.Trainer(case.model, plan, optimizer=sgd, graph=case.graph)
        losses = [trainer.step(*a, **k) for a, k, _ in case.batches[:STEPS]]
        state = trainer.gather_state_dict()
        result = {"losses": losses, "placement": [s.rank_group for s in plan.stages], "cuts": plan.boundaries}
        if rank == 0:
            result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
        results[label] = result
    return results


def job_other_seeds(params: dict) -> dict:
    """Rank side: each rank builds the MLP with its own seed; one SGD step as data parallelism and
    as a 2-stage pipeline; rank 0 compares with its own model trained unsplit."""
    import torch.nn.functional as F

    import partita
    from partita.planning.manual import manual_plan

    rank = int(os.environ["RANK"])
    results = {}
    for label, replicas, groups in (("dp-2", 2, 1), ("pipeline-2", 1, 2)):
        torch.manual_seed(100 + rank)  # other weights on every rank
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        reference = copy.deepcopy(model)
        g = torch.Generator().manual_seed(7)
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
        graph = partita.capture(model, (x,), loss_fn=F.cross_entropy, target=y)
        n = graph.num_nodes
        bounds = [0, n] if groups == 1 else [0, n // 2, n]
        plan = manual_plan(
            graph, bounds, schedule="gpipe", num_rank_groups=groups, replicas=replicas, num_microbatches=2,
            global_batch_size=8,
        )  # fmt: skip
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = partita.Trainer(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), graph=graph)
        loss = trainer.step(x, target=y)
        state = trainer.gather_state_dict()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        ref_loss = F.cross_entropy(reference(x), y)
        ref_loss.backward()
        optimizer.step()
        result = {"loss": loss, "ref_loss": float(ref_loss), "warnings": [str(w.message) for w in caught]}
        if rank == 0:
            result["diff"] = max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items())
        results[label] = result
    return results


# the launches (fixture name -> job): shared with the other jobs of their world size (tests/dist/conftest.py)
SHARED_JOBS = {
    "shared_weights": Job("test_shared_weights:job_shared_weights", 2, 400),
    "other_seeds": Job("test_shared_weights:job_other_seeds", 2, 120),
}


@pytest.fixture(scope="module")
def shared_weights(launches):
    return launches.results_of(__name__, "shared_weights")


@pytest.fixture(scope="module")
def other_seeds(launches):
    return launches.results_of(__name__, "other_seeds")


def test_every_plan_of_a_model_sharing_weights_across_depths_trains_exactly(shared_weights):
    mine = shared_weights[0]
    placements = {tuple(r["placement"]) for r in mine.values()}
    assert (0, 1, 1, 0) in placements, f"no V placement among the plans: {placements}"
    assert (0, 1, 0, 1) in placements, f"no interleaved placement among the plans: {placements}"
    wrong = {}
    for label, result in mine.items():
        diff, where = result["param"]
        losses_off = max(abs(a - b) for a, b in zip(result["losses"], result["ref_losses"], strict=True))
        if diff > TOLERANCE or losses_off > TOLERANCE:
            wrong[label] = (result["cuts"], result["placement"], f"{where} off by {diff:.3g}", f"loss {losses_off:.3g}")
        assert shared_weights[1][label]["losses"] == result["losses"], "every rank returns the same loss"
    assert not wrong, wrong


@pytest.mark.parametrize("label", ["dp-2", "pipeline-2"])
def test_ranks_that_built_other_weights_train_from_rank_0s(other_seeds, label):
    mine = other_seeds[0][label]
    assert abs(mine["loss"] - mine["ref_loss"]) <= TOLERANCE, mine
    assert mine["diff"] <= TOLERANCE, mine
    assert other_seeds[1][label]["loss"] == mine["loss"]
    assert abs(other_seeds[1][label]["ref_loss"] - mine["ref_loss"]) > 1e-3, "rank 1 built the same weights"
    warned = [w for w in mine["warnings"] if "built the model with other weights than rank 0" in w]
    assert len(warned) == 1 and "4 of 4 tensors differ" in warned[0] and "as DDP does" in warned[0], mine["warnings"]
    assert not any("other weights" in w for w in other_seeds[1][label]["warnings"]), "only rank 0 warns"
