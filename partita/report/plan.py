"""The `partita plan` report: the chosen plan as a table, and the baselines side by side."""

from __future__ import annotations

from collections.abc import Mapping

from partita.report.format import (
    fmt_bytes,
    fmt_layout,
    fmt_microbatches,
    fmt_ranks,
    fmt_seconds,
    fmt_sharding,
    table,
)
from partita.types import Accumulation, Plan, StagePlan
from partita.units import counted


def plan_text(
    plan: Plan, *, baselines: Mapping[str, Plan | None] = (), baseline_reasons: Mapping[str, str] = ()
) -> str:
    """Stages (modules, ranks, params, whole blocks, sharding, memory vs limit, times, cut bytes), the memory of
    each rank group's devices by kind, then the step figures, with each plan's layout. The
    header names the tensor-parallel degree (and sequence parallelism); a stage's params, memory
    and cut bytes are then one device's of its group, and its times include the group's
    collectives. The recompute column is each stage's level (none, selective, full; with the blocks
    it recomputes where it recomputes only its first ones), its backward time including what that
    level recomputes; the memory table names each rank group's. A stage
    runs by block: each of its whole blocks is one FSDP2 unit when it is sharded (the rest of the
    stage one more) and one recomputation segment (``partita.types.segments``).

    ``baseline_reasons`` (``PlanningResult.baseline_reasons``) tells a baseline that cannot make the
    plan's stage count ("fits: n/a", with the reason below the table) from one that does not fit
    the memory ("fits: no"); without it every missing baseline shows "no".

    The efficiency column needs ``plan.total_compute_s`` (forward + backward seconds of one whole
    step on one device; the ideal step is this divided by the cluster's devices, for every plan): "-"
    without it.
    """
    total_compute_s = plan.total_compute_s
    reasons = dict(baseline_reasons)
    unsplittable = {name: why for name, why in reasons.items() if why.startswith("cannot split")}
    limit = int(plan.options.get("memory_limit_bytes", 0))
    rows = [
        (
            s.index,
            s.module_range,
            fmt_ranks(s),
            fmt_bytes(s.param_bytes),
            "-" if s.blocks is None else str(s.blocks),
            _sharding_cell(s),
            f"{fmt_bytes(s.memory_bytes)} / {fmt_bytes(limit)}",
            fmt_seconds(s.forward_s),
            fmt_seconds(s.backward_s),
            _recompute_cell(s),
            fmt_bytes(s.cut_bytes),
        )
        for s in plan.stages
    ]
    lines = [
        f"plan: {counted(plan.num_stages, 'stage')} on {fmt_layout(plan)}, schedule {plan.schedule.value}, "
        f"{fmt_microbatches(plan)}, global batch {plan.global_batch_size}, precision {plan.precision.value}"
        f"{', compiled blocks' if plan.compile else ''}, costs {plan.cost_source}",
        table(
            [
                "stage",
                "modules",
                "ranks",
                "params",
                "blocks",
                "sharding",
                "memory/device",
                "fwd/mb",
                "bwd/mb",
                "recompute",
                "cut",
            ],
            rows,
            align="llrrrlrrrrr",
        ),
        *_memory_lines(plan),
        "",
        table(
            ["plan", "fits", "step", "samples/s", "bubble", "efficiency", "vs partita", "layout"],
            [_summary_row("partita", plan, plan, total_compute_s)]
            + [
                _summary_row(name, p, plan, total_compute_s, name in unsplittable)
                for name, p in dict(baselines).items()
            ],
            align="lrrrrrrl",
        ),
        "efficiency = ideal step (total compute / the cluster's devices) / predicted step",
    ]
    lines += [f"n/a: {name} {why}" for name, why in unsplittable.items() if dict(baselines).get(name) is None]
    available = plan.cluster.num_devices
    if plan.num_devices < available:
        lines.append(
            f"note: the plan uses {plan.num_devices} of {available} devices: no plan over more of them was faster "
            f"(replicas must divide the global batch of {plan.global_batch_size}, micro-batches must divide a "
            f"replica's share, and every stage needs work of its own)"
        )
        if plan.cluster.is_mixed:
            lines.append(f"idle devices: {_idle_by_type(plan)}")
    return "\n".join(lines)


