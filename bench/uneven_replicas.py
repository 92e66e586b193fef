"""What do uneven replica counts per stage buy? (``partita.plan``'s default against ``uniform_replicas=True``)

For zoo models built on ``meta`` and costed analytically (as in plan_quality.py), it plans each
case four ways and reports the predicted steps:

  uniform         the search over pp x dp meshes (every schedule): ``uniform_replicas=True``;
  uneven          the same search plus stages with their own replica counts (GPipe/1F1B only): the
                  default up to 64 devices (``uniform_replicas=False`` here, to say it explicitly);
  uniform 1F1B    the uniform search restricted to GPipe and 1F1B;
  uneven 1F1B     the uneven search restricted to GPipe and 1F1B: against "uniform 1F1B" it shows
                  the device axis alone, without the zero-bubble schedules uneven plans cannot use.

A ratio is uniform step / uneven step (> 1: the uneven search found a faster plan). The cases
mix device counts that are no good pp x dp product (6, 12) with powers of two, and memory
limits that force pipelining. Everything is predicted; nothing runs on a GPU.

Usage:  python bench/uneven_replicas.py [--out bench/results/uneven_replicas.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _e2e_common import command_line, machine_line, now_utc  # noqa: E402
from plan_quality import GIB, Case, captured  # noqa: E402

import partita  # noqa: E402
from partita.planning.context import planning_context  # noqa: E402
from partita.planning.driver import best_plan  # noqa: E402
from partita.report.format import fmt_replicas, fmt_seconds  # noqa: E402
from partita.types import Schedule  # noqa: E402

CASES = [
    Case("gpt2-355m", "h100", 6, 96, memory_gib=4),
    Case("gpt2-xl", "h100", 6, 96, memory_gib=16),
    Case("gpt2-xl", "h100", 8, 128, memory_gib=16),
    Case("gpt2-xl", "h100", 12, 96, memory_gib=16),
    Case("t5-large", "a100-80gb", 6, 96, memory_gib=8),
    Case("vit-large", "a100-80gb", 6, 384, memory_gib=6),
    Case("llama-7b", "h100", 12, 96, memory_gib=40),
]
PIPELINE_ONLY = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def plan_case(case: Case, *, uniform: bool, schedules) -> tuple[partita.Plan | None, float]:
    graph = captured(case.model, case.seq_len)
    per_node = max(d for d in range(1, 9) if case.devices % d == 0)  # 12 devices: 3 nodes of 4
    cluster = partita.Cluster(
        device=case.device,
        num_devices=case.devices,
        devices_per_node=per_node,
        memory_bytes=None if case.memory_gib is None else int(case.memory_gib * GIB),
    )
    start = time.perf_counter()
    options = partita.PlanOptions(
        schedules=tuple(Schedule) if schedules is None else schedules, uniform_replicas=uniform, costs="analytic"
    )
    ctx = planning_context(graph, cluster=cluster, global_batch_size=case.global_batch, options=options)
    return best_plan(ctx), time.perf_counter() - start


def layout(p) -> str:
    if p is None:
        return "none fits"
    recompute = sum(bool(s.recompute) for s in p.stages)
    v = p.num_stages // p.num_rank_groups
    return (
        f"{p.num_rank_groups}x{fmt_replicas(p)}{f' (v={v})' if v > 1 else ''} {p.schedule.value} "
        f"m={p.num_microbatches} rc={recompute}/{p.num_stages}"
    )


def ratio(reference, p) -> str:
    if reference is None or p is None:
        return "-"
    return f"{reference.predicted_step_s / p.predicted_step_s:.2f}"


def step(p) -> str:
    return "-" if p is None else fmt_seconds(p.predicted_step_s)


def run_case(case: Case) -> dict:
    captured(case.model, case.seq_len)  # not timed
    row = {"case": case}
    for name, uniform, schedules in (
        ("uniform", True, None),
        ("uneven", False, None),
        ("uniform_pipe", True, PIPELINE_ONLY),
        ("uneven_pipe", False, PIPELINE_ONLY),
    ):
        row[name], row[name + "_s"] = plan_case(case, uniform=uniform, schedules=schedules)
    return row


def markdown_row(row: dict) -> str:
    c = row["case"]
    cluster = f"{c.devices} x {c.device}" + (f" @{c.memory_gib:g} GiB" if c.memory_gib is not None else "")
    return (
        f"| {c.model} | {cluster} | {c.global_batch} "
        f"| {step(row['uniform'])} | {step(row['uneven'])} | {ratio(row['uniform'], row['uneven'])} "
        f"| {layout(row['uneven'])} "
        f"| {step(row['uniform_pipe'])} | {step(row['uneven_pipe'])} | {ratio(row['uniform_pipe'], row['uneven_pipe'])} "
        f"| {layout(row['uniform_pipe'])} | {layout(row['uneven_pipe'])} "
        f"| {row['uniform_s']:.0f} s / {row['uneven_s']:.0f} s |"
    )


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Uneven replica counts per stage: uniform vs uneven search",
        "",
        f"- machine: {machine_line()}; partita {partita.__version__}",
        f"- date: {now_utc()}",
        f"- command: `{command_line()}`",
        "- models captured on meta, analytic costs in partita's default precision (bf16 on the A100 and H100), Adam, nodes of 8 devices (6 devices: one node; 12: 2 nodes of 6); "
        "`@N GiB`: memory per device",
        "- ratio = uniform step / uneven step (> 1: uneven faster). Layout `GxR...`: G rank groups with R replicas "
        "each (`2+1+3`: per rank group). `pipe`: schedules GPipe and 1F1B only. time: planning without capture, "
        "uniform / uneven (all schedules)",
        "",
        "| model | cluster | batch | uniform | uneven | ratio | uneven layout | uniform pipe | uneven pipe | ratio "
        "| uniform pipe layout | uneven pipe layout | time |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|",
        *(markdown_row(r) for r in rows),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the markdown here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for case in CASES:
        row = run_case(case)
        print(markdown_row(row), file=sys.stderr, flush=True)
        rows.append(row)
    text = markdown(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
