"""GPU truth (issue 18): partita's cost and memory models and its Trainer against one CUDA device.

The one command for a one-GPU machine (an H200; about 5-7 minutes, never more than --time-budget-s
of work; results are written after every unit, so a run cut short still leaves its report):

    python bench/gpu/check.py --out $OUT

CPU dry run, tiny models (what tests/unit/test_gpu_check.py runs, well under a minute):

    python bench/gpu/check.py --dry-run --device cpu --out /tmp/gpu-check

Suggested calibration of the catalog entry from a report (prints it; --out also writes a device file):

    python bench/gpu/check.py --calibrate $OUT/gpu_check.json [--out DIR]

Parts. Each runs on its own: one that fails is recorded in the report with its error, and the rest go on.

1. trainer: ``partita.Trainer`` on one rank -- a process group of world size 1 made here (NCCL on
   CUDA, gloo on CPU; MASTER_ADDR/PORT set for it and restored after) -- with 1-stage plans (GPipe,
   1F1B with full and with selective recomputation, GPipe under bf16 autocast: data parallel of 1)
   and 2-stage plans on one rank group (ZBV, Interleaved1F1B), ``manual_plan(..., num_rank_groups=1)``,
   a few AdamW steps each on the zoo's synthetic data: the loss must be finite and fall, and every
   case of the fp32 model is compared with the unsplit model trained on the same batches (losses and
   every parameter; under the same autocast for the bf16-precision case).
2. per model, dtype and micro-batch size (GPT-2 medium: 24 layers x 1024, 16 heads, seq 1024;
   Llama-7B-shaped: 4 layers of hidden 4096, 32 heads, intermediate 11008, seq 1024; bf16 = the model
   cast with ``model.to(torch.bfloat16)`` before capture, because partita profiles and costs the
   captured graph in the dtypes it was captured in; tf32 = the fp32 graph with TF32 matmuls, costed
   with ``analytic_costs(..., dtype="tfloat32")``):
   a. profile: ``partita.cost.profiler.profile(graph, inputs, microbatch_size=b)`` on the device; its
      per-node times, summed per operator against the roofline terms, give each operator's implied
      compute and memory efficiency (``op_types.py``: which kind of op the catalog's values miss);
   b. time: each stage range -- the whole graph, halves and quarters cut at layer starts, the middle
      layer alone -- runs as a stage module (``split_graph``) on the real boundary tensors; forward and
      backward are timed apart (synchronised, medians of round-robin rounds) and compared with the
      analytic roofline table of the catalog entry (``--analytic-device``, default ``h200``) and with
      the profiled table, each summed over the range. Error = (predicted - measured) / measured;
   c. memory: each quarter's training step -- k micro-batches forward, then their backwards, then
      ``Adam.step`` (k in --in-flight), with no, selective and full recomputation (non-reentrant
      ``torch.utils.checkpoint`` of the whole stage, with the selective op policy for selective, as
      the runtime's StageRunner does) -- measured
      with ``torch.cuda.max_memory_allocated`` (on CPU: the allocator's profiler events) against
      ``partita.cost.memory.device_memory(costs, [(start, stop)], in_flight=k, recompute=r,
      num_microbatches=k)`` on the analytic and on the profiled table.
3. calibration: compute_efficiency, memory_efficiency and op_overhead_s of the catalog entry fitted
   to the measured stage times (least squares of log(predicted / measured), grid search). The JSON
   keeps every node's roofline terms, so ``--calibrate`` refits from the file alone.

Outputs in --out: ``gpu_check.md`` (the report), ``gpu_check.json`` (every number, the environment,
each part's status and error), ``calibrated_device.json`` (a partita device file: ``base`` plus the
fitted values; usable as ``--analytic-device``, ``Cluster(device=path)`` or ``partita plan
--device-type path``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as `python bench/gpu/check.py` from a checkout where partita is not installed: import it from here.
_ROOT = Path(__file__).resolve().parents[2]
if (_ROOT / "partita" / "__init__.py").is_file() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
if str(Path(__file__).resolve().parent) not in sys.path:  # its sibling modules, however it is loaded
    sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the GPU machine has no network

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from op_types import op_type_table  # noqa: E402

MIB = 2**20
REPORT_JSON, REPORT_MD, DEVICE_FILE = "gpu_check.json", "gpu_check.md", "calibrated_device.json"
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
ANALYTIC_DTYPE = {"fp32": None, "tf32": "tfloat32", "bf16": None}  # None: each node's own dtype
RECOMPUTE_LEVELS = ("none", "selective", "full")  # partita's Recompute levels, in the memory part
LAYER_PREFIX = {"gpt2": "transformer.h.", "llama": "model.layers."}
TRAINER_TIMEOUT_S = 180.0  # collective timeout of the trainer's groups: a hang ends instead of eating the session


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class ModelSpec:
    """One model of the check: a zoo family/size with optional config overrides."""

    key: str  # "gpt2", "llama"
    label: str  # shown in the report
    family: str  # partita.examples.hf family
    size: str  # its size, whose config is the base
    overrides: dict = field(default_factory=dict)  # config kwargs on top (e.g. fewer layers)
    seq_len: int = 1024
    microbatches: tuple[int, ...] = (1, 2, 4)


@dataclass(frozen=True)
class TrainerCase:
    schedule: str
    num_stages: int
    num_microbatches: int
    dtype: str = "fp32"
    recompute: str = "none"  # a partita Recompute level
    precision: str = "fp32"  # the plan's precision: "bf16" trains the fp32 model under bf16 autocast

    @property
    def name(self) -> str:
        return (
            f"{self.schedule}/{self.num_stages}st/{self.dtype}"
            + ("" if self.recompute == "none" else f"/{self.recompute}")
            + ("" if self.precision == "fp32" else f"/autocast-{self.precision}")
        )


@dataclass(frozen=True)
class Settings:
    models: tuple[ModelSpec, ...]
    dtypes: tuple[str, ...]
    profile_repeats: int
    profile_warmup: int
    time_rounds: int
    time_warmup: int
    in_flight: tuple[int, ...]
    trainer_model: ModelSpec
    trainer_batch: int
    trainer_steps: int
    trainer_lr: float
    trainer_cases: tuple[TrainerCase, ...]


def full_settings(args: argparse.Namespace) -> Settings:
    gpt2 = ModelSpec(
        "gpt2",
        "GPT-2 medium (24 x 1024, 16 heads, vocab 50257)",
        "gpt2",
        "355m",
        seq_len=args.gpt2_seq_len,
        microbatches=(1, 2, 4, 8),
    )
    llama = ModelSpec(
        "llama",
        f"Llama-7B-shaped, {args.llama_layers} layers (hidden 4096, 32 heads, ffn 11008)",
        "llama",
        "7b",
        overrides={"num_hidden_layers": args.llama_layers},
        seq_len=args.llama_seq_len,
        microbatches=(1, 2, 4),
    )
    trainer = ModelSpec("gpt2", "GPT-2 medium, seq 256", "gpt2", "355m", seq_len=256)
    return Settings(
        models=(gpt2, llama),
        dtypes=("fp32", "bf16", "tf32"),
        profile_repeats=3,
        profile_warmup=1,
        time_rounds=5,
        time_warmup=1,
        in_flight=(1, 2),
        trainer_model=trainer,
        trainer_batch=8,
        trainer_steps=6,
        trainer_lr=3e-4,
        trainer_cases=trainer_cases(("fp32", "bf16")),
    )


def dry_settings(args: argparse.Namespace) -> Settings:
    gpt2 = ModelSpec("gpt2", "GPT-2 tiny (2 x 64)", "gpt2", "tiny", seq_len=32, microbatches=(1, 2))
    llama = ModelSpec("llama", "Llama tiny (2 x 64, GQA)", "llama", "tiny", seq_len=32, microbatches=(1, 2))
    dtypes = ("fp32", "bf16") if cpu_supports_bf16() else ("fp32",)
    return Settings(
        models=(gpt2, llama),
        dtypes=dtypes,
        profile_repeats=1,
        profile_warmup=0,
        time_rounds=1,
        time_warmup=1,
        in_flight=(1, 2),
        trainer_model=gpt2,
        trainer_batch=8,
        trainer_steps=4,
        trainer_lr=3e-3,
        trainer_cases=trainer_cases(dtypes),
    )


def trainer_cases(dtypes: tuple[str, ...]) -> tuple[TrainerCase, ...]:
    """One stage on the rank (GPipe; 1F1B with full and with selective recomputation; GPipe under
    bf16 autocast), two stages on it (ZBV, Interleaved1F1B)."""
    cases = (
        TrainerCase("gpipe", 1, 2),
        TrainerCase("1f1b", 1, 2, recompute="full"),
        TrainerCase("1f1b", 1, 2, recompute="selective"),
        TrainerCase("zbv", 2, 4),
        TrainerCase("interleaved1f1b", 2, 4),
        TrainerCase("gpipe", 1, 2, precision="bf16"),
    )
    return cases + ((TrainerCase("zbv", 2, 4, dtype="bf16"),) if "bf16" in dtypes else ())


def cpu_supports_bf16() -> bool:
    """Whether bf16 matmuls, softmax and their backward run on this CPU."""
    try:
        x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(8, 8, dtype=torch.bfloat16, requires_grad=True)
        torch.softmax(x @ w, dim=-1).sum().backward()
        return bool(torch.isfinite(w.grad.float()).all())
    except (RuntimeError, TypeError):
        return False


# ----------------------------------------------------------------------------- report


class Report:
    """Everything the run found; written out (JSON + markdown) after every unit of work."""

    def __init__(self, out: Path, args: argparse.Namespace, argv: list[str]):
        self.out = out
        self.fail_in = set((args.fail_in or "").split(",")) - {""}
        self.started = time.perf_counter()
        self.data: dict[str, Any] = {
            "command": "python bench/gpu/check.py " + " ".join(shlex.quote(a) for a in argv),
            "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "environment": {},
            "parts": [],
            "configs": [],
            "time_rows": [],
            "memory_rows": [],
            "trainer_rows": [],
            "calibration": None,
            "elapsed_s": 0.0,
        }

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    @contextlib.contextmanager
    def part(self, name: str):
        """Run one part: its status, seconds and error (with the traceback's tail) go into the report.
        The body calls ``report.check(name)`` first: it raises when --fail-in names this part."""
        entry: dict[str, Any] = {"name": name, "status": "running", "seconds": 0.0, "error": None}
        self.data["parts"].append(entry)
        start = time.perf_counter()
        log(f"{name} ...")
        free_memory()  # what a failed part before left: its exception's frames are gone by now
        try:
            yield entry
            if entry["status"] == "running":
                entry["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - recorded, and the run goes on
            entry["status"] = "error"
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
            log(f"{name} FAILED: {entry['error']}")
        finally:
            entry["seconds"] = round(time.perf_counter() - start, 2)
            self.write()

    def check(self, name: str) -> None:
        """Raise when --fail-in names this part (to test that a failing part is recorded)."""
        if name in self.fail_in:
            raise RuntimeError(f"failure injected in {name!r} (--fail-in)")

    def skip(self, name: str, why: str) -> None:
        self.data["parts"].append({"name": name, "status": "skipped", "seconds": 0.0, "error": why})
        log(f"{name} skipped: {why}")
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed_s(), 1)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / REPORT_JSON).write_text(json.dumps(self.data, separators=(",", ":"), default=_json_default))
        try:
            text = render_markdown(self.data)
        except Exception as e:  # noqa: BLE001 - the JSON has everything; say why the markdown does not
            text = f"# GPU check\n\nThe markdown report failed ({type(e).__name__}: {e}); see {REPORT_JSON}.\n"
        (self.out / REPORT_MD).write_text(text)


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def log(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def environment(device: torch.device) -> dict[str, Any]:
    import partita

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda,
        "partita": partita.__version__,
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError as e:
        env["transformers"] = f"not importable: {e}"
    env["git_commit"] = _command(["git", "rev-parse", "--short", "HEAD"])
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            {
                "gpu": props.name,
                "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                "gpu_sms": props.multi_processor_count,
                "compute_capability": f"{props.major}.{props.minor}",
                "cudnn": torch.backends.cudnn.version(),
                "nccl": _nccl_version(),
                "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            }
        )
        from partita.cost.profiler import device_name

        env["catalog name (profiler)"] = device_name(device)
        env["nvidia-smi"] = _command(
            ["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.max.sm", "--format=csv,noheader"]
        )
    else:
        env["cpu"] = _cpu_model()
    return env


def _command(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent)
        return done.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _nccl_version() -> str | None:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - informative only
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ----------------------------------------------------------------------------- devices and models


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class Built:
    model: torch.nn.Module
    make_batch: Callable[[int, int], tuple[tuple, dict, Any]]  # (batch, step) -> (args, kwargs, target)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Built:
    """A zoo model (``partita.examples.hf`` config of ``spec.size`` plus ``spec.overrides``), built
    directly on ``device`` (fast on a GPU; the weights' values do not matter here), cast to ``dtype``,
    with the zoo's synthetic batches on ``device``."""
    import transformers

    from partita.examples import hf

    family = hf.FAMILIES[spec.family]
    config_kwargs = {**hf.config_kwargs(spec.family, spec.size), **spec.overrides}
    config = getattr(transformers, family.config_class)(attn_implementation="eager", **config_kwargs)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = getattr(transformers, family.model_class)(config)
    if family.loss_type is not None:
        model.loss_type = family.loss_type
    model = model.to(device=device, dtype=dtype).train()

    def make_batch(batch_size: int, step: int) -> tuple[tuple, dict, Any]:
        kwargs = family.make_inputs(seed, step, batch_size, spec.seq_len, config_kwargs)
        return (), {k: v.to(device) for k, v in kwargs.items()}, None

    return Built(model, make_batch)


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# ----------------------------------------------------------------------------- stage ranges


@dataclass
class RangeRun:
    """One node range [start, stop) of a graph, ready to run as a stage module."""

    label: str
    kind: str  # whole, half, quarter, layer
    start: int
    stop: int
    stage: Any = field(repr=False, default=None)
    inputs: list = field(repr=False, default_factory=list)  # received boundary tensors, then graph inputs
    num_received: int = 0
    grad_outputs: list = field(repr=False, default_factory=list)  # empty on the last range (the loss)
    forward_s: list = field(default_factory=list)
    backward_s: list = field(default_factory=list)


def layer_bounds(graph: Any, prefix: str) -> list[int]:
    """Position of the first node of each layer, then where the last layer ends."""
    starts: list[int] = []

    def in_layer(path: str, k: int) -> bool:
        return path == f"{prefix}{k}" or path.startswith(f"{prefix}{k}.")

    for node in graph.nodes:
        if in_layer(node.module_path, len(starts)):
            starts.append(node.index)
    if not starts:
        raise ValueError(f"no node of the graph is in a module named {prefix}0")
    last = len(starts) - 1
    end = next(
        (n.index for n in graph.nodes[starts[-1] :] if n.module_path and not in_layer(n.module_path, last)),
        graph.num_nodes,
    )
    return starts + [end]


def range_sets(graph: Any, prefix: str) -> list[tuple[list[int], dict[int, tuple[str, str]]]]:
    """Splits of the graph, each with the stages to keep: {stage index: (label, kind)}."""
    bounds, n = layer_bounds(graph, prefix), graph.num_nodes
    num_layers = len(bounds) - 1

    def cut(k: int) -> int:  # k quarters of the layers in
        return bounds[round(k * num_layers / 4)]

    mid = num_layers // 2
    sets = [
        ([0, n], {0: ("whole", "whole")}),
        ([0, cut(2), n], {0: ("half 1/2", "half"), 1: ("half 2/2", "half")}),
        ([0, cut(1), cut(2), cut(3), n], {k: (f"quarter {k + 1}/4", "quarter") for k in range(4)}),
        ([0, bounds[mid], bounds[mid + 1], n], {1: (f"layer {mid}", "layer")}),
    ]
    result = []
    for cuts, keep in sets:
        unique = sorted(set(cuts))
        if unique != cuts:  # a degenerate split (tiny models): keep the ranges that exist
            keep = {unique.index(cuts[k]): v for k, v in keep.items() if cuts[k] < cuts[k + 1]}
        result.append((unique, keep))
    return result


def differentiable(values: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if torch.is_tensor(t) and t.requires_grad]


def prepare_ranges(graph: Any, flat_inputs: list, prefix: str) -> list[RangeRun]:
    """Stage modules for every range and their real inputs (the boundary tensors a full forward
    sends into them, as leaves that require grad exactly when the original values do). Ranges
    that appear in several splits are kept once, with their labels joined."""
    from partita.runtime.stages import split_graph

    runs: dict[tuple[int, int], RangeRun] = {}
    for cuts, keep in range_sets(graph, prefix):
        if not keep:
            continue
        stages = split_graph(graph, cuts)
        received: tuple = ()
        for k, stage in enumerate(stages):
            if k > max(keep):
                break
            inputs = [*received, *stage.graph_inputs(flat_inputs)]
            with torch.enable_grad():
                outputs = stage(*inputs)
            if k in keep:
                label, kind = keep[k]
                key = (cuts[k], cuts[k + 1])
                if key in runs:
                    runs[key].label += f" = {label}"
                else:
                    grads = [] if stage.spec.is_last else [torch.randn_like(t) for t in differentiable(outputs)]
                    runs[key] = RangeRun(label, kind, cuts[k], cuts[k + 1], stage, inputs, len(received), grads)
            if not stage.spec.is_last:
                received = tuple(
                    t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in outputs
                )
            del outputs
    return sorted(runs.values(), key=lambda r: ({"whole": 0, "half": 1, "quarter": 2, "layer": 3}[r.kind], r.start))


# ----------------------------------------------------------------------------- time


def time_step(run: RangeRun, device: torch.device) -> tuple[float, float]:
    """(forward, backward) seconds of one step of the range; gradients of parameters and inputs."""
    wrt = [p for p in run.stage.parameters() if p.requires_grad] + differentiable(run.inputs)
    start_s = now(device)
    with torch.enable_grad():
        outputs = run.stage(*run.inputs)
    forward_end_s = now(device)
    torch.autograd.grad(differentiable(outputs), wrt, run.grad_outputs or None, allow_unused=True)
    return forward_end_s - start_s, now(device) - forward_end_s


def time_ranges(runs: list[RangeRun], device: torch.device, rounds: int, warmup: int) -> None:
    """Every range once per round, rotating who goes first (load changes hit all alike)."""
    for r in range(warmup + rounds):
        for run in runs[r % len(runs) :] + runs[: r % len(runs)]:
            forward_s, backward_s = time_step(run, device)
            if r >= warmup:
                run.forward_s.append(forward_s)
                run.backward_s.append(backward_s)


# ----------------------------------------------------------------------------- analytic terms


def roofline_terms(graph: Any, spec: Any, microbatch_size: int, dtype: str | None) -> dict[str, np.ndarray]:
    """Each node's roofline terms, so that for any efficiencies and overhead

        forward_s  = max(c_f / compute_efficiency, m_f / memory_efficiency) + n_f * op_overhead_s
        backward_s = max(c_b / compute_efficiency, m_b / memory_efficiency) + n_b * op_overhead_s

    is what ``analytic_costs`` gives (c: FLOP-seconds at peak, m: bytes over the full bandwidth, n:
    overheads counted). Obtained from ``analytic_costs`` itself with one of the three terms left in."""
    from partita.cost.analytic import analytic_costs

    huge = 1e30
    ideal = dict(compute_efficiency=1.0, memory_efficiency=1.0, op_overhead_s=0.0)
    no_flops_limit = {k: huge for k in spec.peak_flops}
    compute = analytic_costs(
        graph, dataclasses.replace(spec, memory_bandwidth_bytes_per_s=huge, **ideal), microbatch_size, dtype=dtype
    )
    memory = analytic_costs(
        graph, dataclasses.replace(spec, peak_flops=no_flops_limit, **ideal), microbatch_size, dtype=dtype
    )
    count = analytic_costs(
        graph,
        dataclasses.replace(
            spec,
            peak_flops=no_flops_limit,
            memory_bandwidth_bytes_per_s=huge,
            compute_efficiency=1.0,
            memory_efficiency=1.0,
            op_overhead_s=1.0,
        ),
        microbatch_size,
        dtype=dtype,
    )
    return {
        "c_f": compute.forward_s,
        "m_f": memory.forward_s,
        "n_f": np.round(count.forward_s),
        "c_b": compute.backward_s,
        "m_b": memory.backward_s,
        "n_b": np.round(count.backward_s),
    }


def roofline_time(terms: dict, direction: str, ce: float, me: float, oh: float) -> np.ndarray:
    """Per-node seconds of one direction ("f" or "b") from the terms (see ``roofline_terms``)."""
    c, m, n = (np.asarray(terms[f"{k}_{direction}"], dtype=float) for k in "cmn")
    return np.maximum(c / ce, m / me) + n * oh


def _compact(values: np.ndarray) -> list[float]:
    return [float(f"{v:.5g}") for v in np.asarray(values, dtype=float)]


# ----------------------------------------------------------------------------- memory


class PeakMeter:
    """Peak and final bytes allocated above the start while ``fn`` runs: CUDA allocator statistics,
    or on CPU the allocator's events in torch.profiler (exact, and no hook on any tensor)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, fn: Callable[[], Any]) -> tuple[int, int]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            fn()
            torch.cuda.synchronize(self.device)
            return (
                torch.cuda.max_memory_allocated(self.device) - base,
                torch.cuda.memory_allocated(self.device) - base,
            )
        from torch.profiler import ProfilerActivity

        with _quiet_stderr(), torch.profiler.profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            live += event.nbytes()
            peak = max(peak, live)
        return peak, live


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null: kineto prints two lines per profiler session there (C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def unique_bytes(tensors: Any) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    return sum(storages.values())


def measure_step_memory(run: RangeRun, in_flight: int, recompute: str, meter: PeakMeter) -> dict[str, int]:
    """Peak bytes of one training step of the range: ``in_flight`` micro-batches forward (each on its
    own copy of the received tensors), then their backwards, then ``Adam.step`` (states made by a
    step before; lr=0, so the model's shared weights stay as they are).

    Parts: at the start P parameters and buffers, O Adam states, X the received copies and the output
    gradient; B the peak of forwards + backwards above the start; G what is left after them (the
    gradients); S the peak of ``Adam.step`` above that. Total = P + O + X + max(B, G + S).

    ``recompute`` is a Recompute level, run as the runtime's StageRunner runs it: non-reentrant
    checkpointing of the whole stage (full), with the selective op policy (selective), or none."""
    import functools

    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from partita.runtime.pipeline import selective_policy

    def run_stage(*inputs: torch.Tensor) -> Any:
        if recompute == "full":
            return checkpoint(run.stage, *inputs, use_reentrant=False)
        if recompute == "selective":
            contexts = functools.partial(create_selective_checkpoint_contexts, selective_policy)
            return checkpoint(run.stage, *inputs, use_reentrant=False, context_fn=contexts)
        return run.stage(*inputs)

    params = [p for p in run.stage.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=0.0)
    graph_inputs = run.inputs[run.num_received :]
    copies = [
        [t.detach().clone().requires_grad_(t.requires_grad) for t in run.inputs[: run.num_received]]
        for _ in range(in_flight)
    ]

    def forward_backward() -> None:
        outputs = []
        with torch.enable_grad():
            for received in copies:
                inputs = [*received, *graph_inputs]
                outputs.append(run_stage(*inputs))
        for out, received in zip(outputs, copies):
            torch.autograd.backward(differentiable(out), run.grad_outputs or None)
            for t in received:
                t.grad = None  # sent to the previous stage and freed, in a pipeline
        outputs.clear()

    def clear() -> None:
        optimizer.zero_grad(set_to_none=True)

    try:
        forward_backward()  # warm-up, and the Adam states
        optimizer.step()
        clear()
        states = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        parts = {
            "params": unique_bytes([*run.stage.parameters(), *run.stage.buffers()]),
            "optimizer": unique_bytes(states),
            "boundary": unique_bytes([t for c in copies for t in c] + list(run.grad_outputs)),
        }
        parts["backward_peak"], parts["grads"] = meter(forward_backward)
        parts["optimizer_peak"], _ = meter(optimizer.step)
        start = parts["params"] + parts["optimizer"] + parts["boundary"]
        parts["total"] = start + max(parts["backward_peak"], parts["grads"] + parts["optimizer_peak"])
        parts["peak_in"] = (
            "adam.step" if parts["grads"] + parts["optimizer_peak"] > parts["backward_peak"] else "backward"
        )
        return parts
    finally:
        clear()


def predicted_memory(costs: Any, run: RangeRun, in_flight: int, recompute: str) -> dict[str, int]:
    from partita.cost.memory import device_memory
    from partita.types import OptimizerKind, Recompute

    p = device_memory(
        costs,
        [(run.start, run.stop)],
        in_flight=in_flight,
        optimizer=OptimizerKind.ADAM,
        recompute=Recompute.parse(recompute),
        num_microbatches=in_flight,
    )
    return {
        "total": int(p.total_bytes),
        "params": p.param_bytes,
        "grads": p.grad_bytes,
        "optimizer": p.optimizer_bytes,
        "activations": p.activation_bytes,
        "comm": p.comm_buffer_bytes,
        "working": p.working_bytes,
        "optimizer_step": p.optimizer_step_bytes,
        "backward_grads": p.grad_bytes if p.backward_grad_bytes is None else p.backward_grad_bytes,
    }


def free_device_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


# ----------------------------------------------------------------------------- one configuration


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured <= 0:
        return None
    return 100.0 * (predicted - measured) / measured


def run_config(
    report: Report,
    config: dict,
    spec: ModelSpec,
    graph: Any,
    built: Built,
    device: torch.device,
    settings: Settings,
    analytic_spec: Any,
    do_memory: bool,
    deadline: float,
) -> None:
    """Profile, time and measure the memory of one (model, dtype, micro-batch size): ``config``,
    already in the report, gets the configuration's numbers; rows go to the report's tables."""
    from partita.cost.analytic import analytic_costs
    from partita.cost.profiler import profile
    from partita.runtime.stages import flatten_inputs

    dtype_name, mb = config["dtype"], config["microbatch_size"]
    report.check(f"{spec.key}/{dtype_name}/mb{mb}")
    where = dict(model=spec.key, dtype=dtype_name, microbatch_size=mb)
    config.update(seq_len=spec.seq_len, num_nodes=graph.num_nodes, allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    analytic_dtype = ANALYTIC_DTYPE[dtype_name]
    analytic = analytic_costs(graph, analytic_spec, mb, dtype=analytic_dtype)
    terms = roofline_terms(graph, analytic_spec, mb, analytic_dtype)
    rebuilt_f = roofline_time(
        terms, "f", analytic_spec.compute_efficiency, analytic_spec.memory_efficiency, analytic_spec.op_overhead_s
    )
    rebuilt_b = roofline_time(
        terms, "b", analytic_spec.compute_efficiency, analytic_spec.memory_efficiency, analytic_spec.op_overhead_s
    )
    scale = max(float(analytic.forward_s.max()), float(analytic.backward_s.max()), 1e-30)
    config["terms_check"] = float(
        max(np.abs(rebuilt_f - analytic.forward_s).max(), np.abs(rebuilt_b - analytic.backward_s).max()) / scale
    )
    config["terms"] = {k: _compact(v) for k, v in terms.items()}
    config["targets"] = [node.target for node in graph.nodes]
    config["analytic_whole_ms"] = 1e3 * float(analytic.forward_s.sum() + analytic.backward_s.sum())

    args, kwargs, target = built.make_batch(mb, 0)
    measured = None
    start_s = time.perf_counter()
    # The profiler keeps one recorded forward alive while it times another (and a whole step):
    # about twice the graph's activations. Skip it where that cannot fit rather than run out.
    need = 2.5 * float(analytic.activation_bytes.sum()) + 3 * float(analytic.param_bytes.sum())
    free = free_device_bytes(device)
    if free is not None and need > free:
        config["errors"]["profile"] = (
            f"skipped: needs ~{need / 2**30:.0f} GiB (2.5 x activations + 3 x params), {free / 2**30:.0f} GiB free"
        )
    else:
        try:
            measured = profile(
                graph,
                (args, kwargs, target),
                microbatch_size=mb,
                repeats=settings.profile_repeats,
                warmup=settings.profile_warmup,
            )
            config["profile"] = {k: float(v) for k, v in measured.calibration.items()}
            config["profile"]["device"] = measured.device
            config["profiled_nodes"] = {
                "forward_s": _compact(measured.forward_s),
                "backward_s": _compact(measured.backward_s),
            }
        except Exception as e:  # noqa: BLE001 - the range timings below do not need it
            config["errors"]["profile"] = f"{type(e).__name__}: {e}"
            log(f"  profile failed: {config['errors']['profile']}")
        free_memory()  # after the except block: the exception's frames hold the profiler's tensors
    config["profile_s"] = round(time.perf_counter() - start_s, 2)
    if time.perf_counter() > deadline:
        config["errors"]["time"] = "skipped: time budget spent"
        return

    flat = flatten_inputs(graph, args, kwargs, target)
    start_s = time.perf_counter()
    runs = prepare_ranges(graph, flat, LAYER_PREFIX[spec.family])
    time_ranges(runs, device, settings.time_rounds, settings.time_warmup)
    config["time_s"] = round(time.perf_counter() - start_s, 2)
    for run in runs:
        span = slice(run.start, run.stop)
        forward_s, backward_s = statistics.median(run.forward_s), statistics.median(run.backward_s)
        row = {
            **where,
            "stage": run.label,
            "kind": run.kind,
            "start": run.start,
            "stop": run.stop,
            "measured_forward_ms": 1e3 * forward_s,
            "measured_backward_ms": 1e3 * backward_s,
            "analytic_forward_ms": 1e3 * float(analytic.forward_s[span].sum()),
            "analytic_backward_ms": 1e3 * float(analytic.backward_s[span].sum()),
            "spread_pct": 100.0
            * (max(run.forward_s) + max(run.backward_s))
            / (min(run.forward_s) + min(run.backward_s))
            - 100.0,
        }
        if measured is not None:
            row["profiled_forward_ms"] = 1e3 * float(measured.forward_s[span].sum())
            row["profiled_backward_ms"] = 1e3 * float(measured.backward_s[span].sum())
        add_errors(row)
        report.data["time_rows"].append(row)

    if do_memory:
        start_s = time.perf_counter()
        meter = PeakMeter(device)
        for run in (r for r in runs if r.kind == "quarter"):
            for in_flight in settings.in_flight:
                for recompute in RECOMPUTE_LEVELS:
                    if time.perf_counter() > deadline:
                        config["errors"]["memory"] = "some rows skipped: time budget spent"
                        break
                    row = {
                        **where,
                        "stage": run.label,
                        "start": run.start,
                        "stop": run.stop,
                        "in_flight": in_flight,
                        "recompute": recompute,
                        "predicted_analytic": predicted_memory(analytic, run, in_flight, recompute),
                    }
                    if measured is not None:
                        row["predicted_profiled"] = predicted_memory(measured, run, in_flight, recompute)
                    free = free_device_bytes(device)
                    if free is not None and row["predicted_analytic"]["total"] * 1.3 > free:
                        row["error"] = (
                            f"skipped: predicted {row['predicted_analytic']['total'] / 2**30:.1f} GiB "
                            f"x 1.3 > {free / 2**30:.1f} GiB free"
                        )
                    else:
                        try:
                            row["measured"] = measure_step_memory(run, in_flight, recompute, meter)
                        except Exception as e:  # noqa: BLE001 - recorded per row (out of memory, ...)
                            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                        if "error" in row:
                            free_memory()
                    add_memory_errors(row)
                    report.data["memory_rows"].append(row)
        config["memory_s"] = round(time.perf_counter() - start_s, 2)
    del runs
    free_memory()


def add_errors(row: dict) -> None:
    for source in ("analytic", "profiled"):
        if f"{source}_forward_ms" not in row:
            continue
        f, b = row[f"{source}_forward_ms"], row[f"{source}_backward_ms"]
        row[f"{source}_forward_err"] = error_pct(f, row["measured_forward_ms"])
        row[f"{source}_backward_err"] = error_pct(b, row["measured_backward_ms"])
        row[f"{source}_step_err"] = error_pct(f + b, row["measured_forward_ms"] + row["measured_backward_ms"])


def add_memory_errors(row: dict) -> None:
    measured = row.get("measured", {}).get("total")
    for source in ("analytic", "profiled"):
        if f"predicted_{source}" in row:
            row[f"{source}_err"] = error_pct(row[f"predicted_{source}"]["total"], measured)


# ----------------------------------------------------------------------------- models part


def run_models(
    report: Report,
    settings: Settings,
    device: torch.device,
    args: argparse.Namespace,
    deadline: float,
    analytic_spec: Any,
) -> None:
    import partita

    # fp32 and bf16 of every model first, tf32 last (dropped first when time runs out)
    groups = [(spec, dtype) for dtype in settings.dtypes if dtype != "tf32" for spec in settings.models]
    groups.sort(key=lambda g: [s.key for s in settings.models].index(g[0].key))
    groups += [(spec, "tf32") for spec in settings.models if "tf32" in settings.dtypes]
    for g, (spec, dtype_name) in enumerate(groups):
        name = f"{spec.key}/{dtype_name}"
        remaining = deadline - time.perf_counter()
        if remaining < 10:
            report.skip(name, f"time budget spent ({args.time_budget_s:.0f} s)")
            continue
        share = remaining / (len(groups) - g)
        with report.part(name) as entry:
            report.check(name)
            group_start = time.perf_counter()
            torch.backends.cuda.matmul.allow_tf32 = dtype_name == "tf32"
            built = build_model(spec, device, DTYPES[dtype_name])
            # batch >= 2: torch.export specialises a batch of 1 (FACTS.md), and the graph must run every size
            args_, kwargs, target = built.make_batch(max(2, *spec.microbatches), 0)
            start_s = time.perf_counter()
            graph = partita.capture(built.model, args_, kwargs)
            entry["capture_s"] = round(time.perf_counter() - start_s, 2)
            entry["num_nodes"], entry["num_parameters"] = graph.num_nodes, count_params(built.model)
            entry["label"] = spec.label
            log(
                f"  {spec.label}, {dtype_name}: {graph.num_nodes} nodes, {entry['num_parameters'] / 1e6:.1f} M "
                f"parameters, captured in {entry['capture_s']} s"
            )
            last_s, last_mb, done, failed = None, None, [], []
            for mb in spec.microbatches:
                if mb in entry.get("skipped_microbatches", ()):
                    continue
                spent = time.perf_counter() - group_start
                estimate = 0.0 if last_s is None else last_s * mb / last_mb
                if done and (spent + estimate > share or time.perf_counter() + estimate > deadline):
                    entry.setdefault("skipped_microbatches", []).append(mb)
                    log(f"  micro-batch {mb} skipped: ~{estimate:.0f} s would pass this part's share of the budget")
                    continue
                start_s = time.perf_counter()
                log(f"  micro-batch {mb}")
                config = {"model": spec.key, "dtype": dtype_name, "microbatch_size": mb, "errors": {}}
                report.data["configs"].append(config)
                out_of_memory = False
                try:
                    run_config(
                        report,
                        config,
                        spec,
                        graph,
                        built,
                        device,
                        settings,
                        analytic_spec,
                        do_memory=not args.no_memory,
                        deadline=deadline,
                    )
                except Exception as e:  # noqa: BLE001 - recorded; the next micro-batch size goes on
                    out_of_memory = isinstance(e, torch.cuda.OutOfMemoryError)
                    config["errors"]["run"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                    config["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
                    log(f"  micro-batch {mb} FAILED: {config['errors']['run']}")
                    failed.append(mb)
                free_memory()
                if out_of_memory:  # larger micro-batches will not fit either
                    entry.setdefault("skipped_microbatches", []).extend(m for m in spec.microbatches if m > mb)
                    break
                last_s, last_mb = time.perf_counter() - start_s, mb
                done.append(mb)
                report.write()
            entry["microbatches"] = [m for m in done if m not in failed]
            if failed:
                entry["status"] = "error"
                entry["error"] = f"micro-batch sizes {failed} failed (see the configurations and errors)"
            del graph, built
            torch.backends.cuda.matmul.allow_tf32 = False
            free_memory()
            if device.type == "cuda":  # what the part left allocated: a leak shows here first
                entry["allocated_after_mib"] = round(torch.cuda.memory_allocated(device) / 2**20, 1)
                log(f"  left allocated: {entry['allocated_after_mib']} MiB")


# ----------------------------------------------------------------------------- trainer part


@contextlib.contextmanager
def one_rank_process_group(device: torch.device):
    """A process group of world size 1 (NCCL on CUDA, gloo on CPU) from MASTER_ADDR/PORT on a free
    port; the environment is restored and the group destroyed afterwards."""
    import torch.distributed as dist

    names = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    saved = {k: os.environ.get(k) for k in names}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=TRAINER_TIMEOUT_S),
        )
        yield dist.get_backend()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_trainer(
    report: Report, settings: Settings, device: torch.device, args: argparse.Namespace, deadline: float
) -> None:
    import partita
    from partita.planning.manual import manual_plan

    spec = settings.trainer_model
    with report.part("trainer") as entry, one_rank_process_group(device) as backend:
        report.check("trainer")
        entry["backend"] = backend
        by_dtype: dict[str, tuple[Built, Any, dict]] = {}
        references: dict[str, tuple[list[float], dict, list[float]]] = {}  # precision -> unsplit losses, state, step s
        for case in settings.trainer_cases:
            if time.perf_counter() > deadline - 20:
                report.data["trainer_rows"].append({"case": case.name, "error": "skipped: time budget"})
                continue
            row: dict[str, Any] = {
                "case": case.name,
                "schedule": case.schedule,
                "stages": case.num_stages,
                "microbatches": case.num_microbatches,
                "dtype": case.dtype,
                "recompute": case.recompute,
                "precision": case.precision,
                "global_batch": settings.trainer_batch,
                "error": "did not finish (the process was killed or hung in this case)",
            }
            report.data["trainer_rows"].append(row)
            report.write()
            try:
                if case.dtype not in by_dtype:
                    built = build_model(spec, device, DTYPES[case.dtype], seed=1)
                    a, kw, t = built.make_batch(settings.trainer_batch, 0)
                    graph = partita.capture(built.model, a, kw)
                    initial = {k: v.detach().clone() for k, v in built.model.state_dict().items()}
                    by_dtype[case.dtype] = (built, graph, initial)
                built, graph, initial = by_dtype[case.dtype]
                built.model.load_state_dict(initial)  # every case starts from the same weights
                bounds = layer_bounds(graph, LAYER_PREFIX[spec.family])
                cuts = (
                    [0, graph.num_nodes]
                    if case.num_stages == 1
                    else [0, bounds[(len(bounds) - 1) // 2], graph.num_nodes]
                )
                row["cuts"] = cuts
                plan = manual_plan(
                    graph,
                    cuts,
                    schedule=case.schedule,
                    num_rank_groups=1,
                    num_microbatches=case.num_microbatches,
                    global_batch_size=settings.trainer_batch,
                    recompute=case.recompute,
                    precision=case.precision,
                    cluster=_trainer_cluster(device),
                )
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                trainer = partita.Trainer(
                    built.model,
                    plan,
                    graph=graph,
                    max_grad_norm=1.0,
                    optimizer=lambda ps: torch.optim.AdamW(ps, lr=settings.trainer_lr),
                    collective_timeout_s=TRAINER_TIMEOUT_S,
                )
                row["trainer_device"] = str(trainer.topology.device)
                losses, step_s = [], []
                for step in range(settings.trainer_steps):
                    a, kw, t = built.make_batch(settings.trainer_batch, step)
                    start_s = now(device)
                    losses.append(float(trainer.step(*a, **kw)))
                    step_s.append(now(device) - start_s)
                row["losses"] = losses
                if case.dtype == "fp32":  # the fp32 model, trained in fp32 or under autocast
                    state = trainer.gather_state_dict()
                    if case.precision not in references:
                        references[case.precision] = unsplit_training(built, initial, settings, case.precision, device)
                    ref_losses, ref_state, ref_step_s = references[case.precision]
                    row["unsplit_step_ms"] = 1e3 * statistics.median(ref_step_s[1:] or ref_step_s)
                    row["unsplit_loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
                    row["unsplit_missing_keys"] = sorted(set(ref_state) ^ set(state))
                    row["unsplit_param_diff"] = max(  # gather_state_dict gives CPU tensors
                        (state[k].double() - v.double().cpu()).abs().max().item()
                        for k, v in ref_state.items()
                        if v.numel() and k in state
                    )
                    del state
                row["finite"] = all(math.isfinite(x) for x in losses)
                row["falls"] = row["finite"] and losses[-1] < losses[0]
                row["step_ms"] = 1e3 * statistics.median(step_s[1:] or step_s)
                row["first_step_ms"] = 1e3 * step_s[0]
                if device.type == "cuda":
                    row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                row.pop("error")
                del trainer
            except Exception as e:  # noqa: BLE001 - recorded per case
                row["error"] = f"{type(e).__name__}: {e}"
                row["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:])
                log(f"  trainer {case.name} FAILED: {row['error']}")
            free_memory()
            report.write()
            log(f"  trainer {case.name}: {row.get('losses', row.get('error'))}")
        by_dtype.clear()
        references.clear()
        bad = [r["case"] for r in report.data["trainer_rows"] if not r.get("falls")]  # failed and skipped too
        if bad:
            entry["status"] = "error"
            entry["error"] = f"loss not finite and falling (or the case failed) in: {', '.join(bad)}"


def unsplit_training(
    built: Built, initial: dict, settings: Settings, precision: str, device: torch.device
) -> tuple[list[float], dict, list[float]]:
    """The unsplit model trained on the trainer cases' batches, whole batch at a time, with the same
    optimizer and clipping, in fp32 or under ``torch.autocast`` to bf16 (``precision``): its losses,
    final state (on the same device; the model is left at ``initial`` afterwards) and the seconds of
    each step, timed as the Trainer's are (what partita's runtime adds is the difference)."""
    model = built.model
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.trainer_lr)
    losses, step_s = [], []
    for step in range(settings.trainer_steps):
        a, kw, _ = built.make_batch(settings.trainer_batch, step)
        start_s = now(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(*a, **kw).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        step_s.append(now(device) - start_s)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    del optimizer
    model.load_state_dict(initial)
    return losses, state, step_s


def _trainer_cluster(device: torch.device) -> Any:
    from partita.types import Cluster

    if device.type == "cuda":
        from partita.cost.profiler import device_name
        from partita.types.devices import known_devices

        name = device_name(device)
        return Cluster(device=name if name in known_devices() else "h200", num_devices=1, devices_per_node=1)
    return Cluster(device="cpu", num_devices=1, devices_per_node=1)


# ----------------------------------------------------------------------------- calibration


def calibrate(data: dict, base_spec: dict | None = None) -> dict:
    """Fit compute_efficiency, memory_efficiency and op_overhead_s to the measured stage times.

    Observations: every time row's forward and backward (ms) with the roofline terms of its config.
    Objective: sum of log(predicted / measured)^2, on a coarse grid then a fine one around its best.
    Returns the fit overall and per dtype, with the median / worst |error| before and after."""
    base = base_spec or data["analytic_device"]
    terms_by_config = {
        (c["model"], c["dtype"], c["microbatch_size"]): c["terms"] for c in data["configs"] if "terms" in c
    }
    observations = []  # (config key, direction, start, stop, measured seconds, dtype)
    for row in data["time_rows"]:
        key = (row["model"], row["dtype"], row["microbatch_size"])
        if key not in terms_by_config:
            continue
        for direction, column in (("f", "measured_forward_ms"), ("b", "measured_backward_ms")):
            if row.get(column):
                observations.append((key, direction, row["start"], row["stop"], row[column] / 1e3, row["dtype"]))
    result: dict[str, Any] = {
        "base": {k: base[k] for k in ("name", "compute_efficiency", "memory_efficiency", "op_overhead_s")},
        "num_observations": len(observations),
    }
    if not observations:
        result["error"] = "no time rows with roofline terms: nothing to fit"
        return result
    arrays = {key: {k: np.asarray(v, dtype=float) for k, v in t.items()} for key, t in terms_by_config.items()}
    result["all"] = _fit(arrays, observations, base)
    # Not what partita computes: a stage takes max(kernel time, launches x overhead), as when the
    # host launches kernels asynchronously ahead of the device. If it fits much better, the
    # per-node additive overhead of analytic.py is the wrong shape for this device.
    result["all, overlapped overhead"] = _fit(arrays, observations, base, overlapped=True)
    for dtype in sorted({o[5] for o in observations}):
        subset = [o for o in observations if o[5] == dtype]
        result[f"dtype {dtype}"] = _fit(arrays, subset, base)
    for direction, name in (("f", "forward only"), ("b", "backward only")):
        subset = [o for o in observations if o[1] == direction]
        if subset:
            result[name] = _fit(arrays, subset, base)
    return result


def _fit(arrays: dict, observations: list, base: dict, overlapped: bool = False) -> dict:
    measured = np.array([o[4] for o in observations])
    keys = sorted({(o[0], o[1]) for o in observations})
    counts = np.zeros(len(observations))
    for i, (key, direction, start, stop, _, _) in enumerate(observations):
        counts[i] = arrays[key][f"n_{direction}"][start:stop].sum()

    def roofline_sums(ce: float, me: float, compute_bound_only: bool = False) -> np.ndarray:
        """Per observation: the sum over its nodes of max(compute, memory) seconds (or only the
        nodes where compute is the larger term)."""
        sums = np.zeros(len(observations))
        cumulative = {}
        for key, direction in keys:
            t = arrays[key]
            compute, memory = t[f"c_{direction}"] / ce, t[f"m_{direction}"] / me
            per_node = np.where(compute > memory, compute, 0.0 if compute_bound_only else memory)
            cumulative[key, direction] = np.concatenate([[0.0], np.cumsum(per_node)])
        for i, (key, direction, start, stop, _, _) in enumerate(observations):
            c = cumulative[key, direction]
            sums[i] = c[stop] - c[start]
        return sums

    def combine(sums: Any, overhead_s: Any, launches: Any) -> Any:
        return np.maximum(sums, overhead_s * launches) if overlapped else sums + overhead_s * launches

    def best_overhead(sums: np.ndarray, overheads: np.ndarray) -> tuple[float, float]:
        predicted = combine(sums[None, :], overheads[:, None], counts[None, :])
        loss = (np.log(np.maximum(predicted, 1e-15) / measured[None, :]) ** 2).sum(axis=1)
        i = int(np.argmin(loss))
        return float(loss[i]), float(overheads[i])

    def search(ces: np.ndarray, mes: np.ndarray, overheads: np.ndarray) -> tuple[float, float, float, float]:
        best = (math.inf, 0.0, 0.0, 0.0)
        for ce in ces:
            for me in mes:
                loss, oh = best_overhead(roofline_sums(ce, me), overheads)
                if loss < best[0]:
                    best = (loss, float(ce), float(me), oh)
        return best

    _, ce, me, oh = search(np.linspace(0.05, 1.0, 20), np.linspace(0.05, 1.0, 20), np.linspace(0, 300e-6, 151))
    _, ce, me, oh = search(
        np.clip(np.linspace(ce - 0.05, ce + 0.05, 11), 0.01, 1.0),
        np.clip(np.linspace(me - 0.05, me + 0.05, 11), 0.01, 1.0),
        np.clip(np.linspace(oh - 3e-6, oh + 3e-6, 61), 0.0, None),
    )

    def stats(ce_: float, me_: float, oh_: float, shape: Callable = combine) -> dict:
        predicted = shape(roofline_sums(ce_, me_), oh_, counts)
        errors = np.abs(100.0 * (predicted - measured) / measured)
        return {
            "median_abs_err_pct": float(np.median(errors)),
            "worst_abs_err_pct": float(errors.max()),
            "median_measured_over_predicted": float(np.median(measured / predicted)),
        }

    additive = lambda sums, oh_, launches: sums + oh_ * launches  # noqa: E731 - partita's model
    before = stats(base["compute_efficiency"], base["memory_efficiency"], base["op_overhead_s"], additive)
    after = stats(ce, me, oh)
    # What pins each value down: the shares of the fitted prediction in compute-bound nodes, in
    # memory-bound nodes and in overheads (additive shape), over all observations.
    sums, compute_part = roofline_sums(ce, me), roofline_sums(ce, me, compute_bound_only=True)
    total = float((sums + oh * counts).sum())
    shares = {
        "compute": float(compute_part.sum()) / total,
        "memory": float((sums - compute_part).sum()) / total,
        "overhead": float((oh * counts).sum()) / total,
    }
    return {
        "compute_efficiency": round(ce, 3),
        "memory_efficiency": round(me, 3),
        "op_overhead_s": float(f"{oh:.3g}"),
        "observations": len(observations),
        "before": before,
        "after": after,
        "time_shares": {k: round(v, 3) for k, v in shares.items()},
        "at_bounds": [n for n, v in (("compute_efficiency", ce), ("memory_efficiency", me)) if v >= 0.999 or v <= 0.011]
        + (["op_overhead_s"] if oh <= 0 or oh >= 300e-6 else []),
    }


def calibrated_device_file(calibration: dict) -> dict | None:
    fit = calibration.get("all")
    if not fit:
        return None
    base = calibration["base"]["name"]
    return {
        "name": f"{base}-calibrated",
        "base": base,
        "compute_efficiency": fit["compute_efficiency"],
        "memory_efficiency": fit["memory_efficiency"],
        "op_overhead_s": fit["op_overhead_s"],
    }


def calibration_text(calibration: dict) -> list[str]:
    lines = []
    if "error" in calibration:
        return [f"Calibration: {calibration['error']}."]
    base = calibration["base"]
    lines += [
        f"Catalog entry `{base['name']}` now: compute_efficiency {base['compute_efficiency']}, memory_efficiency "
        f"{base['memory_efficiency']}, op_overhead_s {base['op_overhead_s']:.3g}. "
        f"{calibration['num_observations']} observations (forward and backward of every time row). Fit: least "
        "squares of log(predicted / measured) over a grid. `before`: the entry as it is; `after`: the fit. "
        "`overlapped overhead` is another shape than partita's (stage time = max(roofline sum, nodes x "
        "overhead) instead of the sum): if it fits much better, the additive per-node overhead is wrong here. "
        "`time in`: shares of the fitted prediction in compute-bound nodes, memory-bound nodes and overheads: a "
        "value whose share is small is not pinned down by these measurements.",
        "",
        "| fit on | compute_efficiency | memory_efficiency | op_overhead_s | before: median / worst abs err % | "
        "after | measured / predicted (median) before -> after | time in compute / memory / overhead | at bounds |",
        "|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for name, fit in calibration.items():
        if not isinstance(fit, dict) or "compute_efficiency" not in fit or name == "base":
            continue
        b, a = fit["before"], fit["after"]
        lines.append(
            f"| {name} ({fit['observations']}) | {fit['compute_efficiency']} | {fit['memory_efficiency']} | "
            f"{fit['op_overhead_s'] * 1e6:.1f} us | {b['median_abs_err_pct']:.1f} / {b['worst_abs_err_pct']:.1f} | "
            f"{a['median_abs_err_pct']:.1f} / {a['worst_abs_err_pct']:.1f} | "
            f"{b['median_measured_over_predicted']:.2f} -> {a['median_measured_over_predicted']:.2f} | "
            f"{' / '.join(f'{v:.2f}' for v in fit['time_shares'].values())} | {', '.join(fit['at_bounds']) or '-'} |"
        )
    device_file = calibrated_device_file(calibration)
    if device_file:
        lines += [
            "",
            "Suggested device file (`calibrated_device.json`; or edit the entry in partita/types/devices.py):",
            "",
            "```json",
            json.dumps(device_file),
            "```",
        ]
    return lines


def run_calibrate(path: Path, out: Path | None) -> int:
    data = json.loads(Path(path).read_text())
    calibration = calibrate(data)
    print("\n".join(calibration_text(calibration)))
    device_file = calibrated_device_file(calibration)
    if out is not None and device_file is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / DEVICE_FILE).write_text(json.dumps(device_file, indent=1) + "\n")
        print(f"\nwrote {out / DEVICE_FILE}")
    return 0 if "error" not in calibration else 1


# ----------------------------------------------------------------------------- markdown


def _e(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0f}"


def _abs_stats(values: list[float | None]) -> str:
    values = [abs(v) for v in values if v is not None]
    return f"{statistics.median(values):.0f} / {max(values):.0f}" if values else "-"


def render_markdown(data: dict) -> str:
    lines = [
        "# GPU check: partita's cost and memory models against one device (issue 18)",
        "",
        f"- command: `{data['command']}`",
        f"- started {data['started_utc']} UTC, ran {data['elapsed_s']:.0f} s "
        f"(budget {data['options'].get('time_budget_s')} s); analytic device: "
        f"`{data.get('analytic_device', {}).get('name', '?')}`",
        "",
        "## Environment",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in data["environment"].items()]
    lines += ["", "## Parts", "", "| part | status | seconds | notes |", "|---|---|---:|---|"]
    for p in data["parts"]:
        notes = p.get("error") or ""
        if "num_nodes" in p:
            notes = (
                f"{p['num_nodes']} nodes, {p['num_parameters'] / 1e6:.1f} M params, capture {p['capture_s']} s, "
                f"micro-batches {p.get('microbatches')}"
                + (f", skipped {p['skipped_microbatches']}" if p.get("skipped_microbatches") else "")
                + (f"; {p['error']}" if p.get("error") else "")
            )
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']} | {notes} |")
    lines += (
        _config_table(data)
        + _time_summary(data)
        + _time_table(data)
        + op_type_table(data)
        + _memory_table(data)
        + _trainer_table(data)
    )
    lines += ["", "## Calibration", ""]
    lines += calibration_text(data["calibration"]) if data.get("calibration") else ["(not run yet)"]
    failures = [p for p in data["parts"] if p.get("traceback")] + [
        r for r in [*data["trainer_rows"], *data["configs"]] if r.get("traceback")
    ]
    config_errors = [(c, k, v) for c in data["configs"] for k, v in c.get("errors", {}).items()]
    if failures or config_errors:
        lines += ["", "## Errors", ""]
        for p in failures:
            title = p.get("name") or p.get("case") or f"{p['model']}/{p['dtype']}/mb {p['microbatch_size']}"
            lines += [f"### {title}", "", "```", p["traceback"].rstrip(), "```", ""]
        for c, k, v in config_errors:
            lines.append(f"- {c['model']}/{c['dtype']}/mb {c['microbatch_size']} {k}: {v}")
    return "\n".join(lines) + "\n"


def _config_table(data: dict) -> list[str]:
    lines = [
        "",
        "## Configurations",
        "",
        "`profile`: seconds of `profile()`; its whole-graph forward and forward+backward (flat module) and the "
        "factors it scaled its per-node timings by to match them (`fwd scale`, `bwd scale`: below 1 when "
        "timing nodes one by one overstates them). `terms check`: how far the roofline terms kept for "
        "`--calibrate` rebuild `analytic_costs` (relative; ~1e-16 expected).",
        "",
        "| model | dtype | mb | nodes | profile s | time s | memory s | profiled fwd / step ms | fwd scale | "
        "bwd scale | analytic fwd+bwd ms | terms check | errors |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for c in data["configs"]:
        p = c.get("profile") or {}
        whole = f"{1e3 * p['whole_forward_s']:.2f} / {1e3 * p['whole_step_s']:.2f}" if "whole_step_s" in p else "-"
        lines.append(
            f"| {c['model']} | {c['dtype']} | {c['microbatch_size']} | {c.get('num_nodes', '-')} | "
            f"{c.get('profile_s', '-')} | {c.get('time_s', '-')} | {c.get('memory_s', '-')} | {whole} | "
            f"{_f(p.get('forward_scale'))} | {_f(p.get('backward_scale'))} | {_f(c.get('analytic_whole_ms'))} | "
            f"{c['terms_check']:.1e} | {'; '.join(f'{k}: {v}' for k, v in c.get('errors', {}).items()) or '-'} |"
            if "terms_check" in c
            else f"| {c['model']} | {c['dtype']} | {c['microbatch_size']} | - | - | - | - | - | - | - | - | - | "
            f"{'; '.join(f'{k}: {v}' for k, v in c.get('errors', {}).items())} |"
        )
    return lines


def _time_summary(data: dict) -> list[str]:
    rows = data["time_rows"]
    lines = [
        "",
        "## Time: summary (median / worst abs error %, per model and dtype)",
        "",
        "Error = (predicted - measured) / measured, per stage range; `analytic`: roofline table of the "
        "analytic device; `profiled`: partita's profiler on this device, summed over the range.",
        "",
        "| model | dtype | rows | analytic fwd | analytic bwd | analytic fwd+bwd | profiled fwd+bwd | "
        "measured / analytic (median) |",
        "|---|---|---:|---|---|---|---|---:|",
    ]
    groups = sorted({(r["model"], r["dtype"]) for r in rows})
    for model, dtype in [*groups, ("all", "all")]:
        sel = [r for r in rows if (model == "all" or (r["model"], r["dtype"]) == (model, dtype))]
        if not sel:
            continue
        ratio = statistics.median(
            (r["measured_forward_ms"] + r["measured_backward_ms"])
            / max(r["analytic_forward_ms"] + r["analytic_backward_ms"], 1e-12)
            for r in sel
        )
        lines.append(
            f"| {model} | {dtype} | {len(sel)} | {_abs_stats([r.get('analytic_forward_err') for r in sel])} | "
            f"{_abs_stats([r.get('analytic_backward_err') for r in sel])} | "
            f"{_abs_stats([r.get('analytic_step_err') for r in sel])} | "
            f"{_abs_stats([r.get('profiled_step_err') for r in sel])} | {ratio:.2f} |"
        )
    return lines


def _time_table(data: dict) -> list[str]:
    lines = [
        "",
        "## Time per stage (ms)",
        "",
        "`spread`: (slowest - fastest) / fastest round of the measured step, %.",
        "",
        "| model | dtype | mb | stage | nodes | measured fwd | bwd | analytic fwd | bwd | err fwd % | err bwd % | "
        "profiled fwd | bwd | err fwd+bwd % | spread % |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["time_rows"]:
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['microbatch_size']} | {r['stage']} | {r['start']}-{r['stop']} | "
            f"{_f(r['measured_forward_ms'])} | {_f(r['measured_backward_ms'])} | {_f(r['analytic_forward_ms'])} | "
            f"{_f(r['analytic_backward_ms'])} | {_pct(r.get('analytic_forward_err'))} | "
            f"{_pct(r.get('analytic_backward_err'))} | {_f(r.get('profiled_forward_ms'))} | "
            f"{_f(r.get('profiled_backward_ms'))} | {_pct(r.get('profiled_step_err'))} | "
            f"{_f(r.get('spread_pct'), 0)} |"
        )
    return lines


def _mib(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value / MIB:.1f}" if abs(value) >= 10 * MIB else f"{value / MIB:.2f}"


def _memory_summary(data: dict) -> list[str]:
    measured = [r for r in data["memory_rows"] if "measured" in r]
    lines = ["", "## Memory: summary (median / worst abs error % of the step's peak, per stage)", ""]
    if not measured:
        return lines + ["(no memory row measured)"]
    lines += [
        "| model | dtype | recompute | in flight | rows | analytic | profiled | peak in Adam.step |",
        "|---|---|---|---:|---:|---|---|---:|",
    ]
    keys = sorted({(r["model"], r["dtype"], r["recompute"], r["in_flight"]) for r in measured})
    for key in [*keys, ("all", "all", "all", "all")]:
        sel = [
            r for r in measured if key[0] == "all" or (r["model"], r["dtype"], r["recompute"], r["in_flight"]) == key
        ]
        in_step = sum(r["measured"]["peak_in"] == "adam.step" for r in sel)
        lines.append(
            f"| {' | '.join(map(str, key))} | {len(sel)} | {_abs_stats([r.get('analytic_err') for r in sel])} | "
            f"{_abs_stats([r.get('profiled_err') for r in sel])} | {in_step} |"
        )
    return lines


def _memory_table(data: dict) -> list[str]:
    rows = data["memory_rows"]
    lines = [
        "",
        "## Memory of one Adam training step per stage (MiB)",
        "",
        "Measured: P params, O Adam states, X received copies + output gradient (alive at the start), B peak "
        "of the forwards + backwards above the start, G left after them, S peak of `Adam.step` above that; "
        "total = P + O + X + max(B, G + S). Predicted (`device_memory`): P params, G grads, O states, A "
        "activations, C comm buffers, W working, S step temporaries. `analytic` uses the analytic table's "
        "activation bytes, `profiled` the profiler's (saved tensors).",
    ]
    lines += _memory_summary(data)[3:] + [""]
    lines += [
        "| model | dtype | mb | stage | in flight | recompute | measured | analytic | err % | profiled | err % | "
        "measured P/O/X B G S (peak in) | predicted P/G/O/A/C/W/S |",
        "|---|---|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        m, pa, pp = r.get("measured"), r["predicted_analytic"], r.get("predicted_profiled")
        parts = (
            f"{_mib(m['params'])}/{_mib(m['optimizer'])}/{_mib(m['boundary'])} {_mib(m['backward_peak'])} "
            f"{_mib(m['grads'])} {_mib(m['optimizer_peak'])} ({m['peak_in']})"
            if m
            else r.get("error", "-")
        )
        predicted = "/".join(
            _mib(pa[k]) for k in ("params", "grads", "optimizer", "activations", "comm", "working", "optimizer_step")
        )
        lines.append(
            f"| {r['model']} | {r['dtype']} | {r['microbatch_size']} | {r['stage']} | {r['in_flight']} | "
            f"{r['recompute']} | {_mib(m['total'] if m else None)} | {_mib(pa['total'])} | "
            f"{_pct(r.get('analytic_err'))} | {_mib(pp['total'] if pp else None)} | {_pct(r.get('profiled_err'))} | "
            f"{parts} | {predicted} |"
        )
    return lines


def _trainer_table(data: dict) -> list[str]:
    lines = [
        "",
        "## Trainer on one rank",
        "",
        "| case | microbatches | global batch | losses | finite | falls | max loss diff vs unsplit | "
        "max param diff vs unsplit | step ms (median, first) | unsplit step ms | peak GiB | device |",
        "|---|---:|---:|---|---|---|---:|---:|---|---:|---:|---|",
    ]
    for r in data["trainer_rows"]:
        if "error" in r:  # failed before or after its steps: the losses it got, then the error
            losses = ", ".join(f"{x:.3f}" for x in r.get("losses", []))
            lines.append(
                f"| {r['case']} | {r.get('microbatches', '-')} | {r.get('global_batch', '-')} | "
                f"{losses + '; ' if losses else ''}{r['error']} | | | | | | | | |"
            )
            continue
        losses = ", ".join(f"{x:.3f}" for x in r["losses"])
        lines.append(
            f"| {r['case']} | {r['microbatches']} | {r['global_batch']} | {losses} | {r['finite']} | "
            f"{r['falls']} | {_e(r.get('unsplit_loss_diff'))} | {_e(r.get('unsplit_param_diff'))} | "
            f"{r['step_ms']:.1f}, {r['first_step_ms']:.0f} | {_f(r.get('unsplit_step_ms'), 1)} | {_f(r.get('peak_gib'))} | "
            f"{r.get('trainer_device')} |"
        )
    return lines


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, help="output folder (report, JSON, device file)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--dry-run", action="store_true", help="tiny models, few repeats (a CPU check of the script)")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop starting new work after this many seconds (default 450, dry run 120)",
    )
    parser.add_argument(
        "--calibrate",
        type=Path,
        metavar="REPORT_JSON",
        help="only fit the catalog entry to a report's measurements and print it",
    )
    parser.add_argument("--models", default="gpt2,llama", help="comma-separated subset of gpt2,llama")
    parser.add_argument(
        "--dtypes", default=None, help="comma-separated of fp32,bf16,tf32 (default fp32,bf16,tf32; dry run fp32,bf16)"
    )
    parser.add_argument(
        "--microbatches", default=None, help="comma-separated sizes for every model (default per model)"
    )
    parser.add_argument("--analytic-device", default="h200", help="catalog name or device file to compare with")
    parser.add_argument("--gpt2-seq-len", type=int, default=1024)
    parser.add_argument("--llama-seq-len", type=int, default=1024)
    parser.add_argument("--llama-layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 on CPU)")
    parser.add_argument("--no-trainer", action="store_true", help="skip the trainer part")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurements")
    parser.add_argument(
        "--fail-in",
        default=None,
        metavar="PART",
        help="raise inside these comma-separated parts (trainer, llama/bf16, gpt2/fp32/mb2, ...): tests that "
        "a failing part is recorded and the rest goes on",
    )
    args = parser.parse_args(argv)
    if args.calibrate is None and args.out is None:
        parser.error("--out DIR is required (or --calibrate REPORT_JSON)")
    if args.time_budget_s is None:
        args.time_budget_s = 120.0 if args.dry_run else 450.0
    return args


def resolve_settings(args: argparse.Namespace) -> Settings:
    settings = dry_settings(args) if args.dry_run else full_settings(args)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in {s.key for s in settings.models}]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from gpt2, llama")
    models = tuple(s for s in settings.models if s.key in wanted)
    if args.microbatches:
        sizes = tuple(int(x) for x in args.microbatches.split(","))
        models = tuple(dataclasses.replace(s, microbatches=sizes) for s in models)
    dtypes = settings.dtypes
    if args.dtypes:
        dtypes = tuple(d.strip() for d in args.dtypes.split(","))
        if any(d not in DTYPES for d in dtypes):
            raise SystemExit(f"--dtypes: choose from {', '.join(DTYPES)}")
    return dataclasses.replace(settings, models=models, dtypes=dtypes)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.calibrate is not None:
        return run_calibrate(args.calibrate, args.out)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the Trainer takes CUDA whenever it sees one
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (torch.cuda.is_available() is False)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu" and args.threads is None:
        args.threads = 1  # shared CPU machines: 2 threads of a loaded 2-core machine wait on each other
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = resolve_settings(args)
    report = Report(args.out, args, argv)
    deadline = time.perf_counter() + args.time_budget_s
    report.data["settings"] = dataclasses.asdict(settings)

    from partita.types.devices import device_to_dict, resolve_device

    analytic_spec = resolve_device(args.analytic_device)
    report.data["analytic_device"] = device_to_dict(analytic_spec)
    with report.part("environment"):
        report.check("environment")
        report.data["environment"] = environment(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # The trainer runs last: a hung collective or a broken CUDA context there cannot take the
    # measurements with it (they are written by then); it gets a reserve of the budget.
    reserve_s = 0.0 if args.no_trainer else (20.0 if args.dry_run else 120.0)
    run_models(report, settings, device, args, deadline - reserve_s, analytic_spec)
    with report.part("calibration"):
        report.check("calibration")
        report.data["calibration"] = calibrate(report.data)
        device_file = calibrated_device_file(report.data["calibration"])
        if device_file is not None:
            (args.out / DEVICE_FILE).write_text(json.dumps(device_file, indent=1) + "\n")
    if not args.no_trainer:
        run_trainer(report, settings, device, args, deadline)
    report.write()
    failed = [p["name"] for p in report.data["parts"] if p["status"] != "ok"]
    # The essentials on stdout too (a remote run's output tail), the full tables in the files.
    summary = _time_summary(report.data) + _memory_summary(report.data) + _trainer_table(report.data)
    print("\n".join(summary + ["", "## Calibration", ""]))
    print("\n".join(calibration_text(report.data["calibration"] or {"error": "calibration failed"})))
    print(
        f"\nwrote {args.out / REPORT_MD} and {args.out / REPORT_JSON} in {report.elapsed_s():.0f} s; "
        f"parts not ok: {', '.join(failed) or 'none'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
