"""Shared by bench/e2e_throughput.py and bench/e2e_memory.py: models, rank launcher, memory probes.

Nothing here is part of partita; it is benchmark plumbing:

- ``build_example(name, batch_size)``: a zoo name, or ``gpt2-small-v50k`` (gpt2-small with GPT-2's
  real 50257-word vocabulary: the zoo has no vocabulary override), or ``gpt2-L{layers}-H{hidden}``
  (GPT-2 of any depth and width, vocabulary 8192, for the memory ladder), or
  ``llama-L{layers}-H{hidden}`` (Llama of any depth and width: heads of 64, half as many key/value
  heads, the zoo's small size otherwise).
- ``run_ranks(script, world_size, out_dir, timeout_s, **params)``: start ``world_size`` fresh
  ``python script --worker out_dir`` processes, torchrun style (RANK, WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, one thread each), kill all of them (only them) when one fails or the job times out.
- ``reset_peak()`` / ``memory_status()``: end-to-end peak memory of this process, as FACTS.md says:
  ``malloc_trim(0)``, write ``5`` to ``/proc/self/clear_refs`` (resets VmHWM to the current RSS),
  then read ``VmHWM`` / ``VmRSS`` from ``/proc/self/status``.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from partita.cost.local_machine import free_port
from partita.report.format import fmt_replicas

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20

_CUSTOM_GPT2 = re.compile(r"^gpt2-L(\d+)-H(\d+)$")
_CUSTOM_LLAMA = re.compile(r"^llama-L(\d+)-H(\d+)$")


# ----------------------------------------------------------------------------- models


def build_example(name: str, batch_size: int, *, device: str = "cpu", seed: int = 0, data_device: str | None = None):
    """A ``partita.examples.Example`` for a zoo name or one of the custom GPT-2 names above;
    ``data_device``: where the batches go (default: with the model)."""
    from partita import examples

    data_device = data_device or device
    if name == "gpt2-small-v50k":
        return _gpt2_example(name, dict(vocab_size=50257), batch_size, device, seed, data_device)
    m = _CUSTOM_GPT2.match(name)
    if m:
        layers, hidden = int(m.group(1)), int(m.group(2))
        return _gpt2_example(
            name,
            dict(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64)),
            batch_size,
            device,
            seed,
            data_device,
        )
    m = _CUSTOM_LLAMA.match(name)
    if m:
        layers, hidden = int(m.group(1)), int(m.group(2))
        heads = max(1, hidden // 64)
        overrides = dict(
            num_hidden_layers=layers,
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            intermediate_size=hidden * 8 // 3 // 16 * 16,
        )
        return _hf_example(
            name, "llama", "LlamaConfig", "LlamaForCausalLM", overrides, batch_size, device, seed, data_device
        )
    return examples.build(name, batch_size=batch_size, device=device, seed=seed, data_device=data_device)


def config_text(p, *, always_recompute: bool = False) -> str:
    """A plan's configuration in one token run: ``GxR [v=V] schedule m=M mb=B [rc=...]`` (legend in the
    reports). ``always_recompute``: write ``rc=k/S`` even when no stage recomputes (else ``rc=k`` only
    when some do)."""
    v = p.num_stages // p.num_rank_groups
    rc = sum(bool(s.recompute) for s in p.stages)
    recompute = f" rc={rc}/{p.num_stages}" if always_recompute else (f" rc={rc}" if rc else "")
    tp = f" tp={p.tensor_parallel}" if p.tensor_parallel > 1 else ""
    return (
        f"{p.num_rank_groups}x{fmt_replicas(p)}{tp}{f' v={v}' if v > 1 else ''} {p.schedule.value} "
        f"m={p.num_microbatches} mb={p.microbatch_size}{recompute}"
    )


def gpt2_params(layers: int, hidden: int, vocab: int = 8192, positions: int = 1024) -> int:
    """Parameter count of a GPT-2 (tied head) of this shape."""
    per_layer = 12 * hidden * hidden + 13 * hidden
    return vocab * hidden + positions * hidden + layers * per_layer + 2 * hidden


def _gpt2_example(name: str, overrides: dict, batch_size: int, device: str, seed: int, data_device: str):
    """gpt2-small's config with ``overrides``, built as the zoo builds (seeded, eager attention, no
    dropout) and fed the zoo's causal-LM data (seq_len 128)."""
    example = _hf_example(
        name, "gpt2", "GPT2Config", "GPT2LMHeadModel", overrides, batch_size, device, seed, data_device
    )
    example.model.loss_type = "ForCausalLM"
    return example


def _hf_example(
    name: str, family: str, config: str, model_class: str, overrides: dict, batch_size: int, device: str, seed: int,
    data_device: str,
):  # fmt: skip
    """The zoo family's small config with ``overrides``, built as the zoo builds (seeded, eager
    attention, no dropout) and fed the zoo's causal-LM data (seq_len 128)."""
    import transformers

    from partita.examples import Example, data, hf

    kwargs = {**hf.config_kwargs(family, "small"), **overrides}
    seq_len = 128
    build_device = torch.device("meta") if device == "meta" else torch.device("cpu")
    with torch.random.fork_rng(devices=[]), build_device:
        torch.default_generator.manual_seed(seed)
        made = getattr(transformers, model_class)(getattr(transformers, config)(attn_implementation="eager", **kwargs))
    model = made
    model.train()
    vocab = kwargs["vocab_size"]

    def make_batch(b: int, step: int):
        batch = data.causal_lm_batch(data.batch_generator(seed, step), b, seq_len, vocab)
        if data_device == "meta":
            batch = {k: v.to("meta") for k, v in batch.items()}
        return (), batch, None

    args, kw, target = make_batch(batch_size, 0)
    return Example(name, model, args, kw, None, target, make_batch)


