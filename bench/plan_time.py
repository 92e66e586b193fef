"""How long does planning take at cluster scale? Capture, cost tables and search, timed separately.

Cases (issue "Planning at cluster scale in seconds"): the GPT-3 175B shape (96 layers, hidden 12288,
sequence 2048) on 1,024 H100s, and Megatron-LM's GPT configurations of 39B to 1T parameters on 512 to
3,072 A100-80GB (``bench/_megatron.py``: Narayanan et al. 2021, Table 1), all in nodes of 8, bf16,
AdamW, analytic costs, every tensor-parallel degree (1, 2, 4, 8), sharding level, schedule,
micro-batch count and recomputation searched (``partita.plan`` with ``PlanOptions(costs="analytic")``).
Goals: under 10 s of search for 175B, under 30 s for the others.

  capture   transformers' GPT-2 class at the shape, built on meta and captured (torch.export)
  layouts   the tensor-parallel rules on the graph, once per degree (``find_layout``)
  tables    every CostTable the search asks for: analytic costs per micro-batch size, and the
            tensor-parallel degrees' per-device tables made from them (their number in brackets)
  search    the rest of ``partita.plan``: coarsening, the memory bound, configs, stage DPs,
            simulating the best candidates and refining them

Each case is captured and planned in a process of its own (as a user plans one model per run).
Each plan's predicted model TFLOP/s per GPU (Megatron's FLOP count without recomputation, over all
GPUs of the cluster) is set beside the paper's achieved figure converted to the same count.

Usage:  python bench/plan_time.py [--out bench/results/plan_time.md] [--cases 175B 39.1B ...] [--profile N]
``--profile N`` adds the N most expensive functions of each planning run (cProfile, cumulative),
from a second run, so that profiling does not slow the timed one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import datetime
import io
import multiprocessing
import os
import platform
import pstats
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _megatron  # noqa: E402
import torch  # noqa: E402

import partita  # noqa: E402
import partita.planning.context as context_module  # noqa: E402
import partita.planning.degree_contexts as degree_contexts_module  # noqa: E402
from partita.errors import InfeasiblePlanError  # noqa: E402
from partita.report.format import fmt_replicas  # noqa: E402

GPT3_175B = _megatron.Row("175B", 96, 12288, 96, 1024, 1536, 0.0, 0, 0)  # GPT-3's shape; no published row
CASES = {
    "175B": (GPT3_175B, "h100", 10.0),
    **{
        name: (_megatron.BY_NAME[name], "a100-80gb", 30.0) for name in ("39.1B", "76.1B", "310.1B", "529.6B", "1008.0B")
    },
}

HISTORY = """\
## Before (same machine)

- 2026-12-07 03:24 UTC (this table): sequence parallelism's ring ops without block copies where a
  block's rows are contiguous, the column-parallel input gradient's reduce-scatter overlapped with
  the weight gradient (``CostTable.split_backward_s``), the norms' gradients summed once per step.
  Search 16.5 s (175B), 10.5, 24.2, 38.6, 20.2 and 27.2 s (1T); captures -2 to +24% against the
  table below. 310B's search grew and missed its goal: its best simulated candidates before
  refinement are now interleaved configs whose split floors lie below the best simulated step,
  so six configs are refined (under the profiler 18.7 s of refinement, 3.9 s before), and it
  keeps another plan (TP 8 x 16 x 15, interleaved 1F1B, 24.47 s; ZB-V 20 x 12, pinned, refines to
  24.28 s, but its search candidates start at 28.7 s and are not among the simulated ones). In
  one period, the code before (551377e) and this one: 310B 18.7 against 31.8 s of search, 175B
  12.4 against 14.9 s.
- 2026-12-07 01:07 UTC: column-parallel matmuls fused with their input's all-gather
  where their blocks are large (``partita::all_gather_matmul``). Search 12.9 s (175B), 11.9, 25.9,
  20.4, 25.2 and 34.2 s (1T): the goals for 175B and 1T missed in a slow hour (captures 26-81% slower
  than at 08:50 below). The same period, the code before (6a87467) and this one alternating, search
  seconds: 175B 17.3, 15.9 s against 13.5, 15.4 s; 1T 36.4 s against 36.4 s: the change costs no
  planning time, the machine was slower.
