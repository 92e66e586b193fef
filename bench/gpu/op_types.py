"""Where the analytic model's time goes wrong, per operator: partita's profiler against the roofline.

``bench/gpu/check.py`` keeps, per configuration (model, dtype, micro-batch), each node's target
(``aten.mm.default``, ...), its roofline terms (``c``: FLOP-seconds at peak, ``m``: bytes over the full
bandwidth, ``n``: per-op overheads counted) and its time as partita's profiler measured it on the
device (one node at a time, scaled to the whole graph's run). Summed per operator, forward and
backward apart, they say which kind of operation the catalog's efficiencies miss:

- ``implied compute efficiency`` = sum of c / measured: what the operator's FLOPs ran at, against peak;
- ``implied memory efficiency`` = sum of m / measured: what its bytes moved at, against the bandwidth;
- ``us per op``: its measured time per node, the floor that launching and dispatching set.

A compute-bound operator (matmuls) is judged by the first, a memory-bound one (elementwise, softmax,
norms, copies) by the second, an operator with neither (views, ``getitem``) by the third.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

DIRECTIONS = (("forward", "f"), ("backward", "b"))


def short_target(target: str) -> str:
    """``aten.mm.default`` -> ``mm``; anything else as it is."""
    parts = target.split(".")
    return parts[1] if len(parts) == 3 and parts[0] == "aten" else target


def op_type_rows(config: dict) -> list[dict[str, Any]]:
    """Per operator and direction of one configuration: nodes, measured and roofline seconds, the
    implied efficiencies; [] when the configuration was not profiled. Largest measured time first."""
    nodes, terms = config.get("profiled_nodes"), config.get("terms")
    if not nodes or not terms:
        return []
    sums: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for direction, d in DIRECTIONS:
        measured = nodes[f"{direction}_s"]
        for i, target in enumerate(config["targets"]):
            if terms[f"n_{d}"][i] == 0 and measured[i] == 0:
                continue  # no work in this direction (a node without a backward)
            s = sums[(short_target(target), direction)]
            s["nodes"] += 1
            s["measured_s"] += measured[i]
            s["compute_s"] += terms[f"c_{d}"][i]
            s["memory_s"] += terms[f"m_{d}"][i]
    rows = []
    for (op, direction), s in sums.items():
        t = s["measured_s"]
        rows.append(
            {
                "model": config["model"],
                "dtype": config["dtype"],
                "microbatch_size": config["microbatch_size"],
                "op": op,
                "direction": direction,
                "nodes": int(s["nodes"]),
                "measured_ms": 1e3 * t,
                "compute_ms": 1e3 * s["compute_s"],
                "memory_ms": 1e3 * s["memory_s"],
                "compute_efficiency": s["compute_s"] / t if t > 0 else None,
                "memory_efficiency": s["memory_s"] / t if t > 0 else None,
                "us_per_op": 1e6 * t / s["nodes"],
            }
        )
    return sorted(rows, key=lambda r: -r["measured_ms"])


def op_type_table(data: dict, top: int = 8) -> list[str]:
    """Markdown: per profiled configuration, its ``top`` operators by measured time (both directions)."""
    lines = [
        "",
        "## Time per operator (profiled against the roofline)",
        "",
        "Per configuration, the operators that took the most time, forward and backward apart: partita's "
        "profiler (per node, scaled to the whole graph) against the roofline terms at peak (`compute ms`: "
        "FLOPs over peak, `memory ms`: bytes over the full bandwidth). `implied` efficiencies are roofline over "
        "measured: compare a compute-bound operator's with the catalog's compute efficiency, a memory-bound "
        "one's with its memory efficiency; `us per op` is the floor set by launching each node.",
        "",
        "| model | dtype | mb | op | direction | nodes | measured ms | compute ms | memory ms | implied compute eff. "
        "| implied memory eff. | us per op |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    found = False
    for config in data["configs"]:
        for r in op_type_rows(config)[:top]:
            found = True
            lines.append(
                f"| {r['model']} | {r['dtype']} | {r['microbatch_size']} | {r['op']} | {r['direction']} | "
                f"{r['nodes']} | {r['measured_ms']:.3g} | {r['compute_ms']:.3g} | {r['memory_ms']:.3g} | "
                f"{_ratio(r['compute_efficiency'])} | {_ratio(r['memory_efficiency'])} | {r['us_per_op']:.1f} |"
            )
    return lines if found else lines[:3] + ["(no configuration was profiled)"]


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
