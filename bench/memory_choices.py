"""What the planner chooses as memory tightens: recomputing some of a stage's blocks
(``StagePlan.recompute_blocks``) and accumulating a sharded stage's gradients in shards
(``StagePlan.accumulation``), with each plan's predicted memory and step.

- GPT-2 small (8 layers, 128 tokens), one H100 of the given memory (nothing reserved), fp32, global
  batch 8, one 1F1B stage of one micro-batch: the recomputation level and blocks the plan takes.
- The same model fully sharded over 2 H100s, 1F1B, 4 micro-batches, no recomputation: whole or
  sharded gradient accumulation.

Analytic costs: the same plans on every machine. Usage: python bench/memory_choices.py [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _e2e_common import MIB, REPO, command_line, now_utc  # noqa: E402

import partita  # noqa: E402
from partita import examples  # noqa: E402
from partita.errors import InfeasiblePlanError  # noqa: E402
from partita.planning.options import PlanOptions  # noqa: E402
from partita.types.cluster import Cluster  # noqa: E402

RECOMPUTE_MIB = (2000, 400, 350, 300, 250, 220, 200)
ACCUMULATION_MIB = (400, 195, 190, 185, 180, 175)


def _plan(graph, devices: int, mib: float, **pins):
    cluster = Cluster(device="h100", num_devices=devices, memory_bytes=int(mib * MIB), reserved_memory_fraction=0.0)
    options = PlanOptions(costs="analytic", schedules="1f1b", num_stages=1, precision="fp32", **pins)
    try:
        return partita.plan(graph, cluster=cluster, global_batch_size=8 * devices, options=options)
    except InfeasiblePlanError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "memory_choices.md")
    args = parser.parse_args()
    ex = examples.build("gpt2-small", batch_size=8, seq_len=128)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    lines = [
        "# What the planner chooses as memory tightens: blocks recomputed, gradients accumulated in shards",
        "",
        f"- command: `{command_line()}`",
        f"- date: {now_utc()}; analytic costs (the same plans on every machine)",
        "- model: GPT-2 small (8 layers, hidden 768, 128 tokens), fp32, AdamW, one 1F1B stage, nothing reserved.",
        "",
        "## Recomputation: one H100, 1 replica, 1 micro-batch of 8",
        "",
        "| memory MiB | recompute | blocks recomputed | predicted peak MiB | predicted step ms |",
        "|---:|---|---:|---:|---:|",
    ]
    for mib in RECOMPUTE_MIB:
        plan = _plan(graph, 1, mib, replicas=1, num_microbatches=1)
        if plan is None:
            lines.append(f"| {mib} | does not fit | - | - | - |")
            continue
        s = plan.stages[0]
        blocks = "all" if s.recompute_blocks is None and s.recompute.value != "none" else (s.recompute_blocks or 0)
        lines.append(
            f"| {mib} | {s.recompute.value} | {blocks} of {s.blocks} | {s.memory_bytes / MIB:.0f} | "
            f"{plan.predicted_step_s * 1e3:.2f} |"
        )
    lines += [
        "",
        "## Gradient accumulation: 2 H100s, full_shard, 4 micro-batches of 2, no recomputation",
        "",
        "| memory MiB | accumulation | predicted peak MiB | grads MiB | predicted step ms |",
        "|---:|---|---:|---:|---:|",
    ]
    for mib in ACCUMULATION_MIB:
        plan = _plan(graph, 2, mib, replicas=2, num_microbatches=4, sharding="full_shard", recompute="none")
        if plan is None:
            lines.append(f"| {mib} | does not fit | - | - | - |")
            continue
        s = plan.stages[0]
        lines.append(
            f"| {mib} | {s.accumulation.value} | {s.memory_bytes / MIB:.0f} | "
            f"{s.memory_breakdown.grads_bytes / MIB:.0f} | {plan.predicted_step_s * 1e3:.2f} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
