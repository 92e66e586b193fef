"""Compiled blocks against eager execution on this CPU: step time side by side, the cost model's
predicted ratio beside each, and compile time by depth.

- Speed: the demo model (GPT-2 small, 8 layers, ``make demo``'s 64 tokens) and a Llama of 8
  layers (hidden 512, 128 tokens, eager attention), one rank, one stage, fp32, SGD. Two trainers of the same plan but for
  ``compile``, from the same weights, stepped in turn on the same batches (the order rotated every
  round); the first steps (compilation) dropped; medians of the rest. ``predicted``: the analytic
  cost model's ratio of compiled to eager forward + backward, for this machine as
  ``partita.Cluster.local`` measured it.
- Memory: what the stage holds between its forward and its backward, eager and compiled.
- Compile time: Llama-shaped models of 1, 2 and 32 layers (hidden 256, 4 x 128 tokens), each in a fresh process with
  an empty inductor cache: the first step's time less a later step's. One compiled function runs
  every layer of a structure, so depth should add next to nothing.

Usage: python bench/compiled_blocks.py [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _e2e_common import REPO, build_example, command_line, now_utc  # noqa: E402

import partita  # noqa: E402
from partita import examples  # noqa: E402

SPEED_MODELS = (("gpt2-small", 8, 64), ("llama-L8-H512", 4, 128))  # name, batch, tokens
DEPTHS = ("llama-L1-H256", "llama-L2-H256", "llama-L32-H256")


def _trainer(ex, compile: bool):
    model = copy.deepcopy(ex.model)  # the same weights for both; a graph of its own each
    graph = partita.capture(model, ex.args, ex.kwargs)
    plan = partita.manual_plan(
        graph,
        [0, graph.num_nodes],
        schedule="gpipe",
        num_rank_groups=1,
        num_microbatches=1,
        global_batch_size=ex.args[0].shape[0] if ex.args else next(iter(ex.kwargs.values())).shape[0],
        compile=compile,
    )
    return partita.Trainer(model, plan, graph=graph, optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-3))


def _example(name: str, batch: int, tokens: int):
    """The zoo's model, or a Llama of the given depth and width (``build_example``: 128 tokens)."""
    if name.startswith("llama-L"):
        return build_example(name, batch)
    return examples.build(name, batch_size=batch, seq_len=tokens)


def _step(trainer, ex) -> float:
    start = time.perf_counter()
    trainer.step(*ex.args, **ex.kwargs)
    return time.perf_counter() - start


def _predicted_ratio(graph, batch: int) -> float:
    from partita.cost.analytic import analytic_costs

    device = partita.Cluster.local(1, num_threads=1).device
    eager = analytic_costs(graph, device, batch)
    fused = analytic_costs(graph, device, batch, compiled=True)
    total = lambda t: float(t.forward_s.sum() + t.backward_s.sum())  # noqa: E731
    return total(fused) / total(eager)


def speed(rounds: int) -> list[dict]:
    rows = []
    for name, batch, tokens in SPEED_MODELS:
        ex = _example(name, batch, tokens)
        graph = partita.capture(ex.model, ex.args, ex.kwargs)
        trainers = {"eager": _trainer(ex, False), "compiled": _trainer(ex, True)}
        first = {k: _step(t, ex) for k, t in trainers.items()}  # builds the pipeline; compiles
        for t in trainers.values():
            _step(t, ex)
        times: dict[str, list[float]] = {k: [] for k in trainers}
        for r in range(rounds):
            order = list(trainers) if r % 2 == 0 else list(reversed(trainers))
            for k in order:
                times[k].append(_step(trainers[k], ex))
        eager, compiled = statistics.median(times["eager"]), statistics.median(times["compiled"])
        rows.append(
            dict(
                model=name,
                batch=batch,
                tokens=tokens,
                nodes=graph.num_nodes,
                eager_s=eager,
                compiled_s=compiled,
                ratio=compiled / eager,
                predicted=_predicted_ratio(graph, batch),
                first_compiled_s=first["compiled"],
                first_eager_s=first["eager"],
            )
        )
        print(rows[-1], flush=True)
    return rows


