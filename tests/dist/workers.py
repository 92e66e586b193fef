"""Rank-side code of the multi-process tests: ``python workers.py JOB DIR`` (see dist_launch.py); the
job ``several`` runs the jobs of a shared launch, ``"module:function"`` of this or another module here.

Each job trains tiny zoo models with partita.Trainer on gloo and, on rank 0, compares the loss
and every parameter with the unsplit model trained on the same full batch. Results go to
``DIR/result<rank>.pt``; the test process asserts on them, so a failed comparison shows all
numbers at once instead of the first.

Glossary: a *config* is one way to run a model: ``(schedule, num_stages, num_rank_groups,
replicas, num_microbatches, recompute)``.
"""

from __future__ import annotations

import copy
import datetime
import importlib
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)
INITIAL_RNG_STATE = torch.get_rng_state()  # what a fresh process starts from (job_several)

BATCH, SEQ = 8, 16
LR = 0.5  # large enough that a gradient error of 2e-5 moves a parameter by 1e-5
MAX_GRAD_NORM = 0.5  # below the tiny models' gradient norms: clipping is active
ADAMW_LR = 3e-3


# ----------------------------------------------------------------------------- models and data


class Case:
    """A zoo model, its captured graph, its initial weights and fixed batches."""

    def __init__(self, name: str, batch_size: int = BATCH):
        import partita
        from partita import examples

        ex = examples.build(name, batch_size=batch_size, seq_len=SEQ)
        self.name, self.model, self.loss_fn, self.batch_size = name, ex.model, ex.loss_fn, batch_size
        self.batches = [_exact_batch(name, ex.make_batch(batch_size, step)) for step in range(10)]
        args, kwargs, target = self.batches[0]
        self.graph = partita.capture(ex.model, args, kwargs, loss_fn=ex.loss_fn, target=target)
        self.initial = copy.deepcopy(ex.model.state_dict())
        self.reference_model = copy.deepcopy(ex.model)

    def reset(self) -> None:
        """Back to the initial weights, in place (the graph reads these very Parameter objects)."""
        self.model.load_state_dict(self.initial)
        self.model.train()

    def loss(self, model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        args, kwargs, target = batch
        out = model(*args, **kwargs)
        return self.loss_fn(out, target) if self.loss_fn is not None else out.loss


_SHARED_CASES: dict[tuple[str, int], Case] = {}


def shared_case(name: str, batch_size: int = BATCH) -> Case:
    """``Case(name, batch_size)``, built once per process and reset to its initial weights: the jobs of
    a launch whose trainers only read the model's weights (they never change its modules) capture
    each model once, and share the graph's variants."""
    case = _SHARED_CASES.get((name, batch_size))
    if case is None:
        case = _SHARED_CASES[name, batch_size] = Case(name, batch_size)
    case.reset()
    return case


def _exact_batch(name: str, batch: tuple) -> tuple:
    """BERT's masked-LM labels with the same number of masked positions in every sample, so that
    every micro-batch's mean loss averages equally many tokens (see the trainer's docstring)."""
    if name != "bert":
        return batch
    args, kwargs, target = batch
    labels = kwargs["labels"]
    g = torch.Generator().manual_seed(int(labels.sum()))
    positions = torch.stack([torch.randperm(labels.shape[1], generator=g)[:3] for _ in range(labels.shape[0])])
    tokens = torch.where(labels >= 0, labels, kwargs["input_ids"])
    masked = torch.zeros_like(labels, dtype=torch.bool).scatter_(1, positions, True)
    kwargs = {
        **kwargs,
        "input_ids": torch.where(masked, torch.full_like(tokens, 3), tokens),
        "labels": torch.where(masked, tokens, torch.full_like(tokens, -100)),
    }
    return args, kwargs, target


def reference_run(
    case: Case, optimizer, num_steps: int, *, max_grad_norm: float | None = None, lr_scheduler=None
) -> tuple[list[float], dict]:
    """Unsplit full-batch training: the losses and the final state dict."""
    losses, states = reference_states(
        case, optimizer, num_steps, max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler
    )
    return losses, states["final"]


def reference_states(
    case: Case,
    optimizer,
    num_steps: int,
    *,
    max_grad_norm: float | None = None,
    lr_scheduler=None,
    states_after: tuple[int, ...] = (),
) -> tuple[list[float], dict]:
    """``reference_run`` that also keeps the state dict after each step count of ``states_after``:
    the losses and ``{k: the state after k steps, ..., "final": the final state}``."""
    model = copy.deepcopy(case.reference_model)
    opt = optimizer(model.parameters())
    sched = lr_scheduler(opt) if lr_scheduler else None
    losses, states = [], {}
    for step in range(num_steps):
        if step in states_after:
            states[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model, case.batches[step])
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        if sched:
            sched.step()
        losses.append(float(loss))
    states["final"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, states


def max_diff(state: dict, reference: dict) -> tuple[float, str]:
    """Largest |a - b| over all entries of two state dicts, and where it is."""
    worst, where = 0.0, ""
    assert set(state) == set(reference), sorted(set(state) ^ set(reference))
    for key, ref in reference.items():
        diff = (state[key].double() - ref.double()).abs().max().item() if ref.numel() else 0.0
        if diff > worst:
            worst, where = diff, key
    return worst, where


def make_plan(case: Case, config: dict):
    from partita.planning.manual import manual_plan

    n, s = case.graph.num_nodes, config["num_stages"]
    return manual_plan(
        case.graph,
        [n * k // s for k in range(s + 1)],
        schedule=config["schedule"],
        num_rank_groups=config["num_rank_groups"],
        replicas=config.get("replicas", 1),
        num_microbatches=config["num_microbatches"],
        global_batch_size=BATCH,
        recompute=config.get("recompute", False),
    )


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


# ----------------------------------------------------------------------------- jobs


def job_one_step(params: dict) -> dict:
    """For each model and config: one SGD step (clipped where asked); loss and parameter diffs."""
    import partita

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in params["models"]:
        case = shared_case(name)
        for config in params["configs"]:
            if name not in config.get("models", params["models"]):
                continue
            clip = MAX_GRAD_NORM if config.get("clip") else None
            print(f"{name}/{config['label']}", flush=True)
            case.reset()
            started = time.perf_counter()
            trainer = partita.Trainer(
                case.model, make_plan(case, config), optimizer=sgd, graph=case.graph, max_grad_norm=clip
            )
            args, kwargs, target = case.batches[0]
            loss = trainer.step(*args, **kwargs, **({"target": target} if target is not None else {}))
            state = trainer.gather_state_dict()
            key = f"{name}/{config['label']}"
            if rank == 0:
                ref_losses, ref_state = reference_run(case, sgd, 1, max_grad_norm=clip)
                results[key] = {
                    "loss": loss,
                    "ref_loss": ref_losses[0],
                    "param": max_diff(state, ref_state),
                    "seconds": time.perf_counter() - started,
                }
            else:
                results[key] = {"loss": loss}
    return results


def adamw(params):
    # eps 1e-6, not 1e-8: Adam divides by sqrt(v) + eps, which turns the summation-order noise
    # (~1e-9) of near-zero gradient entries into update differences of up to ~1e-5 in 10 steps.
    return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.1, eps=1e-6)


def halving(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def job_checkpoint(params: dict) -> dict:
    """For each run: train under each of its plans in turn, saving a checkpoint after each part
    and loading it under the next plan (from reset weights, so everything must come from the
    checkpoint); compare with unsplit training. Also: load_into_model of every checkpoint equals
    gather_state_dict. The last plan's trainer captures its own graph from the example inputs."""
    import partita

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for run in params["runs"]:
        case = shared_case(run["model"])
        ckpt = Path(params["dir"]) / run["label"]
        out: dict[str, Any] = {"losses": [], "resumed_at": [], "load_into_model": []}
        plans = run["plans"]
        for part, config in enumerate(plans):
            case.reset()  # every weight must come from the checkpoint
            print(f"{run['label']}: part {part}", flush=True)
            source = (
                {"graph": case.graph}
                if part < len(plans) - 1
                else dict(zip(("args", "kwargs", "target"), case.batches[0]), loss_fn=case.loss_fn)
            )
            trainer = partita.Trainer(
                case.model, make_plan(case, config), optimizer=adamw, lr_scheduler=halving, max_grad_norm=1.0, **source
            )
            if part > 0:
                trainer.load_checkpoint(ckpt)
                out["resumed_at"].append(trainer.num_steps)
            for step in range(trainer.num_steps, run["steps_per_plan"] * (part + 1)):
                args, kwargs, target = case.batches[step]
                out["losses"].append(trainer.step(*args, **kwargs))
            trainer.save_checkpoint(ckpt)
            state = trainer.gather_state_dict()
            if rank == 0:
                plain = copy.deepcopy(case.reference_model)
                partita.load_into_model(plain, ckpt)
                out["load_into_model"].append(max_diff(plain.state_dict(), state))
        if rank == 0:
            num_steps = run["steps_per_plan"] * len(plans)
            out["ref_losses"], ref_state = reference_run(
                case, adamw, num_steps, max_grad_norm=1.0, lr_scheduler=halving
            )
            out["param"] = max_diff(state, ref_state)
            out["lr"] = (trainer.optimizer.param_groups[0]["lr"], ADAMW_LR * 0.5 ** (num_steps // 3))
            out["partial_left"] = os.path.exists(str(ckpt) + ".partial")
        results[run["label"]] = out
    return results


def job_fail(params: dict) -> None:
    """Rank 1 fails while rank 0 waits for it in a collective: the launcher must not hang."""
    import torch.distributed as dist

    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()


class SqrtNet(torch.nn.Module):
    """A 3-layer MLP whose first activation is |a(x)| written as sqrt(a(x)^2): its backward is
    NaN where a(x) == 0 (inf * 0), so all-zero samples give a finite loss with NaN gradients of
    ``a`` only; inf samples give a NaN loss."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        torch.nn.init.zeros_(self.a.bias)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.sqrt(self.a(x) ** 2))))


def job_numerics(params: dict) -> dict:
    """Stage 0 = a, stage 1 = b, c and the loss (1F1B, 2 micro-batches of 4). Three steps from the
    same weights, each with a fresh AdamW trainer: an inf micro-batch and an all-zero micro-batch
    under on_nonfinite="raise" (the error and the weights after it), then the inf batch under
    "skip" followed by a clean step, compared with one unsplit AdamW step on the clean batch."""
    import warnings

    import partita
    from partita.errors import NumericsError
    from partita.planning.manual import manual_plan

    torch.manual_seed(0)
    model, loss_fn = SqrtNet(), torch.nn.functional.cross_entropy
    x, y = torch.randn(BATCH, 4), torch.randint(0, 3, (BATCH,))
    graph = partita.capture(model, (x,), loss_fn=loss_fn, target=y)
    plan = manual_plan(
        graph, [0, 3, graph.num_nodes], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=BATCH
    )
    initial = copy.deepcopy(model.state_dict())
    bad = {
        "inf": x.clone().index_fill_(0, torch.arange(4, 8), float("inf")),  # micro-batch 1
        "zero": x.clone().index_fill_(0, torch.arange(0, 4), 0.0),
    }  # micro-batch 0
    results: dict[str, Any] = {}
    for name, inputs in bad.items():
        model.load_state_dict(initial)
        trainer = partita.Trainer(model, plan, graph=graph, optimizer=adamw)
        try:
            trainer.step(inputs, target=y)
            results[name] = {"raised": None}
        except NumericsError as e:
            results[name] = {"raised": str(e), "step": e.step, "findings": e.findings}
        results[name]["state"] = trainer.gather_state_dict()
    model.load_state_dict(initial)
    trainer = partita.Trainer(model, plan, graph=graph, optimizer=adamw, on_nonfinite="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        skipped_loss = trainer.step(bad["inf"], target=y)
    after_skip = trainer.gather_state_dict()
    clean_loss = trainer.step(x, target=y)
    try:  # a batch that is not the plan's global batch is refused before anything runs
        trainer.step(x[: BATCH - 2], target=y[: BATCH - 2])
        results["wrong_batch"] = None
    except partita.InputError as e:
        results["wrong_batch"] = str(e)
    results["skip"] = {
        "loss": skipped_loss,
        "warnings": [str(w.message) for w in caught],
        "state": after_skip,
        "counts": (trainer.num_steps, trainer.num_skipped_steps),
        "clean_loss": clean_loss,
        "final": trainer.gather_state_dict(),
    }
    if int(os.environ["RANK"]) == 0:
        reference = SqrtNet()
        reference.load_state_dict(initial)
        opt = adamw(reference.parameters())
        loss = loss_fn(reference(x), y)
        loss.backward()
        opt.step()
        results["initial"], results["reference"] = initial, reference.state_dict()
    return results


def job_meta_init(params: dict) -> dict:
    """Each rank builds the model on ``meta`` and takes its stages' weights from a seed checkpoint
    (written by rank 0 from the real model): three AdamW steps, compared with unsplit training;
    also how many parameter elements each rank allocated."""
    import torch.distributed as dist

    import partita
    from partita import examples
    from partita.runtime.materialize import meta_copies, save_seed

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in params["models"]:
        case = shared_case(name)
        seed = Path(params["dir"]) / f"{name}-seed"
        if rank == 0:
            save_seed(case.model, seed)
        dist.barrier()
        for config in params["configs"]:
            if name not in config.get("models", [name]):
                continue
            key = f"{name}/{config['label']}"
            print(key, flush=True)
            meta = examples.build(name, batch_size=BATCH, seq_len=SEQ, device="meta")
            args, kwargs, target = case.batches[0]
            graph = partita.capture(
                meta.model, meta_copies(args), meta_copies(kwargs), loss_fn=case.loss_fn, target=meta_copies(target)
            )
            trainer = partita.Trainer(
                meta.model, make_plan(case, config), optimizer=adamw, graph=graph, init_from=str(seed)
            )
            allocated = sum(p.numel() for p in meta.model.parameters() if not p.is_meta)
            losses = []
            for step in range(3):
                args, kwargs, target = case.batches[step]
                losses.append(trainer.step(*args, **kwargs))
            state = trainer.gather_state_dict()
            results[key] = {
                "losses": losses,
                "allocated": allocated,
                "total": sum(p.numel() for p in case.model.parameters()),
            }
            if rank == 0:
                ref_losses, ref_state = reference_run(case, adamw, 3)
                results[key].update(ref_losses=ref_losses, param=max_diff(state, ref_state))
    return results


# ----------------------------------------------------------------------------- uneven replicas


class GatedNet(torch.nn.Module):
    """``b(relu(a(x)) * gate)`` with ``gate = 2 tanh(g)``: cut after ``gate``, stage 0 sends a
    per-sample tensor and a tensor without batch dim that needs a gradient (summed by its owner)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.g = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))

    def forward(self, x):
        hidden = torch.relu(self.a(x))
        gate = torch.tanh(self.g) * 2
        return self.b(hidden * gate)


class GatedCase(Case):
    """GatedNet as a Case (same interface as the zoo models'). ``mse``: a mean squared error against
    random targets (a mean over equally many elements per sample: the averaging path of
    partita.runtime.loss_scaling) instead of cross-entropy (a count over the global batch)."""

    def __init__(self, mse: bool = False):  # not Case.__init__: that one builds zoo models
        import partita

        torch.manual_seed(0)
        self.name, self.model = "gated-mse" if mse else "gated", GatedNet()
        self.loss_fn = torch.nn.functional.mse_loss if mse else torch.nn.functional.cross_entropy
        self.batch_size = BATCH
        g = torch.Generator().manual_seed(1)
        self.batches = [
            (
                (torch.randn(BATCH, 4, generator=g),),
                {},
                torch.randn(BATCH, 3, generator=g) if mse else torch.randint(0, 3, (BATCH,), generator=g),
            )
            for _ in range(10)
        ]
        args, kwargs, target = self.batches[0]
        self.graph = partita.capture(self.model, args, kwargs, loss_fn=self.loss_fn, target=target)
        self.initial = copy.deepcopy(self.model.state_dict())
        self.reference_model = copy.deepcopy(self.model)


def per_sample_cut(graph, near: int) -> int:
    """The first legal cut at or after ``near`` that no merged batch dim (``(B*T, C)``) crosses:
    uneven replica counts route boundary tensors by sample (partita.runtime.uneven)."""
    from partita.planning.chain import legal_cuts, per_sample_cuts

    ok = per_sample_cuts(graph) & legal_cuts(graph)
    return next(cut for cut in range(near, graph.num_nodes) if ok[cut])


def make_uneven_plan(case: Case, config: dict):
    from partita.planning.manual import manual_plan

    num_stages = len(config["replicas"])
    if case.name.startswith("gated"):  # right after gate = tanh(g) * 2
        cuts = [next(n.index for n in case.graph.nodes if n.target == "aten.tanh.default") + 2]
    else:
        cuts = [per_sample_cut(case.graph, case.graph.num_nodes * k // num_stages) for k in range(1, num_stages)]
    return manual_plan(
        case.graph,
        [0, *cuts, case.graph.num_nodes],
        schedule=config["schedule"],
        num_rank_groups=num_stages,
        replicas=config["replicas"],
        num_microbatches=config["num_microbatches"],
        global_batch_size=case.batch_size,
        recompute=config.get("recompute", False),
        sharding=config.get("sharding", "replicate"),
        replica_samples=config.get("replica_samples"),
        tensor_parallel=config.get("tensor_parallel", 1),
        sequence_parallel=config.get("sequence_parallel", False),
    )


def planned_mixed_plan(case: Case, config: dict):
    """The mixed search's best plan for ``case`` on the cluster of ``config["groups"]`` with each device
    group at the degree of ``config["planned_degrees"]`` (``per_type_degree_runs``), through its plan file."""
    from partita.planning.device_groups import mixed_run, per_type_degree_runs
    from partita.planning.hetero import best_mixed
    from partita.planning.options import PlanOptions
    from partita.types.cluster import Cluster, DeviceGroup
    from partita.types.plan_file import plan_from_json, plan_to_json

    cluster = Cluster(groups=[DeviceGroup(device, count, count) for device, count in config["groups"]])
    options = PlanOptions(costs="analytic", precision="fp32", compile=False)  # compiled: test_compiled_exact.py
    run = mixed_run(case.graph, cluster=cluster, global_batch_size=case.batch_size, options=options)
    degrees = tuple(config["planned_degrees"])
    chosen = next(r for r in per_type_degree_runs(run, max(degrees)) if r.degrees == degrees)
    plan, why = best_mixed(chosen)
    assert plan is not None and len({s.tensor_parallel for s in plan.stages}) > 1, (why, plan)
    return plan_from_json(plan_to_json(plan))


def on_device_groups(plan, groups: list, counts: list | None = None):
    """``plan`` on a mixed cluster of ``groups`` ((device, count) in rank order), through its plan
    file: a mixed-cluster plan whose stages sit on different device groups (the runtime runs every
    rank on this CPU). ``counts``: each stage's devices per device group, its ranks then following
    the groups as the mixed planner places them (``Cluster.assign_ranks``: a stage on the second
    group may come first)."""
    import dataclasses

    from partita.types.cluster import Cluster, DeviceGroup
    from partita.types.plan_file import plan_from_json, plan_to_json

    cluster = Cluster(groups=[DeviceGroup(device, count, count) for device, count in groups])
    stages = plan.stages
    if counts is not None:
        ranks = cluster.assign_ranks(counts)
        stages = tuple(dataclasses.replace(s, ranks=r) for s, r in zip(stages, ranks))
    return plan_from_json(plan_to_json(dataclasses.replace(plan, cluster=cluster, stages=stages)))


def _train_step(trainer, batch: tuple) -> float:
    args, kwargs, target = batch
    return trainer.step(*args, **kwargs, **({"target": target} if target is not None else {}))


def _uneven_trainer(case: Case, plan, meta_seed: Path | None, max_grad_norm: float | None = None):
    """A trainer of ``case.model``; or, with ``meta_seed``, of a copy built on meta that takes its
    weights from a seed checkpoint (written by rank 0 from ``case.model``)."""
    import torch.distributed as dist

    import partita
    from partita import examples
    from partita.runtime.materialize import meta_copies, save_seed

    if meta_seed is None:
        return partita.Trainer(case.model, plan, optimizer=adamw, graph=case.graph, max_grad_norm=max_grad_norm)
    if int(os.environ["RANK"]) == 0:
        save_seed(case.model, meta_seed)
    dist.barrier()
    meta = examples.build(case.name, batch_size=BATCH, seq_len=SEQ, device="meta")
    args, kwargs, target = case.batches[0]
    graph = partita.capture(
        meta.model, meta_copies(args), meta_copies(kwargs), loss_fn=case.loss_fn, target=meta_copies(target)
    )
    return partita.Trainer(
        meta.model, plan, optimizer=adamw, graph=graph, init_from=str(meta_seed), max_grad_norm=max_grad_norm
    )


def _nonfinite_message(case: Case, plan) -> str | None:
    """The NumericsError of a step whose global samples 6-7 are inf (None if nothing was raised)."""
    import partita
    from partita.errors import NumericsError

    trainer = partita.Trainer(case.model, plan, optimizer=adamw, graph=case.graph)
    (x,), kwargs, target = case.batches[0]
    try:
        trainer.step(x.clone().index_fill_(0, torch.tensor([6, 7]), float("inf")), target=target)
    except NumericsError as e:
        return str(e)
    return None


def job_uneven(params: dict) -> dict:
    """For each model and uneven config (stages with different replica counts): three AdamW steps
    compared with unsplit full-batch training; with ``resume``, a checkpoint after them is loaded
    into a trainer under the ``resume`` plan, which takes two more steps."""
    import partita

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in params["models"]:
        if not any(name in c.get("models", params.get("default_models", params["models"])) for c in params["configs"]):
            continue
        case = _uneven_case(name, params.get("batch_size", BATCH))
        for config in params["configs"]:
            if name not in config.get("models", params.get("default_models", params["models"])):
                continue
            key = f"{name}/{config['label']}"
            print(key, flush=True)
            case.reset()
            plan = planned_mixed_plan(case, config) if "planned_degrees" in config else make_uneven_plan(case, config)
            if "groups" in config and "planned_degrees" not in config:
                plan = on_device_groups(plan, config["groups"], config.get("group_counts"))
            if config.get("nonfinite"):
                results[key] = {"raised": _nonfinite_message(case, plan)}
                continue
            seed = Path(params["dir"]) / f"{name}-seed" if config.get("meta") else None
            clip = config.get("max_grad_norm")
            trainer = _uneven_trainer(case, plan, meta_seed=seed, max_grad_norm=clip)
            losses = [_train_step(trainer, batch) for batch in case.batches[:3]]
            if "resume" in config:
                path = Path(params["dir"]) / key.replace("/", "-")
                trainer.save_checkpoint(path)
                case.reset()
                resumed = make_uneven_plan(case, config["resume"])
                trainer = partita.Trainer(case.model, resumed, optimizer=adamw, graph=case.graph, max_grad_norm=clip)
                trainer.load_checkpoint(path)
                losses += [_train_step(trainer, batch) for batch in case.batches[3:5]]
            state = trainer.gather_state_dict()
            results[key] = {"losses": losses}
            if rank == 0:
                ref_losses, ref_state = reference_run(case, adamw, len(losses), max_grad_norm=clip)
                results[key].update(ref_losses=ref_losses, param=max_diff(state, ref_state))
    return results


def _uneven_case(name: str, batch_size: int) -> Case:
    """``gated`` / ``gated-mse`` (GatedCase), ``gpt2-padded`` (GPT-2 whose labels are padded with -100 to
    a different length in every sample: PaddedCase), or a zoo model."""
    if name.startswith("gated"):
        return GatedCase(mse=name == "gated-mse")
    if name.endswith("-padded"):
        return PaddedCase(name.removesuffix("-padded"))
    return shared_case(name, batch_size)


JOBS = {
    "one_step": job_one_step,
    "checkpoint": job_checkpoint,
    "fail": job_fail,
    "numerics": job_numerics,
    "meta_init": job_meta_init,
    "uneven": job_uneven,
}


# ----------------------------------------------------------------------------- exact losses, one plan, dropout,
# ----------------------------------------------------------------------------- frozen stages, hung ranks


class TinyCausalLM(torch.nn.Module):
    """Embedding, causal mixing (a running mean), an MLP and an LM head. The loss: cross-entropy
    of the next token with -100 labels ignored (``masked=False``), or a masked mean of per-token
    losses ``sum(l * mask) / mask.sum()`` over an explicit mask input (``masked=True``)."""

    VOCAB = 32

    def __init__(self, masked: bool = False):
        super().__init__()
        self.masked = masked
        self.embed = torch.nn.Embedding(self.VOCAB, 24)
        self.mix = torch.nn.Linear(24, 24)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24))
        self.head = torch.nn.Linear(24, self.VOCAB)

    def forward(self, input_ids, labels, mask=None):
        h = self.embed(input_ids)
        steps = torch.arange(1, input_ids.shape[1] + 1, device=h.device, dtype=h.dtype)[None, :, None]
        h = h + torch.tanh(self.mix(torch.cumsum(h, dim=1) / steps))
        h = h + self.mlp(h)
        logits = self.head(h)[:, :-1]
        target = labels[:, 1:]
        if not self.masked:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, self.VOCAB), target.reshape(-1))
        per_token = torch.nn.functional.cross_entropy(
            logits.reshape(-1, self.VOCAB), target.clamp(min=0).reshape(-1), reduction="none"
        ).reshape(-1, input_ids.shape[1] - 1)
        m = mask[:, 1:]
        return (per_token * m).sum() / m.sum()


def padded_labels(labels: torch.Tensor, step: int) -> torch.Tensor:
    """``labels`` with the tail of each sample set to -100: sample i keeps a different number of
    positions in every step (one sample keeps none)."""
    batch, seq = labels.shape
    lengths = torch.tensor([(5 * i + 3 * step) % (seq + 1) for i in range(batch)])
    lengths[step % batch] = 0
    keep = torch.arange(seq)[None, :] < lengths[:, None]
    return torch.where(keep, labels, torch.full_like(labels, -100))


class PaddedCase(Case):
    """A causal LM whose batches hold padded labels: ``tiny_lm``, ``masked_lm`` (TinyCausalLM) or a
    zoo model (``gpt2``)."""

    def __init__(self, name: str):
        import partita

        if name not in ("tiny_lm", "masked_lm"):
            super().__init__(name)
            self.batches = [
                (args, {**kwargs, "labels": padded_labels(kwargs["labels"], step)}, target)
                for step, (args, kwargs, target) in enumerate(self.batches)
            ]
            return
        torch.manual_seed(0)
        self.name, self.model, self.loss_fn, self.batch_size = name, TinyCausalLM(name == "masked_lm"), None, BATCH
        g = torch.Generator().manual_seed(1)
        self.batches = []
        for step in range(10):
            ids = torch.randint(0, TinyCausalLM.VOCAB, (BATCH, SEQ), generator=g)
            labels = padded_labels(ids, step)
            mask = {"mask": (labels >= 0).float()} if name == "masked_lm" else {}
            self.batches.append(((), {"input_ids": ids, "labels": labels, **mask}, None))
        self.graph = partita.capture(self.model, (), self.batches[0][1])
        self.initial = copy.deepcopy(self.model.state_dict())
        self.reference_model = copy.deepcopy(self.model)

    def loss(self, model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        out = model(**batch[1])
        return out if isinstance(out, torch.Tensor) else out.loss


def job_exact_losses(params: dict) -> dict:
    """For each padded-label model and config: ``steps`` SGD steps, losses and parameters compared
    with unsplit full-batch training; the warnings rank 0 saw."""
    import warnings

    import partita

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in params["models"]:
        case = PaddedCase(name)
        for config in params["configs"]:
            key = f"{name}/{config['label']}"
            print(key, flush=True)
            case.reset()
            plan = manual_plan_for(
                case.graph,
                schedule=config["schedule"],
                num_stages=config["num_stages"],
                num_microbatches=config["num_microbatches"],
                replicas=config.get("replicas", 1),
                num_rank_groups=config["num_rank_groups"],
                cuts=_lm_cuts(case, config),
                recompute=config.get("recompute", "none"),
                recompute_blocks=config.get("recompute_blocks"),
            )
            trainer = partita.Trainer(case.model, plan, optimizer=sgd, graph=case.graph)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses = [_train_step(trainer, batch) for batch in case.batches[: params["steps"]]]
            state = trainer.gather_state_dict()
            scaling = getattr(trainer, "loss_scaling", None)  # None: a partita without it (for comparison)
            results[key] = {
                "losses": losses,
                "normalised": scaling is not None and scaling.normalised,
                "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
            }
            if rank == 0:
                ref_losses, ref_state = reference_run(case, sgd, params["steps"])
                results[key].update(ref_losses=ref_losses, param=max_diff(state, ref_state))
    return results


def _lm_cuts(case: Case, config: dict) -> list[int] | None:
    """TinyCausalLM on 2 stages: cut after the MLP's first layer, so that both stages hold
    parameters (the head and the loss on stage 1); zoo models: near the middle."""
    if config["num_stages"] != 2 or case.name not in ("tiny_lm", "masked_lm"):
        return None
    linears = [n.index for n in case.graph.nodes if n.target == "aten.linear.default"]
    return [legal_cut(case.graph, linears[1] + 1)]


class SquaredLossLM(TinyCausalLM):
    """A loss partita cannot normalise over the global batch: the square of a mean."""

    def forward(self, input_ids, labels, mask=None):
        return super().forward(input_ids, labels) ** 2


def job_unrecognised_loss(params: dict) -> dict:
    """The square of a mean couples the samples of the batch: a plan of 4 micro-batches is refused
    on every rank before any step (the error each rank saw)."""
    import partita
    from partita.errors import InputError

    torch.manual_seed(0)
    model = SquaredLossLM()
    case = PaddedCase("tiny_lm")
    graph = partita.capture(model, (), case.batches[0][1])
    try:
        manual_plan_for(graph, schedule="1f1b", num_stages=2, num_microbatches=4)
    except InputError as e:
        return {"error": str(e)}
    return {"error": None}


def legal_cut(graph, near: int) -> int:
    """The first cut at or after node ``near`` that a plan may use."""
    from partita.planning.chain import legal_cuts

    ok = legal_cuts(graph)
    return next(cut for cut in range(near, graph.num_nodes) if ok[cut])


def manual_plan_for(
    graph,
    *,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    replicas: int = 1,
    cuts: list[int] | None = None,
    num_rank_groups: int | None = None,
    recompute: str = "none",
    recompute_blocks: int | None = None,
):
    """A plan of ``num_stages`` stages cut at ``cuts`` (default: legal cuts near equal node counts)."""
    from partita.planning.manual import manual_plan

    n = graph.num_nodes
    cuts = cuts if cuts is not None else [legal_cut(graph, n * k // num_stages) for k in range(1, num_stages)]
    return manual_plan(
        graph,
        [0, *cuts, n],
        schedule=schedule,
        num_rank_groups=num_rank_groups or num_stages,
        replicas=replicas,
        num_microbatches=num_microbatches,
        global_batch_size=BATCH,
        recompute=recompute,
        recompute_blocks=recompute_blocks,
    )


def job_one_plan(params: dict) -> dict:
    """Rank r is given a plan cut at another node than rank 0's: every rank must raise PlanFileError
    quickly. Then shared_plan: made on rank 0 only, trained on both ranks; and a make_plan that
    fails on rank 0."""
    import partita
    from partita.errors import PlanFileError

    rank = int(os.environ["RANK"])
    case = PaddedCase("tiny_lm")
    first = legal_cut(case.graph, case.graph.num_nodes // 2)
    plan = manual_plan_for(
        case.graph,
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2,
        cuts=[first if rank == 0 else legal_cut(case.graph, first + 1)],
    )
    results: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        partita.Trainer(case.model, plan, optimizer=sgd, graph=case.graph)
        results["mismatch"] = None
    except PlanFileError as e:
        results["mismatch"] = str(e)
    results["mismatch_s"] = time.perf_counter() - started
    from partita import shared_plan

    calls = []

    def make():
        calls.append(rank)
        return manual_plan_for(case.graph, schedule="1f1b", num_stages=2, num_microbatches=2)

    shared = shared_plan(make)
    case.reset()
    trainer = partita.Trainer(case.model, shared, optimizer=sgd, graph=case.graph)
    results["shared"] = {
        "calls": calls,
        "loss": _train_step(trainer, case.batches[0]),
        "boundaries": list(shared.boundaries),
    }

    def broken():
        raise ValueError("no cluster given")

    try:
        shared_plan(broken)
        results["broken"] = None
    except Exception as e:  # noqa: BLE001 - the test checks the type
        results["broken"] = (type(e).__name__, str(e))
    return results


class DropoutMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.drop, self.b = torch.nn.Linear(16, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 4)

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.a(x))))


def job_dropout(params: dict) -> dict:
    """2-way data parallelism of an MLP with dropout, every sample of the batch the same: each
    replica's micro-batch losses (equal iff both drew the same masks); the step losses of two runs
    with seed 5 and one with seed 6; the caller's RNG stream after the steps."""
    import inspect

    import partita

    torch.manual_seed(0)
    model = DropoutMLP()
    x = torch.randn(1, 16).expand(BATCH, 16).contiguous()
    y = torch.zeros(BATCH, dtype=torch.long)
    graph = partita.capture(model, (x,), loss_fn=torch.nn.functional.cross_entropy, target=y)
    plan = manual_plan_for(graph, schedule="gpipe", num_stages=1, num_microbatches=2, replicas=2, num_rank_groups=1)
    initial = copy.deepcopy(model.state_dict())
    runs: dict[str, Any] = {}
    for label, seed in (("first", 5), ("again", 5), ("other", 6)):
        model.load_state_dict(initial)
        seeded = {"seed": seed} if "seed" in inspect.signature(partita.Trainer).parameters else {}  # older partita
        trainer = partita.Trainer(model, plan, optimizer=sgd, graph=graph, **seeded)
        local: list[list[float]] = []
        run_rounds = trainer._run_rounds

        def recorded(program, batch, run=run_rounds, local=local, **options):
            losses = run(program, batch, **options)
            local.append([float(loss) for loss in losses])
            return losses

        trainer._run_rounds = recorded
        torch.manual_seed(123)  # the caller's stream: the trainer must leave it alone
        losses = [trainer.step(x, target=y) for _ in range(3)]
        runs[label] = {"losses": losses, "local": local, "after": torch.rand(4)}
    return runs


class FrozenMLP(torch.nn.Module):
    def __init__(self, frozen: str):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)
        if frozen == "tail":
            self.c.requires_grad_(False)
        elif frozen == "head":
            self.a.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def job_frozen(params: dict) -> dict:
    """Stages without trainable parameters, 2 ranks, 1F1B: a frozen last layer alone on stage 1,
    a stage 1 that only computes the loss, a frozen first layer alone on stage 0. Three AdamW
    steps with an LR schedule compared with unsplit training; a checkpoint written and read."""
    import partita

    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g)
    results: dict[str, Any] = {}
    for label, frozen in (("frozen-tail", "tail"), ("loss-only", "none"), ("frozen-head", "head")):
        print(label, flush=True)
        torch.manual_seed(0)
        model = FrozenMLP(frozen)
        loss_fn = torch.nn.functional.cross_entropy
        graph = partita.capture(model, (x,), loss_fn=loss_fn, target=y)
        targets = [n.target for n in graph.nodes]
        linears = [i for i, t in enumerate(targets) if t == "aten.linear.default"]
        cut = {
            "frozen-tail": linears[2],
            "loss-only": targets.index("aten.cross_entropy_loss.default"),
            "frozen-head": linears[0] + 1,
        }[label]
        plan = manual_plan_for(graph, schedule="1f1b", num_stages=2, num_microbatches=2, cuts=[cut])
        reference = copy.deepcopy(model)
        trainer = partita.Trainer(model, plan, optimizer=adamw, lr_scheduler=halving, graph=graph)
        losses = [trainer.step(x, target=y) for _ in range(3)]
        ckpt = Path(params["dir"]) / label
        trainer.save_checkpoint(ckpt)
        trainer.load_checkpoint(ckpt)
        state = trainer.gather_state_dict()
        results[label] = {"losses": losses, "num_params": len(trainer.params)}
        if rank == 0:
            opt = adamw([p for p in reference.parameters() if p.requires_grad])
            sched = halving(opt)
            ref_losses = []
            for _ in range(3):
                opt.zero_grad()
                loss = loss_fn(reference(x), y)
                loss.backward()
                opt.step()
                sched.step()
                ref_losses.append(float(loss))
            results[label].update(ref_losses=ref_losses, param=max_diff(state, reference.state_dict()))
    return results


