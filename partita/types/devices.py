"""The device catalog: what one accelerator (or the local CPU) can do, as a ``DeviceSpec``.

Numbers are the vendors' published dense (no sparsity) peaks for the SXM/OAM parts, which is
what a roofline model divides by; the efficiency factors turn peaks into what PyTorch achieves.

Conventions:
    peak_flops["float32"]   plain FP32, which is what PyTorch runs by default
                            (``torch.backends.cuda.matmul.allow_tf32`` is False). Training with
                            ``torch.set_float32_matmul_precision("high")`` runs float32 matmuls as
                            TF32: plan with ``dtype="tfloat32"`` then (``analytic_costs(...,
                            dtype="tfloat32")``). MI300X's "float32" is its FP32 *matrix* rate,
                            which hipBLASLt uses for float32 GEMMs.
    memory_bytes            total device memory as the driver reports it (nvidia-smi MiB × 2^20).
    intra_node_bandwidth    per device and per direction over NVLink / Infinity Fabric: the
                            figure a ring collective's bus bandwidth approaches.
    inter_node_bandwidth    per device, one network adapter per GPU as in DGX/HGX nodes
                            (400 Gb/s InfiniBand NDR = 50e9 B/s, 200 Gb/s HDR = 25e9 B/s).
    compute_efficiency      achieved / peak FLOP/s for large matmuls. Transformer GEMMs are
                            smaller than the products that come closest to the peak, so the
                            catalog uses 0.7 for NVIDIA Hopper/Ampere, less for parts whose
                            libraries reach less of their peak. Checked for the A100 against
                            Megatron-LM's published runs (``bench/megatron_calibration.py``);
                            the other parts' are estimates nobody has checked here.
    memory_efficiency       achieved / peak bandwidth for elementwise kernels, which reach less
                            than a plain copy.
    op_overhead_s           fixed cost per operation: kernel launch + eager dispatch on a GPU,
                            eager dispatch on a CPU (the catalog's guesses).

``partita.cost.local_machine.local_cpu_spec`` replaces the CPU guesses (rates and per-op
overhead) by a short measurement of this machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partita.errors import InputError


@dataclass(frozen=True)
class DeviceSpec:
    """One kind of accelerator (or the local CPU), from the catalog or a user's file."""

    name: str  # "h100", "a100-80gb", "cpu", ...
    memory_bytes: int
    peak_flops: Mapping[str, float]  # dense FLOP/s per dtype name ("float32", "bfloat16", "float16")
    memory_bandwidth_bytes_per_s: float
    intra_node_bandwidth_bytes_per_s: float  # per device, NVLink-class
    inter_node_bandwidth_bytes_per_s: float  # per device, network
    intra_node_latency_s: float = 5e-6
    inter_node_latency_s: float = 20e-6
    compute_efficiency: float = 0.6  # achieved fraction of peak FLOP/s for matmul-like ops
    memory_efficiency: float = 0.7  # achieved fraction of memory bandwidth for memory-bound ops
    op_overhead_s: float = 5e-6  # fixed cost of launching one operation (kernel launch / dispatch)


try:  # Python >= 3.11; older Pythons read TOML device files only with tomli installed
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - depends on the Python version
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

__all__ = [
    "device_from_dict",
    "device_to_dict",
    "get_device",
    "known_devices",
    "load_device_file",
    "resolve_device",
]

_MIB = 2**20
_IB_NDR = 400e9 / 8  # 400 Gb/s InfiniBand NDR / 400 GbE per GPU, bytes/s
_IB_HDR = 200e9 / 8  # 200 Gb/s InfiniBand HDR per GPU (DGX A100), bytes/s

