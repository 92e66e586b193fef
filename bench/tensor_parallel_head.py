"""The vocab-parallel LM head on this machine: GPT-2 small with GPT-2's 50k vocabulary on 2 ranks.

With a 50,257-token vocabulary the LM head and its cross-entropy are one matmul node holding most
of the compute of ``gpt2-small-v50k`` (8 layers, hidden 256), so no cut into pipeline stages
balances it. Side by side, on 2 ranks x 1 thread (gloo, separate processes), fp32, AdamW:

  partita, tensor parallel   ``partita.plan`` with ``tensor_parallel=2``: every matmul pair, the
                             embedding and the head + loss split over both ranks (measured costs);
  partita, searched          ``partita.plan`` with nothing pinned (it picks the degree itself);
  best node-cut pipeline     ``partita.plan`` with ``tensor_parallel=1, replicas=1``: the best cut
                             into stages (2 stages, 1 replica each), micro-batches and schedule;
  data parallel              ``partita.plan`` with ``tensor_parallel=1, num_stages=1, replicas=2``.

All run in the same two processes, interleaved step by step in an order rotated every round
(sharding_throughput.py's worker); ``--warmup`` rounds dropped, ``--rounds`` timed. Ratios are
medians of within-round ratios to the tensor-parallel plan; the planner's predicted step is beside
each. tests/dist/test_tensor_parallel.py checks the numbers are exact; this is timing only.

Usage: python bench/tensor_parallel_head.py [--rounds 5] [--warmup 1] [--global-batch 8]
                                            [--out bench/results/tensor_parallel_head.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _e2e_common import REPO, command_line, machine_line, now_utc, run_ranks  # noqa: E402
from sharding_throughput import plan_model, worker  # noqa: E402

MODEL = "gpt2-small-v50k"
PINS = {
    "partita, tensor parallel": {"tensor_parallel": 2},
    "partita, searched": {},
    "best node-cut pipeline": {"tensor_parallel": 1, "replicas": 1},
    "data parallel": {"tensor_parallel": 1, "num_stages": 1, "replicas": 2},
}


def write_markdown(path: Path, args, header: str, info: dict, times: dict, started: float) -> None:
    base = times["partita, tensor parallel"]
    lines = [
        "# The vocab-parallel LM head: tensor parallelism vs node cuts and data parallelism on 2 ranks",
        "",
        f"- command: `{command_line()}`",
        f"- date: {now_utc()}; {header}",
        f"- model: {MODEL} ({info['num_parameters'] / 1e6:.1f} M parameters), global batch {args.global_batch}, "
        f"fp32, AdamW, measured costs, budget {args.budget_mib} MiB per rank for the planner; 2 ranks x 1 thread, "
        f"gloo on loopback; interleaved rounds (order rotated), {args.warmup} warm-up dropped, {args.rounds} timed; "
        "step = the slower rank's. `vs TP`: median of within-round ratios (> 1: slower than the tensor-parallel plan).",
        f"- wall time: {(time.perf_counter() - started) / 60:.1f} min.",
        "",
        "| method | configuration | step (median) | samples/s | vs TP | predicted step | predicted / measured |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label in PINS:
        plan = info["plans"].get(label)
        if plan is None or label not in times:
            lines.append(f"| {label} | no plan fits the budget | | | | | |")
            continue
        median = statistics.median(times[label])
        ratio = statistics.median(t / b for t, b in zip(times[label], base))
        lines.append(
            f"| {label} | {plan['config']} | {median:.3f} s | {args.global_batch / median:.1f} | {ratio:.2f}x "
            f"| {plan['predicted_s']:.3f} s | {plan['predicted_s'] / median:.2f} |"
        )
    lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--budget-mib", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=2400)
    parser.add_argument("--cache-dir", default=".partita-cache/e2e")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/partita-tensor-parallel-head"))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/tensor_parallel_head.md")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    started, header = time.perf_counter(), machine_line()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    info = plan_model(MODEL, args, args.work_dir, PINS)
    for label, plan in info["plans"].items():
        print(f"{label}: {plan and plan['config']} predicted {plan and round(plan['predicted_s'], 3)} s", flush=True)
    plans = {label: p["path"] for label, p in info["plans"].items() if p is not None}
    out = run_ranks(
        Path(__file__).with_name("sharding_throughput.py"),
        2,
        args.work_dir / MODEL,
        timeout_s=args.timeout,
        model=MODEL,
        plans=plans,
        plain=(),
        global_batch=args.global_batch,
        warmup=args.warmup,
        rounds=args.rounds,
    )
    write_markdown(args.out, args, header, info, out[0]["times"], started)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
