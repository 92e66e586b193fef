"""A simulated pipeline step as a rank x time grid of characters.

One row per rank group; each column is ``step_s / width`` seconds. A column shows the action that
covers the column's midpoint (an action shorter than a column still shows in the column where it
starts, if that column is otherwise idle). Rank groups running several stages get a second row
with the stage of each column; rank groups with all-reduces a row marking when they are in flight.

    F   forward of micro-batch i          0-9  (i mod 10)
    B   full backward of micro-batch i    a-j  (i mod 10)
    I   input-gradient backward of i      A-J  (i mod 10)
    W   weight-gradient backward of i     k-t  (i mod 10)
    .   idle;  =  all-reduce, reduce-scatter or all-gather in flight (communication row)

Example (GPipe, 2 stages, 2 micro-batches, forward 1 s, backward 2 s, 9 columns):

    rank 0 |01...aabb|
    rank 1 |.01aabb..|
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from partita.report.format import fmt_seconds

if TYPE_CHECKING:  # report/ depends on data only: SimResult is read by duck typing
    from partita.types import SimResult, TimelineEvent

__all__ = ["timeline_text"]

_FIRST_CHAR = {"F": "0", "B": "a", "I": "A", "W": "k"}
IDLE, COMM, STEP = ".", "=", "o"  # idle, all-reduce, optimizer step


def action_char(kind: str, microbatch: int) -> str:
    """The grid character of one action: its kind's alphabet at ``microbatch mod 10``."""
    return chr(ord(_FIRST_CHAR[kind]) + microbatch % 10)


def timeline_text(result: SimResult, width: int = 100) -> str:
    """The step of ``result`` as a rank x time grid of ``width`` columns, with a legend."""
    if width < 1:
        raise ValueError(f"width must be >= 1 columns, got {width}")
    if not result.timeline:
        return "(no timeline: simulate with keep_timeline=True)"
    step = result.step_s if result.step_s > 0 else 1.0
    slot_s = step / width
    groups = len(result.rank_busy_s)
    compute = [[e for e in result.timeline if e.rank_group == r and e.kind in _FIRST_CHAR] for r in range(groups)]
    comm = [[e for e in result.timeline if e.rank_group == r and e.kind not in _FIRST_CHAR] for r in range(groups)]
    label_width = len(f"rank {groups - 1}")
    lines = [f"{'':{label_width}} |0{fmt_seconds(result.step_s).rjust(width - 1)}|"]
    for r in range(groups):
        label = f"rank {r}".ljust(label_width)
        lines.append(f"{label} |{_row(compute[r], slot_s, width, lambda e: action_char(e.kind, e.microbatch))}|")
        if len({e.stage for e in compute[r]}) > 1:
            lines.append(
                f"{'stage':>{label_width}} |{_row(compute[r], slot_s, width, lambda e: _stage_char(e.stage))}|"
            )
        if comm[r]:
            lines.append(
                f"{'comm':>{label_width}} |"
                f"{_row(comm[r], slot_s, width, lambda e: COMM if e.kind in ('allreduce', 'allgather') else STEP)}|"
            )
    lines.extend(_legend(result, slot_s))
    return "\n".join(lines)


def _row(events: Sequence[TimelineEvent], slot_s: float, width: int, char) -> str:
    """Characters of one row: the event covering each column's midpoint, else '.'."""
    cells = [IDLE] * width
    for e in sorted(events, key=lambda e: (e.start_s, e.end_s, e.stage)):
        first = int(e.start_s / slot_s)
        covered = False
        for j in range(max(0, first), min(width, int(e.end_s / slot_s) + 1)):
            if e.start_s <= (j + 0.5) * slot_s < e.end_s:
                cells[j] = char(e)
                covered = True
        if not covered and 0 <= first < width and cells[first] == IDLE and e.end_s > e.start_s:
            cells[first] = char(e)
    return "".join(cells)


def _stage_char(stage: int) -> str:
    """0-9, then a-z, then '+' for stages beyond 35."""
    return "0123456789abcdefghijklmnopqrstuvwxyz"[stage] if stage < 36 else "+"


def _legend(result: SimResult, slot_s: float) -> list[str]:
    busy = ", ".join(fmt_seconds(b) for b in result.rank_busy_s)
    return [
        f"step {fmt_seconds(result.step_s)}, bubble {100 * result.bubble_fraction:.1f}%, "
        f"1 column = {fmt_seconds(slot_s)}; busy per rank group: {busy}",
        "F 0-9 | B a-j | I A-J | W k-t (micro-batch mod 10) | . idle | = all-reduce / gather in flight | o optimizer step",
    ]
