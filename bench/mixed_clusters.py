"""Mixed clusters (several device types): partita's plan against the two baselines and a homogeneous
cluster of the same total peak FLOP/s; planning time on a mixed cluster of 1,024 devices.

Predicted steps, analytic costs (``PlanOptions(costs="analytic")``), bf16 where every type runs it,
AdamW, nodes of 8. Models captured on ``meta``: GPT at Megatron-LM's 1.7B, 7.5B and 18.4B shapes
(``bench/_megatron.py``, sequence 2048) and Llama 2 7B and 13B (``partita.examples``, sequence 2048).

Columns, each a simulated step on the same cluster and global batch:

  partita      ``partita.plan`` on the mixed cluster: the best of the mixed search (stages placed
               on device types, unequal sample shares between replicas of unequal speed, stages
               over both types, type blocks in either order of the groups, at every
               tensor-parallel degree that tiles both groups) and the two baselines
  one degree   partita's plan with one tensor-parallel degree for every stage (the mixed search's
               runs of one degree and both baselines): what giving each device type a degree of its
               own (``per_type_degree_runs``, next to the best degree) adds is its step / partita's
  fastest      the best plan on the fastest type's devices alone (the other type idle)
  slowest      the best plan over every device taken as the slowest type (its memory and links)
  ideal        the mixed cluster's samples/s over the fastest type's alone if every device computed
               at its type's speed with nothing in the way (``ideal_over_fastest``): what adding the
               other type can give at most, were both used perfectly
  homog.       per peak FLOP/s, the mixed plan's samples/s against the best plan's on a cluster of
               the fastest type alone with about the same total peak (``homog_devices``): 1.00 means
               the mixed cluster uses its peak as well as a homogeneous one (HexiScale's measure)

Usage:  python bench/mixed_clusters.py [--out bench/results/mixed_clusters.md] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _megatron  # noqa: E402
import torch  # noqa: E402

import partita  # noqa: E402
from partita import examples  # noqa: E402
from partita.errors import InfeasiblePlanError  # noqa: E402
from partita.planning.api import plan as plan_one_type  # noqa: E402
from partita.planning.device_groups import degree_runs, mixed_run  # noqa: E402
from partita.planning.hetero import best_mixed, plan_mixed  # noqa: E402
from partita.types.cluster import Cluster, DeviceGroup  # noqa: E402

OPTIONS = partita.PlanOptions(costs="analytic")
CLUSTERS = {
    "8 H100 + 16 A100-40GB": [("h100", 8), ("a100-40gb", 16)],
    "16 A100-80GB + 16 L4": [("a100-80gb", 16), ("l4", 16)],
}
MODELS = ["gpt-1.7B", "gpt-7.5B", "gpt-18.4B", "llama-7b", "llama-13b"]
SCALE_CASE = ("llama-13b", [("h100", 512), ("a100-40gb", 512)], 1024)  # planning time at 1,024 devices


def capture(name: str):
    if name.startswith("gpt-"):
        return _megatron.capture(_megatron.BY_NAME[name[4:]])
    ex = examples.build(name, batch_size=2, seq_len=2048, device="meta")
    return partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def mixed_cluster(groups) -> Cluster:
    return Cluster(groups=[DeviceGroup(device, n, 8) for device, n in groups])


def peak_flops(cluster: Cluster, precision: str) -> float:
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[precision]
    return sum(c.num_devices * c.device.peak_flops.get(dtype, c.device.peak_flops["float32"]) for c in _groups(cluster))


def _groups(cluster: Cluster):
    return cluster.group_clusters if cluster.is_mixed else (cluster,)


def homog_devices(cluster: Cluster, device: str, precision: str) -> int:
    """Devices of ``device`` with about ``cluster``'s total peak: the nearest multiple of 8."""
    one = Cluster(device=device, num_devices=8, devices_per_node=8)
    return max(8, 8 * round(peak_flops(cluster, precision) / peak_flops(one, precision)))


