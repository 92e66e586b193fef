"""Megatron-LM's GPT configurations (Narayanan et al., "Efficient Large-Scale Language Model Training
on GPU Clusters Using Megatron-LM", SC21, arXiv:2104.04473, Table 1), shared by the benchmarks that
plan them: the shapes, GPU counts, global batches, the paper's tensor x pipeline sizes and achieved
TFLOP/s per GPU (counted with recomputation), and a capture of each on ``meta``.

GPT with vocabulary 51,200 and sequence 2048, built as transformers' GPT-2 class at those shapes.
The published figures are the paper's as cited here, not re-measured.

How Megatron ran each row (its repository's ``examples/sc21/run_table_1.sh`` and ``CONFIG.sh``,
commit de7dc40, "scripts for sc21", with ``megatron/arguments.py``'s defaults of then): the
micro-batch size and the layers per virtual pipeline stage (interleaved schedule) below;
``--checkpoint-activations`` (every transformer layer recomputed, the LM head not), fp16 with
loss scaling, hidden and attention dropout 0.1 (the defaults), GELU fused with its bias, the
scale-mask-softmax and bias-dropout-add fusions on, PyTorch DDP up to 18B and Megatron's own
("local": one all-reduce after the last backward) from 39B on, and the pipeline's point-to-point
sends split over the tensor-parallel ranks and all-gathered (scatter-gather, on by default).
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
    microbatch_size: int = 1  # run_table_1.sh's MBS
    virtual_stages: int = 1  # model chunks per pipeline rank: layers / (pp x layers per virtual stage)


ROWS = [
    Row("1.7B", 24, 2304, 24, 32, 512, 137, 1, 1, 16),
    Row("3.6B", 32, 3072, 30, 64, 512, 138, 2, 1, 16),
    Row("7.5B", 32, 4096, 36, 128, 512, 142, 4, 1, 16),
    Row("18.4B", 48, 6144, 40, 256, 1024, 135, 8, 1, 8),
    Row("39.1B", 64, 8192, 48, 512, 1536, 138, 8, 2, 4),
    Row("76.1B", 80, 10240, 60, 1024, 1792, 140, 8, 4, 2, 3),  # 5 layers per virtual stage
    Row("145.6B", 96, 12288, 80, 1536, 2304, 148, 8, 8, 2, 2),  # 5
    Row("310.1B", 128, 16384, 96, 1920, 2160, 155, 8, 16, 1, 2),  # 3
    Row("529.6B", 128, 20480, 105, 2520, 2520, 163, 8, 35, 1, 3),  # 1
    Row("1008.0B", 160, 25600, 128, 3072, 3072, 163, 8, 64, 1),
]
# The model as Megatron trained it (module docstring), for ``capture(row, **MEGATRON_TRAINING)``:
# dropout 0.1 and GELU as one op (Megatron's fused bias-GELU is one kernel; GPT-2's default
# "gelu_new" is eight elementwise ops in an eager graph).
MEGATRON_TRAINING = {"dropout": 0.1, "activation": "gelu"}
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


def capture(row: Row, *, batch_size: int = 2, dropout: float = 0.0, activation: str = "gelu_new"):
    """``partita.capture`` of the row's GPT on ``meta`` (example batch 2: export keeps the batch
    symbolic), with ``dropout`` on embeddings, residuals and attention probabilities and the MLP's
    ``activation`` (transformers' name)."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=row.layers,
        n_embd=row.hidden,
        n_head=row.heads,
        vocab_size=VOCAB,
        n_positions=SEQ,
        attn_implementation="eager",
        use_cache=False,
        activation_function=activation,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    ids = torch.zeros(batch_size, SEQ, dtype=torch.long, device="meta")
    return partita.capture(model, (), {"input_ids": ids, "labels": ids})