# Name -> spec. Built once and never mutated; get_device hands out copies.
_CATALOG: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        # A100 SXM4 (NVIDIA A100 datasheet): FP32 19.5, TF32 156, BF16/FP16 312 TFLOP/s dense;
        # HBM2 1,555 GB/s (40 GB) / HBM2e 2,039 GB/s (80 GB); NVLink3 600 GB/s both ways through
        # NVSwitch, so 300 GB/s per direction. Between nodes: DGX A100 (and Selene, where
        # Megatron-LM measured its SC21 runs: "eight NVIDIA Mellanox 200Gbps HDR Infiniband HCAs")
        # has one 200 Gb/s HDR port per GPU. Latencies 5 us (NVLink) and 20 us (InfiniBand, with
        # NCCL's protocol) are estimates; no calibration row depends on them (sends of 1-100 MB).
        # compute_efficiency 0.7 (218 of 312 TFLOP/s on large bf16 GEMMs) and memory_efficiency
        # 0.8 (elementwise kernels) are estimates too, checked, not fitted: with them partita
        # predicts each of Megatron-LM's ten SC21 layouts on A100-80GB within 8% of the measured
        # step (bench/results/megatron_calibration.md). op_overhead_s: launch + eager dispatch.
        # nvidia-smi reports 40960 / 81920 MiB.
        DeviceSpec(
            "a100-40gb",
            40960 * _MIB,
            {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12},
            1555e9,
            300e9,
            _IB_HDR,
            compute_efficiency=0.7,
            memory_efficiency=0.8,
            op_overhead_s=5e-6,
        ),
        DeviceSpec(
            "a100-80gb",
            81920 * _MIB,  # nvidia-smi: 81920 MiB
            {"float32": 19.5e12, "tfloat32": 156e12, "bfloat16": 312e12, "float16": 312e12},
            2039e9,
            300e9,
            _IB_HDR,
            compute_efficiency=0.7,
            memory_efficiency=0.8,
            op_overhead_s=5e-6,
        ),
        # H100 SXM5: FP32 67, TF32 494.7, BF16/FP16 989.4 TFLOP/s; HBM3 3.35 TB/s; NVLink4 900 GB/s both ways.
        DeviceSpec(
            "h100",
            81559 * _MIB,
            {"float32": 67e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
            3.35e12,
            450e9,
            _IB_NDR,
            compute_efficiency=0.7,
            memory_efficiency=0.8,
            op_overhead_s=5e-6,
        ),
        # H200 SXM: H100's compute, 141 GB HBM3e at 4.8 TB/s (nvidia-smi: 143771 MiB).
        DeviceSpec(
            "h200",
            143771 * _MIB,
            {"float32": 67e12, "tfloat32": 494.7e12, "bfloat16": 989.4e12, "float16": 989.4e12},
            4.8e12,
            450e9,
            _IB_NDR,
            compute_efficiency=0.7,
            memory_efficiency=0.8,
            op_overhead_s=5e-6,
        ),
        # B200 (HGX): FP32 75, TF32 1100, BF16/FP16 2250 TFLOP/s dense; HBM3e 8 TB/s; NVLink5 1.8 TB/s both ways.
        DeviceSpec(
            "b200",
            183359 * _MIB,
            {"float32": 75e12, "tfloat32": 1.1e15, "bfloat16": 2.25e15, "float16": 2.25e15},
            8e12,
            900e9,
            _IB_NDR,
            compute_efficiency=0.65,
            memory_efficiency=0.8,
            op_overhead_s=5e-6,
        ),
        # MI300X: FP32 matrix 163.4, TF32 653.7, BF16/FP16 1307.4 TFLOP/s dense; HBM3 5.3 TB/s;
        # Infinity Fabric 7 links × 64 GB/s per direction.
        DeviceSpec(
            "mi300x",
            196608 * _MIB,
            {"float32": 163.4e12, "tfloat32": 653.7e12, "bfloat16": 1307.4e12, "float16": 1307.4e12},
            5.3e12,
            448e9,
            _IB_NDR,
            compute_efficiency=0.5,
            memory_efficiency=0.7,
            op_overhead_s=5e-6,
        ),
        # V100 SXM2 (NVIDIA Tesla V100 datasheet, "V100 SXM2" column): FP32 15.7, FP16 Tensor 125 TFLOP/s; no
        # bfloat16 in hardware, so a bf16 plan costs its matmuls at the FP32 rate (analytic._peak_flops falls
        # back to "float32"); HBM2 900 GB/s; NVLink2 300 GB/s both ways (150e9 per direction). memory_bytes:
        # what nvidia-smi reports for the 32 GB and 16 GB parts (32510 / 16160 MiB). Network: DGX-1V has
        # four 100 Gb/s EDR InfiniBand adapters for 8 GPUs, 6.25e9 B/s per GPU. compute_efficiency 0.65:
        # cuBLAS reaches ~80 of the 125 TFLOP/s on large FP16 GEMMs (a guess for transformer shapes).
        DeviceSpec(
            "v100-32gb",
            32510 * _MIB,
            {"float32": 15.7e12, "float16": 125e12},
            900e9,
            150e9,
            100e9 / 8 / 2,
            compute_efficiency=0.65,
            memory_efficiency=0.8,
            op_overhead_s=6e-6,
        ),
        DeviceSpec(
            "v100-16gb",
            16160 * _MIB,
            {"float32": 15.7e12, "float16": 125e12},
            900e9,
            150e9,
            100e9 / 8 / 2,
            compute_efficiency=0.65,
            memory_efficiency=0.8,
            op_overhead_s=6e-6,
        ),
        # L4 (NVIDIA L4 datasheet): FP32 30.3, TF32 60, BF16/FP16 121 TFLOP/s dense (the datasheet's 120 /
        # 242 are with sparsity); 24 GB GDDR6 at 300 GB/s (nvidia-smi: 23034 MiB). No NVLink: PCIe Gen4 x16,
        # 32 GB/s per direction. Network: 8-GPU cloud nodes (AWS g6.48xlarge, GCP g2-standard-96) have
        # 100 Gb/s for all 8, 1.5625e9 B/s per GPU. compute_efficiency 0.5: a 72 W part whose clocks drop
        # under sustained tensor load (a guess).
        DeviceSpec(
            "l4",
            23034 * _MIB,
            {"float32": 30.3e12, "tfloat32": 60e12, "bfloat16": 121e12, "float16": 121e12},
            300e9,
            32e9,
            100e9 / 8 / 8,
            compute_efficiency=0.5,
            memory_efficiency=0.8,
            op_overhead_s=5e-6,
        ),
        # A generic server CPU (placeholder numbers; local_machine.local_cpu_spec measures the real one). Ranks
        # talk over TCP: loopback inside a node, 25 GbE (typical of cloud CPU instances) between nodes. memory_bytes is set to
        # this machine's RAM by get_device.
        DeviceSpec(
            "cpu",
            0,
            {"float32": 1e12, "bfloat16": 5e11, "float16": 5e11},
            1e11,
            5e9,
            25e9 / 8,
            intra_node_latency_s=20e-6,
            inter_node_latency_s=50e-6,
            compute_efficiency=0.6,
            memory_efficiency=0.7,
            op_overhead_s=2e-6,
        ),
    )
}
_ALIASES = {
    "h100-sxm": "h100",
    "h100-sxm5": "h100",
    "h200-sxm": "h200",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb",
    "b200-sxm": "b200",
    "v100": "v100-32gb",
    "v100-sxm2-32gb": "v100-32gb",
    "v100-sxm2-16gb": "v100-16gb",
}