def ideal_over_fastest(run, samples: int = 4) -> float:
    """Every device computing at its own type's speed with nothing else in the way (no communication,
    bubble or memory limit): the mixed cluster's samples/s over the fastest group's alone. Each
    type's seconds per sample of a whole forward + backward at ``samples`` samples
    (``MixedRun.seconds_per_sample``, degree 1)."""
    seconds, rates = [], []
    for g, c in enumerate(run.cluster.group_clusters):
        fixed, per_sample = run.seconds_per_sample(g, samples)
        seconds.append(fixed + per_sample * samples)
        rates.append(c.num_devices * samples / seconds[-1])
    return sum(rates) / rates[seconds.index(min(seconds))]


def run_case(model: str, graph, cluster_name: str, groups, batch: int) -> dict:
    cluster = mixed_cluster(groups)
    start = time.perf_counter()
    outcome = plan_mixed(graph, cluster=cluster, global_batch_size=batch, plan_one_type=plan_one_type, options=OPTIONS)
    total_s = time.perf_counter() - start
    (fast_name, fast), (slow_name, slow) = outcome.baselines.items()
    one_degree = [best_mixed(r)[0] for r in outcome.runs.values() if r.degrees is None] + [fast, slow]
    one_degree = min((p for p in one_degree if p is not None), key=lambda p: p.predicted_step_s, default=None)
    fastest = fast_name[fast_name.index("(") + 1 : -1]  # "fastest type only (h100)"
    precision = outcome.plan.precision.value
    n = homog_devices(cluster, fastest, precision)
    homog_cluster = Cluster(device=fastest, num_devices=n, devices_per_node=8)
    try:
        homog = plan_one_type(graph, cluster=homog_cluster, global_batch_size=batch, options=OPTIONS)
    except InfeasiblePlanError:
        homog = None
    return dict(
        model=model,
        cluster=cluster_name,
        batch=batch,
        precision=precision,
        plan=outcome.plan,
        one_degree=one_degree,
        fastest=fast,
        slowest=slow,
        homog=homog,
        homog_label=f"{n} {fastest}",
        per_peak=None
        if homog is None
        else (batch / outcome.plan.predicted_step_s / peak_flops(cluster, precision))
        / (batch / homog.predicted_step_s / peak_flops(homog_cluster, precision)),
        planning_s=total_s,
        ideal=ideal_over_fastest(outcome.run),
    )


def scale_case() -> dict:
    model, groups, batch = SCALE_CASE
    graph = capture(model)
    cluster = mixed_cluster(groups)
    start = time.perf_counter()
    run = mixed_run(graph, cluster=cluster, global_batch_size=batch, options=OPTIONS)
    tables_s = time.perf_counter() - start
    start = time.perf_counter()
    runs = degree_runs(run)
    tables_s += time.perf_counter() - start
    searched = []
    for each in runs:  # the mixed search at each tensor-parallel degree, timed apart
        start = time.perf_counter()
        found, why = best_mixed(each)
        searched.append((each.tensor_parallel, time.perf_counter() - start, found, why))
    search_s = sum(seconds for _, seconds, _, _ in searched)
    found = min((f for _, _, f, _ in searched if f is not None), key=lambda p: p.predicted_step_s, default=None)
    why = "; ".join(w for _, _, _, w in searched if w)
    start = time.perf_counter()
    outcome = plan_mixed(graph, cluster=cluster, global_batch_size=batch, plan_one_type=plan_one_type, options=OPTIONS)
    whole_s = time.perf_counter() - start
    return dict(
        model=model,
        groups=groups,
        batch=batch,
        plan=found,
        why=why,
        tables_s=tables_s,
        search_s=search_s,
        by_degree=[(t, seconds) for t, seconds, _, _ in searched],
        whole_s=whole_s,
        outcome=outcome,
    )


def fmt_step(plan) -> str:
    return "no plan" if plan is None else f"{plan.predicted_step_s:.3f} s"


def layout(plan) -> str:
    if plan is None:
        return "-"
    cluster = plan.cluster
    parts = []
    for s in plan.stages:
        if cluster.is_mixed:
            names = [cluster.group_clusters[cluster.group_of_rank(r)].device.name for r in s.ranks]
            types = "+".join(f"{names.count(t)} {t}" for t in dict.fromkeys(names))
        else:
            types = f"{len(s.ranks)} {cluster.device.name}"
        share = f" shares {list(s.replica_samples)}" if s.replica_samples else ""
        tp = f" tp{s.tensor_parallel}" if s.tensor_parallel > 1 else ""
        parts.append(f"[{s.stop - s.start} nodes: {types}{tp}{share}]")
    head = f"{plan.schedule.value} m={plan.num_microbatches}"
    if len(parts) > 4:
        parts = parts[:2] + [f"... {len(parts) - 4} more ..."] + parts[-2:]
    return head + " " + " ".join(parts)


