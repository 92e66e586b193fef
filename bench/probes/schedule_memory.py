"""Live bytes per rank under one schedule against the memory model, for a GPT-2 built on meta.

GPT-2 L8 H512 (bench zoo), global batch 16, 2 ranks: each rank builds the model on meta and loads its
stages from a seed checkpoint; equal node-count stages (2 for 1F1B/GPipe, 4 for interleaved/ZBV).
Bytes in use (glibc ``mallinfo2``) relative to a reading before the model is built: after capture,
resting between steps (after one step) and the peak of the next step (sampled every 0.5 ms), next
to ``device_memory`` with analytic costs.

Usage: torchrun --standalone --nproc-per-node 2 bench/probes/schedule_memory.py SCHEDULE NUM_MICROBATCHES [PRECISION]
(PRECISION: fp32, the default, or bf16: autocast with fp32 master weights, costs in bf16)
"""

import gc
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from _e2e_common import InUseSampler, build_example, malloc_in_use, reset_peak, step_kwargs  # noqa: E402

import partita  # noqa: E402
from partita.cost.analytic import analytic_costs  # noqa: E402
from partita.cost.memory import device_memory, microbatches_in_flight  # noqa: E402
from partita.planning.manual import manual_plan  # noqa: E402
from partita.runtime.materialize import meta_copies, save_seed  # noqa: E402
from partita.types import OptimizerKind, Precision  # noqa: E402

MIB = 2**20
schedule, m = sys.argv[1], int(sys.argv[2])
precision = Precision.parse(sys.argv[3] if len(sys.argv) > 3 else "fp32")
dist.init_process_group("gloo")
rank = dist.get_rank()
name, seed = "gpt2-L8-H512", os.path.join(os.environ.get("TMPDIR", "/tmp"), "partita-probe-seed-L8")
if rank == 0 and not os.path.exists(seed):
    save_seed(build_example(name, 16).model, seed)
dist.barrier()
gc.collect()
reset_peak()
base = malloc_in_use()
ex = build_example(name, 16, device="meta", data_device="cpu")
graph = partita.capture(ex.model, meta_copies(ex.args), meta_copies(ex.kwargs))
captured = malloc_in_use() - base
n = graph.num_nodes
s = 4 if schedule in ("zbv", "interleaved1f1b") else 2
plan = manual_plan(
    graph,
    [n * k // s for k in range(s + 1)],
    schedule=schedule,
    num_rank_groups=2,
    num_microbatches=m,
    global_batch_size=16,
    precision=precision.value,
)
trainer = partita.Trainer(
    ex.model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4), init_from=seed
)
a, k = step_kwargs(ex, ex.make_batch(16, 0))
trainer.step(*a, **k)
gc.collect()
resting = malloc_in_use() - base
with InUseSampler() as sampler:
    trainer.step(*a, **k)
peak = sampler.peak - base
costs = analytic_costs(graph, "cpu", 16 // m, precision=precision)
ranges = [(st.start, st.stop) for st in plan.stages if st.rank_group == rank]
in_flight = microbatches_in_flight(plan.schedule, m, 2, rank, s // 2)
mem = device_memory(
    costs, ranges, in_flight=in_flight, optimizer=OptimizerKind.ADAM, num_microbatches=m, precision=precision
)
line = (
    f"{schedule} m={m} {precision.value} rank {rank}: capture {captured / MIB:.0f}, resting {resting / MIB:.0f}, peak {peak / MIB:.0f} "
    f"MiB | predicted {mem.total_bytes / MIB:.0f} = P {mem.param_bytes / MIB:.0f} + O {mem.optimizer_bytes / MIB:.0f}"
    f" + max(A {mem.activation_bytes / MIB:.0f} + C {mem.comm_buffer_bytes / MIB:.0f} + W "
    f"{mem.working_bytes / MIB:.0f} + G {mem.grad_bytes / MIB:.0f}, G + S)"
)
lines = [None] * 2
dist.all_gather_object(lines, line)
if rank == 0:
    print("\n".join(lines))
dist.destroy_process_group()
