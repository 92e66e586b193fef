"""Megatron-LM's GPT configurations (Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC21, arXiv:2104.04473, Table 1), shared by the benchmarks that
plan them: the shapes, GPU counts, global batches, the paper's tensor x pipeline sizes and achieved
TFLOP/s per GPU (counted with recomputation), and a capture of each on ``meta``.

GPT with vocabulary 51,200 and sequence 2048, built as transformers' GPT-2 class at those shapes.
The published figures are the paper's as cited here, not re-measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import partita

VOCAB, SEQ = 51200, 2048


@dataclass(frozen=True)
class Row:
    """One row of Megatron-LM's Table 1."""

    name: str
    heads: int
    hidden: int
    layers: int
    gpus: int
    global_batch: int
    published_tflops: float  # per GPU, with recomputation counted (96 B s l h^2 ...)
    tp: int
    pp: int


ROWS = [
    Row("1.7B", 24, 2304, 24, 32, 512, 137, 1, 1),
    Row("3.6B", 32, 3072, 30, 64, 512, 138, 2, 1),
    Row("7.5B", 32, 4096, 36, 128, 512, 142, 4, 1),
    Row("18.4B", 48, 6144, 40, 256, 1024, 135, 8, 1),
    Row("39.1B", 64, 8192, 48, 512, 1536, 138, 8, 2),
    Row("76.1B", 80, 10240, 60, 1024, 1792, 140, 8, 4),
    Row("145.6B", 96, 12288, 80, 1536, 2304, 148, 8, 8),
    Row("310.1B", 128, 16384, 96, 1920, 2160, 155, 8, 16),
    Row("529.6B", 128, 20480, 105, 2520, 2520, 163, 8, 35),
    Row("1008.0B", 160, 25600, 128, 3072, 3072, 163, 8, 64),
]
BY_NAME = {r.name: r for r in ROWS}


def step_flops(row: Row, *, recompute: bool) -> float:
    """Megatron's FLOPs of one step (forward + backward, + a second forward when recomputing)."""
    b, s, layers, h, v = row.global_batch, SEQ, row.layers, row.hidden, VOCAB
    passes = 96 if recompute else 72
    return passes * b * s * layers * h * h * (1 + s / (6 * h)) + 6 * b * s * h * v


def model_tflops(row: Row, step_s: float, num_gpus: int) -> float:
    """Model TFLOP/s per GPU of a step of ``step_s`` over ``num_gpus`` (no recomputation counted)."""
    return step_flops(row, recompute=False) / (step_s * num_gpus) / 1e12


def published_model_tflops(row: Row) -> float:
    """The paper's TFLOP/s per GPU converted to the model count (without recomputation)."""
    return row.published_tflops * step_flops(row, recompute=False) / step_flops(row, recompute=True)


def capture(row: Row, *, batch_size: int = 2):
    """``partita.capture`` of the row's GPT on ``meta`` (example batch 2: export keeps the batch symbolic)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=row.layers,
        n_embd=row.hidden,
        n_head=row.heads,
        vocab_size=VOCAB,
        n_positions=SEQ,
        attn_implementation="eager",
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    ids = torch.zeros(batch_size, SEQ, dtype=torch.long, device="meta")
    return partita.capture(model, (), {"input_ids": ids, "labels": ids})
