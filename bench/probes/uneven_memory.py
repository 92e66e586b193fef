"""Live bytes per rank of an uneven plan, against the memory model, with two ways of waiting sends.

GPT-2 L8 H512 (bench zoo), global batch 32, 1F1B with 16 micro-batches, 3 ranks: stage 0 (the
first half of the layers, cut at a layer start) on ranks 0 and 1, stage 1 on rank 2. The same
trainer steps with the executor's send window (each exchange's sends waited at the next one) and
with sends waited only at the end of the step, alternating, 2 steps each after a warm-up step.
Bytes in use (glibc ``mallinfo2``, sampled every 0.5 ms) at the step's peak, above the reading
before the step, next to the activation and boundary terms of ``device_memory`` (analytic costs
at this rank's micro-batch slice): what a step adds on top of the resting state.

Usage: torchrun --standalone --nproc-per-node 3 bench/probes/uneven_memory.py
"""

import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from _e2e_common import InUseSampler, build_example, malloc_in_use, step_kwargs  # noqa: E402

import partita  # noqa: E402
from partita.cost.analytic import analytic_costs  # noqa: E402
from partita.cost.memory import device_memory, microbatches_in_flight  # noqa: E402
from partita.planning.chain import layer_boundaries  # noqa: E402
from partita.planning.manual import manual_plan  # noqa: E402
from partita.runtime import uneven  # noqa: E402
from partita.types import OptimizerKind  # noqa: E402

MIB = 2**20
BATCH, M = 32, 16


class _EndOfStepWindow(uneven._SendWindow):
    """The behaviour before the send window: every send waited at the end of the step."""

    def issued(self, works):
        self.previous = self.previous + works

    def wait_all(self):
        for work in self.previous:
            work.wait()
        self.previous = []


dist.init_process_group("gloo")
rank = dist.get_rank()
ex = build_example("gpt2-L8-H512", BATCH)
graph = partita.capture(ex.model, ex.args, ex.kwargs)
layers = layer_boundaries(graph)
plan = manual_plan(
    graph,
    [0, layers[len(layers) // 2], graph.num_nodes],
    schedule="1f1b",
    num_rank_groups=2,
    replicas=(2, 1),
    num_microbatches=M,
    global_batch_size=BATCH,
)
trainer = partita.Trainer(ex.model, plan, graph=graph, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
a, k = step_kwargs(ex, ex.make_batch(BATCH, 0))
trainer.step(*a, **k)  # warm-up: builds the executor, allocates gradients

stage = plan.stages[trainer.stages[0].spec.index]
samples = BATCH // (M * stage.num_replicas)
costs = analytic_costs(graph, "cpu", samples)
in_flight = microbatches_in_flight(plan.schedule, M, plan.num_rank_groups, stage.rank_group, 1)
model = device_memory(
    costs,
    [(stage.start, stage.stop)],
    in_flight=in_flight,
    optimizer=OptimizerKind.NONE,
    num_replicas=stage.num_replicas,
    num_microbatches=M,
)
predicted = model.activation_bytes + model.comm_buffer_bytes + model.working_bytes

growth: dict[str, list[float]] = {"send window": [], "waited at step end": []}
original = uneven._SendWindow
for _ in range(2):
    for name, window in (("send window", original), ("waited at step end", _EndOfStepWindow)):
        uneven._SendWindow = window
        gc.collect()
        dist.barrier()
        before = malloc_in_use()
        with InUseSampler() as sampler:
            trainer.step(*a, **k)
        growth[name].append((sampler.peak - before) / MIB)
uneven._SendWindow = original
line = (
    f"rank {rank} (stage {stage.index}, {samples} samples per micro-batch): step peak above resting: "
    + "; ".join(f"{name} {statistics.median(v):.0f} MiB" for name, v in growth.items())
    + f" | model A + C + W = {predicted / MIB:.0f} MiB"
)
lines = [None] * dist.get_world_size()
dist.all_gather_object(lines, line)
if rank == 0:
    print("\n".join(lines))
dist.destroy_process_group()
