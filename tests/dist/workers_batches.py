"""Rank-side code of test_batch_shapes.py (``python workers_batches.py JOB DIR``, see dist_launch.py):
batches of other sequence lengths than the captured one, gradient accumulation and evaluation,
each compared on rank 0 with the unsplit model on the same batches."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
from workers import (
    JOBS,
    TinyCausalLM,
    adamw,
    legal_cut,
    main,
    max_diff,
    padded_labels,
)

LONGEST, LENGTHS, BATCH = 32, (32, 17, 25), 8


def _plan(
    graph,
    *,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    replicas: int,
    global_batch: int,
    num_rank_groups: int | None = None,
):
    from partita.planning.manual import manual_plan

    n = graph.num_nodes
    cuts = [legal_cut(graph, n * k // num_stages) for k in range(1, num_stages)]
    return manual_plan(
        graph,
        [0, *cuts, n],
        schedule=schedule,
        num_rank_groups=num_rank_groups or num_stages,
        replicas=replicas,
        num_microbatches=num_microbatches,
        global_batch_size=global_batch,
    )


CONFIGS = {
    "1f1b-2x4": dict(schedule="1f1b", num_stages=2, num_microbatches=4, replicas=1),
    "dp-2": dict(schedule="gpipe", num_stages=1, num_microbatches=2, replicas=2),
}


def _lm(name: str) -> tuple[torch.nn.Module, Any]:
    """A causal LM and ``batch(step, length)``: padded labels, a different number of valid ones per sample."""
    torch.manual_seed(0)
    if name == "gpt2":
        from partita import examples

        ex = examples.build("gpt2", batch_size=BATCH, seq_len=LONGEST)
        model, full = ex.model, ex.make_batch

        def batch(step: int, length: int) -> dict:
            kwargs = full(BATCH, step)[1]
            ids = kwargs["input_ids"][:, :length]
            return {"input_ids": ids, "labels": padded_labels(ids, step)}

        return model, batch
    model = TinyCausalLM(masked=name == "masked_lm")

    def batch(step: int, length: int) -> dict:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, TinyCausalLM.VOCAB, (BATCH, length), generator=g)
        labels = padded_labels(ids, step)
        return {"input_ids": ids, "labels": labels, **({"mask": (labels >= 0).float()} if model.masked else {})}

    return model, batch


def _loss(model: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    out = model(**kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _reference(model: torch.nn.Module, batches: list[dict]) -> tuple[list[float], dict]:
    """Unsplit AdamW training on the same batches."""
    model = copy.deepcopy(model)
    opt = adamw(model.parameters())
    losses = []
    for kwargs in batches:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, kwargs)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def job_lengths(params: dict) -> dict:
    """Captured and planned at length 32, trained on batches of lengths 32, 17 and 25; then a batch
    longer than the plan's (the error every rank raises)."""
    import partita
    from partita.errors import InputError

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name in params["models"]:
        for label, config in CONFIGS.items():
            model, batch = _lm(name)
            initial = copy.deepcopy(model)
            graph = partita.capture(model, (), batch(0, LONGEST))
            plan = _plan(graph, global_batch=BATCH, **config)
            trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph)
            batches = [batch(step, length) for step, length in enumerate(LENGTHS)]
            losses = [trainer.step(**kwargs) for kwargs in batches]
            state = trainer.gather_state_dict()
            result: dict[str, Any] = {"losses": losses, "programs": len(trainer._programs)}
            try:
                trainer.step(**batch(9, LONGEST + 3))
                result["longer"] = None
            except InputError as e:
                result["longer"] = str(e)
            if rank == 0:
                ref_losses, ref_state = _reference(initial, batches)
                result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
            results[f"{name}/{label}"] = result
    return results


