"""The incumbents' standard layouts, pinned through PlanOptions: do they fit, and what does partita predict?

1. torchtitan's Llama 3.1 8B on 8 H100s (``docs/performance.md``, Table 1): FSDP2 over the 8 GPUs
   (one ``fully_shard`` per TransformerBlock), global batch 16 x 8,192 tokens (local batch 2),
   selective activation checkpointing, bf16; measured 5,762 tokens/s/GPU eager (82.4 GiB peak) and
   6,667 compiled (77.0 GiB). Asked of partita as stated: HF ``LlamaConfig`` (32 layers, hidden 4096,
   FFN 14336, 32 heads / 8 KV heads, vocabulary 128,256, SDPA attention), sequence 8192,
   ``Cluster(device="h100", num_devices=8, memory_bytes=96 GiB)``, ``PlanOptions(num_stages=1,
   replicas=8, sharding="full_shard", precision="bf16")``; then with selective recomputation pinned
   (torchtitan's choice), and partita's free plan on the same cluster.
2. Megatron-LM's SC21 layouts of 1.7B-18.4B (``bench/_megatron.py``, Table 1 and
   ``examples/sc21/run_table_1.sh``) on 80 GB A100s, pinned as Megatron ran them: one stage,
   tensor-parallel degree t, d = GPUs / t replicas (replicated: DDP), micro-batches from Megatron's
   micro-batch size, full recomputation, no sequence parallelism, bf16, 1F1B; predicted against the
   step the paper measured (``96 B s l h^2 (1 + s/6h) + 6 B s h V`` / (published TFLOP/s x GPUs)).

Before blocks became the unit of execution (issue 56), partita refused all five: a sharded stage was
one FSDP2 unit (the whole stage gathered at once) and recomputation rebuilt the whole stage at once.

Usage: python bench/standard_layouts.py [--out bench/results/standard_layouts.md]
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _megatron  # noqa: E402
import torch  # noqa: E402

import partita  # noqa: E402
from partita.errors import InfeasiblePlanError  # noqa: E402

GiB = 2**30
TORCHTITAN_EAGER, TORCHTITAN_COMPILED = 5762, 6667  # tokens/s/GPU, docs/performance.md Table 1
TORCHTITAN_PEAK_GIB = 82.4
SEQ, GLOBAL_BATCH, GPUS = 8192, 16, 8
MEGATRON_ROWS = ["1.7B", "3.6B", "7.5B", "18.4B"]


def llama_8b() -> partita.OpGraph:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=SEQ,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        use_cache=False,
        attention_dropout=0.0,
        attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.zeros(2, SEQ, dtype=torch.long, device="meta")
    return partita.capture(model, kwargs=dict(input_ids=ids, labels=ids))


def torchtitan_rows(graph: partita.OpGraph) -> list[str]:
    cluster = partita.Cluster(device="h100", num_devices=GPUS, memory_bytes=96 * GiB)
    pinned = dict(num_stages=1, replicas=GPUS, sharding="full_shard", precision="bf16")
    cases = [  # each against torchtitan's measurement of the same execution: eager or compiled
        ("as stated (pinned FSDP), eager", {**pinned, "compile": False}),
        ("+ selective recomputation pinned, eager", {**pinned, "recompute": "selective", "compile": False}),
        ("as stated, compiled blocks", {**pinned, "compile": True}),
        ("partita's free plan (compiled blocks)", dict(precision="bf16")),
    ]
    rows = []
    for label, options in cases:
        measured = TORCHTITAN_EAGER if options.get("compile") is False else TORCHTITAN_COMPILED
        started = time.perf_counter()
        try:
            plan = partita.plan(
                graph, cluster=cluster, global_batch_size=GLOBAL_BATCH, options=partita.PlanOptions(**options)
            )
        except InfeasiblePlanError as e:
            rows.append(f"| {label} | refused: {str(e)[:160]} | | | | | | |")
            continue
        planning_s = time.perf_counter() - started
        tokens = GLOBAL_BATCH * SEQ / plan.predicted_step_s / GPUS
        peak = max(s.memory_bytes for s in plan.stages) / GiB
        layout = f"{plan.num_rank_groups}x{plan.stages[0].num_replicas} {plan.stages[0].sharding.value}"
        layout += f" tp{plan.tensor_parallel}" if plan.tensor_parallel > 1 else ""
        recompute = ",".join(sorted({s.recompute.value for s in plan.stages}))
        rows.append(
            f"| {label} | {layout}, m={plan.num_microbatches}, {plan.schedule.value}, recompute {recompute} | "
            f"{plan.predicted_step_s:.2f} s | {tokens:,.0f} | {measured:,} | **{tokens / measured:.2f}** | {peak:.1f} GiB | {planning_s:.1f} s |"
        )
    return rows


def megatron_rows() -> list[str]:
    rows = []
    for name in MEGATRON_ROWS:
        row = _megatron.BY_NAME[name]
        graph = _megatron.capture(row, **_megatron.MEGATRON_TRAINING)
        replicas = row.gpus // (row.tp * row.pp)
        options = dict(
            num_stages=1,
            replicas=replicas,
            tensor_parallel=row.tp,
            num_microbatches=row.global_batch // (row.microbatch_size * replicas),
            recompute="full",
            sequence_parallel=False,
            sharding="replicate",
            precision="bf16",
            schedules="1f1b",
        )
        measured = _megatron.step_flops(row, recompute=True) / (row.published_tflops * 1e12 * row.gpus)
        cluster = partita.Cluster(device="a100-80gb", num_devices=row.gpus)
        try:
            plan, fused = (
                partita.plan(
                    graph,
                    cluster=cluster,
                    global_batch_size=row.global_batch,
                    options=partita.PlanOptions(**options, compile=compile),
                )
                for compile in (False, True)
            )
        except InfeasiblePlanError as e:
            rows.append(f"| {name} | t {row.tp} x d {replicas} | refused: {str(e)[:160]} | | | | | | |")
            continue
        peak = max(s.memory_bytes for s in plan.stages) / GiB
        rows.append(
            f"| {name} | t {row.tp} x d {replicas}, mbs {row.microbatch_size}, m {plan.num_microbatches} | fits | "
            f"{peak:.1f} GiB | {measured:.2f} s | {plan.predicted_step_s:.2f} s | **{plan.predicted_step_s / measured:.3f}** | "
            f"{fused.predicted_step_s:.2f} s | {fused.predicted_step_s / measured:.3f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/standard_layouts.md")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    graph = llama_8b()
    titan = torchtitan_rows(graph)
    megatron = megatron_rows()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# The incumbents' standard layouts, pinned: fit and predicted step",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; commit {commit}; "
        f"torch {torch.__version__}; wall time {time.perf_counter() - started:.0f} s (planning on meta: no GPU ran)",
        "",
        "## torchtitan: Llama 3.1 8B on 8 H100 (FSDP2, 16 x 8,192 tokens)",
        "",
        f"torchtitan measured {TORCHTITAN_EAGER:,} tokens/s/GPU eager ({TORCHTITAN_PEAK_GIB} GiB peak) and "
        f"{TORCHTITAN_COMPILED:,} compiled. The catalog's `h100` entry (H100 SXM at 700 W: 989 TFLOP/s bf16, "
        "3.35 TB/s) is used with 96 GB of memory; torchtitan's GPUs were H100s with 96 GB of HBM2e capped "
        "at 500 W, which lowers their clocks: nothing is fitted to this one number.",
        "",
        "| request | plan | predicted step | tokens/s/GPU | torchtitan measured | ratio | memory/device | planning |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *titan,
        "",
        "## Megatron-LM SC21: 1.7B-18.4B on A100-80GB, pinned as Megatron ran them",
        "",
        "Predicted with eager costs (one kernel per operation: the calibration of "
        "`bench/results/megatron_calibration.md`) and, beside them, with compiled blocks' costs (the operations "
        "between two matmuls fused; Megatron-LM fuses some of them by hand: bias + GeLU, the masked softmax, "
        "the layer norm).",
        "",
        "| model | layout | pinned | memory/device | measured step | predicted, eager | ratio | predicted, compiled | ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
        *megatron,
        "",
        NOTES,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


NOTES = """\
## Why these fit now, and what the gap to torchtitan is

