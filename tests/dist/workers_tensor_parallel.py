"""Rank-side code of test_tensor_parallel.py (``python workers_tensor_parallel.py JOB DIR``): stages
split over tensor-parallel groups, against unsplit full-batch training on rank 0."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch
from workers import JOBS, Case, adamw, legal_cut, main, max_diff, reference_run, reference_states, shared_case

STEPS, MAX_GRAD_NORM = 3, 0.5


def _plan(case: Case, config: dict):
    from partita.planning.manual import manual_plan

    n, s = case.graph.num_nodes, config["num_stages"]
    cuts = [legal_cut(case.graph, n * k // s) for k in range(1, s)]
    return manual_plan(
        case.graph,
        [0, *cuts, n],
        schedule=config["schedule"],
        num_rank_groups=config.get("num_rank_groups", s),  # ZBV, interleaved: several stages per rank group
        replicas=config["replicas"],
        num_microbatches=config["num_microbatches"],
        global_batch_size=case.batch_size,
        tensor_parallel=config["tensor_parallel"],
        sharding=config.get("sharding", "replicate"),
        recompute=config.get("recompute", "none"),
        sequence_parallel=config.get("sequence_parallel", False) and config["tensor_parallel"] > 1,
        accumulation=config.get("accumulation", "whole"),
        recompute_blocks=config.get("recompute_blocks"),
    )


def _step(trainer, batch: tuple) -> float:
    args, kwargs, target = batch
    return trainer.step(*args, **kwargs, **({"target": target} if target is not None else {}))


def _shorter(batch: tuple) -> tuple:
    """The batch cut to half its sequence length."""
    args, kwargs, target = batch
    half = {
        k: v[:, : v.shape[1] // 2].contiguous() if isinstance(v, torch.Tensor) and v.dim() > 1 else v
        for k, v in kwargs.items()
    }
    return args, half, target


def _odd_vocabulary(vocab: int, rank: int) -> dict:
    """A tied GPT-2 whose vocabulary does not divide by the degree: one forward and backward of the
    rewritten graph against the unsplit model (loss, the whole embedding's gradient)."""
    import transformers

    import partita
    from partita.runtime import tensor_parallel as T
    from partita.runtime.tensor_parallel_rewrite import rewrite_stage
    from partita.runtime.stages import flatten_inputs, split_graph

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=vocab,
        n_positions=64,
        use_cache=False,
        loss_type="ForCausalLM",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    reference = copy.deepcopy(model)
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    graph = partita.capture(model, (), batch)
    (stage,) = split_graph(graph, [0, graph.num_nodes])
    import torch.distributed as dist

    analyses = T.stage_analyses(graph, [stage], 2)
    tp = T.TensorParallel(2, rank, dist.group.WORLD, analyses)
    T.shard_parameters([stage], tp)
    rewrite_stage(stage, tp)
    loss = stage(*stage.graph_inputs(flatten_inputs(graph, (), batch, None)))
    loss.backward()
    shards = tp.shards()
    padded = [name for name, shard in shards.items() if shard.whole]
    held = stage.state_tensors()
    grads = {name: T.gather_full(held[name].grad, shards[name], tp) for name in sorted(shards)}
    reference_grads = dict(reference.named_parameters())
    return {
        "padded": padded,
        "loss": (float(loss), float(ref_loss)),
        "grad": max((grads[n] - reference_grads[n].grad).abs().max().item() for n in grads),
    }


def _on_meta(config: dict, directory: Path, rank: int) -> dict:
    """The model built on meta, each rank taking its parts of the weights from a seed checkpoint:
    STEPS AdamW steps against unsplit training, and the elements each rank allocated."""
    import torch.distributed as dist

    import partita
    from partita import examples
    from partita.runtime.materialize import meta_copies, save_seed

    case = shared_case(config["model"])
    seed = directory / f"seed-{config['label']}"
    if rank == 0:
        save_seed(case.model, seed)
    dist.barrier()
    meta = examples.build(config["model"], batch_size=case.batch_size, seq_len=16, device="meta")
    args, kwargs, target = case.batches[0]
    graph = partita.capture(
        meta.model, meta_copies(args), meta_copies(kwargs), loss_fn=case.loss_fn, target=meta_copies(target)
    )
    trainer = partita.Trainer(
        meta.model, _plan(case, config), optimizer=adamw, graph=graph, init_from=str(seed), max_grad_norm=MAX_GRAD_NORM
    )
    result: dict[str, Any] = {"losses": [_step(trainer, case.batches[k]) for k in range(STEPS)]}
    state = trainer.gather_state_dict()
    result["held"] = sum(p.numel() for p in trainer.params.values())
    result["parts"] = _parts(trainer, graph)
    if rank == 0:
        ref_losses, ref_state = reference_run(case, adamw, STEPS, max_grad_norm=MAX_GRAD_NORM)
        result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
    return result


def _boundary_shapes(trainer) -> dict[str, list]:
    """"received k" / "sent k" -> the shapes of what this rank's stage k receives and sends."""
    program = trainer._programs.planned
    shapes: dict[str, list] = {}
    for stage in program.stages:
        meta = program._metadata[stage.spec.index]
        shapes[f"received {stage.spec.index}"] = [list(t.shape) for t in meta.input_args]
        if not stage.spec.is_last:
            shapes[f"sent {stage.spec.index}"] = [list(t.shape) for t in meta.output_args]
    return shapes


def _norm_gradients(trainer) -> dict[str, list[str]]:
    """The parameters whose gradients this rank's program leaves as its tokens' part (summed over
    the group once per step), and those the rewritten stage graphs still sum per micro-batch
    (``copy_in`` of a parameter)."""
    from partita.runtime.tensor_parallel_rewrite import _parameter_placeholders, copy_in

    program = trainer._programs.planned
    per_microbatch = set()
    for stage in program.stages if trainer.tensor_parallel is not None else ():
        params = _parameter_placeholders(stage)
        for node in stage.graph_module.graph.nodes:
            if node.target is copy_in and node.args[0] in params:
                per_microbatch.add(params[node.args[0]])
    return {"partial_gradients": sorted(program.partial_gradients), "summed_per_microbatch": sorted(per_microbatch)}


def _parts(trainer, graph) -> list[tuple]:
    """(size along the token dim sent, captured size along it, the split's inner, degree) of each
    value this rank's stages send in part."""
    tp, program = trainer.tensor_parallel, trainer._programs.planned
    captured = {n.name: getattr(n.meta.get("val"), "shape", None) for n in graph.graph_module.graph.nodes}
    found = []
    for stage in program.stages if tp is not None else ():
        sent = tp.sent_in_part(stage.spec.index)
        for position, name in enumerate(stage.spec.output_names if not stage.spec.is_last else ()):
            if name in sent:
                shape = program._metadata[stage.spec.index].output_args[position].shape
                dim = sent[name].dim
                whole = captured[name][dim]
                found.append((int(shape[dim]), whole if isinstance(whole, int) else None, sent[name].inner, tp.degree))
    return found


def job_tp(params: dict) -> dict:
    """Each config: STEPS clipped AdamW steps; losses and parameters against unsplit training; the
    share of each parameter this rank holds; a checkpoint loaded into the plain model."""
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for config in params["configs"]:
        label = config["label"]
        print(label, flush=True)
        with _ring_blocks(config.get("ring", False)) as ring_calls:
            results[label] = _train_config(config, params, rank)
        results[label]["ring_calls"] = ring_calls.count("row")
        results[label]["column_ring_calls"] = ring_calls.count("column")
    return results


@contextlib.contextmanager
def _ring_blocks(ring: bool):
    """``ring``: every fused row- and column-parallel matmul (sequence parallelism) runs block by block
    around the ring, as at scale; these models' blocks are far below ``RING_MIN_BLOCK_FLOPS`` and
    ``RING_MIN_BLOCK_BYTES``, so they run whole. Yields a list that gets "row" or "column" per forward
    the ring runs."""
    import partita.cost.collective_matmul as collective_costs
    from partita.runtime import collective_matmul

    default = (collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES)
    forwards = collective_matmul.matmul_reduce_scatter, collective_matmul.all_gather_matmul
    calls: list[str] = []

    def counted(kind: str, forward):
        def run(*args):
            calls.append(kind)
            return forward(*args)

        return run

    collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES = (0, 0) if ring else default
    collective_matmul.matmul_reduce_scatter = counted("row", forwards[0])
    collective_matmul.all_gather_matmul = counted("column", forwards[1])
    try:
        yield calls
    finally:
        collective_costs.RING_MIN_BLOCK_FLOPS, collective_costs.RING_MIN_BLOCK_BYTES = default
        collective_matmul.matmul_reduce_scatter, collective_matmul.all_gather_matmul = forwards


def _train_config(config: dict, params: dict, rank: int) -> dict:
    import partita
    from partita.runtime.checkpoint import load_into_model

    label = config["label"]
    if config.get("meta"):
        return _on_meta(config, Path(params["checkpoints"]), rank)
    if config.get("vocab"):
        return _odd_vocabulary(config["vocab"], rank)
    case = shared_case(config["model"])  # one capture per model, from its initial weights
    plan = _plan(case, config)
    trainer = partita.Trainer(case.model, plan, optimizer=adamw, graph=case.graph, max_grad_norm=MAX_GRAD_NORM)
    losses = [_step(trainer, case.batches[k]) for k in range(STEPS)]
    state = trainer.gather_state_dict()
    held = sum(p.numel() for p in trainer.params.values())
    whole = sum(p.numel() for p in case.reference_model.parameters())
    tp = trainer.tensor_parallel
    result: dict[str, Any] = {
        "model": config["model"],
        "recompute": [s.recompute.value for s in plan.stages],
        # the regions this rank's stages split by token (sequence parallelism's sources)
        "token_sources": sorted(
            name
            for s in trainer.stages
            if tp is not None and tp.sequence_parallel
            for name in tp.analyses[s.spec.index].sequence.sources
        ),
        # the boundary values sent in part (sequence parallelism on both sides), with the shapes
        # this rank's stages send and receive
        "parts_sent": sorted(f"{k}:{name}" for k, name in tp.parts_sent) if tp is not None else [],
        "boundary_shapes": _boundary_shapes(trainer),
        **_norm_gradients(trainer),
        "parts": _parts(trainer, case.graph),
        "losses": losses,
        "held": held,
        "whole": whole,
        "split": sorted(tp.shards()) if tp is not None else [],
        "rejected": {k: v for a in tp.analyses.values() for k, v in a.layout.rejected.items()} if tp else {},
    }
    short = _shorter(case.batches[0])  # eval mode at another length: a graph captured again, split alike
    args, kwargs, target = short
    result["eval_short"] = trainer.evaluate(*args, **kwargs, **({"target": target} if target is not None else {}))
    checkpoint = Path(params["checkpoints"]) / f"tp-{label}"
    trainer.save_checkpoint(str(checkpoint))
    # the checkpoint into a trainer of the same plan from the initial weights, and into one
    # without tensor parallelism (its replicas on the same ranks)
    for kind, degree in (("loaded_tp", config["tensor_parallel"]), ("loaded_other", 1)):
        case.reset()
        other = _plan(
            case,
            {
                **config,
                "tensor_parallel": degree,
                "replicas": config["replicas"] * config["tensor_parallel"] // degree,
            },
        )
        fresh = partita.Trainer(case.model, other, optimizer=adamw, graph=case.graph, max_grad_norm=MAX_GRAD_NORM)
        fresh.load_checkpoint(str(checkpoint))
        reloaded = fresh.gather_state_dict()
        if kind == "loaded_tp":  # and it trains on as the original would
            next_loss = _step(fresh, case.batches[STEPS])
            result["next_loss"] = next_loss
        if rank == 0:
            result[kind] = max_diff(reloaded, state)
    if rank == 0:
        ref_losses, ref_states = reference_states(
            case, adamw, STEPS + 1, max_grad_norm=MAX_GRAD_NORM, states_after=(STEPS,)
        )
        result["ref_next_loss"] = ref_losses.pop()
        ref_state = ref_states[STEPS]  # after STEPS steps, as the trainer's state
        result.update(ref_losses=ref_losses, param=max_diff(state, ref_state))
        plain = copy.deepcopy(case.reference_model)
        load_into_model(plain, str(checkpoint))
        trained = copy.deepcopy(case.reference_model)
        trained.load_state_dict(ref_state)
        with torch.no_grad():
            result["ref_eval_short"] = float(case.loss(trained.eval(), short))
        result["loaded_plain"] = max_diff(dict(plain.state_dict()), ref_state)
    return result


JOBS.update({"tp": job_tp})

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