def job_hang(params: dict) -> dict:
    """Rank 1 sleeps before its first step (hung, not dead); rank 0, with collective_timeout_s, must
    raise CollectiveTimeoutError naming step 1 and rank 1, in about the timeout."""
    import partita
    from partita.errors import CollectiveTimeoutError

    rank = int(os.environ["RANK"])
    case = PaddedCase("tiny_lm")
    plan = manual_plan_for(case.graph, schedule="1f1b", num_stages=2, num_microbatches=4)
    trainer = partita.Trainer(
        case.model, plan, optimizer=sgd, graph=case.graph, collective_timeout_s=params["collective_timeout_s"]
    )
    _train_step(trainer, case.batches[0])  # a healthy step first: the timeout does not fire on its own
    if rank == 1:  # hung until its peer has given up, then gone (its pipeline connection is closed)
        time.sleep(params["sleep_s"])
        return {"slept": params["sleep_s"]}
    started = time.perf_counter()
    try:
        _train_step(trainer, case.batches[1])
        return {"raised": None}
    except CollectiveTimeoutError as e:
        return {
            "raised": str(e),
            "step": e.step,
            "rank": e.rank,
            "behind": e.behind,
            "seconds": time.perf_counter() - started,
        }


JOBS.update(
    {
        "exact_losses": job_exact_losses,
        "unrecognised_loss": job_unrecognised_loss,
        "one_plan": job_one_plan,
        "dropout": job_dropout,
        "frozen": job_frozen,
        "hang": job_hang,
    }
)


def job_several(params: dict) -> dict:
    """The jobs of a shared launch (dist_launch.SharedLaunches), one after the other: ``params["jobs"]``
    holds ``(label, "module:function", params)``. Each job starts from the random state this process
    started with, as it would in a launch of its own; the ranks meet after each. {label: result}."""
    import torch.distributed as dist

    results = {}
    for label, target, job_params in params["jobs"]:
        module, _, function = target.partition(":")
        print(f"=== job {label} ({target})", flush=True)
        started = time.perf_counter()
        torch.set_rng_state(INITIAL_RNG_STATE)
        results[label] = getattr(importlib.import_module(module), function)(job_params)
        dist.barrier()
        print(f"=== job {label} took {time.perf_counter() - started:.1f} s", flush=True)
    return results


JOBS["several"] = job_several


def main() -> None:
    job, out_dir = sys.argv[1], Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    try:
        import torch.distributed as dist

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
    sys.modules.setdefault("workers", sys.modules[__name__])  # "workers:job_x" of job_several: this module
    main()
