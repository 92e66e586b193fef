"""The `partita` command line's arguments: the three subcommands and their flags (commands in main.py)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from partita.cli.devices import devices_argument
from partita.cli.multinode import DEFAULT_RDZV_TIMEOUT_S
from partita.cli.optimizers import OPTIMIZERS
from partita.errors import InputError
from partita.planning.options import CostSource
from partita.training.lr_schedule import LR_SCHEDULES
from partita.types import OptimizerKind, Precision, Recompute, Schedule, Sharding
from partita.types.choices import spellings
from partita.units import parse_bytes

MODEL_HELP = (
    "a built-in example (gpt2, bert, albert, llama, mixtral, t5, vit, mlp, cnn; with a size: gpt2-xl, llama-7b, mixtral-8x7b) "
    "or path/to/file.py:factory returning (model, inputs), (model, inputs, loss_fn, target) or a dict of "
    'those with "data" and "eval_data" sources (see examples/own_data.py)'
)


DEFAULT_TRAIN_GLOBAL_BATCH = 16

_UNIFORM_REPLICAS_HELP = (
    "search only pp x dp meshes (by default stages may also get different replica counts, GPipe/1F1B, "
    "without tensor parallelism: every shape up to 64 devices, the best uniform plans' shapes beyond)"
)


def _choice(cls: type) -> Callable[[str], str]:
    """argparse ``type=`` for a choice of partita.types.choices: the one vocabulary PlanOptions
    parses too (values and aliases), kept as the member's value; argparse's error lists them."""

    def parse(text: str) -> str:
        try:
            return cls.parse(text).value
        except InputError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = cls.__name__.lower()
    return parse


def _add_schedule(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--schedule", default=None, type=_choice(Schedule), help=f"pin the schedule: {spellings(Schedule)}"
    )


def _add_planner_flags(parser: argparse.ArgumentParser) -> None:
    """The planner's flags, declared once for `plan` and `train` (each is a PlanOptions field, read
    by partita.cli.main._plan_options, or the cluster's memory): what to pin, where costs come from.
    ``--optimizer`` is each command's own (train names a torch optimizer)."""
    parser.add_argument(
        "--memory",
        default=None,
        type=_memory_bytes,
        help="memory per device (train: per process) to plan for, e.g. 80GiB, 512MiB or 40GB (default: the device's)",
    )
    _add_schedule(parser)
    parser.add_argument("--num-stages", type=int, default=None, help="pin the pipeline depth (rank groups)")
    parser.add_argument("--replicas", type=int, default=None, help="pin the data-parallel replicas per stage")
    parser.add_argument("--uniform-replicas", action="store_true", help=_UNIFORM_REPLICAS_HELP)
    parser.add_argument("--microbatches", type=int, default=None, help="pin the number of micro-batches")
    parser.add_argument(
        "--recompute",
        default=None,
        type=_choice(Recompute),
        help="pin the activation recomputation level of every stage (yes: full, no: none; default: each stage "
        f"recomputes as much as it needs to fit): {spellings(Recompute)}",
    )
    _add_precision_sharding(parser)
    parser.add_argument(
        "--costs",
        default=None,
        choices=[c.value for c in CostSource],
        help="where per-node costs come from: measured (profile every node here), analytic (roofline "
        "for the device type), auto (the default: measured for this machine's CPU with real weights, else "
        "analytic)",
    )
    parser.add_argument("--cache-dir", default=None, help="where to cache profiles and calibrations")


