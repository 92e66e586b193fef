"""What bounds a Megatron-LM row's plan: partita's free plan on an A100-80GB whose memory or NVLink
bandwidth is scaled, against Megatron's SC21 layout on the catalog A100 (the "vs Megatron" of
bench/scale_prediction.py, analytic costs, bf16).

Usage: python bench/probes/scaled_device.py ROWS MEMORY_SCALE NVLINK_SCALE
(e.g. ``529.6B 10 1000``; ROWS: names of bench/_megatron.py's rows, comma-separated)
"""

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _megatron import ROWS, capture  # noqa: E402
from megatron_calibration import layout_inputs  # noqa: E402

import partita  # noqa: E402
from partita.planning.simulator import simulate_pipeline  # noqa: E402
from partita.types.devices import get_device  # noqa: E402


def main() -> None:
    names, memory, nvlink = sys.argv[1].split(","), float(sys.argv[2]), float(sys.argv[3])
    for row in (r for r in ROWS if r.name in names):
        graph = capture(row)
        base = get_device("a100-80gb")
        scaled = dataclasses.replace(
            base,
            memory_bytes=int(base.memory_bytes * memory),
            intra_node_bandwidth_bytes_per_s=base.intra_node_bandwidth_bytes_per_s * nvlink,
        )
        started = time.perf_counter()
        cluster = partita.Cluster(device=scaled, num_devices=row.gpus, devices_per_node=8)
        options = partita.PlanOptions(costs="analytic")
        plan = partita.plan(graph, cluster=cluster, global_batch_size=row.global_batch, options=options)
        catalog = partita.Cluster(device="a100-80gb", num_devices=row.gpus, devices_per_node=8)
        megatron = simulate_pipeline(**layout_inputs(graph, row, catalog)[1], keep_timeline=False).step_s
        selective = sum(s.recompute.value == "selective" for s in plan.stages)
        full = sum(s.recompute.value == "full" for s in plan.stages)
        print(
            f"{row.name} memory x{memory:g} NVLink x{nvlink:g}: {plan.predicted_step_s:.2f} s, "
            f"vs Megatron {megatron / plan.predicted_step_s:.3f}x; TP {plan.tensor_parallel} x "
            f"{plan.num_rank_groups} groups, {plan.schedule.value}, m={plan.num_microbatches}, "
            f"{plan.num_stages} stages, recompute full {full} selective {selective} "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
