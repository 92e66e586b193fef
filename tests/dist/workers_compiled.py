"""Rank-side code of test_compiled_exact.py (``python workers_compiled.py JOB DIR``): plans whose
blocks run through torch.compile, against the unsplit model trained eagerly on rank 0."""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import torch
from workers import JOBS, Case, legal_cut, main, max_diff, sgd, shared_case

STEPS = 3


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


def _batches(case: Case) -> list[tuple]:
    """STEPS batches, the second cut to a shorter sequence: a graph captured again, compiled at its
    own shapes."""
    batches = list(case.batches[:STEPS])
    args, kwargs, target = batches[1]
    shorter = {k: v[:, : v.shape[1] * 3 // 4].contiguous() if v.dim() > 1 else v for k, v in kwargs.items()}
    batches[1] = (args, shorter, target)
    return batches


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
        print(label, flush=True)
        case = shared_case(config["model"])
        batches = _batches(case)
        before = compiled_count()
        trainer = partita.Trainer(case.model, _plan(case, config), optimizer=sgd, graph=case.graph)
        losses = [_step(trainer, batch) for batch in batches]
        result: dict[str, Any] = {
            "losses": losses,
            "compiled": compiled_count() - before,
            "segments": sum(s.__dict__["segmented"].num_segments for s in trainer._programs.planned.stages),
            "train_programs": sum(1 for training, _ in trainer._programs if training),  # one per length
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