def _memory_bytes(text: str) -> int:
    """argparse ``type=`` of ``--memory``: bytes, from a size with a byte unit (partita.units.parse_bytes)."""
    try:
        return parse_bytes(text, "memory")
    except InputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--batch-size", type=int, default=8, help="example batch size (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length of example models")
    parser.add_argument(
        "--model-device",
        default="auto",
        choices=["auto", "cpu", "meta"],
        help="where to build example models: meta allocates no weights (auto: meta when the "
        "weights would not comfortably fit in this machine's memory)",
    )


def _add_precision_sharding(parser: argparse.ArgumentParser) -> None:
    """--precision, --sharding, --tensor-parallel, --sequence-parallel and --compile: how each device
    computes and what it holds."""
    parser.add_argument(
        "--precision",
        default=None,
        type=_choice(Precision),
        help=f"compute dtype, {spellings(Precision)}: bf16 (fp32 master weights, optimizer state and gradient "
        "reduction) or fp32 (default: bf16 on GPU device types, fp32 on the CPU)",
    )
    parser.add_argument(
        "--sharding",
        default=None,
        type=_choice(Sharding),
        help=f"pin how every stage's replicas share parameters, gradients and optimizer state, {spellings(Sharding)} "
        "(default: searched per stage; stages with one replica replicate)",
    )
    parser.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="N",
        help="pin the tensor-parallel degree: every replica splits its matmuls over N devices of one node "
        "(default: searched over 1, 2, 4 and 8 where the devices per node allow; 1: none)",
    )
    parser.add_argument(
        "--sequence-parallel",
        default=None,
        choices=["yes", "no"],
        help="pin sequence parallelism: the tensor-parallel groups also split, by token, the regions they leave "
        "whole (norms, dropout, residual additions) (default: on wherever the model allows it)",
    )
    parser.add_argument(
        "--compile",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="run every block through torch.compile, compiled once per distinct block, and cost it so "
        "(--no-compile: eagerly; default: compiled on GPU device types, eager on the CPU)",
    )


