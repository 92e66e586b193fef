"""Rank-side code of test_sharding.py (``python workers_sharding.py JOB DIR``, see dist_launch.py):
stages sharded with FSDP2 at each level, against unsplit full-batch training on rank 0."""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
from workers import JOBS, TinyCausalLM, adamw, legal_cut, main, max_diff, padded_labels, per_sample_cut

BATCH, SEQ, STEPS, MAX_GRAD_NORM = 8, 16, 3, 0.5
LENGTHS = (SEQ, SEQ - 5, SEQ)  # per step: the 2nd batch is padded to a shorter length than the plan's


def _case(name: str) -> tuple[torch.nn.Module, list[dict]]:
    torch.manual_seed(0)
    if name == "gpt2":  # tied input and output embeddings
        from partita import examples

        ex = examples.build("gpt2", batch_size=BATCH, seq_len=SEQ)
        full = [ex.make_batch(BATCH, step)[1] for step in range(STEPS)]
        return ex.model, [{k: v[:, :n] for k, v in b.items()} for b, n in zip(full, LENGTHS)]
    model = TinyCausalLM()
    g = torch.Generator().manual_seed(1)
    batches = []
    for step, length in enumerate(LENGTHS):
        ids = torch.randint(0, TinyCausalLM.VOCAB, (BATCH, length), generator=g)
        batches.append({"input_ids": ids, "labels": padded_labels(ids, step)})
    return model, batches


