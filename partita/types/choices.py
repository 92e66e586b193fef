"""The fixed choices a plan is made of: pipeline schedules and optimizer kinds."""

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

    @classmethod
    def parse(cls, value: Schedule | str) -> Schedule:
        """``"1F1B"``, ``"interleaved-1f1b"``, ``Schedule.ZBV`` -> the member; InputError otherwise."""
        return parse_choice(cls, value, "schedule")


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
        return parse_choice(cls, value, "optimizer", aliases=_OPTIMIZER_ALIASES)


_OPTIMIZER_ALIASES = {"sgd": "none", "adamw": "adam", "momentum": "sgd-momentum"}
