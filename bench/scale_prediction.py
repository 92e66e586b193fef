"""What partita predicts at cluster scale: GPT models of 1.7 B to 1 T parameters on 32 to 3,072 A100s.

The configurations of Megatron-LM's scaling table (Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", SC21, arXiv:2104.04473, Table 1): GPT with
vocabulary 51,200, sequence 2048, the paper's hidden size, heads, layers, GPU count and global batch,
on A100-80GB in nodes of 8 (the catalog's A100: 312 TFLOP/s dense bf16, NVLink in a node,
InfiniBand between nodes). Each model is captured on ``meta`` (transformers' GPT-2 class at those
shapes) and planned with analytic costs in bf16 (``partita.plan``: every tensor-parallel degree,
sharding level, schedule, micro-batch count and recomputation searched).

Beside it, Megatron's own layout of the row under the same model and cost model (its TP, PP,
micro-batch size and interleaving, every stage recomputed: ``bench/megatron_calibration.py``, which
checks those predictions against the steps the paper measured); "vs Megatron" is that step over
partita's (> 1: partita's plan is predicted faster).

Reported: the predicted step, and the model FLOP/s per GPU it implies over ALL GPUs of the cluster
(idle ones included), with Megatron's count of a step's FLOPs *without* recomputation,
``72 B s l h^2 (1 + s / 6h) + 6 B s h V``. The paper reports FLOP/s with full activation
recomputation counted (``96 B s l h^2 (1 + s / 6h) + 6 B s h V``); its figures are converted to the
model count (the ratio of the two formulas) for the comparison. Published figures are the paper's
Table 1 as cited here, not re-measured.

Usage: python bench/scale_prediction.py [--rows 1.7B,7.5B,...] [--out bench/results/scale_prediction.md]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _megatron import ROWS, Row, capture, model_tflops, published_model_tflops  # noqa: E402
from megatron_calibration import layout_inputs  # noqa: E402

import partita  # noqa: E402
from partita.planning.simulate import simulate_pipeline  # noqa: E402


def plan_row(row: Row) -> dict:
    started = time.perf_counter()
    graph = capture(row)
    captured = time.perf_counter() - started
    cluster = partita.Cluster(device="a100-80gb", num_devices=row.gpus, devices_per_node=8)
    plan = partita.plan(
        graph, cluster=cluster, global_batch_size=row.global_batch, options=partita.PlanOptions(costs="analytic")
    )
    planned = time.perf_counter() - started - captured
    _, inputs = layout_inputs(graph, row, cluster)
    _, selective_inputs = layout_inputs(graph, row, cluster, selective=True)
    return {
        "row": row,
        "params": graph.num_parameters,
        "plan": plan,
        "megatron_step_s": simulate_pipeline(**inputs, keep_timeline=False).step_s,
        "megatron_selective_step_s": simulate_pipeline(**selective_inputs, keep_timeline=False).step_s,
        "model_tflops": model_tflops(row, plan.predicted_step_s, row.gpus),
        "published_model": published_model_tflops(row),
        "capture_s": captured,
        "plan_s": planned,
    }


def layout(plan) -> str:
    from partita.report.format import fmt_replicas

    levels = sorted({s.sharding.value for s in plan.stages})
    full = sum(s.recompute.value == "full" for s in plan.stages)
    selective = sum(s.recompute.value == "selective" for s in plan.stages)
    return (
        f"TP {plan.tensor_parallel} x {plan.num_rank_groups} x {fmt_replicas(plan)} ({plan.num_devices} dev), "
        f"{plan.schedule.value}, "
        f"m={plan.num_microbatches}, {plan.num_stages} stages, recompute full {full} selective {selective} "
        f"of {plan.num_stages}, {'sequence parallel, ' if plan.sequence_parallel else ''}"
        f"{'/'.join(levels)}, {plan.precision.value}"
    )


def write(path: Path, results: list[dict], started: float) -> None:
    lines = [
        "# Scale prediction: partita's plans for Megatron-LM's GPT configurations",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
        f"wall time {(time.perf_counter() - started) / 60:.1f} min",
        "- GPT, vocabulary 51,200, sequence 2048, A100-80GB (catalog: 312 TFLOP/s bf16) in nodes of 8, bf16, "
        "AdamW, analytic costs; shapes, GPU counts and global batches of Megatron-LM's Table 1 (arXiv:2104.04473).",
        "- model TFLOP/s per GPU: `72 B s l h^2 (1 + s/6h) + 6 B s h V` per step / (predicted step x GPUs of the "
        "cluster). Published: the paper's TFLOP/s per GPU (counted with recomputation, `96 B s l h^2 ...`), and "
        "the same converted to the model count.",
        "- Megatron's layout: its TP x PP x DP, micro-batch size and interleaving (v chunks per rank), every stage "
        "recomputed (as in the paper), simulated under the same model and costs; vs Megatron = its step / "
        "partita's step. Megatron 2022: the same layout with sequence parallelism and selective recomputation "
        "(Korthikanti et al., arXiv:2205.05198, as Megatron-LM runs today), same model.",
        "",
        "| model | params | GPUs | batch | partita's plan | predicted step | predicted model TFLOP/s/GPU | "
        "Megatron-LM (TP x PP) | Megatron's layout, predicted | vs Megatron | Megatron 2022, predicted | "
        "vs Megatron 2022 | "
        "published TFLOP/s/GPU (with recompute) | published, model count | ratio | capture + plan |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        row, plan = r["row"], r["plan"]
        lines.append(
            f"| {row.name} | {r['params'] / 1e9:.2f} B | {row.gpus} | {row.global_batch} | {layout(plan)} | "
            f"{plan.predicted_step_s:.2f} s | {r['model_tflops']:.0f} | {row.tp} x {row.pp} | "
            f"{r['megatron_step_s']:.2f} s (mbs {row.microbatch_size}, v {row.virtual_stages}) | "
            f"**{r['megatron_step_s'] / plan.predicted_step_s:.2f}x** | {r['megatron_selective_step_s']:.2f} s | "
            f"**{r['megatron_selective_step_s'] / plan.predicted_step_s:.2f}x** | {row.published_tflops:.0f} | {r['published_model']:.0f} | {r['model_tflops'] / r['published_model']:.2f} | "
            f"{r['capture_s']:.0f} + {r['plan_s']:.0f} s |"
        )
    lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(r.name for r in ROWS))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results/scale_prediction.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    wanted = args.rows.split(",")
    results = []
    for row in ROWS:
        if row.name not in wanted:
            continue
        result = plan_row(row)
        results.append(result)
        print(
            f"{row.name}: {layout(result['plan'])}, step {result['plan'].predicted_step_s:.2f} s, "
            f"{result['model_tflops']:.0f} model TFLOP/s/GPU (published {result['published_model']:.0f}), "
            f"Megatron's layout {result['megatron_step_s']:.2f} s, "
            f"with sequence parallelism + selective recomputation {result['megatron_selective_step_s']:.2f} s",
            flush=True,
        )
        write(args.out, results, started)
    print(args.out.read_text())


if __name__ == "__main__":
    main()