def _sharded_plan(
    graph,
    levels: list[str],
    *,
    num_stages: int,
    replicas: int,
    num_microbatches: int,
    schedule: str,
    rank_groups: int | None = None,
    recompute: list[str] | None = None,
    tensor_parallel: int = 1,
    accumulation: str = "whole",
    recompute_blocks: int | None = None,
):
    from partita.planning.manual import manual_plan
    from partita.types import Accumulation, Sharding

    n = graph.num_nodes
    cut = per_sample_cut if isinstance(replicas, list) else legal_cut  # uneven: a boundary the executor can slice
    cuts = [cut(graph, n * k // num_stages) for k in range(1, num_stages)]
    plan = manual_plan(
        graph,
        [0, *cuts, n],
        schedule=schedule,
        num_rank_groups=rank_groups or num_stages,
        replicas=replicas,
        num_microbatches=num_microbatches,
        global_batch_size=BATCH,
        **({} if recompute is None else dict(recompute=recompute, recompute_blocks=recompute_blocks)),
        **({} if tensor_parallel == 1 else dict(tensor_parallel=tensor_parallel, sequence_parallel=True)),
    )
    stages = tuple(
        dataclasses.replace(
            s,
            sharding=Sharding(level),
            accumulation=Accumulation.WHOLE if level == "replicate" else Accumulation(accumulation),
        )
        for s, level in zip(plan.stages, levels)
    )
    return dataclasses.replace(plan, stages=stages)


def _loss(model: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    out = model(**kwargs)
    return out if isinstance(out, torch.Tensor) else out.loss


def _reference(model: torch.nn.Module, batches: list[dict]) -> tuple[list[float], dict]:
    model = copy.deepcopy(model)
    opt = adamw(model.parameters())
    losses = []
    for kwargs in batches:
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, kwargs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def job_levels(params: dict) -> dict:
    """Each config: STEPS AdamW steps with clipping; losses and parameters against unsplit training;
    the local shard's share of each sharded parameter; a checkpoint written under the config."""
    import partita
    from partita.errors import InputError
    from partita.runtime.checkpoint import load_into_model

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for config in params["configs"]:
        label = config["label"]
        model, batches = _case(config["model"])
        initial = copy.deepcopy(model)
        graph = partita.capture(model, (), batches[0])
        plan = _sharded_plan(
            graph,
            config["levels"],
            num_stages=config["num_stages"],
            replicas=config["replicas"],
            num_microbatches=config["num_microbatches"],
            schedule=config["schedule"],
            rank_groups=config.get("rank_groups"),
            recompute=config.get("recompute"),
            recompute_blocks=config.get("recompute_blocks"),
            accumulation=config.get("accumulation", "whole"),
        )
        try:
            trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph, max_grad_norm=MAX_GRAD_NORM)
        except InputError as e:
            results[label] = {"refused": str(e)}
            continue
        losses = [trainer.step(**kwargs) for kwargs in batches]
        state = trainer.gather_state_dict()
        from torch.distributed.tensor import DTensor

        shards = {
            name: (p.to_local().numel(), p.numel()) for name, p in trainer.params.items() if isinstance(p, DTensor)
        }
        result: dict[str, Any] = {"losses": losses, "shards": shards, "eval": trainer.evaluate(**batches[0])}
        from torch.distributed.fsdp import FSDPModule

        # how this rank's stages ran: FSDP2 units per sharded stage, segments per stage (by block)
        result["units"] = {k: sum(isinstance(m, FSDPModule) for m in r.modules()) for k, r in trainer._stages.runners.items()}
        result["segments"] = {
            s.spec.index: s.__dict__["segmented"].num_segments if s.__dict__.get("segmented") else 1
            for s in trainer._programs.planned.stages
        }
        result["train_programs"] = sum(1 for training, _ in trainer._programs if training)  # one per length
        checkpoint = Path(params["checkpoints"]) / f"ckpt-{label}"
        trainer.save_checkpoint(str(checkpoint))
        if rank == 0:
            ref_losses, ref_state = _reference(initial, batches)
            result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
            evaluated = copy.deepcopy(initial)
            evaluated.load_state_dict(ref_state)
            with torch.no_grad():
                result["ref_eval"] = float(_loss(evaluated.eval(), batches[0]))
            plain = copy.deepcopy(initial)
            load_into_model(plain, str(checkpoint))
            result["loaded_plain"] = max_diff({k: v for k, v in plain.state_dict().items()}, ref_state)
        # the same checkpoint loaded into a trainer of another level (replicated) on the same ranks
        other = _sharded_plan(
            graph,
            ["replicate"] * config["num_stages"],
            num_stages=config["num_stages"],
            replicas=config["replicas"],
            num_microbatches=config["num_microbatches"],
            schedule=config["schedule"],
            rank_groups=config.get("rank_groups"),
        )
        fresh = copy.deepcopy(initial)
        fresh_graph = partita.capture(fresh, (), batches[0])
        replicated = partita.Trainer(fresh, other, optimizer=adamw, graph=fresh_graph, max_grad_norm=MAX_GRAD_NORM)
        replicated.load_checkpoint(str(checkpoint))
        reloaded = replicated.gather_state_dict()
        if rank == 0:
            result["loaded_replicated"] = max_diff(reloaded, state)
        results[label] = result
    return results


def job_bf16(params: dict) -> dict:
    """bf16 plans (autocast, fp32 master weights): 5 steps against unsplit training under the same
    autocast policy; the dtypes of what the pipeline sends and of the checkpoint's weights."""
    from torch.distributed.checkpoint import FileSystemReader

    import partita
    from partita.types import Precision

    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for config in params["configs"]:
        label = config["label"]
        model, batches = _case(config["model"])
        batches = (batches * 2)[:5]
        initial = copy.deepcopy(model)
        graph = partita.capture(model, (), batches[0])
        plan = _sharded_plan(
            graph,
            config["levels"],
            num_stages=config["num_stages"],
            replicas=config["replicas"],
            num_microbatches=config["num_microbatches"],
            schedule=config["schedule"],
            rank_groups=config.get("rank_groups"),
            recompute=config.get("recompute"),
            tensor_parallel=config.get("tensor_parallel", 1),
        )
        plan = dataclasses.replace(plan, precision=Precision.BF16)
        trainer = partita.Trainer(model, plan, optimizer=adamw, graph=graph, max_grad_norm=MAX_GRAD_NORM)
        losses = [trainer.step(**kwargs) for kwargs in batches]
        program = trainer._programs.planned  # the planned graph's
        sent = {
            k: [(str(t.dtype), t.requires_grad) for t in m.output_args]
            for k, m in enumerate(program._metadata)
            if k < plan.num_stages - 1
        }
        checkpoint = Path(params["checkpoints"]) / f"bf16-{label}"
        trainer.save_checkpoint(str(checkpoint))
        state = trainer.gather_state_dict()
        result: dict[str, Any] = {"losses": losses, "sent": sent}
        if rank == 0:
            stored = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
            result["stored_dtypes"] = sorted(
                {
                    str(m.properties.dtype)
                    for key, m in stored.items()
                    if key.startswith("model.") and hasattr(m, "properties")
                }
            )
            reference = copy.deepcopy(initial)
            opt = adamw(reference.parameters())
            ref_losses = []
            for kwargs in batches:
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = _loss(reference, kwargs)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_GRAD_NORM)
                opt.step()
                ref_losses.append(float(loss))
            fp32_losses, _ = _reference(initial, batches)
            result.update(ref_losses=ref_losses, fp32_losses=fp32_losses, param=max_diff(state, reference.state_dict()))
            if any(level != "replicate" for level in config["levels"]):  # bf16 gathers' own reference
                gathered_losses, gathered_state = _bf16_gathered_reference(initial, batches)
                result.update(gathered_losses=gathered_losses, gathered_param=max_diff(state, gathered_state))
        results[label] = result
    return results


def _bf16_gathered_reference(model: torch.nn.Module, batches: list[dict]) -> tuple[list[float], dict]:
    """Unsplit training under the policy of a sharded bf16 stage (partita/runtime/precision.py): every
    forward reads the weights cast to bf16, as FSDP2 gathers them (``param_dtype``), under the same
    autocast; gradients flow back to the fp32 master weights, which the optimizer steps."""
    model = copy.deepcopy(model)
    opt = adamw(model.parameters())
    losses = []
    for kwargs in batches:
        opt.zero_grad(set_to_none=True)
        weights = {name: p.to(torch.bfloat16) for name, p in model.named_parameters()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = torch.func.functional_call(model, weights, (), kwargs)
        loss = out if isinstance(out, torch.Tensor) else out.loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


JOBS.update({"levels": job_levels, "bf16": job_bf16})

if __name__ == "__main__":
    sys.modules.setdefault("workers_sharding", sys.modules[__name__])
    main()
