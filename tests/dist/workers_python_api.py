"""Rank-side code of tests/dist/test_python_api.py and the Python half of
tests/dist/test_cli_data_runs.py: ``python workers_python_api.py JOB DIR`` (see dist_launch.py).

The jobs start as a user's torchrun script does, with no process group: partita initialises it
(``natural_script``), or they initialise it first as workers.py does (the others).
"""

from __future__ import annotations

import copy
import datetime
import importlib.util
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

sys.path.insert(0, str(Path(__file__).parent))
from workers import BATCH, Case, GatedCase, _train_step, max_diff, reference_run, sgd, shared_case  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def job_natural_script(params: dict) -> dict:
    """The script a torch user writes, under torchrun, with no process group initialised before it:
    every rank calls ``partita.Cluster.local`` and ``partita.plan`` (measured costs), then builds a
    ``partita.Trainer`` from the model, the plan and the example inputs, then steps. One plan per job
    by construction: rank 0 measures and searches, every rank trains its plan. A pipeline plan
    and a fully sharded one, each against unsplit training."""
    import torch.distributed as dist

    import partita

    rank = int(os.environ["RANK"])
    case = Case("gpt2")
    args, kwargs, target = case.batches[0]
    cluster = partita.Cluster.local(num_devices=2, cache_dir=params["cache"])
    results: dict[str, Any] = {"initialised_by_partita": dist.is_initialized(), "cluster": cluster.to_dict()}
    pins = {
        "pipeline": dict(num_stages=2, schedules="1f1b", num_microbatches=2),
        "sharded": dict(num_stages=1, replicas=2, sharding="full_shard", num_microbatches=1),
    }
    for label, pinned in pins.items():
        case.reset()
        options = partita.PlanOptions(costs="measured", cache_dir=params["cache"], **pinned)
        plan = partita.plan(
            case.model, args, kwargs, loss_fn=case.loss_fn, target=target, cluster=cluster,
            global_batch_size=BATCH, options=options,
        )  # fmt: skip
        trainer = partita.Trainer(
            case.model, plan, args=args, kwargs=kwargs, loss_fn=case.loss_fn, target=target, optimizer=sgd
        )
        losses = [_train_step(trainer, case.batches[step]) for step in range(params["steps"])]
        state = trainer.gather_state_dict()
        out: dict[str, Any] = {
            "losses": losses,
            "plan": plan.to_json(),
            "layout": (plan.num_stages, [s.num_replicas for s in plan.stages], [s.sharding.value for s in plan.stages]),
        }
        if rank == 0:
            out["ref_losses"], ref_state = reference_run(case, sgd, params["steps"])
            out["param"] = max_diff(state, ref_state)
        results[label] = out
    return results


class ReusedNet(torch.nn.Module):
    """One layer's weights applied at three depths (weight sharing across depth, as ALBERT does)."""

    def __init__(self):
        super().__init__()
        self.inp, self.shared = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32)
        self.mid, self.out = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        h = torch.tanh(self.shared(torch.tanh(self.mid(h))))
        return self.out(torch.tanh(self.shared(h)))


class ReusedCase(GatedCase):
    """ReusedNet as a Case."""

    def __init__(self):  # not Case.__init__: that one builds zoo models
        import partita

        torch.manual_seed(0)
        self.name, self.model, self.loss_fn = "reused", ReusedNet(), torch.nn.functional.cross_entropy
        self.batch_size = BATCH
        g = torch.Generator().manual_seed(1)
        self.batches = [
            ((torch.randn(BATCH, 16, generator=g),), {}, torch.randint(0, 4, (BATCH,), generator=g)) for _ in range(10)
        ]
        args, kwargs, target = self.batches[0]
        self.graph = partita.capture(self.model, args, kwargs, loss_fn=self.loss_fn, target=target)
        self.initial = copy.deepcopy(self.model.state_dict())
        self.reference_model = copy.deepcopy(self.model)


