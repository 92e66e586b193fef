"""The fixed choices a plan is made of: pipeline schedules, optimizer kinds, precision, sharding,
gradient accumulation and recomputation.

One vocabulary: ``PlanOptions``, the plan-file codec and the command line's flags all parse a
choice with its enum's ``parse``, which accepts the member's value and the aliases in ``ALIASES``
(case, ``-`` and ``_`` ignored: ``"1F1B"``, ``"interleaved-1f1b"``, ``"ZeRO-3"``). ``spellings``
lists them for help texts and errors.
"""

from __future__ import annotations

import enum

from partita.checks import parse_choice


class Schedule(str, enum.Enum):
    """Pipeline schedules, as in torch.distributed.pipelining."""

    GPIPE = "gpipe"  # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"  # PipeDream-flush: warm-up forwards, then one forward / one backward
    INTERLEAVED_1F1B = "interleaved1f1b"  # Megatron-LM interleaving: several virtual stages per rank
    ZBV = "zbv"  # zero-bubble V schedule: 2 virtual stages per rank, backward split into input/weight

    @property
    def virtual_stages_per_rank(self) -> int | None:
        """Fixed number of stages each rank holds (None: chosen by the plan)."""
        return {Schedule.GPIPE: 1, Schedule.ONE_F_ONE_B: 1, Schedule.ZBV: 2}.get(self)

    @property
    def one_stage_per_rank_group(self) -> bool:
        """GPipe and 1F1B: each rank group holds one stage (the others hold several)."""
        return self.virtual_stages_per_rank == 1

    @classmethod
    def parse(cls, value: Schedule | str) -> Schedule:
        """``"1F1B"``, ``"interleaved-1f1b"``, ``Schedule.ZBV`` -> the member; InputError otherwise."""
        return parse_choice(cls, value, "schedule", aliases=ALIASES[cls])


class OptimizerKind(str, enum.Enum):
    """What the optimizer keeps per parameter (sets optimizer-state memory)."""

    NONE = "none"  # plain SGD without momentum: no state
    SGD_MOMENTUM = "sgd-momentum"  # one buffer per parameter
    ADAM = "adam"  # two buffers per parameter (Adam, AdamW)

    @property
    def states_per_parameter(self) -> int:
        return {OptimizerKind.NONE: 0, OptimizerKind.SGD_MOMENTUM: 1, OptimizerKind.ADAM: 2}[self]

    @classmethod
    def parse(cls, value: OptimizerKind | str) -> OptimizerKind:
        """Also ``"sgd"`` (no state), ``"adamw"``, ``"momentum"``."""
        return parse_choice(cls, value, "optimizer", aliases=ALIASES[cls])


