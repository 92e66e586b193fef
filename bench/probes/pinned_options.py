"""Each PlanOptions pin alone on a Megatron-LM row: the plan partita finds (or its error) and the time
to the answer (analytic costs, A100-80GB in nodes of 8, bf16; bench/_megatron.py's rows).

Usage: python bench/probes/pinned_options.py ROW (e.g. ``145.6B``)
"""

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _megatron import BY_NAME, capture  # noqa: E402
from scale_prediction import layout  # noqa: E402

import partita  # noqa: E402

PINS = [
    {},
    {"sharding": "shard_grads_and_optimizer"},
    {"sharding": "full_shard"},
    {"sharding": "replicate"},
    {"recompute": "selective"},
    {"recompute": "full"},
    {"sequence_parallel": False},
    {"tensor_parallel": 2},
    {"schedules": ("zbv",)},
    {"schedules": ("interleaved1f1b",)},
    {"schedules": ("gpipe",)},
]


def main() -> None:
    warnings.simplefilter("ignore")
    row = BY_NAME[sys.argv[1]]
    graph = capture(row)
    cluster = partita.Cluster(device="a100-80gb", num_devices=row.gpus, devices_per_node=8)
    for pins in PINS:
        started = time.perf_counter()
        try:
            options = partita.PlanOptions(costs="analytic", **pins)
            plan = partita.plan(graph, cluster=cluster, global_batch_size=row.global_batch, options=options)
            outcome = f"{plan.predicted_step_s:.2f} s, {layout(plan)}"
        except partita.InfeasiblePlanError as e:
            outcome = f"InfeasiblePlanError: {str(e)[:200]}"
        print(f"{row.name} {pins or 'nothing pinned'}: {outcome} ({time.perf_counter() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
