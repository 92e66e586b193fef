"""How long does "nothing fits" take? Requests that cannot fit, answered by the memory bound.

Cases: Megatron-LM's GPT shapes (Narayanan et al., SC21, arXiv:2104.04473, Table 1; vocabulary 51,200,
sequence 2048) on A100-80GB in nodes of 8, bf16, AdamW, analytic costs, captured on ``meta``
(transformers' GPT-2 class at those shapes, as bench/scale_prediction.py builds them):

  1t-3072-tp1   1T (128 layers, hidden 25600) on 3,072 GPUs, batch 3072, tensor_parallel=1 pinned
  530b-64       530B (105 layers, hidden 20480) on 64 GPUs, batch 2520, every degree searched
  1t-3072-zbv   1T on 3,072 GPUs, batch 3072, schedules=("zbv",) pinned: the bound lets it through,
                the search finds nothing (ZBV never recomputes), and the fixes are checked by
                planning with them, within the checks' budget (``partita.planning.infeasible``)

For each: capture (torch.export on meta), then ``partita.plan`` until it raises InfeasiblePlanError
(context, memory bound, the error's checked fixes), timed separately; the error's text; and each fix
the error names, checked again here by re-running the bound with it applied. ``--plan-fix CASE ...``
also plans those cases with their first fix (the full search; minutes on these shapes).

Usage: python bench/infeasible_time.py [--cases 1t-3072-tp1 530b-64 1t-3072-zbv] [--plan-fix 1t-3072-tp1]
       [--out bench/results/infeasible_time.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _megatron  # noqa: E402
import torch  # noqa: E402

import partita  # noqa: E402
from partita.planning.context import planning_context  # noqa: E402
from partita.planning.degree_contexts import degree_contexts  # noqa: E402
from partita.planning.infeasible import memory_bound  # noqa: E402

TARGET_S = 15.0


@dataclass(frozen=True)
class Case:
    name: str
    shape: str  # a row of bench/_megatron.py
    gpus: int
    global_batch: int
    tensor_parallel: int | None
    schedules: tuple[str, ...] | None = None


CASES = {
    c.name: c
    for c in (
        Case("1t-3072-tp1", "1008.0B", 3072, 3072, 1),
        Case("530b-64", "529.6B", 64, 2520, None),
        Case("1t-3072-zbv", "1008.0B", 3072, 3072, None, ("zbv",)),
    )
}


def capture(case: Case):
    return _megatron.capture(_megatron.BY_NAME[case.shape])


def run_case(case: Case, plan_fix: bool) -> dict:
    started = time.perf_counter()
    graph = capture(case)
    capture_s = time.perf_counter() - started
    cluster = partita.Cluster(device="a100-80gb", num_devices=case.gpus, devices_per_node=8)
    options = partita.PlanOptions(costs="analytic", tensor_parallel=case.tensor_parallel)
    if case.schedules is not None:
        options = options.replace(schedules=case.schedules)
    started = time.perf_counter()
    try:
        partita.plan(graph, cluster=cluster, global_batch_size=case.global_batch, options=options)
        error = None
    except partita.InfeasiblePlanError as e:
        error = e
    answer_s = time.perf_counter() - started
    row = dict(case=case, params=graph.num_parameters, capture_s=capture_s, answer_s=answer_s, error=error, checks=[])
    if error is None:
        return row
    for fix in error.fixes:  # each fix once more, by the bound, outside the planner
        row["checks"].append((fix, _bound_lets_through(graph, cluster, case, options, fix)))
    if plan_fix and error.fixes:
        row["plan_fix"] = _plan_with(graph, cluster, case, options, error.fixes[0])
    return row


def _applied(cluster, case: Case, options, fix):
    batch, changes = case.global_batch, dict(fix.changes)
    devices = changes.pop("num_devices", case.gpus)
    memory = changes.pop("memory_bytes", None)
    batch = changes.pop("global_batch_size", batch)
    cluster = partita.Cluster(device="a100-80gb", num_devices=devices, devices_per_node=8, memory_bytes=memory)
    return cluster, batch, options.replace(**changes)


def _bound_lets_through(graph, cluster, case: Case, options, fix) -> bool:
    cluster, batch, options = _applied(cluster, case, options, fix)
    ctx = planning_context(graph, cluster=cluster, global_batch_size=batch, options=options)
    return any(memory_bound(c).may_fit() for c in degree_contexts(ctx, options.tensor_parallel))


def _plan_with(graph, cluster, case: Case, options, fix) -> str:
    cluster, batch, options = _applied(cluster, case, options, fix)
    started = time.perf_counter()
    try:
        p = partita.plan(graph, cluster=cluster, global_batch_size=batch, options=options)
        outcome = f"plan: TP {p.tensor_parallel}, {p.num_rank_groups} rank groups, step {p.predicted_step_s:.2f} s"
    except partita.InfeasiblePlanError as e:
        outcome = f"still infeasible: {str(e)[:200]}"
    return f"{outcome} ({time.perf_counter() - started:.0f} s)"


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Infeasible requests: time to the answer",
        "",
        f"- machine: {platform.node() or 'unknown'}, {os.cpu_count()} CPUs (shared), Python {platform.python_version()}, "
        f"torch {torch.__version__}, partita {partita.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- command: `{command}`",
        "- GPT shapes of Megatron-LM's Table 1 (vocabulary 51,200, sequence 2048) captured on meta; A100-80GB in "
        "nodes of 8, bf16, AdamW, analytic costs. *answer*: `partita.plan` from the captured graph until "
        "InfeasiblePlanError (context, memory bound, the error with its checked fixes). Each fix is checked "
        "again here: the bound re-run with it applied (a fresh planning context) lets the request through.",
        "",
        f"| case | parameters | GPUs | batch | pinned | capture | answer | < {TARGET_S:.0f} s | refused without search "
        "| binding | fixes (checked by) | fixes re-checked |",
        "|---|---:|---:|---:|---:|---:|---:|:-:|:-:|---|---|:-:|",
    ]
    for r in rows:
        c, e = r["case"], r["error"]
        fixes = "; ".join(f"`{_changes(f)}` ({f.checked_by})" for f in e.fixes) if e else "plan found"
        rechecked = "yes" if e and all(ok for _, ok in r["checks"]) else "no"
        lines.append(
            f"| {c.name} | {r['params'] / 1e9:.0f} B | {c.gpus:,} | {c.global_batch} | {_pins(c)} "
            f"| {r['capture_s']:.0f} s | {r['answer_s']:.1f} s | {'yes' if r['answer_s'] < TARGET_S else 'no'} "
            f"| {'yes' if e and e.refused_by_bound else 'no'} | {e.binding if e else '-'} | {fixes} | {rechecked} |"
        )
    for r in rows:
        if r["error"] is None:
            continue
        lines += ["", f"## {r['case'].name}: the error", "", "```"]
        lines += textwrap.wrap(str(r["error"]), 110, break_on_hyphens=False)
        lines += ["```"]
        if "plan_fix" in r:
            fix = r["error"].fixes[0]
            lines += ["", f"Planning with the first fix (`{_changes(fix)}`): {r['plan_fix']}"]
    return "\n".join(lines) + "\n"


def _pins(case: Case) -> str:
    pins = [f"TP {case.tensor_parallel}"] if case.tensor_parallel else []
    pins += [f"schedules {'/'.join(case.schedules)}"] if case.schedules else []
    return ", ".join(pins) or "-"


def _changes(fix) -> str:
    def shown(value) -> str:
        if isinstance(value, tuple):
            return "/".join(shown(v) for v in value)
        return str(getattr(value, "value", value))

    return ", ".join(f"{k}={shown(v)}" for k, v in fix.changes.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--plan-fix", nargs="*", default=[], metavar="CASE", help="also plan with these cases' first fix (slow)"
    )
    parser.add_argument("--out", help="write the markdown here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.cases:
        row = run_case(CASES[name], name in args.plan_fix)
        print(f"{name}: capture {row['capture_s']:.0f} s, answer {row['answer_s']:.1f} s", file=sys.stderr, flush=True)
        rows.append(row)
    command = "python " + " ".join(shlex.quote(a) for a in ["bench/infeasible_time.py", *(argv or sys.argv[1:])])
    text = markdown(rows, command)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
