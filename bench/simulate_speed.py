"""How fast is the pipeline simulator? Milliseconds per ``simulate_pipeline`` call, as the search calls it.

The search simulates many candidate plans per request (``keep_timeline=False``: no timeline, only the
step time and the memory peaks), so the simulator's speed bounds how many candidates it can afford.
Each case: one schedule, S stages on G rank groups, m micro-batches, random per-stage times (seeded);
one warm-up call fills the order cache, then ``--repeats`` calls are timed and the median of
``--rounds`` rounds is reported. This replaced a wall-clock assertion in tests/unit/test_simulate.py
(under 0.5 ms per call for 1F1B, 8 stages, 64 micro-batches), which timed a shared machine.

Usage:  python bench/simulate_speed.py [--repeats 20] [--rounds 5] [--out bench/results/simulate_speed.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import partita  # noqa: E402
from partita.planning.simulator import simulate_pipeline  # noqa: E402
from partita.types import Schedule  # noqa: E402

# (schedule, rank groups, stages, micro-batches)
CASES = [
    (Schedule.GPIPE, 8, 8, 64),
    (Schedule.ONE_F_ONE_B, 8, 8, 64),
    (Schedule.ONE_F_ONE_B, 16, 16, 256),
    (Schedule.INTERLEAVED_1F1B, 8, 16, 64),
    (Schedule.ZBV, 8, 16, 64),
]


def case_kwargs(schedule: Schedule, num_groups: int, num_stages: int, num_microbatches: int) -> dict:
    rng = random.Random(0)
    forward_s = [rng.uniform(0.5, 2.0) for _ in range(num_stages)]
    backward_s = [rng.uniform(1.0, 4.0) for _ in range(num_stages)]
    split = schedule is Schedule.ZBV
    return dict(
        schedule=schedule,
        num_microbatches=num_microbatches,
        num_rank_groups=num_groups,
        forward_s=forward_s,
        backward_s=backward_s,
        backward_weight_s=[b * rng.uniform(0.2, 0.6) if split else 0.0 for b in backward_s],
        send_s=[rng.uniform(0.0, 0.5) for _ in range(num_stages - 1)],
        allreduce_s=[0.1] * num_stages,
        activation_bytes=[10] * num_stages,
        keep_timeline=False,
    )


def time_case(kwargs: dict, repeats: int, rounds: int) -> tuple[float, float]:
    """(median, fastest) milliseconds per call over ``rounds`` rounds of ``repeats`` calls."""
    simulate_pipeline(**kwargs)  # warm the order cache, as the search does once per shape
    per_call_ms = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            simulate_pipeline(**kwargs)
        per_call_ms.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(per_call_ms), min(per_call_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the markdown here")
    args = parser.parse_args(argv)
    lines = [
        "# Pipeline simulator: time per call",
        "",
        f"- machine: {platform.node() or 'unknown'}, {os.cpu_count()} CPUs (shared), Python "
        f"{platform.python_version()}, torch {torch.__version__}, partita {partita.__version__}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; load average "
        f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}",
        f"- command: `python bench/simulate_speed.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
        f"- `simulate_pipeline(..., keep_timeline=False)` after one warm-up call; median and fastest of "
        f"{args.rounds} rounds of {args.repeats} calls",
        "",
        "| schedule | rank groups | stages | micro-batches | ms per call (median) | ms per call (fastest) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for schedule, groups, stages, microbatches in CASES:
        median_ms, fastest_ms = time_case(
            case_kwargs(schedule, groups, stages, microbatches), args.repeats, args.rounds
        )
        lines.append(
            f"| {schedule.value} | {groups} | {stages} | {microbatches} | {median_ms:.2f} | {fastest_ms:.2f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