- 2026-12-06 08:50 UTC: interleaved 1F1B also with 5 stages per rank group, and ZB-V
  candidates held against other degrees' steps without the fill and drain (``search.rounds_s``).
  Search 9.9 s (175B), 8.3, 22.7, 13.6, 17.0 and 28.4 s (1T); captures 8-30% slower than the run
  below (a slower hour). The cost in one period, old code (de913b1) and new alternating, tables +
  search in CPU seconds: 175B 12.0, 10.4, 10.9, 10.1 s against 14.4, 13.1, 13.0, 10.2 s (+17%); 1T
  28.5, 27.3 s against 28.9, 32.7 s (+10%, beside another benchmark). 530B to TP 8 x 21 x 15, 105
  stages (37.96 s predicted, was 39.48), 39.1B to TP 4 x 4 x 32 (9.05 s, was 9.17); the rest the same.
  175B and 1T are near their goals (10 s, 30 s) on this machine's slow hours.
- 2026-12-06 05:52 UTC: every row-parallel matmul under sequence parallelism runs fused
  with its reduce-scatter, around the ring where its blocks are large (`partita/cost/collective_matmul.py`).
  Search 7.5 s (175B), 6.5, 17.8, 10.6, 13.2 and 20.3 s against 6.8, 5.4, 16.7, 10.5, 12.2 and 17.4 s
  before (captures 6-39% slower too: the machine was busier); 310B to TP 8 x 20 x 12 (25.11 s
  predicted, was 25.54), 530B 39.66 -> 39.48 s, 1T 75.17 -> 74.83 s, 39.1B 9.20 -> 9.17 s (m=48).
- 2026-12-06 01:36 UTC: selective recomputation under sequence parallelism keeps each
  row-parallel matmul's token part (fused with its reduce-scatter), and the default chain of a model
  deeper than 112 layers starts a block at every layer (1T: 147 blocks, was 128). 1T 7.9 -> 17.4 s
  of search, to the 64 x 2 interleaved plan (75.17 s predicted, was 76.57 s in 1F1B); 530B
  15.4 -> 12.2 s (39.66 s predicted, was 40.15); the other plans the same.
- 2026-12-05 22:01-23:43 UTC, rank groups of interleaved/ZB-V splits moved until they fit
  (`partita/planning/group_fit.py`), the most even split proposed for them
  (`partition.candidate_partitions(even=True)`) and, for the best config, baseline splits within 5%
  of its refined plan refined too (`refine.SEED_MARGIN`): 7.1 s (175B), 5.3, 16.3, 10.8, 15.4 and 7.9 s. The code before (930c5e4), run
  at 22:01: 6.4 s (175B), 5.0, 14.5, 10.2, 15.9 and 7.4 s of search, the same plans (76B 10.08 s
  predicted, now 10.07 s). Intermediate versions: the even split under every bound 9.1 s (175B);
  the repair before it gave up on groups that overflow by more than the others have left 17.8 s
  (175B) and 31.3 s (530B); the seed margin for every refined config 25.0 s (76B; 25.5 s with a second
  refinement start for the best config besides). Those were changed or dropped for that.
- 2026-12-04, issue 27: interleaved 1F1B searched with 3 stages per rank group too (the table's
  175B, 39B, 310B and 530B plans are such; 8.51 s predicted for 175B, 9.24, 27.50 and 40.81 s,
  against 8.85, 9.33, 27.94 and 42.90 s with 2), with the configs' estimate lower bound counting
  recomputation and the fill and drain exactly. Before that bound, at load 4-14 (other agents'
  full test runs): 16.1 s (175B), 14.2, 32.4, 18.9, 22.6 and 14.9 s of search. CPU seconds of
  ``partita.plan`` (tables + search, graph captured before, twice each), the code before
  (ed7d5b5) / this table's: 175B 9.7, 8.3 / 9.4, 7.9; 1T 11.0, 6.9 / 11.4,
  7.9; 530B 23.9, 19.7 / 20.4, 17.2. The previous table (10:01 UTC): 9.4 s (175B), 5.6, 15.5,
  13.8, 18.3 and 8.6 s.