class Precision(str, enum.Enum):
    """The dtype a plan computes in.

    ``bf16``: mixed precision as torchtitan and FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)`` run it: bf16 parameter copies, activations and boundary tensors; fp32 master
    weights, optimizer state and gradient reduction.
    """

    FP32 = "fp32"
    BF16 = "bf16"

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of parameters as computed with, activations and boundary tensors."""
        return {Precision.FP32: 4, Precision.BF16: 2}[self]

    @classmethod
    def parse(cls, value: Precision | str) -> Precision:
        """Also ``"float32"``, ``"bfloat16"``."""
        return parse_choice(cls, value, "precision", aliases=ALIASES[cls])


class Sharding(str, enum.Enum):
    """How a stage's replicas share its parameters, gradients and optimizer state (ZeRO levels).

    Within the replica group of one stage (r devices): ``replicate`` keeps a full copy on each and
    all-reduces gradients (DDP); ``shard_grads_and_optimizer`` is FSDP2 with
    ``reshard_after_forward=False`` (ZeRO-2-like: parameters all-gathered once per step, gradients
    reduce-scattered, optimizer state and master weights 1/r each); ``full_shard`` is ZeRO-3
    (parameters also 1/r, re-gathered for every micro-batch's forward and backward).
    """

    REPLICATE = "replicate"
    SHARD_GRADS_AND_OPTIMIZER = "shard_grads_and_optimizer"
    FULL_SHARD = "full_shard"

    @classmethod
    def parse(cls, value: Sharding | str) -> Sharding:
        """Also ``"ddp"``, ``"zero2"``, ``"zero3"``, ``"fsdp"`` (full shard)."""
        return parse_choice(cls, value, "sharding", aliases=ALIASES[cls])


class Accumulation(str, enum.Enum):
    """How a sharded stage accumulates its gradients over a step's micro-batches.

    ``whole`` keeps them unsharded (fp32) until the step's last backward, which reduce-scatters them
    unit by unit: one reduce-scatter per step, but every gradient of the stage held whole.
    ``sharded`` reduce-scatters each unit's gradients as its backward ends in every micro-batch and
    sums them into this rank's shard (FSDP2's own default): ``m`` reduce-scatters per step, and
    ``1/r`` of the gradients held, plus those of the unit in backward. The planner takes ``whole``
    where it fits, as it moves less. Replicated stages, and steps of one micro-batch, are ``whole``.
    """

    WHOLE = "whole"
    SHARDED = "sharded"

    @classmethod
    def parse(cls, value: Accumulation | str) -> Accumulation:
        return parse_choice(cls, value, "accumulation", aliases=ALIASES[cls])


class Recompute(str, enum.Enum):
    """Activation recomputation of a stage, from keeping everything to keeping its blocks' inputs alone.

    ``none`` keeps every tensor the stage's backward needs. ``selective`` keeps each segment's input
    and the outputs of the expensive operations (matmuls, attention: the op classes of
    ``partita.capturing.recompute``) and recomputes the cheap, memory-heavy rest (softmax, dropout,
    norms, activation functions, elementwise) in backward (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", 2022). ``full`` keeps each segment's input alone and
    runs its forward again in backward. A segment is a whole block of the stage (a transformer
    layer) or the nodes around its blocks (``partita.types.segments``): both levels rebuild one
    segment at a time, as Megatron-LM and torchtitan recompute one layer at a time; a stage without
    a whole block is one segment. Each level keeps less and recomputes more than the one before
    (``order``).
    """

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"

    @property
    def order(self) -> int:
        """0, 1, 2 for none, selective, full: the position in ``RECOMPUTE_LEVELS``."""
        return RECOMPUTE_LEVELS.index(self)

    def __bool__(self) -> bool:
        """Whether anything is recomputed (``if stage.recompute:``); a str would be true for "none"."""
        return self is not Recompute.NONE

    @classmethod
    def parse(cls, value: Recompute | str | bool) -> Recompute:
        """Also ``True`` / ``False`` (full / none: the plan files and options of partita before
        selective recomputation), ``"yes"`` / ``"no"``."""
        if isinstance(value, bool):
            return cls.FULL if value else cls.NONE
        return parse_choice(cls, value, "recompute", aliases=ALIASES[cls])

    @classmethod
    def most(cls, levels) -> Recompute:
        """The level among ``levels`` that recomputes the most (none for no levels): what a rank
        group holding stages of these levels runs them all with."""
        return max(levels, key=lambda level: level.order, default=cls.NONE)


RECOMPUTE_LEVELS = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)  # by memory saved (and time added)


# Every other spelling each choice accepts (alias -> the member's value). The whole vocabulary:
# what is not here (or a member's value) is refused everywhere, with the list of spellings.
ALIASES: dict[type[enum.Enum], dict[str, str]] = {
    Schedule: {},
    OptimizerKind: {"sgd": "none", "adamw": "adam", "momentum": "sgd-momentum"},
    Precision: {"float32": "fp32", "bfloat16": "bf16"},
    Sharding: {
        "ddp": "replicate",
        "zero2": "shard_grads_and_optimizer",
        "zero3": "full_shard",
        "fsdp": "full_shard",
    },
    Accumulation: {},
    Recompute: {"yes": "full", "no": "none", "true": "full", "false": "none", "off": "none"},
}


def spellings(cls: type[enum.Enum]) -> str:
    """The values of ``cls`` with their aliases: ``"replicate (ddp), ..., full_shard (zero3, fsdp)"``."""
    aliases = ALIASES[cls]
    parts = []
    for member in cls:
        mine = [alias for alias, value in aliases.items() if value == member.value]
        parts.append(member.value + (f" ({', '.join(mine)})" if mine else ""))
    return ", ".join(parts)
