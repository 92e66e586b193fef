"""A plan and its simulated step as one picture: memory per stage beside the pipeline timeline.

The same data as ``report.plan.plan_text`` and ``report.timeline.timeline_text``, drawn:

- left: each stage's predicted peak memory per device (``StagePlan.memory_bytes``; stages that
  share a rank group share its devices, so they show the group's peak) against the usable limit
  ``plan.options["memory_limit_bytes"]``, with the same stage under the baselines' splits beside it;
- right: the timeline as a Gantt chart, one row per rank group, a box per action coloured by kind
  (F, B, I, W), the micro-batch number written in boxes wide enough for it; a rank group's
  second and later virtual stages are drawn lighter; all-reduces run beside compute and are drawn
  as a thin strip under the row.

matplotlib is imported only when a figure is drawn (the ``plot`` extra), with the Agg backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from partita.report.format import fmt_bytes, fmt_layout, fmt_microbatches, fmt_seconds
from partita.types import Plan
from partita.units import counted

if TYPE_CHECKING:  # report/ depends on data only: SimResult is read by duck typing
    from partita.types import SimResult

__all__ = ["plan_figure"]

GIB = 2**30
KIND_COLOURS = {
    "F": "#4C72B0",
    "B": "#DD8452",
    "I": "#C44E52",
    "W": "#8172B3",
    "allreduce": "#55A868",
    "allgather": "#64B5CD",
    "optimizer": "#937860",
}
STRIP_KINDS = ("allreduce", "allgather", "optimizer")  # drawn as thin strips under a rank group's compute boxes
KIND_LABELS = {
    "F": "forward",
    "B": "backward",
    "I": "backward (input)",
    "W": "backward (weight)",
    "allreduce": "gradient all-reduce / reduce-scatter",
    "allgather": "parameter all-gather",
    "optimizer": "optimizer step",
}
BASELINE_COLOURS = ("#BBBBBB", "#888888", "#555555")
MIN_LABEL_PIXELS = 9.0  # a box narrower than this per character gets no micro-batch number
MAX_EDGED_BOXES_PER_ROW = 300  # beyond this, boxes are drawn without separating edges


def plan_figure(plan: Plan, sim_result: SimResult, path, *, baselines: Mapping[str, Plan | None] = {}) -> None:
    """Write the memory panel and the timeline of ``plan`` to ``path`` (PNG, or SVG/PDF by extension).

    ``sim_result`` is ``simulate(plan, ...)`` with its timeline kept. ``baselines`` (name -> Plan,
    or None for a baseline that does not fit) add their per-stage memory beside partita's.
    Output is deterministic: the same inputs give the same file.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = plan.num_rank_groups
    width = 15.0
    height = max(3.6, 1.2 + 0.42 * rows)
    with plt.rc_context({"svg.hashsalt": "partita", "font.size": 9}):
        fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(width, height), width_ratios=(1, 3), layout="constrained")
        _memory_panel(mem_ax, plan, baselines)
        _timeline_panel(fig, time_ax, plan, sim_result)
        fig.suptitle(_title(plan, sim_result), fontsize=10)
        fig.savefig(path, dpi=110, metadata=_metadata(str(path)))
        plt.close(fig)


def _title(plan: Plan, result: SimResult) -> str:
    recompute = sum(1 for s in plan.stages if s.recompute)
    return (
        f"{plan.method}: {counted(plan.num_stages, 'stage')} on {fmt_layout(plan)}, {plan.schedule.value}, "
        f"{fmt_microbatches(plan)}, recompute {recompute}/{plan.num_stages} stages; "
        f"step {fmt_seconds(result.step_s)}, bubble {result.bubble_fraction:.1%}"
    )


def _metadata(path: str) -> dict:
    """No creation dates or software versions in the file, so that it is byte-for-byte reproducible."""
    if path.lower().endswith(".svg"):
        return {"Date": None, "Creator": None}
    if path.lower().endswith(".pdf"):
        return {"CreationDate": None, "Creator": None, "Producer": None}
    return {"Software": None}