- 2026-12-04, this table's code (issue 27: the vocabulary split over the tensor-parallel group
  at every hidden size, the analytic backward's traffic) on a VM that ran other agents' jobs on
  both cores (load 3-6; captures 1.5-2x slower than in the 12-02 table): a second full run minutes
  later gave 17.1 s (175B), 6.7, 17.3, 25.1, 25.4 and 29.8 s; 1T alone 18.7 s, and the code
  before the change (f167c30) run right after it 22.3 s. 175B alone, new and old code
  alternating: 17.2 / 9.5 s, 18.0 / 15.3 s; with profiling 13.8 / 6.8 s. Both changes move the
  costs of degree-8 plans closer together, so the search simulates more candidates (175B: 66
  against 52) before the bounds stop it; the 76B plan changed to a 122-stage ZBV plan. The
  12-02 table's plans, for comparison: 175B 10.73 s predicted; 39B the same plan; 76B
  TP 8 x 16 x 8, zbv, 32 stages; 310B and 530B the same meshes (310B recomputed 8 of 15
  stages, now 6); 1T TP 8 x 64 x 6, m=512, 64
  stages, 53 recomputed (110.76 s predicted, 99.84 s now with 32 stages).
- This VM's speed varies from hour to hour: the same code (49820db, before uneven replica counts
  beyond 64 devices, which the table's cases never reach: their degree-1 searches find no plan)
  gave 11.0 s (175B), 8.4, 11.9, 22.2, 31.1 and 29.5 s at 2026-12-02 01:40 UTC, and 5.6 s, 3.9,
  6.5, 14.0, 16.1 and 18.6 s at 05:29 UTC, minutes after the table's run, with the same plans.
