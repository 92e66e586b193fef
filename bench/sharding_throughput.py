"""Throughput with sharding on this machine: partita's plan vs plain FSDP2 and DDP on the same ranks.

For each model, on 2 ranks x 1 thread (gloo, separate processes, torchrun-style environment), under
one per-rank memory budget (``--budget-mib``, ``Cluster.local(num_devices=2, memory_bytes=...)``):

  partita               ``partita.plan`` with measured costs: stages, replicas, micro-batches,
                        schedule, recomputation and the sharding level per stage searched;
  partita, no sharding  the same search with ``sharding="replicate"`` (every replica a whole copy);
  partita FSDP          partita's trainer on plain data parallelism, fully sharded, one micro-batch
                        (``num_stages=1, replicas=2, sharding="full_shard", num_microbatches=1``):
                        every transformer block its own FSDP2 unit;
  torch FSDP2           what most users write: ``fully_shard`` on every transformer block and on the
                        root of the unmodified model, each rank half the batch, AdamW;
  torch DDP             ``DistributedDataParallel`` over the unmodified model, half the batch each.

All configurations of one model run in the SAME two processes, interleaved step by step, in an order
rotated every round, so that the machine's drift (other jobs on the shared cores) hits all alike;
``--warmup`` rounds are dropped, then ``--rounds`` rounds are timed. Numbers are medians over rounds;
ratios are medians of within-round ratios to partita's step. A configuration whose plan the planner
says does not fit the budget is not run (its row says so). Every configuration trains its own copy of
the weights (timing only; tests/dist/test_sharding.py checks exactness).

Usage: python bench/sharding_throughput.py [--models gpt2-small,gpt2-small-v50k] [--rounds 6] [--warmup 2]
                                           [--budget-mib 1024] [--out bench/results/sharding_throughput.md]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _e2e_common import (  # noqa: E402
    MIB,
    REPO,
    build_example,
    command_line,
    config_text,
    loss_of,
    machine_line,
    now_utc,
    run_ranks,
    step_kwargs,
)

LR = 1e-4
PLANNED = ("partita", "partita, no sharding", "partita FSDP")
PLAIN = ("torch FSDP2", "torch DDP")


PINS = {
    "partita": {},
    "partita, no sharding": {"sharding": "replicate"},
    # pinned as torch's FSDP2 runs below: plain data parallelism, one micro-batch, every block its own unit
    "partita FSDP": {"num_stages": 1, "replicas": 2, "sharding": "full_shard", "num_microbatches": 1},
}


def plan_model(name: str, args, work: Path, pins: dict[str, dict] = PINS) -> dict:
    """partita's plans of one model, one per entry of ``pins`` (PlanOptions pinned; saved under
    ``work``), with their predictions."""
    import partita
    from partita.errors import InfeasiblePlanError

    torch.set_num_threads(1)  # the profile must see what one rank with one thread sees
    ex = build_example(name, args.global_batch)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = partita.Cluster.local(
        num_devices=2, memory_bytes=args.budget_mib * MIB, cache_dir=args.cache_dir, num_threads=1
    )
    out = {"name": name, "num_parameters": graph.num_parameters, "plans": {}}
    for label, pin in pins.items():
        options = partita.PlanOptions(costs="measured", cache_dir=args.cache_dir, **pin)
        try:  # partita.plan: the tensor-parallel degree searched (or pinned) as well
            p = partita.plan(
                graph, ex.args, ex.kwargs, cluster=cluster, global_batch_size=args.global_batch, options=options
            )
        except InfeasiblePlanError:
            out["plans"][label] = None
            continue
        path = work / f"{name}.{label.replace(' ', '_').replace(',', '')}.json"
        p.save(str(path))
        out["plans"][label] = {
            "path": str(path),
            "predicted_s": p.predicted_step_s,
            "config": config_text(p),
            "sharding": ",".join(s.sharding.value for s in p.stages),
            "peak_mib": max(s.memory_bytes for s in p.stages) / MIB,
            "tensor_parallel": p.tensor_parallel,
        }
    return out


def _blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The module list of transformer blocks of a GPT-2 (``transformer.h``) or a Llama (``model.layers``)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def _plain(ex, kind: str):
    """torch's own FSDP2 or DDP over a copy of the unmodified model: (module, optimizer)."""
    model = copy.deepcopy(ex.model)
    if kind == "torch DDP":
        module = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2,))
        for block in _blocks(model):  # torchtitan's layout: every transformer block, then the root
            fully_shard(block, mesh=mesh)
        module = fully_shard(model, mesh=mesh)
    return module, torch.optim.AdamW(module.parameters(), lr=LR)