def job_schedules_by_shape(params: dict) -> dict:
    """Every schedule the planner may emit, on models of several shapes: a layer's weights used at
    several depths (ReusedNet), tied embeddings (GPT-2), a weight beside the input's path
    (GatedNet). For each model and schedule, the plan partita.plan makes for 2 ranks (analytic
    costs, the schedule pinned), and for ReusedNet under ZBV also a stage holding all three uses
    of the shared layer; each trains ``steps`` SGD steps against unsplit training."""
    import partita
    from partita.planning.manual import manual_plan

    rank = int(os.environ["RANK"])
    cluster = partita.Cluster(device="cpu", num_devices=2, devices_per_node=2)
    cases = {"reused": ReusedCase, "tied": lambda: shared_case("gpt2"), "gated": GatedCase}
    results: dict[str, Any] = {}
    for shape, make_case in cases.items():
        case = make_case()
        plans = {}
        for schedule in params["schedules"]:
            options = partita.PlanOptions(schedules=schedule, num_stages=2, replicas=1, costs="analytic")
            plans[schedule] = partita.plan(case.graph, cluster=cluster, global_batch_size=BATCH, options=options)
        if shape == "reused":  # stage 1 runs all three uses of `shared` (nodes 2..8)
            n = case.graph.num_nodes
            plans["zbv-one-stage"] = manual_plan(
                case.graph, [0, 1, 2, n - 1, n], schedule="zbv", num_rank_groups=2, num_microbatches=4,
                global_batch_size=BATCH,
            )  # fmt: skip
        for label, plan in plans.items():
            print(f"{shape}/{label}", flush=True)
            case.reset()
            trainer = partita.Trainer(case.model, plan, optimizer=sgd, graph=case.graph)
            losses = [_train_step(trainer, case.batches[step]) for step in range(params["steps"])]
            state = trainer.gather_state_dict()
            out: dict[str, Any] = {"losses": losses, "schedule": plan.schedule.value, "stages": plan.num_stages}
            if rank == 0:
                out["ref_losses"], ref_state = reference_run(case, sgd, params["steps"])
                out["param"] = max_diff(state, ref_state)
            results[f"{shape}/{label}"] = out
    return results


def job_fit_like_cli(params: dict) -> dict:
    """``partita.fit`` on examples/own_data.py's ``build``, as a Python user writes it, with the plan
    file and the settings of test_cli_data_runs' ``loader`` run of `partita train` (AdamW, a cosine
    schedule with warm-up, clipping at 1.0, an evaluation every 3 steps over 2 batches)."""
    import partita
    from partita.training.lr_schedule import lr_scheduler_factory

    spec = importlib.util.spec_from_file_location("own_data", REPO / "examples" / "own_data.py")
    own_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(own_data)
    torch.manual_seed(0)  # as `partita train --seed 0` calls the factory
    parts = own_data.build()
    plan = partita.Plan.load(params["plan"])
    torch.manual_seed(0)  # as `partita train --seed 0` builds its Trainer
    lr, steps = params["lr"], params["steps"]
    trainer = partita.Trainer(
        parts["model"],
        plan,
        args=parts["inputs"],
        loss_fn=parts["loss_fn"],
        target=parts["target"],
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr),
        lr_scheduler=lr_scheduler_factory("cosine", lr=lr, steps=steps, warmup_steps=params["warmup"], min_lr=0.0),
        max_grad_norm=1.0,
    )
    result = partita.fit(
        trainer,
        parts["data"],
        num_steps=steps,
        eval_data=parts["eval_data"],
        eval_every=3,
        eval_batches=2,
        progress=False,
    )
    return {"losses": result.losses, "eval_losses": result.eval_losses, "first_step": result.first_step}


JOBS = {
    "natural_script": job_natural_script,
    "schedules_by_shape": job_schedules_by_shape,
    "fit_like_cli": job_fit_like_cli,
}
SELF_INITIALISED = {"natural_script"}  # no process group before the job runs: partita makes it


def main() -> None:
    job, out_dir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    try:
        import torch.distributed as dist

        if job not in SELF_INITIALISED:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        result = JOBS[job](torch.load(out_dir / "params.pt", weights_only=False))
        torch.save(result, out_dir / f"result{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # at once: do not wait for peers that may be blocked in a collective


if __name__ == "__main__":
    main()