def _memory_panel(ax, plan: Plan, baselines: Mapping[str, Plan | None]) -> None:
    limit = int(plan.options.get("memory_limit_bytes", 0))
    others = [(name, p) for name, p in dict(baselines).items() if p is not None and p.num_stages == plan.num_stages]
    series = [(plan.method, plan)] + others
    peak = max(s.memory_bytes for _, p in series for s in p.stages)
    # A limit far above every bar would flatten them: then it is named in the legend, not drawn.
    limit_drawn = limit > 0 and peak >= 0.05 * limit
    unit, scale = ("GiB", GIB) if max(peak, limit if limit_drawn else 0) >= GIB else ("MiB", 2**20)
    bar_width = 0.8 / len(series)
    for k, (name, p) in enumerate(series):
        xs = [s.index - 0.4 + (k + 0.5) * bar_width for s in p.stages]
        colour = KIND_COLOURS["F"] if k == 0 else BASELINE_COLOURS[(k - 1) % len(BASELINE_COLOURS)]
        ax.bar(xs, [s.memory_bytes / scale for s in p.stages], width=bar_width, color=colour, label=name, zorder=2)
        for x, s in zip(xs, p.stages):
            if s.recompute:  # recomputed stages marked above the bar: R full, S selective
                mark = "S" if s.recompute.value == "selective" else "R"
                ax.text(x, s.memory_bytes / scale, mark, ha="center", va="bottom", fontsize=7)
    if limit_drawn:
        ax.axhline(
            limit / scale, color="#C44E52", linestyle="--", linewidth=1.2, zorder=3, label=f"limit {fmt_bytes(limit)}"
        )
    elif limit:
        ax.plot([], [], " ", label=f"limit {fmt_bytes(limit)} (off scale)")
    missing = [name for name, p in dict(baselines).items() if p is None]
    if missing:  # a baseline that does not fit, or cannot make this many stages
        ax.plot([], [], " ", label="no plan: " + ", ".join(missing))
    ax.set_xlabel("stage (R: recomputed, S: selectively)")
    ax.set_ylabel(f"peak memory per device ({unit})")
    ax.set_title("memory per stage")
    step = max(1, -(-plan.num_stages // 16))
    ax.set_xticks([t for t in range(plan.num_stages) if t % step == 0])
    ax.grid(axis="y", alpha=0.3, zorder=0)
    top = max(peak, limit if limit_drawn else 0) / scale
    legend_rows = -(-len(ax.get_legend_handles_labels()[0]) // 2)
    ax.set_ylim(0, top * (1.2 + 0.12 * legend_rows))  # headroom for the legend above the bars
    ax.legend(loc="upper left", ncol=2, fontsize=7, framealpha=0.9)


def _timeline_panel(fig, ax, plan: Plan, result: SimResult) -> None:
    rows = len(result.rank_busy_s)
    step = result.step_s if result.step_s > 0 else 1.0
    boxes: dict[tuple[str, bool], list] = {}
    strips: list[tuple[str, int, float, float]] = []
    for e in result.timeline:
        if e.kind in STRIP_KINDS:
            strips.append((e.kind, e.rank_group, e.start_s, e.end_s - e.start_s))
        else:
            later_chunk = e.stage >= rows  # a rank group's second (or later) virtual stage
            boxes.setdefault((e.kind, later_chunk), []).append(e)
    # White edges separate neighbouring boxes, but would whiten a row of boxes narrower than a pixel.
    per_row = max(1, sum(len(events) for events in boxes.values()) // rows)
    edge = 0.3 if per_row <= MAX_EDGED_BOXES_PER_ROW else 0.0
    for (kind, later_chunk), events in sorted(boxes.items()):
        for r in range(rows):
            spans = [(e.start_s, e.end_s - e.start_s) for e in events if e.rank_group == r]
            if spans:
                ax.broken_barh(
                    spans,
                    (r - 0.4, 0.62),
                    facecolors=KIND_COLOURS[kind],
                    alpha=0.55 if later_chunk else 1.0,
                    edgecolor="white",
                    linewidth=edge,
                )
    for kind in STRIP_KINDS:
        for r in range(rows):
            spans = [(start, length) for k, group, start, length in strips if group == r and k == kind]
            if spans:
                ax.broken_barh(spans, (r + 0.26, 0.12), facecolors=KIND_COLOURS[kind], linewidth=0)
    ax.set_xlim(0, step * 1.005)
    ax.set_ylim(rows - 0.5, -0.5)  # rank group 0 on top
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"group {r}" for r in range(rows)])
    ax.set_xlabel(f"time (s); step {fmt_seconds(result.step_s)}")
    ax.set_title("simulated step (lighter: a rank group's later virtual stage)")
    _label_microbatches(fig, ax, result)
    _timeline_legend(ax, result)


def _label_microbatches(fig, ax, result: SimResult) -> None:
    """Write the micro-batch number in every compute box wide enough to hold it."""
    fig.canvas.draw()  # the layout is final only after a draw: box widths in pixels depend on it
    x0, x1 = ax.get_xlim()
    pixels_per_s = ax.get_window_extent().width / (x1 - x0)
    for e in result.timeline:
        if e.kind in STRIP_KINDS:
            continue
        text = str(e.microbatch)
        if (e.end_s - e.start_s) * pixels_per_s >= MIN_LABEL_PIXELS * (len(text) + 0.5):
            ax.text(
                (e.start_s + e.end_s) / 2,
                e.rank_group - 0.09,
                text,
                ha="center",
                va="center",
                fontsize=7,
                color="white",
                clip_on=True,
            )


def _timeline_legend(ax, result: SimResult) -> None:
    from matplotlib.patches import Patch

    kinds = sorted({e.kind for e in result.timeline}, key=list(KIND_COLOURS).index)
    handles = [Patch(facecolor=KIND_COLOURS[k], label=KIND_LABELS[k]) for k in kinds]
    ax.legend(
        handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(handles), fontsize=8, frameon=False
    )
