"""What partita's trainer adds to a data-parallel step, against a hand-written loop on the same ranks.

GPT-2 small (bench zoo), global batch 16, 2 ranks x 1 thread (gloo): forward + backward of 2 micro-batches
of 4 per rank alone; a flat gradient all-reduce alone; the hand-written step (fwd/bwd, flat all-reduce,
AdamW); partita's Trainer with the same plan (1 stage x 2 replicas, GPipe, 2 micro-batches). Medians of
6 steps after a barrier; rank 0 prints.

Usage: torchrun --standalone --nproc-per-node 2 bench/probes/trainer_overhead.py
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
from _e2e_common import build_example, loss_of, step_kwargs  # noqa: E402

import partita  # noqa: E402
from partita.planning.manual import manual_plan  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()
ex = build_example("gpt2-small", 16)
model, batch = ex.model, ex.make_batch(16, 0)
params = list(model.parameters())
opt = torch.optim.AdamW(params, lr=1e-4)


def part(start, n):
    args, kwargs, target = batch
    return args, {k: v[start : start + n] for k, v in kwargs.items()}, target


def forward_backward():
    for i in range(2):
        loss_of(ex, model, part(rank * 8 + i * 4, 4)).backward()


def all_reduce():
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)


def hand_written():
    forward_backward()
    all_reduce()
    opt.step()
    opt.zero_grad(set_to_none=True)


graph = partita.capture(model, ex.args, ex.kwargs)
plan = manual_plan(
    graph,
    [0, graph.num_nodes],
    schedule="gpipe",
    num_rank_groups=1,
    replicas=2,
    num_microbatches=2,
    global_batch_size=16,
)
trainer = partita.Trainer(model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))
a, k = step_kwargs(ex, batch)


def median_s(fn, n=6):
    fn()
    times = []
    for _ in range(n):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


results = {"forward+backward": median_s(lambda: (forward_backward(), opt.zero_grad(set_to_none=True)))}
forward_backward()
results["flat all-reduce (35 MB)"] = median_s(all_reduce)
opt.zero_grad(set_to_none=True)
results["hand-written step"] = median_s(hand_written)
results["partita Trainer step"] = median_s(lambda: trainer.step(*a, **k))
if rank == 0:
    for name, seconds in results.items():
        print(f"{name}: {seconds:.3f} s")
dist.destroy_process_group()
