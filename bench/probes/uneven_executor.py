"""partita's uneven-plan executor against torch's Schedule1F1B on the same pipeline.

Uneven plans (stages with different replica counts) run on partita's own GPipe/1F1B executor
(partita/runtime/uneven.py), not on torch.distributed.pipelining. This probe runs ONE plan both
ways, so the executor's cost shows apart from the layout: GPT-2 small (bench zoo), global batch
16, 2 stages cut at the middle layer, 1F1B with 4 micro-batches, 1 replica each, 2 ranks x 1
thread (gloo). The same Trainer steps with torch's schedule, then with an UnevenExecutor built
for its stage (1 replica on each side routes exactly like torch's one-to-one pipeline); rounds
alternate; medians of 5 steps per round after a barrier, 3 rounds. Rank 0 prints. It also checks
that both paths give the same loss on the same weights.

Usage: torchrun --standalone --nproc-per-node 2 bench/probes/uneven_executor.py
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from _e2e_common import build_example, step_kwargs  # noqa: E402

import partita  # noqa: E402
from partita.planning.chain import layer_boundaries  # noqa: E402
from partita.planning.manual import manual_plan  # noqa: E402
from partita.runtime.pipeline import stage_metadata  # noqa: E402
from partita.runtime.stages import flatten_inputs, narrow_batch  # noqa: E402
from partita.runtime.uneven import UnevenExecutor  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
ex = build_example("gpt2-small", 16)
model, batch = ex.model, ex.make_batch(16, 0)
graph = partita.capture(model, ex.args, ex.kwargs)
layers = layer_boundaries(graph)
plan = manual_plan(
    graph,
    [0, layers[len(layers) // 2], graph.num_nodes],
    schedule="1f1b",
    num_rank_groups=2,
    num_microbatches=4,
    global_batch_size=16,
)
# SGD with lr 0: the weights stay as they are, so both paths compute the same losses every step.
trainer = partita.Trainer(model, plan, graph=graph, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0))
a, k = step_kwargs(ex, batch)
trainer.step(*a, **k)  # builds torch's schedule

flat = flatten_inputs(graph, a, k)
metadata = stage_metadata(
    trainer._stages.all_stages, narrow_batch(graph, flat, 0, plan.microbatch_size), torch.device("cpu")
)
stage = trainer.stages[0]
executor = UnevenExecutor(graph, plan, stage, 0, metadata[stage.spec.index], torch.device("cpu"))


def steps(use_executor: bool, n: int = 5) -> tuple[float, float]:
    trainer._executor = executor if use_executor else None
    times, loss = [], None
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        loss = trainer.step(*a, **k)
        times.append(time.perf_counter() - start)
    return statistics.median(times), loss


results: dict[str, list[float]] = {"torch Schedule1F1B": [], "partita UnevenExecutor": []}
losses = {}
for _ in range(3):
    for name, use in (("torch Schedule1F1B", False), ("partita UnevenExecutor", True)):
        seconds, losses[name] = steps(use)
        results[name].append(seconds)
if rank == 0:
    for name, values in results.items():
        print(f"{name}: step medians per round {', '.join(f'{v:.3f}' for v in values)} s; loss {losses[name]:.6f}")
    ratios = [u / t for u, t in zip(results["partita UnevenExecutor"], results["torch Schedule1F1B"])]
    print(f"executor / torch per round: {', '.join(f'{r:.3f}' for r in ratios)}")
dist.destroy_process_group()