- 2026-12-01 22:43 UTC, before the refinement simulated its neighbours without building their
  Plans (``partita/planning/split_steps.py``), with all cases in one process: 10.4 s (175B), 10.1 s,
  12.9 s, 28.4 s, 29.8 s and 45.5 s of search (39B-1T), the same plans as in the table. That code,
  re-run on 2026-12-02 for 175B alone, took 12.2 s: this VM ran slower that day. The same day the
  code of then gave 28.3 s (530B) and 48.8 s (1T), each case alone; today's code re-run for 530B
  alone gave 28.2 s (31.1 s in the table's run: about +-10% between runs).

- Before the search and refinement speed-ups of this table (issue 17), with tensor parallelism not yet
  searched: 6-8 min for 18B-76B on 256-1,024 GPUs (`bench/results/scale_prediction.md`, 13:28 UTC);
  once every tensor-parallel degree was searched, 39B on 512 A100s took over 20 min (killed).
- 2026-12-01 20:01 UTC, before the in-flight memory, stage reach and activation-peak speed-ups
  and the idle-unit replica counts: 16.2 s (175B, TP 8 x 16 x 8 on 1,024), 9.8 s, 18.4 s, 32.8 s,
  42.7 s and 84.2 s of search (39B-1T), the same plans as in the table but 175B's.
- 2026-11-30: gpt2-13b on 64 H100s: 80 s; the 175B shape on 1,024 H100s (fp32, no tensor
  parallelism): killed after 30 min, then 26.5 s of search after the first speed-ups.
"""


class Timers:
    """Seconds spent in the cost tables and the tensor-parallel rules, by wrapping the functions
    that ``partita.planning`` calls for them."""

    def __init__(self) -> None:
        self.tables_s, self.num_tables, self.layouts_s = 0.0, 0, 0.0
        self._saved = []

    def __enter__(self) -> Timers:
        self._wrap(context_module, "analytic_costs", "tables")
        self._wrap(degree_contexts_module, "tensor_parallel_costs", "tables")
        self._wrap(degree_contexts_module, "find_layout", "layouts")
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in self._saved:
            setattr(module, name, original)

    def _wrap(self, module, name: str, kind: str) -> None:
        original = getattr(module, name)
        self._saved.append((module, name, original))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if kind == "tables":
                    self.tables_s += spent
                    self.num_tables += 1
                else:
                    self.layouts_s += spent

        setattr(module, name, timed)


def plan_case(row, graph, device: str):
    cluster = partita.Cluster(device=device, num_devices=row.gpus, devices_per_node=8)
    return partita.plan(
        graph, cluster=cluster, global_batch_size=row.global_batch, options=partita.PlanOptions(costs="analytic")
    )


def run_case(name: str, profile_top: int) -> dict:
    row, device, goal_s = CASES[name]
    start = time.perf_counter()
    graph = _megatron.capture(row)
    capture_s = time.perf_counter() - start
    plan, error = None, None
    with Timers() as timers:
        start = time.perf_counter()
        try:
            plan = plan_case(row, graph, device)
        except InfeasiblePlanError as e:
            error = str(e)
        planning_s = time.perf_counter() - start
    result = dict(
        name=name,
        row=row,
        device=device,
        goal_s=goal_s,
        params=graph.num_parameters,
        nodes=graph.num_nodes,
        capture_s=capture_s,
        layouts_s=timers.layouts_s,
        tables_s=timers.tables_s,
        num_tables=timers.num_tables,
        search_s=planning_s - timers.layouts_s - timers.tables_s,
        plan=plan,
        error=error,
        profile="",
    )
    if profile_top:
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            plan_case(row, graph, device)
        except InfeasiblePlanError:
            pass
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(profile_top)
        result["profile"] = _trim_profile(out.getvalue())
    return result


def _trim_profile(text: str) -> str:
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return "\n".join(line.replace(root, "") for line in lines[start:] if line.strip())


def layout(plan) -> str:
    if plan is None:
        return "no plan fits"
    full = sum(s.recompute.value == "full" for s in plan.stages)
    selective = sum(s.recompute.value == "selective" for s in plan.stages)
    levels = "/".join(sorted({s.sharding.value for s in plan.stages}))
    return (
        f"TP {plan.tensor_parallel}{' + SP' if plan.sequence_parallel else ''} x {plan.num_rank_groups} x "
        f"{fmt_replicas(plan)} ({plan.num_devices} dev), {plan.schedule.value}, m={plan.num_microbatches}, "
        f"{plan.num_stages} stages, recompute full {full} selective {selective}, {levels}"
    )


def tflops_cells(r: dict) -> str:
    row, plan = r["row"], r["plan"]
    if plan is None:
        return "- | - | -"
    predicted = _megatron.model_tflops(row, plan.predicted_step_s, row.gpus)
    if not row.published_tflops:
        return f"{predicted:.0f} | - | -"
    published = _megatron.published_model_tflops(row)
    return f"{predicted:.0f} | {published:.0f} ({row.tp} x {row.pp}) | {predicted / published:.2f}"


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Planning time at cluster scale",
        "",
        f"- machine: {platform.node() or 'unknown'}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs (shared), Python {platform.python_version()}",
        f"- torch {torch.__version__}, partita {partita.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `{command}`",
        "- GPT shapes on meta (vocabulary 51,200, sequence 2048), nodes of 8, bf16, AdamW, analytic costs, "
        "every tensor-parallel degree searched. Columns as in the script's docstring; TFLOP/s: predicted model "
        "TFLOP/s per GPU vs Megatron-LM's published figure at the model count (its TP x PP in brackets)",
        "",
        "| model | params | GPUs | batch | capture | layouts | tables | search | goal | plan | predicted step "
        "| TFLOP/s/GPU | Megatron-LM | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|:-:|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        row, plan = r["row"], r["plan"]
        met = "yes" if r["search_s"] < r["goal_s"] else "no"
        step = f"{plan.predicted_step_s:.2f} s" if plan is not None else "-"
        lines.append(
            f"| {r['name']} | {r['params'] / 1e9:.0f} B | {row.gpus:,} {r['device']} | {row.global_batch} "
            f"| {r['capture_s']:.1f} s | {r['layouts_s']:.1f} s | {r['tables_s']:.1f} s ({r['num_tables']}) "
            f"| {r['search_s']:.1f} s | {met} (< {r['goal_s']:.0f} s) | {layout(plan)} | {step} | {tflops_cells(r)} |"
        )
    for r in rows:
        if r["error"]:
            lines += ["", f"{r['name']}: {r['error']}"]
    lines += ["", HISTORY.rstrip()]
    for r in rows:
        if r["profile"]:
            lines += ["", f"## Profile: {r['name']} on {r['row'].gpus}", "", "```", r["profile"], "```"]
    return "\n".join(lines) + "\n"


def _in_own_process(name: str, profile_top: int) -> dict:
    """``run_case`` in a fresh process, as a user plans one model per run: what an earlier case left
    behind (module-level caches, a heap of hundreds of thousands of objects) slowed the next case's
    search by up to a fifth."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=_one_thread) as pool:
        return pool.submit(run_case, name, profile_top).result()


def _one_thread() -> None:
    torch.set_num_threads(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="top N functions, from a second run")
    parser.add_argument("--out", help="write the markdown table here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/plan_time.py", *(argv or sys.argv[1:])])
    rows = []
    for name in args.cases:
        rows.append(_in_own_process(name, args.profile))
        r = rows[-1]
        print(
            f"{name}: capture {r['capture_s']:.1f} s, layouts {r['layouts_s']:.1f} s, tables {r['tables_s']:.1f} s, "
            f"search {r['search_s']:.1f} s; {layout(r['plan'])}",
            file=sys.stderr,
            flush=True,
        )
        if args.out:  # written after every case: a long run keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