def worker(out_dir: Path) -> None:
    import torch.distributed as dist

    import partita

    torch.set_num_threads(1)
    params = torch.load(out_dir / "params.pt", weights_only=False)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    gb = params["global_batch"]
    ex = build_example(params["model"], gb)
    steps = {}
    for label, path in params["plans"].items():
        model = copy.deepcopy(ex.model)
        graph = partita.capture(model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        trainer = partita.Trainer(
            model, partita.Plan.load(path, graph=graph), graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR)
        )
        steps[label] = lambda batch, t=trainer: t.step(*step_kwargs(ex, batch)[0], **step_kwargs(ex, batch)[1])
    for kind in params.get("plain", PLAIN):
        module, opt = _plain(ex, kind)

        def plain_step(batch, module=module, opt=opt):
            args, kwargs, target = batch
            half = gb // 2
            mine = (args, {k: v[rank * half : (rank + 1) * half] for k, v in kwargs.items()}, target)
            loss = loss_of(ex, module, mine)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        steps[kind] = plain_step
    labels = list(steps)
    batches = [ex.make_batch(gb, s) for s in range(3)]
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(params["warmup"] + params["rounds"]):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            dist.barrier()
            start = time.perf_counter()
            steps[label](batches[r % len(batches)])
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step ends when the slower rank is done
            if r >= params["warmup"]:
                times[label].append(float(elapsed))
        if rank == 0:
            print(f"round {r}: " + ", ".join(f"{k} {times[k][-1]:.3f}" for k in labels if times[k]), flush=True)
    torch.save({"times": times}, out_dir / f"result{rank}.pt")
    dist.destroy_process_group()


def summarize(info: dict, times: dict, global_batch: int) -> list[dict]:
    rows = []
    base = times.get("partita")
    for label in (*PLANNED, *PLAIN):
        plan = info["plans"].get(label) if label in PLANNED else None
        if label not in times:
            rows.append({"label": label, "missing": "no plan fits the budget"})
            continue
        median = statistics.median(times[label])
        ratio = statistics.median(t / b for t, b in zip(times[label], base)) if base else float("nan")
        rows.append(
            {
                "label": label,
                "median_s": median,
                "samples_s": global_batch / median,
                "vs_partita": ratio,
                "config": plan["config"] if plan else "unsplit model, half the batch per rank",
                "sharding": plan["sharding"] if plan else ("full_shard" if "FSDP" in label else "replicate"),
                "predicted_s": plan["predicted_s"] if plan else None,
                "peak_mib": plan["peak_mib"] if plan else None,
            }
        )
    return rows


def write_markdown(path: Path, args, header: str, results: dict, started: float) -> None:
    lines = [
        "# Throughput with sharding: partita's plan vs plain FSDP2 and DDP on the same 2 ranks",
        "",
        f"- command: `{command_line()}`",
        f"- date: {now_utc()}; {header}",
        f"- setup: 2 ranks x 1 thread, gloo on loopback; global batch {args.global_batch}; AdamW; fp32; budget "
        f"{args.budget_mib} MiB per rank for the planner. Configurations interleaved step by step in the same two "
        f"processes (order rotated every round); {args.warmup} warm-up rounds dropped, {args.rounds} timed. Step = "
        "the slower rank's. `vs partita`: median of within-round ratios (> 1: slower than partita's plan).",
        f"- wall time: {(time.perf_counter() - started) / 60:.1f} min.",
        "",
        "| model | params | method | configuration | sharding | predicted peak / rank | step (median) | samples/s "
        "| vs partita | predicted step |",
        "|---|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, (info, rows) in results.items():
        for row in rows:
            if "missing" in row:
                lines.append(
                    f"| {name} | {info['num_parameters'] / 1e6:.1f} M | {row['label']} | {row['missing']} | | | | | | |"
                )
                continue
            peak = f"{row['peak_mib']:.0f} MiB" if row["peak_mib"] is not None else "-"
            pred = f"{row['predicted_s']:.3f} s" if row["predicted_s"] is not None else "-"
            lines.append(
                f"| {name} | {info['num_parameters'] / 1e6:.1f} M | {row['label']} | {row['config']} | {row['sharding']} "
                f"| {peak} | {row['median_s']:.3f} s | {row['samples_s']:.1f} | {row['vs_partita']:.2f}x | {pred} |"
            )
    lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--models", default="gpt2-small,gpt2-small-v50k")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--budget-mib", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--cache-dir", default=".partita-cache/e2e")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/partita-sharding-throughput"))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/sharding_throughput.md")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    started, header = time.perf_counter(), machine_line()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.models.split(","):
        info = plan_model(name, args, args.work_dir)
        print(
            f"{name}: "
            + ", ".join(f"{k}: {v and v['config']} [{v and v['sharding']}]" for k, v in info["plans"].items()),
            flush=True,
        )
        plans = {label: p["path"] for label, p in info["plans"].items() if p is not None}
        out = run_ranks(
            Path(__file__),
            2,
            args.work_dir / name,
            timeout_s=args.timeout,
            model=name,
            plans=plans,
            global_batch=args.global_batch,
            warmup=args.warmup,
            rounds=args.rounds,
        )
        results[name] = (info, summarize(info, out[0]["times"], args.global_batch))
        write_markdown(args.out, args, header, results, started)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