def _recompute_cell(stage: StagePlan) -> str:
    """A stage's recomputation level, with '(n of N blocks)' where it recomputes only its first n."""
    if stage.recompute_blocks is None:
        return stage.recompute.value
    return f"{stage.recompute.value} ({stage.recompute_blocks} of {stage.blocks} blocks)"


def _sharding_cell(stage: StagePlan) -> str:
    """A stage's sharding level, and ', grads sharded' where it reduce-scatters its gradients in
    every backward (``Accumulation.SHARDED``); '-' for one replica."""
    if stage.num_replicas == 1:
        return "-"
    sharded = stage.accumulation is Accumulation.SHARDED
    return fmt_sharding(stage.sharding) + (", grads sharded" if sharded else "")


def _idle_by_type(plan: Plan) -> str:
    """The devices of each type the plan leaves idle, e.g. "4 x v100-32gb"."""
    cluster, used = plan.cluster, {r for s in plan.stages for r in s.ranks}
    idle = []
    for g, group in enumerate(cluster.group_clusters):
        count = sum(r not in used for r in cluster.group_ranks(g))
        if count:
            idle.append(f"{count} x {group.device.name}")
    return ", ".join(idle)


def _memory_lines(plan: Plan) -> list[str]:
    """The peak memory of each rank group's devices by kind (plans with predictions only)."""
    groups = {}
    for s in plan.stages:
        if s.memory_breakdown is not None:
            groups.setdefault(s.rank_group, s)
    if not groups:
        return []
    rows = [
        (
            g,
            *(fmt_bytes(b) for b in (m.params_bytes, m.grads_bytes, m.optimizer_bytes, m.activations_bytes)),
            fmt_bytes(m.buffers_bytes),
            fmt_bytes(m.total_bytes),
            s.recompute.value,
        )
        for g, s, m in ((g, s, s.memory_breakdown) for g, s in sorted(groups.items()))
    ]
    headers = ["rank group", "params", "grads", "optimizer", "activations", "buffers", "peak/device", "recompute"]
    return ["", "memory per device at its peak (optimizer: states + fp32 master weights)", table(headers, rows)]


def _layout(p: Plan) -> str:
    """'2x4 tp2 sp grads+opt': rank groups x replicas, the tensor-parallel degree (when above 1; per
    stage, 'tp4+2', where they differ; sp: with sequence parallelism), and the sharding levels of
    replicated stages."""
    levels = sorted({fmt_sharding(s.sharding) for s in p.stages if s.num_replicas > 1})
    counts = "+".join(str(s.num_replicas) for s in p.stages[: p.num_rank_groups]) if not p.uniform_replicas else None
    shape = f"{p.num_rank_groups}x{counts or p.stages[0].num_replicas}"
    degrees = (
        str(p.tensor_parallel) if p.uniform_tensor_parallel else "+".join(str(s.tensor_parallel) for s in p.stages)
    )
    parallel = [f"tp{degrees}"] + (["sp"] if p.sequence_parallel else []) if p.tensor_parallel > 1 else []
    parts = [shape, *parallel, "/".join(levels)]
    return " ".join(part for part in parts if part)


def _summary_row(
    name: str, p: Plan | None, reference: Plan, total_compute_s: float | None, unsplittable: bool = False
) -> tuple:
    if p is None:
        return (name, "n/a" if unsplittable else "no", "-", "-", "-", "-", "-", "-")
    if not p.predicted_step_s or not reference.predicted_step_s:  # a manual plan: nothing predicted
        return (name, "yes", "-", "-", "-", "-", "-", _layout(p))
    # of the cluster's devices, the same for every plan: one that leaves devices idle is less efficient
    # (over its own devices alone a baseline on fewer of them showed more than 100%)
    devices = max(1, reference.cluster.num_devices)
    efficiency = "-" if total_compute_s is None else f"{total_compute_s / devices / p.predicted_step_s:.1%}"
    return (
        name,
        "yes",
        fmt_seconds(p.predicted_step_s),
        f"{p.global_batch_size / p.predicted_step_s:,.1f}",
        f"{p.predicted_bubble_fraction:.1%}",
        efficiency,
        f"{p.predicted_step_s / reference.predicted_step_s:.2f}x",
        _layout(p),
    )