_REQUIRED_FIELDS = (
    "name",
    "memory_bytes",
    "peak_flops",
    "memory_bandwidth_bytes_per_s",
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
)
_FIELDS = tuple(f.name for f in dataclasses.fields(DeviceSpec))


def known_devices() -> tuple[str, ...]:
    """Catalog names and aliases, sorted."""
    return tuple(sorted(set(_CATALOG) | set(_ALIASES)))


def get_device(name: str) -> DeviceSpec:
    """The catalog entry ``name`` (case-insensitive; aliases such as "h100-sxm" accepted).

    The "cpu" entry's ``memory_bytes`` is this machine's RAM. Raises InputError for an
    unknown name, listing the known ones.
    """
    if not isinstance(name, str):
        raise InputError(f"device name must be a string, got {type(name).__name__}: use e.g. 'h100'")
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _CATALOG:
        raise InputError(
            f"unknown device {name!r}: known devices are {', '.join(known_devices())}; "
            "for another device write a JSON/TOML device file and pass its path"
        )
    spec = _CATALOG[key]
    if key == "cpu":
        memory_bytes = machine_memory_bytes()
    else:
        memory_bytes = spec.memory_bytes
    return dataclasses.replace(spec, memory_bytes=memory_bytes, peak_flops=dict(spec.peak_flops))