def _add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """--nnodes, --node-rank and --rdzv-*: one node's share of a multi-node job (torchrun's flags)."""
    parser.add_argument(
        "--nnodes",
        type=int,
        default=1,
        metavar="N",
        help="machines of the job (default 1): run the same command on each, with its --node-rank; rank 0 "
        "of the job plans for N x --nproc devices in nodes of --nproc, like the machine it runs on, and "
        "shares the plan (or every node reads --plan)",
    )
    parser.add_argument(
        "--node-rank", type=int, default=0, metavar="K", help="this machine's index in 0..N-1 (default 0)"
    )
    parser.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the nodes meet (torchrun's rendezvous), the same on every node; needed with --nnodes > 1",
    )
    parser.add_argument(
        "--rdzv-backend",
        default=None,
        choices=["c10d", "static"],
        help="c10d (default: the endpoint's machine hosts the rendezvous; node ranks are assigned as the "
        "nodes meet) or static (node K gets ranks K x --nproc on; the endpoint is node 0's)",
    )
    parser.add_argument(
        "--rdzv-id",
        default=None,
        metavar="ID",
        help="the job's id, the same on every node (default: made from --rdzv-endpoint)",
    )
    parser.add_argument(
        "--rdzv-timeout",
        type=int,
        default=None,
        metavar="SECONDS",
        help=f"how long each node waits for all --nnodes nodes to join the rendezvous before it gives up with "
        f"an error (default {DEFAULT_RDZV_TIMEOUT_S})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="partita", description="Plan and train PyTorch models too large for one device."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser(
        "inspect", help="capture a model and show its graph: nodes, parameters, FLOPs, activations"
    )
    _add_model_arguments(inspect)
    inspect.add_argument("--depth", type=int, default=3, help="module depth of the per-module table (default 3)")
    inspect.add_argument("--top", type=int, default=10, help="how many of the largest activations to list")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.add_argument("--costs", action="store_true", help="also print per-module costs (time, saved activations)")
    inspect.add_argument(
        "--device",
        default=None,
        help="with --costs: a catalog device for analytic costs (h100, a100-80gb, ...); "
        "default: measured on this machine when the model has real weights",
    )

    plan = sub.add_parser("plan", help="search the best split over devices; compare with the baselines")
    _add_model_arguments(plan)
    plan.add_argument(
        "--devices",
        type=devices_argument,
        required=True,
        help="number of devices (of --device-type), or device groups of several types: COUNTxTYPE[@MEMORY] "
        "separated by commas, e.g. 16xh100,32xa100-40gb (a mixed cluster: stages placed by device type, "
        "replicas of unequal speed given unequal sample shares)",
    )
    plan.add_argument(
        "--device-type",
        default="cpu",
        help="catalog name (h100, a100-80gb, a100-40gb, h200, b200, mi300x, v100-32gb, l4, cpu) or a device file",
    )
    plan.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="number of nodes the devices are spread over (must divide --devices; default: nodes of 8 catalog "
        "devices, or one node for 8 or fewer, as device groups fill them; 1 for cpu)",
    )
    plan.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    plan.add_argument(
        "--optimizer",
        default="adam",
        type=_choice(OptimizerKind),
        help=f"what the optimizer keeps per parameter (sets optimizer-state memory): {spellings(OptimizerKind)}",
    )
    _add_planner_flags(plan)
    plan.add_argument("--out", default=None, help="write the plan as JSON to this path")
    plan.add_argument("--png", default=None, help="write memory bars per stage and the pipeline timeline (PNG or SVG)")
    plan.add_argument(
        "--trace",
        default=None,
        help="write the simulated step as a Chrome/Perfetto trace (JSON; one track per rank group)",
    )

    train = sub.add_parser("train", help="plan (or load a plan) and train with one process per device")
    _add_model_arguments(train)
    train.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="processes (devices) on this machine to plan for (default 2); the job starts as many "
        "as the plan uses. With --plan: the plan's device count (default), or an error if different. "
        "With --nnodes: per node",
    )
    _add_node_arguments(train)
    train.add_argument("--plan", default=None, help="a plan file from `partita plan`; otherwise plan now")
    train.add_argument("--plan-out", default=None, help="where to write the plan made now")
    train.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help=f"samples per optimizer step (default {DEFAULT_TRAIN_GLOBAL_BATCH}); with --plan: the "
        "plan's, and another value is refused",
    )
    train.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
    train.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    train.add_argument(
        "--optimizer",
        default="adamw",
        choices=sorted(OPTIMIZERS),
        help="the torch optimizer (default adamw); the planner counts its state memory",
    )
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    train.add_argument(
        "--lr-schedule",
        default="constant",
        choices=LR_SCHEDULES,
        help="the learning rate per step: constant (default), cosine or linear decay from --lr to --min-lr "
        "over the steps after --warmup-steps",
    )
    train.add_argument(
        "--warmup-steps", type=int, default=0, help="steps of linear warm-up from 0 to --lr (any schedule; default 0)"
    )
    train.add_argument("--min-lr", type=float, default=0.0, help="where cosine and linear decay end (default 0)")
    train.add_argument(
        "--accumulate",
        type=int,
        default=1,
        metavar="K",
        help="gradient accumulation: plan for --global-batch / K samples per pipeline round, and step the "
        "optimizer once per K rounds (the whole --global-batch); K must divide --global-batch",
    )
    _add_planner_flags(train)
    train.add_argument("--checkpoint-dir", default=None, help="write checkpoints here (step-NNNNNN)")
    train.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every K steps (0: at the end)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all processes up to R times when one fails; restarted processes resume from "
        "the latest complete checkpoint in --checkpoint-dir",
    )
    train.add_argument("--seed", type=int, default=0, help="seed of the example's weights and data and of torch's RNG")
    train.add_argument(
        "--on-nonfinite",
        default="raise",
        choices=["raise", "skip"],
        help="a NaN/inf loss or gradient: stop with an error naming where (raise), or skip that "
        "update with a warning (skip); the weights are never updated with it",
    )
    train.add_argument(
        "--trace",
        default=None,
        metavar="DIR",
        help="write steps 2-4 as measured by torch's profiler, one Chrome/Perfetto trace per rank "
        "(DIR/rank-R.json); `partita plan --trace` writes the predicted step in the same format",
    )
    train.add_argument(
        "--losses-out", default=None, help="write this run's per-step losses as JSON to this path (rank 0)"
    )
    train.add_argument(
        "--eval-every",
        type=int,
        default=0,
        metavar="N",
        help="every N steps, the mean loss over --eval-batches held-out batches (a factory's eval_data; "
        "zoo models: synthetic batches no training step draws); 0: never",
    )
    train.add_argument(
        "--eval-batches", type=int, default=4, metavar="M", help="held-out batches per evaluation (default 4)"
    )
    train.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="write per-step metrics (loss, lr, grad norm, step time, samples/s, eval loss) as TensorBoard "
        "scalars and DIR/metrics.jsonl (rank 0)",
    )
    train.add_argument(
        "--init-from",
        default=None,
        help="a seed checkpoint of the initial weights: every process builds the model on meta and "
        "allocates only its stages (written by the planning process for zoo models)",
    )
    return parser


_NEGATIVE_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def joined_negative_numbers(argv: list[str]) -> list[str]:
    """``--flag -1e-3`` as ``--flag=-1e-3``: argparse takes a negative number in scientific notation
    for an option and fails with "expected one argument" (plain ``-0.001`` it reads as a value)."""
    joined: list[str] = []
    for token in argv:
        previous = joined[-1] if joined else ""
        if _NEGATIVE_NUMBER.fullmatch(token) and previous.startswith("--") and "=" not in previous:
            joined[-1] = f"{previous}={token}"
        else:
            joined.append(token)
    return joined
