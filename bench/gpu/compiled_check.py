"""Compiled blocks on one GPU (issue 55): a whole-model stage's forward and backward, eager and
compiled (``partita.runtime.compiled_segments``: one compiled function per distinct block),
timed side by side, each beside the analytic cost model's prediction, with the memory each holds
between forward and backward and the time the first compiled step took.

    python bench/gpu/compiled_check.py --out $OUT            (one H100 or H200: a few minutes)
    python bench/gpu/compiled_check.py --dry-run --device cpu --out /tmp/compiled-check

Models as ``check.py`` builds them (bf16 weights, eager attention, the zoo's synthetic batches):
GPT-2 medium (24 layers, 1,024 tokens) at 1 and 4 sequences, a Llama-7B-shaped model of 4 layers
(1,024 tokens) at 1 and 2. The dry run: the zoo's tiny GPT-2 and Llama in fp32. The eager and the
compiled run take turns, ``--rounds`` times after one step each (the compiled one compiles);
medians. ``predicted``: ``analytic_costs`` of the catalog entry named by the device (``h100``,
``h200``; else ``--analytic-device``), eager and ``compiled=True``, forward + backward summed.

Outputs in --out: ``compiled_check.md`` and ``compiled_check.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from check import ModelSpec, build_model, environment  # noqa: E402

import partita  # noqa: E402
from partita.cost.analytic import analytic_costs  # noqa: E402
from partita.runtime.compiled_segments import compiled_count  # noqa: E402
from partita.runtime.segments import SegmentedStage  # noqa: E402
from partita.runtime.stages import flatten_inputs, split_graph  # noqa: E402
from partita.types.devices import resolve_device  # noqa: E402


def _cases(dry_run: bool) -> list[tuple[ModelSpec, tuple[int, ...], torch.dtype]]:
    if dry_run:
        return [
            (ModelSpec("gpt2", "GPT-2 tiny (2 x 64)", "gpt2", "tiny", seq_len=32), (2,), torch.float32),
            (ModelSpec("llama", "Llama tiny (2 x 64, GQA)", "llama", "tiny", seq_len=32), (2,), torch.float32),
        ]
    return [
        (ModelSpec("gpt2", "GPT-2 medium (24 x 1024), seq 1024", "gpt2", "355m"), (1, 4), torch.bfloat16),
        (
            ModelSpec("llama", "Llama-7B-shaped, 4 layers, seq 1024", "llama", "7b", {"num_hidden_layers": 4}),
            (1, 2),
            torch.bfloat16,
        ),
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def _measure(spec: ModelSpec, batch: int, dtype: torch.dtype, device: torch.device, rounds: int, analytic) -> dict:
    built = build_model(spec, device, dtype)
    args, kwargs, _ = built.make_batch(batch, 0)
    graph = partita.capture(built.model, args, kwargs)
    flat = flatten_inputs(graph, args, kwargs)
    (stage,) = split_graph(graph, [0, graph.num_nodes])
    runs = {"eager": SegmentedStage(stage, graph), "compiled": SegmentedStage(stage, graph, compiled=True)}
    held: dict[str, int | None] = {}

    def step(kind: str) -> float:
        _sync(device)
        base = _allocated(device)
        start = time.perf_counter()
        loss = runs[kind].run(stage.state_tensors, stage.graph_inputs(flat))
        _sync(device)
        held[kind] = None if base is None else _allocated(device) - base
        loss.backward()
        _sync(device)
        elapsed = time.perf_counter() - start
        built.model.zero_grad(set_to_none=True)
        return elapsed

    before = compiled_count()
    first = {kind: step(kind) for kind in ("compiled", "eager")}
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for r in range(rounds):
        for kind in ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager"):
            times[kind].append(step(kind))
    eager, compiled = (statistics.median(times[k]) for k in ("eager", "compiled"))
    tables = {k: analytic_costs(graph, analytic, batch, compiled=k == "compiled") for k in ("eager", "compiled")}
    predicted = {k: float(t.forward_s.sum() + t.backward_s.sum()) for k, t in tables.items()}
    return dict(
        model=spec.label,
        batch=batch,
        dtype=str(dtype).removeprefix("torch."),
        nodes=graph.num_nodes,
        segments=runs["compiled"].num_segments,
        functions=compiled_count() - before,
        eager_s=eager,
        compiled_s=compiled,
        ratio=compiled / eager,
        predicted_eager_s=predicted["eager"],
        predicted_compiled_s=predicted["compiled"],
        predicted_ratio=predicted["compiled"] / predicted["eager"],
        first_compiled_s=first["compiled"],
        held_eager_bytes=held["eager"],
        held_compiled_bytes=held["compiled"],
        model_activation_bytes=int(tables["eager"].activation_bytes.sum()),
    )


def _markdown(rows: list[dict], env: dict, analytic: str, command: str) -> str:
    mib = lambda b: "-" if b is None else f"{b / 2**20:,.0f} MiB"  # noqa: E731
    lines = [
        "# Compiled blocks on one device: eager against compiled, measured and predicted",
        "",
        f"- command: `{command}`",
        f"- device: {env.get('device_name', env.get('device', '?'))}; torch {torch.__version__}; analytic entry `{analytic}`",
        "",
        "| model | batch | dtype | eager | compiled | compiled / eager | predicted ratio | predicted eager | "
        "predicted compiled | first compiled step | functions | held eager | held compiled | model (eager count) |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['dtype']} | {r['eager_s'] * 1e3:.1f} ms | {r['compiled_s'] * 1e3:.1f} ms | "
            f"**{r['ratio']:.2f}** | {r['predicted_ratio']:.2f} | {r['predicted_eager_s'] * 1e3:.1f} ms | "
            f"{r['predicted_compiled_s'] * 1e3:.1f} ms | {r['first_compiled_s']:.1f} s | {r['functions']} | "
            f"{mib(r['held_eager_bytes'])} | {mib(r['held_compiled_bytes'])} | {mib(r['model_activation_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny models (a CPU check of this script)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--analytic-device", default="h100", help="catalog entry when the device's name says none")
    args = parser.parse_args()
    device = torch.device(args.device)
    env = environment(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    analytic = next((k for k in ("h200", "h100") if k in name.lower()), "cpu" if device.type == "cpu" else None)
    analytic = analytic or args.analytic_device
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for spec, batches, dtype in _cases(args.dry_run):
        for batch in batches:
            rows.append(
                _measure(spec, batch, dtype, device, 1 if args.dry_run else args.rounds, resolve_device(analytic))
            )
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "compiled_check.json").write_text(json.dumps(dict(environment=env, rows=rows), indent=1))
    text = _markdown(rows, env, analytic, " ".join(sys.argv))
    (args.out / "compiled_check.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
