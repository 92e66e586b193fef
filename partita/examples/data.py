"""Synthetic, learnable training data for the model zoo.

Every batch is a pure function of ``(seed, step)``: it is drawn from its own
``torch.Generator`` on the CPU, so the same step gives the same tensors on every machine
and every run, and tests can compare a pipelined run with an unsplit one batch for batch.

The data is made to be *learnable*, so that a training loss visibly falls within tens of
steps (a flat loss would hide a broken optimizer step or gradient sync):

- token sequences are arithmetic progressions over an alphabet of ``ALPHABET`` data tokens,
  with a random start and a small random stride per sequence: after two tokens the next one
  is predictable, and even a bigram model gets most of the way (the stride takes one of a
  few values). The alphabet is small so that tiny models learn within tens of steps whatever
  their vocabulary: the loss drops from ln(vocab) to ln(ALPHABET) as soon as the model
  learns which tokens occur, then further as it learns the progressions;
- class-labelled inputs (images, vectors) are a fixed per-class prototype plus noise.

The CLI's default learning rate (3e-3, Adam) suits every tiny model; at much higher rates
some stall at ln(ALPHABET) (`make demo` shows the loss falling).

Glossary:
    data tokens   token ids from ``NUM_SPECIAL_TOKENS`` up, at most ``ALPHABET`` of them; the
                  ids below are kept free for the models' special tokens (pad, bos, eos, mask).
    stream        an integer that selects an independent random generator for one seed:
                  stream 0 holds the class prototypes (fixed for a seed), stream
                  ``step + 1`` holds the batch of that step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from partita.errors import InputError

PAD_ID, BOS_ID, EOS_ID, MASK_ID = 0, 1, 2, 3
NUM_SPECIAL_TOKENS = 4

ALPHABET = 64  # distinct data tokens; fewer if the vocabulary is smaller
MAX_STRIDE = 4  # strides 1..4: the next token has ln(4) nats of entropy for a bigram model
MASK_PROB = 0.15  # BERT's share of masked positions
PROTOTYPE_SIZE = 4  # image prototypes are drawn at 4x4 and upsampled: cheap for 1000 classes
NOISE_STD = 1.0


def generator(seed: int, stream: int) -> torch.Generator:
    """A CPU generator for one (seed, stream) pair; distinct pairs (stream < 2**32) never share one."""
    if seed < 0 or stream < 0:
        raise InputError(f"seed and step must be non-negative, got seed={seed}, stream={stream} (step + 1)")
    return torch.Generator().manual_seed(((seed << 32) + stream) & 0xFFFF_FFFF_FFFF_FFFF)


def batch_generator(seed: int, step: int) -> torch.Generator:
    """The generator of the batch of training step ``step`` (stream ``step + 1``)."""
    return generator(seed, step + 1)


# ---------------------------------------------------------------------------------------------
# Token sequences
# ---------------------------------------------------------------------------------------------


def progressions(gen: torch.Generator, batch_size: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Int64 ``(batch_size, seq_len)`` arithmetic progressions over the data tokens.

    Row ``b`` is ``NUM_SPECIAL_TOKENS + (start_b + stride_b * t) mod num_data_tokens``, with
    ``num_data_tokens = min(vocab_size - NUM_SPECIAL_TOKENS, ALPHABET)``.
    """
    num_data_tokens = min(vocab_size - NUM_SPECIAL_TOKENS, ALPHABET)
    if num_data_tokens < 2:
        raise ValueError(f"vocab_size={vocab_size} leaves no data tokens beside the {NUM_SPECIAL_TOKENS} special ids")
    start = torch.randint(num_data_tokens, (batch_size, 1), generator=gen)  # (B, 1)
    stride = torch.randint(1, MAX_STRIDE + 1, (batch_size, 1), generator=gen)  # (B, 1)
    positions = torch.arange(seq_len).unsqueeze(0)  # (1, T)
    return NUM_SPECIAL_TOKENS + (start + stride * positions) % num_data_tokens  # (B, T)


def causal_lm_batch(gen: torch.Generator, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """``input_ids`` and ``labels`` for a causal LM; labels equal the inputs (HF shifts them)."""
    input_ids = progressions(gen, batch_size, seq_len, vocab_size)
    # A separate tensor, so that code which edits one in place cannot change the other.
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def masked_lm_batch(gen: torch.Generator, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """BERT-style masked LM: ~15% of positions become ``MASK_ID``; labels are -100 elsewhere."""
    tokens = progressions(gen, batch_size, seq_len, vocab_size)  # (B, T)
    masked = torch.rand(batch_size, seq_len, generator=gen) < MASK_PROB  # (B, T)
    # At least one masked position per row, so the mean loss is never 0/0 on short sequences.
    forced = torch.randint(seq_len, (batch_size,), generator=gen)
    masked[torch.arange(batch_size), forced] = True
    return {
        "input_ids": torch.where(masked, torch.full_like(tokens, MASK_ID), tokens),
        "labels": torch.where(masked, tokens, torch.full_like(tokens, -100)),
    }


def seq2seq_batch(gen: torch.Generator, batch_size: int, seq_len: int, vocab_size: int) -> dict:
    """Encoder-decoder task: the labels are the input sequence reversed (same length).

    Learnable two ways: the decoder can read the encoder, and a reversed progression is
    itself a progression, so after two label tokens the next one follows.
    """
    input_ids = progressions(gen, batch_size, seq_len, vocab_size)
    return {"input_ids": input_ids, "labels": input_ids.flip(1)}


# ---------------------------------------------------------------------------------------------
# Classification: prototype + noise
# ---------------------------------------------------------------------------------------------


def class_prototypes(seed: int, num_classes: int, input_shape: tuple[int, ...]) -> torch.Tensor:
    """Float ``(num_classes, *input_shape)`` class centres, fixed for a seed.

    Images ``(C, H, W)`` get prototypes drawn at ``PROTOTYPE_SIZE`` squared and upsampled
    (nearest), so 1000 ImageNet-sized classes cost kilobytes, and classes differ in coarse
    structure that convolutions and patch embeddings pick up quickly.
    """
    gen = generator(seed, 0)
    if len(input_shape) == 1:
        return torch.randn(num_classes, *input_shape, generator=gen)
    channels, height, width = input_shape
    coarse = torch.randn(num_classes, channels, PROTOTYPE_SIZE, PROTOTYPE_SIZE, generator=gen)
    return F.interpolate(coarse, size=(height, width), mode="nearest")  # (K, C, H, W)


def classification_batch(
    seed: int, step: int, batch_size: int, num_classes: int, input_shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)``: float ``(B, *input_shape)`` and int64 ``(B,)`` class ids."""
    prototypes = class_prototypes(seed, num_classes, input_shape)
    gen = batch_generator(seed, step)
    labels = torch.randint(num_classes, (batch_size,), generator=gen)  # (B,)
    noise = NOISE_STD * torch.randn(batch_size, *input_shape, generator=gen)
    return prototypes[labels] + noise, labels