def _ratio(slower, plan) -> str:
    return "-" if slower is None or plan is None else f"{slower.predicted_step_s / plan.predicted_step_s:.3f}x"


def speedup(plan, baselines) -> str:
    found = [b.predicted_step_s for b in baselines if b is not None]
    return "-" if plan is None or not found else f"{min(found) / plan.predicted_step_s:.2f}x"


def table(results: list[dict]) -> list[str]:
    lines = [
        "| model | cluster | batch | prec. | partita | one degree (vs partita) | fastest only | slowest everywhere "
        "| partita vs better baseline | ideal vs fastest only | homog. (per peak) | plan s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = (r["fastest"], r["slowest"])
        homog = "-" if r["per_peak"] is None else f"{r['per_peak']:.2f} ({r['homog_label']}: {fmt_step(r['homog'])})"
        lines.append(
            f"| {r['model']} | {r['cluster']} | {r['batch']} | {r['precision']} | {fmt_step(r['plan'])} "
            f"| {fmt_step(r['one_degree'])} ({_ratio(r['one_degree'], r['plan'])}) "
            f"| {fmt_step(r['fastest'])} | {fmt_step(r['slowest'])} "
            f"| {speedup(r['plan'], base)} | {r['ideal']:.2f}x | {homog} | {r['planning_s']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/mixed_clusters.md")
    parser.add_argument("--quick", action="store_true", help="GPT-1.7B on the first cluster only")
    parser.add_argument("--models", nargs="*", default=MODELS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = ["gpt-1.7B"] if args.quick else args.models
    clusters = dict(list(CLUSTERS.items())[:1]) if args.quick else CLUSTERS
    results = []
    for model in models:
        graph = capture(model)
        for name, groups in clusters.items():
            batch = 4 * sum(n for _, n in groups)
            results.append(run_case(model, graph, name, groups, batch))
            print("\n".join(table(results)[-1:]), flush=True)
    scale = None if args.quick else scale_case()
    write(args.out, results, scale)


def write(path: str, results: list[dict], scale: dict | None) -> None:
    lines = [
        "# Mixed clusters: partita's plan against both baselines (predicted, analytic costs)",
        "",
        f"Command: `{' '.join(shlex.quote(a) for a in ['python', *sys.argv])}`  ",
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.node()} "
        f"(torch {torch.__version__}; a shared 2-core VM: planning seconds are noisy)",
        "",
        "Steps are partita's simulated steps under its analytic cost model, not measurements.",
        "Columns: see the docstring of bench/mixed_clusters.py. Global batch = 4 x devices.",
        "",
        *table(results),
        "",
        "Layouts (stage by stage: blocks of graph nodes, devices by type):",
        "",
    ]
    for r in results:
        lines.append(f"- {r['model']}, {r['cluster']}: partita `{layout(r['plan'])}`")
    if scale is not None:
        groups = " + ".join(f"{n} {d}" for d, n in scale["groups"])
        lines += [
            "",
            f"## Planning time on {groups} ({scale['model']}, global batch {scale['batch']})",
            "",
            f"- planning contexts of both types at every degree (their cost tables are made as the search asks): "
            f"{scale['tables_s']:.1f} s",
            f"- mixed search (configs, stage DPs, simulation, refinement) at every tensor-parallel degree: "
            f"{scale['search_s']:.1f} s (goal < 30 s; "
            + ", ".join(f"degree {t}: {seconds:.1f} s" for t, seconds in scale["by_degree"])
            + ")",
            f"- plan: {fmt_step(scale['plan'])} `{layout(scale['plan'])}` {scale['why']}",
            f"- the whole `partita.plan` (contexts, the mixed search and both baselines, each a one-type "
            f"search with tensor parallelism): {scale['whole_s']:.1f} s; its plan {fmt_step(scale['outcome'].plan)} "
            f"`{layout(scale['outcome'].plan)}`; baselines: "
            + "; ".join(f"{name} {fmt_step(p)}" for name, p in scale["outcome"].baselines.items()),
        ]
    Path(path).write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
