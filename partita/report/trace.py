"""A simulated step as a Chrome / Perfetto trace (``chrome://tracing``, https://ui.perfetto.dev).

One track per rank group, named with its ranks; every action of the timeline is a complete event
("ph": "X") named like torch's schedule actions (``2F0``: stage 2's forward of micro-batch 0),
all-reduces and optimizer steps by their kind. Times are microseconds from the step's start.
``partita train --trace DIR`` writes the measured steps per rank in the same format (torch's
profiler), so the predicted and the measured step open side by side.
"""

from __future__ import annotations

import json
import os
from typing import Any

from partita.types import Plan, SimResult

__all__ = ["chrome_trace", "write_chrome_trace"]

_CATEGORIES = {"F": "forward", "B": "backward", "I": "backward input", "W": "backward weight"}


def chrome_trace(result: SimResult, plan: Plan, *, label: str = "predicted") -> dict[str, Any]:
    """The trace document: metadata naming the tracks, then one event per timeline interval."""
    ranks_of = {s.rank_group: s.ranks for s in plan.stages}
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"partita {label}"}}]
    for group in sorted(ranks_of):
        ranks = ",".join(map(str, ranks_of[group]))
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": group,
                "args": {"name": f"rank group {group} (ranks {ranks})"},
            }
        )
    for e in result.timeline:
        kind = e.kind
        name = f"{e.stage}{kind}{e.microbatch}" if kind in _CATEGORIES else kind
        events.append(
            {
                "name": name,
                "cat": _CATEGORIES.get(kind, kind),
                "ph": "X",
                "pid": 0,
                "tid": e.rank_group,
                "ts": e.start_s * 1e6,
                "dur": (e.end_s - e.start_s) * 1e6,
                "args": {"stage": e.stage, "microbatch": e.microbatch},
            }
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": plan.schedule.value, "predicted_step_s": result.step_s},
    }


def write_chrome_trace(path: str | os.PathLike, result: SimResult, plan: Plan) -> None:
    """Write ``chrome_trace(result, plan)`` as JSON to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace(result, plan), f)
        f.write("\n")