Each pinned request was refused before blocks became the unit of execution: a sharded stage was one
FSDP2 unit, so full_shard gathered the whole 8B stage at once (32 GB in fp32), and full recomputation
rebuilt all 24-40 layers of a micro-batch at once (Megatron's 1.7B at micro-batch 16 holds ~10 GB of
activations per layer). Now each transformer layer is its own FSDP2 unit (the root unit and two
layers gathered at a time, in bf16), and recomputation keeps each layer's input and rebuilds one
layer at a time (``partita/cost/segment_memory.py``, ``partita/runtime/segments.py``).

The 8B prediction is faster than torchtitan's measurements, eager (1.53x with selective recomputation
pinned, as torchtitan ran it; the free choice under the FSDP pin, no recomputation over two
micro-batches of one sequence with gradients reduce-scattered in each, predicts 1.59x) and compiled
(1.44x). Known differences, none fitted: torchtitan's GPUs ran at 500 W against the catalog's 700 W
SXM part; its selective checkpointing (`op` policy) recomputes every other matmul, which partita's
selective level keeps; and an eager step pays a launch per op that the catalog's 5 us per op
undercounts (35 us measured on one H100: bench/results/gpu/README.md). The memory of torchtitan's
layout is predicted at 86.0 GiB against 82.4 measured (+4%): since sharded accumulation was measured
on this CPU (bench/results/block_memory_choices.md), the model counts FSDP2's flat fp32 copy of the
unit being reduce-scattered, 3.9 GiB for the root unit of the untied embedding and head. Compiled
blocks' costs (the operations between matmuls fused) shorten the predicted step by 4% where
torchtitan measured 16%: at 8,192 tokens the fused operations are a small share of the step. The
goal of 15% is not met: the rest of the gap is the catalog's compute rate for this part, which one
number cannot calibrate.
"""


if __name__ == "__main__":
    main()
