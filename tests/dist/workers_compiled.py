"""Rank-side code of test_compiled_exact.py (``python workers_compiled.py JOB DIR``): plans whose
blocks run through torch.compile, against the unsplit model trained eagerly on rank 0."""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Any

import torch
from workers import JOBS, Case, legal_cut, main, max_diff, sgd, shared_case

STEPS, BATCH = 3, 8
STARTED = time.monotonic()


def _plan(case: Case, config: dict):
    from partita.planning.manual import manual_plan

    n, s = case.graph.num_nodes, config["num_stages"]
    cuts = [legal_cut(case.graph, n * k // s) for k in range(1, s)]
    degree = config.get("tensor_parallel", 1)
    return manual_plan(
        case.graph,
        [0, *cuts, n],
        schedule=config["schedule"],
        num_rank_groups=config.get("num_rank_groups", s),
        replicas=config.get("replicas", 1),
        num_microbatches=config["num_microbatches"],
        global_batch_size=case.batch_size,
        tensor_parallel=degree,
        sequence_parallel=degree > 1,
        sharding=config.get("sharding", "replicate"),
        recompute=config.get("recompute", "none"),
        compile=True,
    )


def _batches(case: Case, shorter: bool) -> list[tuple]:
    """STEPS batches; with ``shorter`` the second cut to a shorter sequence: a graph captured again,
    compiled at its own shapes."""
    batches = list(case.batches[:STEPS])
    if not shorter:
        return batches
    args, kwargs, target = batches[1]
    shorter = {k: v[:, : v.shape[1] * 3 // 4].contiguous() if v.dim() > 1 else v for k, v in kwargs.items()}
    batches[1] = (args, shorter, target)
    return batches


class _OwnData:
    """The shipped example of a user's own model and data (examples/own_data.py, as
    test_batch_shapes.py's sweep runs it) in a Case's shape: its batches have lengths of their own.
    Its stages split their backward under ZB-V (input, then weight gradients of one graph)."""

    def __init__(self):
        from workers_batches import sweep_case

        ex, self.graph, batches = sweep_case()
        self.model, self.loss_fn, self.batch_size = ex.model, ex.loss_fn, BATCH
        self.reference_model = copy.deepcopy(ex.model)
        self.batches = [((), {"tokens": b["tokens"], "mask": b["mask"]}, b["target"]) for b in batches]

    def loss(self, model: torch.nn.Module, batch: tuple) -> torch.Tensor:
        args, kwargs, target = batch
        return self.loss_fn(model(*args, **kwargs), target)


def _case(name: str, shorter: bool) -> tuple[Any, list[tuple]]:
    """The case and its STEPS batches (``shorter``: the second at a shorter length; each
    compilation costs seconds on this CPU, so the other configs train at one length)."""
    if name == "own_data":
        case = _OwnData()
        return case, case.batches[:STEPS] if shorter else [case.batches[1]] * STEPS  # lengths 30, 32, 28
    case = shared_case(name)
    return case, _batches(case, shorter)


def _step(trainer, batch: tuple) -> float:
    args, kwargs, target = batch
    return trainer.step(*args, **kwargs, **({"target": target} if target is not None else {}))


def _reference(case: Case, batches: list[tuple]) -> tuple[list[float], dict]:
    model = copy.deepcopy(case.reference_model)
    opt = sgd(model.parameters())
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss = case.loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def job_compiled(params: dict) -> dict:
    """Each config: STEPS SGD steps of a compiled plan; losses and parameters against unsplit eager
    training; the compiled functions made and the programs run."""
    import partita
    from partita.runtime.compiled_segments import compiled_count

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for config in params["configs"]:
        label = config["label"]
        print(label, f"{time.monotonic() - STARTED:.0f} s", flush=True)
        case, batches = _case(config["model"], config.get("shorter", False))
        before = compiled_count()
        trainer = partita.Trainer(case.model, _plan(case, config), optimizer=sgd, graph=case.graph)
        losses = [_step(trainer, batch) for batch in batches]
        result: dict[str, Any] = {
            "losses": losses,
            "compiled": compiled_count() - before,
            "segments": sum(s.__dict__["segmented"].num_segments for s in trainer._programs.planned.stages),
            "train_programs": sum(1 for training, _ in trainer._programs if training),  # one per length
            "lengths": len({tuple(v.shape) for _, kwargs, _ in batches for v in kwargs.values()}),
        }
        state = trainer.gather_state_dict()
        if rank == 0:
            ref_losses, ref_state = _reference(case, batches)
            result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
        results[label] = result
    return results


JOBS.update(compiled=job_compiled)

if __name__ == "__main__":
    sys.modules.setdefault("workers_compiled", sys.modules[__name__])
    main()