class MeanMLP(torch.nn.Module):
    """A loss averaged over equally many elements per sample (the trainer averages slices)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(12, 32), torch.nn.Linear(32, 5)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def job_accumulation(params: dict) -> dict:
    """Plans for 4 samples per pipeline round, trainers with accumulation_steps=2 fed 8: a padded-label
    LM (the loss normalised by the count of the whole 8) and a plain mean loss, against unsplit
    training on the 8; and a batch of 4 (the error)."""
    import partita
    from partita.errors import InputError

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    g = torch.Generator().manual_seed(3)
    for name in ("tiny_lm", "mean_mlp"):
        for label, config in {
            "1f1b-2x2": dict(schedule="1f1b", num_stages=2, num_microbatches=2, replicas=1),
            "dp-2": dict(schedule="gpipe", num_stages=1, num_microbatches=1, replicas=2),
        }.items():
            if name == "tiny_lm":
                model, lm_batch = _lm(name)
                batches = [lm_batch(step, 16) for step in range(3)]
            else:
                torch.manual_seed(0)
                model = MeanMLP()
                batches = [{"x": torch.randn(BATCH, 12, generator=g), "y": torch.randn(BATCH, 5, generator=g)}]
                batches *= 3
            initial = copy.deepcopy(model)
            half = {k: v[: BATCH // 2] for k, v in batches[0].items()}
            graph = partita.capture(model, (), half)
            plan = _plan(graph, global_batch=BATCH // 2, **config)
            trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph, accumulation_steps=2)
            losses = [trainer.step(**kwargs) for kwargs in batches]
            state = trainer.gather_state_dict()
            result: dict[str, Any] = {"losses": losses, "normalised": trainer.loss_scaling.normalised}
            try:
                trainer.step(**half)
                result["small"] = None
            except InputError as e:
                result["small"] = str(e)
            if rank == 0:
                ref_losses, ref_state = _reference(initial, batches)
                result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
            results[f"{name}/{label}"] = result
    return results


class NoisyNet(torch.nn.Module):
    """Dropout and batch norm: what eval mode changes."""

    def __init__(self):
        super().__init__()
        self.a, self.norm = torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32)
        self.drop, self.b = torch.nn.Dropout(0.3), torch.nn.Linear(32, 5)

    def forward(self, x, y):
        h = self.drop(torch.relu(self.norm(self.a(x))))
        return torch.nn.functional.cross_entropy(self.b(h), y)


def job_evaluate(params: dict) -> dict:
    """evaluate() on a 2-stage pipeline: its loss against the unsplit model in eval mode, the state
    before and after it, and the loss of the next step against a trainer that did not evaluate; then
    evaluate() of the padded-label LM at a shorter length."""
    import partita

    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(4)
    batches = [
        {"x": torch.randn(BATCH, 12, generator=g), "y": torch.randint(0, 5, (BATCH,), generator=g)} for _ in range(3)
    ]
    runs: dict[str, Any] = {}
    for evaluating in (True, False):
        torch.manual_seed(0)
        model = NoisyNet()
        graph = partita.capture(model, (), batches[0])
        plan = _plan(graph, global_batch=BATCH, schedule="1f1b", num_stages=2, num_microbatches=2, replicas=1)
        trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph, seed=1)
        run: dict[str, Any] = {"losses": [trainer.step(**batches[0])]}
        if evaluating:
            before = trainer.gather_state_dict()
            run["eval"] = trainer.evaluate(**batches[2])
            run["eval_again"] = trainer.evaluate(**batches[2])
            after = trainer.gather_state_dict()
            run["num_steps"] = trainer.num_steps
            if rank == 0:
                run["unchanged"] = max_diff(after, before)
                reference = NoisyNet()
                reference.load_state_dict(before)
                reference.eval()
                with torch.no_grad():
                    run["ref_eval"] = float(reference(**batches[2]))
                    reference.train()
                    run["train_mode_loss"] = float(reference(**batches[2]))
        run["losses"].append(trainer.step(**batches[1]))
        runs["evaluating" if evaluating else "plain"] = run
    for schedule, num_stages in (("1f1b", 2), ("zbv", 4)):
        model, batch = _lm("tiny_lm")
        graph = partita.capture(model, (), batch(0, LONGEST))
        plan = _plan(
            graph,
            global_batch=BATCH,
            schedule=schedule,
            num_stages=num_stages,
            num_microbatches=4,
            replicas=1,
            num_rank_groups=2,
        )
        trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph)
        short = batch(5, 20)
        run = {"eval": trainer.evaluate(**short), "step": trainer.step(**batch(6, LONGEST))}
        run["eval_after"] = trainer.evaluate(**short)
        state = trainer.gather_state_dict()  # each rank trained its own stages' weights
        if rank == 0:
            reference = copy.deepcopy(model)
            reference.load_state_dict(state)
            with torch.no_grad():
                run["ref_eval_after"] = float(_loss(reference.eval(), short))
        runs[f"lm/{schedule}"] = run
    return runs


SWEEP_ROWS = ((0, 8), (8, 16), (24, 32))  # examples/own_data.py's rows per step: lengths 30, 32 (the plan's), 28


def sweep_case():
    """The shipped example's model (seeded as `partita train` builds it), its graph at the longest
    length, and the steps' batches: its rows collated, each padded to its own longest row."""
    import partita
    from partita.cli.model_spec import load_model

    ex = load_model(f"{Path(__file__).resolve().parents[2] / 'examples' / 'own_data.py'}:build_rows")
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    batches = [ex.collate_fn([ex.data[i] for i in range(a, b)]) for a, b in SWEEP_ROWS]
    return ex, graph, batches


def job_sweep(params: dict) -> dict:
    """Every plan the planner returned for the shipped example (test_batch_shapes.py plans them),
    trained on its batches of several lengths; rank 0 compares with unsplit training."""
    import partita
    from partita.types.plan_file import plan_from_json

    rank = int(os.environ["RANK"])
    ex, graph, batches = sweep_case()
    model, initial = ex.model, copy.deepcopy(ex.model)
    results: dict[str, Any] = {}
    for key, text in params["plans"].items():
        model.load_state_dict(initial.state_dict())  # every plan from the same weights, one capture
        plan = plan_from_json(text, graph=graph)
        trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph)
        losses = [trainer.step(tokens=b["tokens"], mask=b["mask"], target=b["target"]) for b in batches]
        state = trainer.gather_state_dict()
        result: dict[str, Any] = {"losses": losses, "programs": sum(1 for t, _ in trainer._programs if t)}
        if rank == 0:
            reference = copy.deepcopy(initial)
            opt = adamw(reference.parameters())
            result["ref_losses"] = []
            for b in batches:
                opt.zero_grad(set_to_none=True)
                loss = ex.loss_fn(reference(tokens=b["tokens"], mask=b["mask"]), b["target"])
                loss.backward()
                opt.step()
                result["ref_losses"].append(float(loss))
            result["param"] = max_diff(state, reference.state_dict())
        results[key] = result
    return results


JOBS.update({"lengths": job_lengths, "accumulation": job_accumulation, "evaluate": job_evaluate, "sweep": job_sweep})

if __name__ == "__main__":
    sys.modules.setdefault("workers_batches", sys.modules[__name__])
    main()
