"""Hugging Face models of the zoo, built from configs (never from downloaded weights).

Families: ``gpt2`` (GPT2LMHeadModel, tied head), ``bert`` (BertForMaskedLM, tied decoder),
``albert`` (AlbertForMaskedLM: one layer's weights shared by every depth, tied decoder),
``llama`` (LlamaForCausalLM), ``mixtral`` (MixtralForCausalLM: mixture of experts), ``t5`` (T5ForConditionalGeneration, tied shared embedding) and
``vit`` (ViTForImageClassification). Each is called with keyword inputs that include
``labels=``, so the model returns its own loss (``output.loss``).

Every config is made for planning and for exact comparisons:
- ``attn_implementation="eager"``: attention as explicit matmuls, which FLOP counters see
  and splitters can cut, instead of one fused SDPA kernel;
- every dropout probability 0.0: a pipelined run must reproduce the unsplit loss exactly;
- ``use_cache=False``: ``torch.export`` fails on a ``DynamicCache`` in the output.

Sizes: ``tiny`` (< 1M params, for tests), ``small`` (a few M params, for CPU benchmarks; not
the published "t5-small" or "ViT-S") and the published sizes with their real shapes, which
are meant to be built on the ``meta`` device for planning. Our own sizes use a small vocabulary
whose ids 0..3 are pad/bos/eos/mask (see ``data.py``); published sizes keep the real vocabulary.

transformers is imported only when a model is built, so listing sizes stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from partita.errors import ModelSpecError
from partita.examples import data

# Special token ids, the same in every config (the published models' real ids only matter
# for generation, which the zoo does not do).
_TOKEN_IDS = dict(pad_token_id=data.PAD_ID, bos_token_id=data.BOS_ID, eos_token_id=data.EOS_ID)


@dataclass(frozen=True)
class HFFamily:
    """How to build and feed one Hugging Face family.

    ``sizes`` maps a size to its config kwargs; ``common`` kwargs go into every size.
    The default sequence length is 32 for tiny, 128 for small, else ``seq_len_exceptions``
    or ``published_seq_len`` (None: the family takes images, not sequences).
    ``make_inputs(seed, step, batch_size, seq_len, config_kwargs)`` gives the keyword inputs.
    ``positions_key`` names the config field that bounds the sequence length (None: no bound).
    ``loss_type`` overrides the model's loss lookup where transformers cannot infer it.
    """

    config_class: str
    model_class: str
    common: dict
    sizes: dict[str, dict]
    published_seq_len: int | None
    positions_key: str | None
    make_inputs: Callable[[int, int, int, int | None, dict], dict]
    loss_type: str | None = None
    seq_len_exceptions: dict[str, int] = field(default_factory=dict)


def _token_inputs(batch_fn: Callable) -> Callable[[int, int, int, int | None, dict], dict]:
    """Adapts a token batch function of ``data`` to ``(seed, step, batch_size, seq_len, config)``."""

    def make(seed: int, step: int, batch_size: int, seq_len: int | None, config: dict) -> dict:
        return batch_fn(data.batch_generator(seed, step), batch_size, seq_len, config["vocab_size"])

    return make


def _image_inputs(seed: int, step: int, batch_size: int, seq_len: int | None, config: dict) -> dict:
    """``pixel_values`` and ``labels``: a class prototype plus noise (``seq_len`` is unused)."""
    shape = (config["num_channels"], config["image_size"], config["image_size"])
    pixels, labels = data.classification_batch(seed, step, batch_size, config["num_labels"], shape)
    return {"pixel_values": pixels, "labels": labels}


GPT2 = HFFamily(
    config_class="GPT2Config",
    model_class="GPT2LMHeadModel",
    common=dict(
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, use_cache=False, **_TOKEN_IDS
    ),
    sizes={
        "tiny": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=256),
        "small": dict(n_layer=8, n_embd=256, n_head=8, vocab_size=8192, n_positions=1024),
        "124m": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024),
        "355m": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024),
        "774m": dict(n_layer=36, n_embd=1280, n_head=20, vocab_size=50257, n_positions=1024),
        "xl": dict(n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024),
        # GPT-3 shapes (Brown et al. 2020, table 2.1) in GPT-2's architecture, 2048-token context.
        "13b": dict(n_layer=40, n_embd=5120, n_head=40, vocab_size=50257, n_positions=2048),
        "gpt3-175b": dict(n_layer=96, n_embd=12288, n_head=96, vocab_size=50257, n_positions=2048),
    },
    published_seq_len=1024,
    seq_len_exceptions={"13b": 2048, "gpt3-175b": 2048},
    positions_key="n_positions",
    make_inputs=_token_inputs(data.causal_lm_batch),
    # "GPT2LMHeadModel" matches no name of transformers' LOSS_MAPPING, which then warns on
    # every forward and falls back to the causal-LM loss; name that loss outright.
    loss_type="ForCausalLM",
)

BERT = HFFamily(
    config_class="BertConfig",
    model_class="BertForMaskedLM",
    common=dict(
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0, use_cache=False, **_TOKEN_IDS
    ),
    sizes={
        "tiny": dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=256,
            vocab_size=512,
            max_position_embeddings=256,
        ),
        "small": dict(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=8192,
            max_position_embeddings=512,
        ),
        "base": dict(
            num_hidden_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            intermediate_size=3072,
            vocab_size=30522,
            max_position_embeddings=512,
        ),
        "large": dict(
            num_hidden_layers=24,
            hidden_size=1024,
            num_attention_heads=16,
            intermediate_size=4096,
            vocab_size=30522,
            max_position_embeddings=512,
        ),
    },
    published_seq_len=512,
    positions_key="max_position_embeddings",
    make_inputs=_token_inputs(data.masked_lm_batch),
)

ALBERT = HFFamily(
    config_class="AlbertConfig",
    model_class="AlbertForMaskedLM",
    # One group of one layer, applied at every depth: every stage of a pipeline reads the same weights.
    common=dict(
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0,
        num_hidden_groups=1,
        inner_group_num=1,
        **_TOKEN_IDS,
    ),
    sizes={
        "tiny": dict(
            num_hidden_layers=4,
            embedding_size=32,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=256,
        ),
        # ALBERT-base (Lan et al. 2020): 12 layers sharing one set of weights, 128-wide embeddings.
        "base": dict(
            num_hidden_layers=12,
            embedding_size=128,
            hidden_size=768,
            num_attention_heads=12,
            intermediate_size=3072,
            vocab_size=30000,
            max_position_embeddings=512,
        ),
    },
    published_seq_len=512,
    positions_key="max_position_embeddings",
    make_inputs=_token_inputs(data.masked_lm_batch),
)

LLAMA = HFFamily(
    config_class="LlamaConfig",
    model_class="LlamaForCausalLM",
    common=dict(attention_dropout=0.0, use_cache=False, tie_word_embeddings=False, rms_norm_eps=1e-5, **_TOKEN_IDS),
    sizes={
        # tiny and small use grouped-query attention too, so tests exercise it.
        "tiny": dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=176,
            vocab_size=512,
            max_position_embeddings=256,
        ),
        "small": dict(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=688,
            vocab_size=8192,
            max_position_embeddings=2048,
        ),
        # Llama 2 shapes (Touvron et al. 2023): 4096-token context, GQA with 8 kv heads at 70B.
        "7b": dict(
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=32,
            intermediate_size=11008,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        "13b": dict(
            num_hidden_layers=40,
            hidden_size=5120,
            num_attention_heads=40,
            num_key_value_heads=40,
            intermediate_size=13824,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
        "70b": dict(
            num_hidden_layers=80,
            hidden_size=8192,
            num_attention_heads=64,
            num_key_value_heads=8,
            intermediate_size=28672,
            vocab_size=32000,
            max_position_embeddings=4096,
        ),
    },
    published_seq_len=2048,
    positions_key="max_position_embeddings",
    make_inputs=_token_inputs(data.causal_lm_batch),
)

T5 = HFFamily(
    config_class="T5Config",
    model_class="T5ForConditionalGeneration",
    # decoder_start_token_id: the model builds decoder inputs by shifting the labels right
    # and putting this id first (real T5 uses pad, too).
    common=dict(
        dropout_rate=0.0,
        use_cache=False,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        decoder_start_token_id=data.PAD_ID,
        **_TOKEN_IDS,
    ),
    sizes={
        "tiny": dict(num_layers=2, d_model=64, d_kv=16, num_heads=4, d_ff=256, vocab_size=512),
        "small": dict(num_layers=4, d_model=256, d_kv=32, num_heads=8, d_ff=1024, vocab_size=8192),
        "base": dict(num_layers=12, d_model=768, d_kv=64, num_heads=12, d_ff=3072, vocab_size=32128),
        "large": dict(num_layers=24, d_model=1024, d_kv=64, num_heads=16, d_ff=4096, vocab_size=32128),
        "3b": dict(num_layers=24, d_model=1024, d_kv=128, num_heads=32, d_ff=16384, vocab_size=32128),
    },
    # Labels have the same length as the inputs (the input reversed, see data.seq2seq_batch).
    published_seq_len=512,
    positions_key=None,  # relative position buckets: any length works
    make_inputs=_token_inputs(data.seq2seq_batch),
)


VIT = HFFamily(
    config_class="ViTConfig",
    model_class="ViTForImageClassification",
    common=dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_channels=3),
    sizes={
        "tiny": dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            intermediate_size=256,
            image_size=32,
            patch_size=8,
            num_labels=10,
        ),
        "small": dict(
            num_hidden_layers=6,
            hidden_size=256,
            num_attention_heads=8,
            intermediate_size=1024,
            image_size=32,
            patch_size=4,
            num_labels=10,
        ),
        # ViT-B/16, ViT-L/16, ViT-H/14 (Dosovitskiy et al. 2021) on 224x224 ImageNet-1k.
        "base": dict(
            num_hidden_layers=12,
            hidden_size=768,
            num_attention_heads=12,
            intermediate_size=3072,
            image_size=224,
            patch_size=16,
            num_labels=1000,
        ),
        "large": dict(
            num_hidden_layers=24,
            hidden_size=1024,
            num_attention_heads=16,
            intermediate_size=4096,
            image_size=224,
            patch_size=16,
            num_labels=1000,
        ),
        "huge": dict(
            num_hidden_layers=32,
            hidden_size=1280,
            num_attention_heads=16,
            intermediate_size=5120,
            image_size=224,
            patch_size=14,
            num_labels=1000,
        ),
    },
    published_seq_len=None,
    positions_key=None,
    make_inputs=_image_inputs,
)

MIXTRAL = HFFamily(
    config_class="MixtralConfig",
    model_class="MixtralForCausalLM",
    # router_jitter_noise 0: routing is deterministic, so pipelined runs reproduce the unsplit one;
    # output_router_logits False: the loss is the LM loss alone (no auxiliary balancing term).
    common=dict(
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        router_jitter_noise=0.0,
        output_router_logits=False,
        **_TOKEN_IDS,
    ),
    sizes={
        "tiny": dict(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=512,
            max_position_embeddings=256,
        ),
        "small": dict(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=512,
            num_local_experts=4,
            num_experts_per_tok=2,
            vocab_size=8192,
            max_position_embeddings=2048,
        ),
        # Mixtral 8x7B (Jiang et al. 2024): 8 experts, 2 per token, GQA with 8 kv heads, 32k context.
        "8x7b": dict(
            num_hidden_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            max_position_embeddings=32768,
        ),
    },
    published_seq_len=4096,
    positions_key="max_position_embeddings",
    make_inputs=_token_inputs(data.causal_lm_batch),
)

FAMILIES: dict[str, HFFamily] = {
    "albert": ALBERT,
    "bert": BERT,
    "gpt2": GPT2,
    "llama": LLAMA,
    "mixtral": MIXTRAL,
    "t5": T5,
    "vit": VIT,
}
SIZES: dict[str, dict[str, dict]] = {name: family.sizes for name, family in FAMILIES.items()}


def default_seq_len(family: str, size: str) -> int | None:
    """The sequence length ``build`` uses when none is given (None for ``vit``)."""
    spec = FAMILIES[family]
    if spec.published_seq_len is None:
        return None
    return {"tiny": 32, "small": 128, **spec.seq_len_exceptions}.get(size, spec.published_seq_len)


def config_kwargs(family: str, size: str) -> dict:
    """All config kwargs of one size (shared ones first, so a size can override them)."""
    return {**FAMILIES[family].common, **FAMILIES[family].sizes[size]}


def build_model(family: str, size: str, seq_len: int | None) -> nn.Module:
    """A freshly initialised model of one size (on the current default device)."""
    import transformers  # lazy: importing it takes seconds

    spec = FAMILIES[family]
    kwargs = config_kwargs(family, size)
    _check_seq_len(family, size, seq_len, kwargs)
    config = getattr(transformers, spec.config_class)(attn_implementation="eager", **kwargs)
    model = getattr(transformers, spec.model_class)(config)
    if spec.loss_type is not None:
        model.loss_type = spec.loss_type
    return model


def _check_seq_len(family: str, size: str, seq_len: int | None, kwargs: dict) -> None:
    """Raises ModelSpecError when ``seq_len`` exceeds the model's position table."""
    key = FAMILIES[family].positions_key
    if key is None or seq_len is None or seq_len <= kwargs[key]:
        return
    raise ModelSpecError(
        f"{family}-{size} has {kwargs[key]} positions ({key}) but seq_len={seq_len} was asked for: "
        f"use seq_len <= {kwargs[key]}"
    )


def batch_maker(family: str, size: str, seq_len: int | None, seed: int) -> Callable[[int, int], tuple]:
    """``(batch_size, step) -> ((), kwargs, None)`` on the CPU; kwargs include ``labels``."""
    spec = FAMILIES[family]
    kwargs = config_kwargs(family, size)

    def make(batch_size: int, step: int) -> tuple:
        return (), spec.make_inputs(seed, step, batch_size, seq_len, kwargs), None

    return make


def loss_fn(family: str) -> None:
    """HF models return their own loss when given ``labels``: no separate loss function."""
    return None