def machine_memory_bytes() -> int:
    """This machine's RAM in bytes (or the container's memory limit, if lower)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:  # cgroup v2: "max" or a number of bytes
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return int(total)


def resolve_device(device: str | os.PathLike | DeviceSpec) -> DeviceSpec:
    """A DeviceSpec as it is, a path to a ``.json``/``.toml`` device file, or a catalog name."""
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, os.PathLike) or (isinstance(device, str) and device.lower().endswith((".json", ".toml"))):
        return load_device_file(device)
    return get_device(device)


# ----------------------------------------------------------------------------- files and dicts


def load_device_file(path: str | os.PathLike) -> DeviceSpec:
    """A DeviceSpec from a JSON or TOML file holding the DeviceSpec fields.

    ``base = "h100"`` starts from a catalog entry so that the file only lists what differs::

        name = "h100-64gb"
        base = "h100"
        memory_bytes = 68719476736
        [peak_flops]          # when given, replaces the base's table
        float32 = 67e12
        bfloat16 = 989.4e12
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError(f"cannot read device file {str(path)!r}: {e.strerror or e}") from e
    is_toml = path.suffix.lower() == ".toml"
    if is_toml and tomllib is None:
        raise InputError(
            f"reading the TOML device file {str(path)!r} needs Python >= 3.11 or the tomli package: "
            "install tomli, or write the file as JSON"
        )
    try:
        data = tomllib.loads(text) if is_toml else json.loads(text)
    except (ValueError, json.JSONDecodeError) as e:  # tomllib.TOMLDecodeError is a ValueError
        kind = "TOML" if is_toml else "JSON"
        raise InputError(f"device file {str(path)!r} is not valid {kind}: {e}") from e
    return device_from_dict(data, source=f"device file {str(path)!r}")


def device_to_dict(spec: DeviceSpec) -> dict[str, Any]:
    """Every DeviceSpec field as JSON-safe values (the inverse of ``device_from_dict``)."""
    data = {f: getattr(spec, f) for f in _FIELDS}
    data["peak_flops"] = {k: float(v) for k, v in spec.peak_flops.items()}
    return data


def device_from_dict(data: Any, *, source: str = "device description") -> DeviceSpec:
    """A validated DeviceSpec from a dict of its fields (optionally ``base`` = catalog name).

    Raises InputError naming the missing, unknown or invalid field and ``source``.
    """
    if not isinstance(data, Mapping):
        raise InputError(f"{source} must be a table/object of DeviceSpec fields, got {type(data).__name__}")
    data = dict(data)
    unknown = sorted(set(data) - set(_FIELDS) - {"base"})
    if unknown:
        raise InputError(
            f"{source} has unknown field(s) {', '.join(unknown)}: valid fields are base, {', '.join(_FIELDS)}"
        )
    if "base" in data:
        base = device_to_dict(get_device(_check_str(data.pop("base"), "base", source)))
        data = base | data
    missing = [f for f in _REQUIRED_FIELDS if f not in data]
    if missing:
        raise InputError(f"{source} lacks the required field(s) {', '.join(missing)} (or give base = '<catalog name>')")
    values = {
        "name": _check_str(data["name"], "name", source),
        "memory_bytes": _check_positive_int(data["memory_bytes"], "memory_bytes", source),
        "peak_flops": _check_peak_flops(data["peak_flops"], source),
    }
    for f in _FIELDS:
        if f not in values and f in data:
            values[f] = _check_number(data[f], f, source)
    return DeviceSpec(**values)


def _check_str(value: Any, field: str, source: str) -> str:
    if not isinstance(value, str) or not value:
        raise InputError(f"{source}: field {field!r} must be a non-empty string, got {value!r}")
    return value


def _check_positive_int(value: Any, field: str, source: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or value <= 0
        or value != int(value)
    ):
        raise InputError(f"{source}: field {field!r} must be a positive whole number of bytes, got {value!r}")
    return int(value)


def _check_number(value: Any, field: str, source: str) -> float:
    """Bandwidths and efficiencies > 0 (efficiencies ≤ 1), latencies and overheads ≥ 0."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if field.endswith("_efficiency"):
        ok = ok and 0 < value <= 1
        want = "a number in (0, 1]"
    elif field.endswith(("latency_s", "overhead_s")):
        ok = ok and value >= 0
        want = "a number of seconds >= 0"
    else:
        ok = ok and value > 0
        want = "a positive number"
    if not ok:
        raise InputError(f"{source}: field {field!r} must be {want}, got {value!r}")
    return float(value)


def _check_peak_flops(value: Any, source: str) -> dict[str, float]:
    if not isinstance(value, Mapping) or not value:
        raise InputError(
            f"{source}: field 'peak_flops' must be a non-empty table of dtype -> FLOP/s, "
            f'e.g. {{"float32": 67e12, "bfloat16": 989e12}}, got {value!r}'
        )
    return {str(k): _check_number(v, f"peak_flops.{k}", source) for k, v in value.items()}
