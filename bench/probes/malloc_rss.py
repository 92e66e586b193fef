"""Resident memory against bytes in use for one training process, under glibc's default malloc
settings and under whatever MALLOC_* environment the process was started with.

GPT-2 L4 H512 (bench zoo), 4 micro-batches of 2, AdamW, 1 thread: after one warm-up step,
``malloc_trim`` + ``clear_refs``, then 3 steps: VmHWM growth, the peak of glibc's bytes in use, and
the mean step time.

Usage: python bench/probes/malloc_rss.py
       MALLOC_TRIM_THRESHOLD_=0 MALLOC_TOP_PAD_=0 python bench/probes/malloc_rss.py
"""

import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from _e2e_common import InUseSampler, build_example, loss_of, malloc_in_use, memory_status, reset_peak  # noqa: E402

MIB = 2**20
reset_peak()
base, base_in_use = memory_status()["VmRSS"], malloc_in_use()
ex = build_example("gpt2-L4-H512", 8)
opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-4)


def step(i):
    for mb in range(4):
        (loss_of(ex, ex.model, ex.make_batch(2, i * 4 + mb)) / 4).backward()
    opt.step()
    opt.zero_grad()


step(0)
reset_peak()
start = time.perf_counter()
with InUseSampler() as sampler:
    for i in range(1, 4):
        step(i)
seconds = (time.perf_counter() - start) / 3
env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "default"
print(
    f"{env}: RSS peak {(memory_status()['VmHWM'] - base) / MIB:.0f} MiB, in use {(sampler.peak - base_in_use) / MIB:.0f}"
    f" MiB, step {seconds:.3f} s"
)