def held_memory() -> list[dict]:
    """Bytes the stage holds between its forward and its backward (glibc's bytes in use after the
    forward, less before it), eager and compiled, beside the memory model's count of activations."""
    import ctypes
    import gc

    from _e2e_common import malloc_in_use

    from partita.cost.analytic import analytic_costs
    from partita.runtime.segments import SegmentedStage
    from partita.runtime.stages import flatten_inputs, split_graph

    rows = []
    for name, batch, tokens in SPEED_MODELS:
        ex = _example(name, batch, tokens)
        graph = partita.capture(ex.model, ex.args, ex.kwargs)
        flat = flatten_inputs(graph, ex.args, ex.kwargs)
        (stage,) = split_graph(graph, [0, graph.num_nodes])
        row = dict(model=name, model_bytes=int(analytic_costs(graph, "cpu", batch).activation_bytes.sum()))
        for kind in ("eager", "compiled"):
            split = SegmentedStage(stage, graph, compiled=kind == "compiled")
            for _ in range(3):  # the last of three: compiled, warm allocator
                gc.collect()
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                before = malloc_in_use()
                loss = split.run(stage.state_tensors, stage.graph_inputs(flat))
                row[kind] = malloc_in_use() - before
                loss.backward()
                del loss
                ex.model.zero_grad(set_to_none=True)
        rows.append(row)
        print(row, flush=True)
    return rows


def _compile_time_worker(name: str) -> None:
    ex = _example(name, 4, 128)
    trainer = _trainer(ex, True)
    first = _step(trainer, ex)
    later = min(_step(trainer, ex) for _ in range(3))
    from partita.runtime.compiled_segments import compiled_count

    print(json.dumps(dict(model=name, first_s=first, step_s=later, functions=compiled_count())))


def compile_times() -> list[dict]:
    rows = []
    for name in DEPTHS:
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
            out = subprocess.run(
                [sys.executable, __file__, "--compile-time-worker", name],
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=1200,
            )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compiled_blocks.md")
    parser.add_argument("--compile-time-worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compile_time_worker:
        _compile_time_worker(args.compile_time_worker)
        return
    started = time.time()
    rows = speed(args.rounds)
    held = held_memory()
    depths = compile_times()
    lines = [
        "# Compiled blocks against eager execution on this CPU",
        "",
        f"- command: `{command_line()}`",
        f"- date: {now_utc()}; torch {torch.__version__}; 1 thread; wall time {time.time() - started:.0f} s",
        "- one rank, one stage, fp32, SGD; the two trainers stepped in turn on the same batch, "
        f"{args.rounds} rounds after two steps each (the first compiles, from inductor's on-disk cache as this "
        "machine had it: the compile times of an empty cache are in the last table); medians.",
        "",
        "## Step time",
        "",
        "| model | batch x tokens | graph nodes | eager step | compiled step | compiled / eager | predicted | "
        "first compiled step |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} x {r['tokens']} | {r['nodes']} | {r['eager_s'] * 1e3:.0f} ms | "
            f"{r['compiled_s'] * 1e3:.0f} ms | **{r['ratio']:.2f}** | {r['predicted']:.2f} | {r['first_compiled_s']:.1f} s |"
        )
    lines += [
        "",
        "## Memory held between forward and backward",
        "",
        "glibc's bytes in use after the stage's forward, less before it (the autograd graph's saved tensors"
        " and the loss), beside the memory model's activation count, which compiled blocks keep as an upper "
        "bound (`partita/cost/fusion.py`).",
        "",
        "| model | eager | compiled | compiled / eager | model (eager count) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in held:
        lines.append(
            f"| {r['model']} | {r['eager'] / 2**20:.1f} MiB | {r['compiled'] / 2**20:.1f} MiB | "
            f"**{r['compiled'] / r['eager']:.2f}** | {r['model_bytes'] / 2**20:.1f} MiB |"
        )
    lines += [
        "",
        "## Compile time by depth (fresh process, empty inductor cache)",
        "",
        "| model | functions compiled | first step | later step | compile time (first - later) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in depths:
        lines.append(
            f"| {r['model']} | {r['functions']} | {r['first_s']:.1f} s | {r['step_s'] * 1e3:.0f} ms | "
            f"{r['first_s'] - r['step_s']:.1f} s |"
        )
    compile_s = {r["model"]: r["first_s"] - r["step_s"] for r in depths}
    one, two, deep = (compile_s[name] for name in DEPTHS)
    lines += [
        "",
        f"32 layers compile in **{deep / one:.2f}x** the time of 1 layer (a model without repeats: one function "
        f"for the whole graph, the layer with the embedding and the head) and **{deep / two:.2f}x** that of 2 "
        "layers (the same three functions: before the layers, one layer, after them). The goal: at most 2x one "
        "block's.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
