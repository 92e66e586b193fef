"""How long does planning take? Capture on meta, analytic costs and the search, timed separately.

Cases (from the "Planner" issue): GPT-2 XL on 8 H100s, a 13 B GPT on 64, and the 175 B GPT-3
shape (96 layers, hidden 12288, sequence 2048) on 1024 H100s in nodes of 8. The target is under
60 s per case on this machine.

  capture   examples.build(..., device="meta") + partita.capture (torch.export on meta)
  costs     every analytic CostTable the planner asks for (one per micro-batch size it tries),
            plus coarsening the graph into the block chain
  search    planning.driver.best_plan less the cost tables it asked for: config enumeration, stage DPs,
            simulating the best candidates and refining them

Usage:  python bench/plan_time.py [--out bench/results/plan_time.md] [--cases gpt2-xl ...] [--profile N]
``--profile N`` adds the N most expensive functions of each search (cProfile, cumulative time), from a
second run of the search, so that profiling does not slow the timed one.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.planning.context import planning_context
from partita.planning.driver import best_plan
from partita.report.format import fmt_replicas

TARGET_S = 60.0

# What the search cost before the speed-ups of 2026-11-30 (same machine, same cases), and what changed;
# the table above this note is measured on every run, this note is not.
HISTORY = """\
## Before the speed-ups (2026-11-30, same machine and cases)

- gpt2-13b on 64: search 80 s; gpt2-gpt3-175b on 1024: killed after 30 min without a plan.
- The profile of the 175 B search: `CostTable.params_in_range` (a Python loop with one
  `np.searchsorted` per parameter, called for every stage of every plan built) took 3/4 of the time;
  then the refinement's hill-climb (about 13 000 splits, each built three times and simulated).
- Changes, each keeping the plan byte for byte (checked against the old code on 8 cases from 4 to 64
  devices, and by tests/unit/test_plan_bounds.py):
  1. `types.CostTable.params_in_range`: one vectorised test over a flat (parameter, use) array.
  2. `planner.finish_plan`: simulate without keeping the timeline (only the step and bubble are used).
  3. `search.search`: skip configs whose parameters and optimizer state, spread over all rank groups,
     exceed the memory limit; with `num_best`, branch and bound over configs sorted by a lower bound
     on the estimate, cut at the `num_best`-th one-stage-per-group candidate (best_plan falls back to
     the full search when fewer than `num_best` plans fit).
  4. `planner.refine`: neighbours ranked by a lower bound on their simulated step (busiest rank group,
     plus pipeline fill and drain for GPipe/1F1B, with the stages that must recompute), skipped once
     the bound cannot beat the best neighbour so far; splits remembered across rounds; a split that
     needs recompute is built twice instead of three times.
"""


@dataclass(frozen=True)
class Case:
    model: str
    devices: int
    global_batch: int
    seq_len: int
    # Example batch of the capture: at least 2, so that export keeps the batch dimension symbolic and
    # costs scale to any micro-batch size (at 1 it specializes, and analytic costs silently stop scaling).
    batch_size: int = 2


CASES = {
    "gpt2-xl": Case("gpt2-xl", 8, 64, 1024),
    "gpt2-13b": Case("gpt2-13b", 64, 512, 2048),
    "gpt2-gpt3-175b": Case("gpt2-gpt3-175b", 1024, 1536, 2048),
}


def run_case(case: Case, profile_top: int) -> dict:
    t0 = time.perf_counter()
    ex = examples.build(case.model, batch_size=case.batch_size, seq_len=case.seq_len, device="meta")
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    capture_s = time.perf_counter() - t0

    cluster = partita.Cluster(device="h100", num_devices=case.devices, devices_per_node=8)
    t0 = time.perf_counter()
    ctx = planning_context(
        graph, cluster=cluster, global_batch_size=case.global_batch, options=partita.PlanOptions(costs="analytic")
    )
    context_s = time.perf_counter() - t0
    # Time every cost table the search asks for separately from the search itself.
    tables: dict[int, object] = {}
    cost_s = [0.0]

    def costs_at(b: int):
        if b not in tables:
            start = time.perf_counter()
            tables[b] = analytic_costs(graph, cluster.device, b, precision=ctx.options.precision)
            cost_s[0] += time.perf_counter() - start
        return tables[b]

    ctx = replace(ctx, costs_at=costs_at)
    t0 = time.perf_counter()
    plan = best_plan(ctx)
    search_s = time.perf_counter() - t0 - cost_s[0]
    row = dict(
        case=case,
        nodes=graph.num_nodes,
        params=graph.num_parameters,
        blocks=len(ctx.chain) - 1,
        capture_s=capture_s,
        costs_s=context_s + cost_s[0],
        tables=len(tables),
        search_s=search_s,
        plan=plan,
        profile="",
    )
    if profile_top:  # a second, profiled run (cost tables cached), so that the timings above stay clean
        profiler = cProfile.Profile()
        profiler.enable()
        best_plan(ctx)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(profile_top)
        row["profile"] = _trim_profile(out.getvalue())
    return row


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return "\n".join(line.replace(root, "") for line in lines[start:] if line.strip())


def config_text(plan) -> str:
    if plan is None:
        return "no plan fits"
    recompute = sum(s.recompute for s in plan.stages)
    return (
        f"{plan.num_rank_groups} x {fmt_replicas(plan)} ({plan.num_devices} dev), {plan.schedule.value}, "
        f"m={plan.num_microbatches}, {plan.num_stages} stages, recompute {recompute}/{plan.num_stages}, "
        f"step {plan.predicted_step_s:.3f} s"
    )


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Planning time",
        "",
        f"- machine: {platform.node() or 'unknown'}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}",
        f"- torch {torch.__version__}, partita {partita.__version__}",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        f"- command: `{command}`",
        "- capture on meta (example batch 2); costs: analytic (H100 catalog entry), the reference table and chain "
        "coarsening, plus one table per micro-batch size the search tries (their number in brackets); search: "
        "`planning.driver.best_plan` less those tables",
        "",
        "| model | devices | global batch | seq | nodes | blocks | capture | costs (tables) | search | total "
        f"| < {TARGET_S:.0f} s | plan |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---|",
    ]
    for r in rows:
        c = r["case"]
        total = r["capture_s"] + r["costs_s"] + r["search_s"]
        lines.append(
            f"| {c.model} | {c.devices} | {c.global_batch} | {c.seq_len} | {r['nodes']:,} | {r['blocks']} "
            f"| {r['capture_s']:.1f} s | {r['costs_s']:.1f} s ({r['tables']}) | {r['search_s']:.1f} s "
            f"| {total:.1f} s | {'yes' if total < TARGET_S else 'no'} | {config_text(r['plan'])} |"
        )
    lines += ["", HISTORY.rstrip()]
    for r in rows:
        if r["profile"]:
            lines += [
                "",
                f"## Profile of the search: {r['case'].model} on {r['case'].devices}",
                "",
                "```",
                r["profile"],
                "```",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="top N functions of each search, from a second (profiled) run",
    )
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.cases:
        row = run_case(CASES[name], args.profile)
        print(
            f"{name}: capture {row['capture_s']:.1f} s, costs {row['costs_s']:.1f} s, "
            f"search {row['search_s']:.1f} s; {config_text(row['plan'])}",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/plan_time.py", *(argv or sys.argv[1:])])
    text = markdown(rows, command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
