"""The `partita inspect` report: what a captured graph holds, as text or JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from partita.report.format import fmt_bytes, fmt_count, fmt_flops, table
from partita.types import OpGraph


@dataclass(frozen=True)
class ModuleSummary:
    path: str  # module path ("" is the whole model)
    num_nodes: int
    num_parameters: int  # trainable elements of the parameters under this path (tied: once, at the canonical name)
    flops: int  # forward FLOPs of the nodes under this path
    activation_bytes: int  # bytes of new tensors the nodes under this path produce (views excluded)


def module_summaries(graph: OpGraph, depth: int) -> list[ModuleSummary]:
    """One summary per module prefix of at most ``depth`` components, in program order."""
    totals = _sum_by_module(graph, depth, lambda node: (1, node.flops, node.bytes_written))
    order = list(totals)
    params = {p: 0 for p in order}
    for info in graph.parameters.values():
        if info.is_buffer or not info.requires_grad:
            continue
        for prefix in _prefixes(info.name.rsplit(".", 1)[0] if "." in info.name else "", depth):
            if prefix in params:
                params[prefix] += info.numel
    return [ModuleSummary(p, totals[p][0], params[p], totals[p][1], totals[p][2]) for p in order]


def _sum_by_module(graph: OpGraph, depth: int, values) -> dict[str, list]:
    """Sums of ``values(node)`` (a tuple) per module prefix of at most ``depth`` components, in
    program order (dicts keep insertion order)."""
    totals: dict[str, list] = {}
    for node in graph.nodes:
        row = values(node)
        for prefix in _prefixes(node.module_path, depth):
            t = totals.setdefault(prefix, [0] * len(row))
            for k, v in enumerate(row):
                t[k] += v
    return totals


def _prefixes(path: str, depth: int) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[:k]) for k in range(0, min(len(parts), depth) + 1)]


def inspect_dict(graph: OpGraph, *, depth: int = 3, top: int = 10) -> dict[str, Any]:
    """Machine-readable summary (the --json output)."""
    largest = sorted((n for n in graph.nodes if n.bytes_written), key=lambda n: (-n.bytes_written, n.index))[:top]
    return {
        "fingerprint": graph.fingerprint,
        "num_nodes": graph.num_nodes,
        "num_parameters": graph.num_parameters,
        "parameter_bytes": graph.parameter_bytes,
        "total_flops": graph.total_flops,
        "batch_size": graph.batch_size,
        "dynamic_batch": graph.dynamic_batch,
        "loss_node": graph.nodes[graph.loss_node].name,
        "inputs": [
            {
                "name": g.name,
                "path": g.path,
                "shape": list(g.tensor.shape) if g.tensor else None,
                "dtype": g.tensor.dtype if g.tensor else None,
            }
            for g in graph.inputs
        ],
        "largest_activations": [
            {
                "node": n.name,
                "target": n.target,
                "module": n.module_path,
                "source": n.source,
                "shape": [list(t.shape) for t in n.outputs],
                "bytes": n.bytes_written,
            }
            for n in largest
        ],
        "modules": [vars(m) for m in module_summaries(graph, depth)],
    }


def inspect_text(graph: OpGraph, *, name: str = "model", depth: int = 3, top: int = 10) -> str:
    """The readable report: totals, the largest activations and a per-module breakdown."""
    data = inspect_dict(graph, depth=depth, top=top)
    inputs = ", ".join(
        f"{i['name']} {tuple(i['shape']) if i['shape'] else ''} {i['dtype'] or ''}".strip() for i in data["inputs"]
    )
    lines = [
        f"{name}: {graph.num_nodes} nodes, {fmt_count(graph.num_parameters)} parameters "
        f"({fmt_bytes(graph.parameter_bytes)}), {fmt_flops(graph.total_flops)} forward per step "
        f"at batch {graph.batch_size}",
        f"inputs: {inputs}",
        f"loss: node {data['loss_node']}   graph fingerprint: {graph.fingerprint}",
        "",
        f"Largest activations (top {top}):",
        table(
            ["node", "op", "module", "shape", "bytes"],
            [
                (
                    a["node"],
                    a["target"],
                    a["module"] or "(root)",
                    " ".join(str(tuple(s)) for s in a["shape"]),
                    fmt_bytes(a["bytes"]),
                )
                for a in data["largest_activations"]
            ],
            align="lllrr",
        ),
        "",
        f"Per module (depth {depth}; activations = bytes of new tensors produced):",
        table(
            ["module", "nodes", "params", "forward FLOPs", "activations"],
            [
                (
                    _indent(m.path),
                    m.num_nodes,
                    fmt_count(m.num_parameters),
                    fmt_flops(m.flops),
                    fmt_bytes(m.activation_bytes),
                )
                for m in module_summaries(graph, depth)
            ],
        ),
    ]
    return "\n".join(lines)


def _indent(path: str) -> str:
    if not path:
        return "(model)"
    parts = path.split(".")
    label = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
    return "  " * len(parts) + label


def costs_text(graph: OpGraph, costs, *, depth: int = 3) -> str:
    """Per-module forward/backward time and saved activations from a CostTable."""
    from partita.report.format import fmt_seconds

    rows = _sum_by_module(
        graph,
        depth,
        lambda node: (
            float(costs.forward_s[node.index]),
            float(costs.backward_s[node.index]),
            float(costs.activation_bytes[node.index]),
        ),
    )
    order = list(rows)
    header = (
        f"Costs ({costs.source} on {costs.device}, micro-batch {costs.microbatch_size}): "
        f"forward {fmt_seconds(float(costs.forward_s.sum()))}, backward {fmt_seconds(float(costs.backward_s.sum()))}, "
        f"saved for backward {fmt_bytes(float(costs.activation_bytes.sum()))}"
    )
    return (
        header
        + "\n"
        + table(
            ["module", "forward", "backward", "saved activations"],
            [(_indent(p), fmt_seconds(rows[p][0]), fmt_seconds(rows[p][1]), fmt_bytes(rows[p][2])) for p in order],
        )
    )