def loss_of(example, model, batch) -> torch.Tensor:
    args, kwargs, target = batch
    out = model(*args, **kwargs)
    return example.loss_fn(out, target) if example.loss_fn is not None else out.loss


def step_kwargs(example, batch) -> tuple[tuple, dict]:
    """(args, kwargs) for ``Trainer.step``: the model's inputs, plus ``target=`` with a loss_fn."""
    args, kwargs, target = batch
    return args, ({**kwargs, "target": target} if example.loss_fn is not None else kwargs)


# ----------------------------------------------------------------------------- memory


def reset_peak() -> None:
    """Free what Python and glibc hold on to, then reset VmHWM to the current RSS."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def memory_status() -> dict[str, int]:
    """VmHWM (peak RSS since the last reset) and VmRSS of this process, in bytes."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                found[key] = int(value.split()[0]) * 1024
    return found


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def malloc_in_use() -> int | None:
    """Bytes glibc has handed out and not taken back (all arenas, plus mmapped chunks): live tensors and
    Python objects, without the freed memory glibc keeps. None without glibc >= 2.33."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class InUseSampler:
    """Samples ``malloc_in_use`` every ``interval_s`` in a thread (torch kernels release the GIL); ``peak``
    is the largest sample. A sampled peak can miss a spike shorter than the interval."""

    def __init__(self, interval_s: float = 0.0005):
        import threading

        self.interval_s, self.peak, self._stop = interval_s, malloc_in_use() or 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, malloc_in_use() or 0)
            time.sleep(self.interval_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, malloc_in_use() or 0)


# ----------------------------------------------------------------------------- ranks


def measured_training(
    name: str, plan: Any, seed: str, num_steps: int, *, global_batch: int, lr: float, base: int = 0,
    sampler_from: int | None = None,
) -> dict:  # fmt: skip
    """On a rank: the model ``name`` built on meta and loaded from the seed checkpoint ``seed``, trained
    ``num_steps`` AdamW steps under ``plan`` (a plan file, or a function of the graph); from step
    ``sampler_from`` on, the peak of glibc's bytes in use less ``base`` (``peak``) and the bytes in use
    before that step (``resting``)."""
    import partita
    from partita.runtime.materialize import meta_copies

    ex = build_example(name, global_batch, device="meta", data_device="cpu")
    graph = partita.capture(
        ex.model, meta_copies(ex.args), meta_copies(ex.kwargs), loss_fn=ex.loss_fn, target=meta_copies(ex.target)
    )
    plan = partita.Plan.load(plan, graph=graph) if isinstance(plan, str) else plan(graph)
    optimizer = lambda ps: torch.optim.AdamW(ps, lr=lr)  # noqa: E731
    trainer = partita.Trainer(ex.model, plan, graph=graph, init_from=seed, optimizer=optimizer)
    out: dict = {}
    for step in range(num_steps):
        if step == sampler_from:
            gc.collect()
            out["resting"] = malloc_in_use() - base
            sampler = InUseSampler().__enter__()
        a, k = step_kwargs(ex, ex.make_batch(global_batch, step))
        trainer.step(*a, **k)
    if sampler_from is not None:
        sampler.__exit__(None, None, None)
        out["peak"] = sampler.peak - base
    return out


def run_ranks(script: Path, world_size: int, out_dir: Path, *, timeout_s: float, **params: Any) -> list[Any]:
    """Run ``script --worker out_dir`` on ``world_size`` ranks; each writes ``out_dir/result<rank>.pt``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("result*.pt"):
        old.unlink()
    torch.save(params, out_dir / "params.pt")
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "TRANSFORMERS_VERBOSITY": "error",
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(script), "--worker", str(out_dir)],
                    env=env,
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            codes = [p.poll() for p, _ in procs]
            if any(c not in (None, 0) for c in codes):
                time.sleep(1.0)
                bad = next(r for r, c in enumerate(codes) if c not in (None, 0))
                raise RuntimeError(f"rank {bad} failed (exit {codes[bad]}):\n{_tail(out_dir / f'rank{bad}.log')}")
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"job timed out after {timeout_s:.0f} s:\n{_tail(out_dir / 'rank0.log')}")
            time.sleep(0.1)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    return [torch.load(out_dir / f"result{rank}.pt", weights_only=False) for rank in range(world_size)]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError as e:
        return f"(no log: {e})"


# ----------------------------------------------------------------------------- reporting


def machine_line() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, shared with other jobs "
        f"(1-min load average at the start: {load:.1f}); Python {platform.python_version()}, "
        f"torch {torch.__version__}"
    )


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
    import shlex

    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]])
