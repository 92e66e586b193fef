"""The `partita` command line: parse arguments, call the library, print. No logic of its own."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from partita.errors import PartitaError

MODEL_HELP = (
    "a built-in example (gpt2, bert, llama, t5, vit, mlp, cnn; with a size: gpt2-xl, llama-7b) "
    "or path/to/file.py:factory returning (model, inputs) or (model, inputs, loss_fn, target)"
)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--batch-size", type=int, default=8, help="example batch size (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="sequence length of example models")
    parser.add_argument(
        "--model-device", default="auto", choices=["auto", "cpu", "meta"],
        help="where to build example models: meta allocates no weights (auto: meta when the "
             "weights would not comfortably fit in this machine's memory)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partita", description="Plan and train PyTorch models too large for one device.")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="capture a model and show its graph: nodes, parameters, FLOPs, activations")
    _add_model_arguments(inspect)
    inspect.add_argument("--depth", type=int, default=3, help="module depth of the per-module table (default 3)")
    inspect.add_argument("--top", type=int, default=10, help="how many of the largest activations to list")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of tables")
    inspect.set_defaults(func=_inspect)
    return parser


def _load(args: argparse.Namespace):
    from partita.model_spec import load_model

    return load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, device=args.model_device)


def _capture(example):
    from partita.capture import capture

    return capture(example.model, example.args, example.kwargs, loss_fn=example.loss_fn, target=example.target)


def _inspect(args: argparse.Namespace) -> int:
    from partita.report.inspect import inspect_dict, inspect_text

    example = _load(args)
    graph = _capture(example)
    if args.json:
        print(json.dumps(inspect_dict(graph, depth=args.depth, top=args.top), indent=2))
    else:
        print(inspect_text(graph, name=example.name, depth=args.depth, top=args.top))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PartitaError as e:
        print(f"partita {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
