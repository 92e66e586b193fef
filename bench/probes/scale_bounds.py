"""How far the techniques partita does not have could move a Megatron-LM row's plan: the free plan
re-searched with one cost made free at a time (analytic costs, A100-80GB in nodes of 8, bf16;
bench/_megatron.py's rows), against Megatron's SC21 layout under the real costs (the "vs Megatron"
of bench/scale_prediction.py).

What each idealisation stands for (upper bounds: no real overlap hides all of it):
- backward TP collectives free: Megatron's overlap of the backward's all-gather and reduce-scatter
  with the input- and weight-gradient matmuls (its ``LinearWithGradAccumulationAndAsyncCommunication``).
- all TP collectives free: collective matmuls (Transformer Engine's userbuffers, torch's async TP).
- selective recomputation free: what a policy that recomputes nothing costly (or offload) could save.
- all three together.

Usage: python bench/probes/scale_bounds.py ROW[,ROW...] (e.g. ``529.6B``)
"""

import dataclasses
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
from _megatron import BY_NAME, capture  # noqa: E402
from megatron_calibration import layout_inputs  # noqa: E402
from scale_prediction import layout  # noqa: E402

import partita  # noqa: E402
import partita.cost.tensor_parallel as tp_costs  # noqa: E402
import partita.planning.degree_contexts as degree_contexts  # noqa: E402
from partita.planning.simulator import simulate_pipeline  # noqa: E402

IDEALISATIONS = {
    "as built": (),
    "backward TP collectives free": ("backward",),
    "all TP collectives free": ("backward", "forward"),
    "selective recomputation free": ("recompute",),
    "all three": ("backward", "forward", "recompute"),
}


def _patched(free: tuple[str, ...]) -> None:
    """Make the costs named in ``free`` zero in every table the search builds from here on."""
    reduction_times_s, costs_of = _ORIGINAL

    def reductions(*args, **kwargs):
        forward, backward = reduction_times_s(*args, **kwargs)
        return (forward * 0 if "forward" in free else forward), (backward * 0 if "backward" in free else backward)

    def costs(*args, **kwargs):
        table = costs_of(*args, **kwargs)
        if "recompute" in free:
            table = dataclasses.replace(table, selective_recompute_s=np.zeros_like(table.selective_recompute_s))
        return table

    tp_costs.reduction_times_s = reductions
    degree_contexts.tensor_parallel_costs = costs


_ORIGINAL = (tp_costs.reduction_times_s, degree_contexts.tensor_parallel_costs)


def main() -> None:
    warnings.simplefilter("ignore")
    for name in sys.argv[1].split(","):
        row = BY_NAME[name]
        graph = capture(row)
        cluster = partita.Cluster(device="a100-80gb", num_devices=row.gpus, devices_per_node=8)
        _patched(())
        megatron_s = simulate_pipeline(**layout_inputs(graph, row, cluster)[1], keep_timeline=False).step_s
        print(f"{row.name}: Megatron's SC21 layout {megatron_s:.2f} s", flush=True)
        for what, free in IDEALISATIONS.items():
            _patched(free)
            started = time.perf_counter()
            options = partita.PlanOptions(costs="analytic")
            plan = partita.plan(graph, cluster=cluster, global_batch_size=row.global_batch, options=options)
            print(
                f"{row.name} {what}: {plan.predicted_step_s:.2f} s, vs Megatron "
                f"{megatron_s / plan.predicted_step_s:.2f}x, {layout(plan)} ({time.perf_counter() - started:.0f} s)",
                flush=True,
            )
        _patched(())


if __name__ == "__main__":
    main()
