"""How much faster are partita's plans than the splits other tools make?

For zoo models at several sizes (GPT-2 with its 50257-word head, T5 encoder-decoder, ViT, Llama)
built on ``meta`` and costed analytically for H100 / A100-80GB clusters, it plans with
``partita.plan``'s search and simulates one step of

  partita         the best plan (split, pp x dp or per-stage replica counts, schedule, micro-batches,
                  recompute), as ``partita.plan`` makes it by default;
  same config     each baseline's split (``uniform``, ``parameters``, ``equal_flops``; see
                  partita.planning.baselines) under partita's configuration, recomputing a stage only
                  where it does not fit otherwise (``planning.baselines.baseline_plans``);
  own config      each baseline's split under ITS best configuration: the uniform configs the search
                  enumerates (every pp x dp, schedule, m and recompute mode; the tools these baselines
                  stand for run pp x dp meshes), each simulated with the
                  baseline's boundaries. Fairer: a split that only fits with more stages or
                  recompute gets them.

A ratio is baseline step / partita step (> 1: partita is faster); "OOM" when the baseline's split
does not fit in memory (with per-stage recompute where needed), "n/a" when it cannot make that many
stages (e.g. uniform with more stages than layers). Efficiency is the ideal step (one step's
forward + backward compute on one device, divided by the cluster's devices) over the predicted
step. Everything is predicted (analytic costs, simulated schedule); nothing runs on a GPU.

Usage:  python bench/plan_quality.py [--out bench/results/plan_quality.md] [--plots bench/results]
                                     [--quick] [--no-own]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import partita
from partita import examples
from partita.planning.baselines import BASELINES, baseline_boundaries, baseline_plans
from partita.planning.chain import legal_cuts
from partita.planning.configs import enumerate_configs
from partita.planning.context import planning_context
from partita.planning.driver import best_plan
from partita.planning.plan_builder import fit_with_recompute
from partita.report.format import fmt_replicas, fmt_seconds

GIB = 2**30


@dataclass(frozen=True)
class Case:
    model: str
    device: str
    devices: int
    global_batch: int
    memory_gib: float | None = None  # None: the device's own memory
    seq_len: int | None = None  # None: the zoo's default for the model
    plot: str | None = None  # file name of a figure of this case


# "tight": memory set low, so that pipelining is needed; "edge": a few % above the least memory with
# which partita fits (found by bisection), where the baselines' splits do not fit at all.
CASES = [
    # GPT-2: the 50257 x hidden head and its logits make the last stage heavy.
    Case("gpt2-124m", "a100-80gb", 4, 64),  # fits as plain data parallelism
    Case("gpt2-124m", "h100", 16, 128, memory_gib=4),  # tight
    Case("gpt2-355m", "h100", 8, 128, memory_gib=8),  # tight
    Case("gpt2-355m", "h100", 8, 128, memory_gib=1.8),  # edge
    Case("gpt2-355m", "a100-80gb", 16, 256),
    Case("gpt2-xl", "h100", 8, 64, plot="gpt2-xl_h100x8.png"),
    Case("gpt2-xl", "h100", 16, 256),
    Case("gpt2-xl", "h100", 64, 512),
    Case("gpt2-xl", "a100-80gb", 4, 64, memory_gib=24, plot="gpt2-xl_4x24GiB.png"),  # tight
    Case("gpt2-xl", "h100", 8, 128, memory_gib=16),  # tight
    Case("gpt2-xl", "h100", 8, 128, memory_gib=6, plot="gpt2-xl_8x6GiB.png"),  # edge
    Case("gpt2-13b", "a100-80gb", 8, 64, memory_gib=40),  # edge
    # T5: encoder and decoder layers differ (cross-attention), shared embedding and head.
    Case("t5-base", "h100", 8, 64, memory_gib=4),  # tight
    Case("t5-large", "a100-80gb", 8, 128),
    Case("t5-large", "a100-80gb", 8, 128, memory_gib=2.6),  # edge
    Case("t5-large", "h100", 16, 256, memory_gib=12),  # tight
    # ViT: uniform layers, light head.
    Case("vit-base", "h100", 4, 256),  # fits as plain data parallelism
    Case("vit-large", "a100-80gb", 8, 512, memory_gib=6),  # tight
    Case("vit-large", "h100", 16, 1024, memory_gib=1.3),  # edge
    # Llama 7B: 32 uniform layers, untied 32000-word head.
    Case("llama-7b", "h100", 8, 64),
    Case("llama-7b", "h100", 4, 64, memory_gib=40),  # edge
    Case("llama-7b", "a100-80gb", 16, 128, memory_gib=32),  # tight
    Case("llama-7b", "h100", 16, 128, memory_gib=13),  # edge
    Case("llama-7b", "h100", 64, 512),
    # Mixtral 8x7B: 46.7 B parameters, 8 experts of which 2 run per token (expert matmuls counted).
    Case("mixtral-8x7b", "h100", 16, 128, seq_len=1024),
]
QUICK = {0, 5, 8, 10, 16}  # rows of --quick
CAPTURE_BATCH = 2  # >= 2: export keeps the batch dimension symbolic, so costs scale with the micro-batch


@functools.cache
def captured(model: str, seq_len: int | None):
    ex = examples.build(model, batch_size=CAPTURE_BATCH, seq_len=seq_len, device="meta")
    return partita.capture(ex.model, ex.args, ex.kwargs)


def context(case: Case):
    graph = captured(case.model, case.seq_len)
    memory = None if case.memory_gib is None else int(case.memory_gib * GIB)
    cluster = partita.Cluster(device=case.device, num_devices=case.devices, devices_per_node=8, memory_bytes=memory)
    return planning_context(
        graph, cluster=cluster, global_batch_size=case.global_batch, options=partita.PlanOptions(costs="analytic")
    )


def own_best(ctx, method: str):
    """The baseline's split under its best config ("n/a": no config can make its split; None: OOM).

    Configs are visited from the smallest lower bound on their step (m * total compute / rank
    groups: the busiest rank group computes at least that) and skipped once that bound reaches the
    best step found, so the answer is the same as simulating every config.
    """
    legal = legal_cuts(ctx.graph)
    configs = list(enumerate_configs(ctx.options, len(ctx.chain) - 1))
    compute = {}
    for c in configs:
        if c.microbatch_size not in compute:
            costs = ctx.costs_at(c.microbatch_size)
            compute[c.microbatch_size] = float(costs.forward_s.sum() + costs.backward_s.sum())
    bound = lambda c: c.num_microbatches * compute[c.microbatch_size] / c.num_rank_groups  # noqa: E731
    best, splittable = None, False
    for config in sorted(
        configs,
        key=lambda c: (
            bound(c),
            c.num_rank_groups,
            c.replicas,
            c.schedule.value,
            c.num_microbatches,
            str(c.recompute_mode),
        ),
    ):
        if best is not None and bound(config) >= best.predicted_step_s:
            break
        boundaries = baseline_boundaries(method, ctx.graph, legal, config.num_stages)
        if boundaries is None:
            continue
        splittable = True
        p = fit_with_recompute(
            ctx,
            config,
            boundaries,
            method,
            mode=config.recompute_mode,
            step_to_beat=None if best is None else best.predicted_step_s,
        )
        if p is not None and (best is None or p.predicted_step_s < best.predicted_step_s):
            best = p
    return best if best is not None or splittable else "n/a"


def ratio(p, reference, splittable: bool = True) -> str:
    if p == "n/a" or (p is None and not splittable):
        return "n/a"
    if p is None:
        return "OOM"
    return f"{p.predicted_step_s / reference.predicted_step_s:.2f}"


def config_text(p) -> str:
    recompute = sum(bool(s.recompute) for s in p.stages)
    v = p.num_stages // p.num_rank_groups
    return (
        f"{p.num_rank_groups}x{fmt_replicas(p)}{f' (v={v})' if v > 1 else ''} {p.schedule.value} "
        f"m={p.num_microbatches} rc={recompute}/{p.num_stages}"
    )


def run_case(case: Case, own: bool, plots: Path | None) -> dict:
    captured(case.model, case.seq_len)  # captured once per model, not timed
    start = time.perf_counter()
    ctx = context(case)
    best = best_plan(ctx)
    row = dict(case=case, plan=best, same={}, own={}, splittable={})
    if best is None:
        row["seconds"] = time.perf_counter() - start
        return row
    same = baseline_plans(ctx, best)
    legal = legal_cuts(ctx.graph)
    for method in BASELINES:
        row["same"][method] = same[method]
        row["splittable"][method] = baseline_boundaries(method, ctx.graph, legal, best.num_stages) is not None
        if own:
            row["own"][method] = own_best(ctx, method)
    costs = ctx.costs_at(best.microbatch_size)
    total = float(costs.forward_s.sum() + costs.backward_s.sum()) * best.global_batch_size / best.microbatch_size
    row["efficiency"] = total / ctx.cluster.num_devices / best.predicted_step_s
    if plots is not None and case.plot:
        from partita.report.plots import plan_figure

        result = partita.simulate(best, ctx.costs_at, ctx.cluster)
        plan_figure(best, result, plots / case.plot, baselines=same)
    row["seconds"] = time.perf_counter() - start
    return row


def markdown_row(row: dict, own: bool) -> str:
    c, p = row["case"], row["plan"]
    memory = "" if c.memory_gib is None else f" @{c.memory_gib:g} GiB"
    head = f"| {c.model} | {c.devices} x {c.device}{memory} | {c.global_batch} |"
    if p is None:
        return head + " no plan fits |" + " |" * (6 + 3 + (3 if own else 0))
    same = [ratio(row["same"][m], p, row["splittable"][m]) for m in BASELINES]
    cells = [fmt_seconds(p.predicted_step_s), *same]
    if own:
        cells += [ratio(row["own"][m], p) for m in BASELINES]
    cells += [
        config_text(p),
        f"{p.predicted_bubble_fraction:.1%}",
        f"{row['efficiency']:.1%}",
        f"{row['seconds']:.0f} s",
    ]
    return head + " " + " | ".join(cells) + " |"


def summary(rows: list[dict], own: bool) -> list[str]:
    import statistics

    lines = []
    for kind in ("same", "own") if own else ("same",):
        for method in BASELINES:
            values = [
                r[kind][method].predicted_step_s / r["plan"].predicted_step_s
                for r in rows
                if r["plan"] is not None and r[kind].get(method) not in (None, "n/a")
            ]
            ooms = sum(
                1
                for r in rows
                if r["plan"] is not None and r[kind].get(method) is None and (kind == "own" or r["splittable"][method])
            )
            faster = sum(1 for v in values if v < 1 - 5e-3)
            if values:
                lines.append(
                    f"- {method} ({kind} config): geometric-mean ratio "
                    f"{statistics.geometric_mean(values):.2f}, max {max(values):.2f}, "
                    f"min {min(values):.2f} over {len(values)} rows; OOM in {ooms} rows"
                    + (f"; faster than partita in {faster} rows" if faster else "")
                )
    return lines


def markdown(rows: list[dict], own: bool, command: str) -> str:
    names = {"uniform": "uniform", "parameters": "params", "equal_flops": "eq. FLOPs"}
    headers = ["model", "cluster", "batch", "partita step"] + [f"{names[m]} (same)" for m in BASELINES]
    if own:
        headers += [f"{names[m]} (own)" for m in BASELINES]
    headers += ["partita config (pp x dp, schedule, m, recompute)", "bubble", "efficiency", "time"]
    lines = [
        "# Plan quality: partita vs baseline splits",
        "",
        f"- machine: {platform.node() or 'unknown'}, {platform.machine()}, {os.cpu_count()} CPUs (shared), "
        f"Python {platform.python_version()}",
        f"- torch {torch.__version__}, partita {partita.__version__}",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- command: `{command}`",
        "- models captured on meta (example batch 2, default sequence length: GPT-2 1024 (13b: 2048), T5 512, "
        "Llama 2048, Mixtral 1024; ViT 224x224), planned in partita's default precision (bf16 on the A100 and H100: "
        "bf16 compute, fp32 master weights), analytic costs at the bf16 peak, Adam, 8 devices per "
        "node, 5% of memory reserved; `@N GiB`: memory per device set to N GiB",
        "- ratio = baseline's predicted step / partita's (> 1: partita faster). same: partita's config with the "
        "baseline's split; own: the baseline's split under its own best config. OOM: does not fit even with "
        "recompute; n/a: cannot make that many stages",
        "- config `GxR (v=2) schedule m=M rc=K/S`: G rank groups (pipeline depth) x R replicas (`2+1+1`: per "
        "rank group), v stages per rank group, M micro-batches, K of S stages recomputed. time: this row's planning, baselines and "
        "own-config searches (capture excluded)",
        "",
        "| " + " | ".join(headers) + " |",
        "|"
        + "|".join("---" if h in ("model", "cluster") or h.startswith("partita config") else "---:" for h in headers)
        + "|",
    ]
    lines += [markdown_row(r, own) for r in rows]
    lines += ["", "## Summary", ""] + summary(rows, own)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown here")
    parser.add_argument("--plots", help="folder for the figures of the cases that have one")
    parser.add_argument("--quick", action="store_true", help=f"only rows {sorted(QUICK)}")
    parser.add_argument("--no-own", action="store_true", help="skip the baselines' own-best-config search")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    plots = Path(args.plots) if args.plots else None
    if plots:
        plots.mkdir(parents=True, exist_ok=True)
    cases = [c for i, c in enumerate(CASES) if not args.quick or i in QUICK]
    rows = []
    for case in cases:
        row = run_case(case, not args.no_own, plots)
        print(markdown_row(row, not args.no_own), file=sys.stderr, flush=True)
        rows.append(row)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/plan_quality.py", *(argv or sys.argv[1:])])
    text = markdown(rows, not args.no_own, command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
