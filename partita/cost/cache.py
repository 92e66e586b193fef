"""partita's one on-disk cache: measured CostTables and measurements of this machine.

Everything lives in the user's ``cache_dir`` (nothing is written anywhere else, and nothing at
all without one), so that measuring the same thing twice runs nothing.

A CostTable (``load``/``store``, used by ``partita.cost.profiler``) is stored as two files:

    costs-<key>.npz   the per-node and per-parameter arrays (numpy, no pickle)
    costs-<key>.json  scalars, parameter names, calibration and the parts of the key, for humans

Its key is a sha256 over everything that changes a measurement: the graph's fingerprint (its
structure, shapes and dtypes, so another batch or sequence length misses), the micro-batch
size, the device and its hardware model, the torch version, the intra-op thread count, the
number of warm-up and timed repeats, and ``FORMAT_VERSION`` (bumped when the profiler's method
changes). The example input *values* are not part of the key: costs do not depend on them.

A measurement of the machine (``measure_once``, used by ``partita.cost.local_machine``: CPU
calibration, gloo link, rank contention) is one file ``<prefix>-<digest of key>.json`` holding
``{"key": ..., "measured": ...}``; a lookup must match the whole key.

Every file is written to a temporary name and moved into place with ``os.replace``; a table's
JSON file is written last and is what a lookup checks first, so a reader never sees half an
entry. A damaged or foreign entry is a miss, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from partita.cost.hardware import hardware_model
from partita.types import CostTable, OpGraph

if TYPE_CHECKING:
    import torch

# Bump when the profiler measures differently: old entries then miss instead of being reused.
# 2: calibrated against the flat module, not the exported one; 3: selective recomputation's arrays;
# 4: the repeated blocks' arrays
FORMAT_VERSION = 4

# Arrays of a CostTable stored as they are (param_uses is ragged and stored flattened).
_ARRAY_FIELDS = (
    "forward_s",
    "backward_s",
    "backward_weight_s",
    "activation_bytes",
    "output_bytes",
    "cut_bytes",
    "param_bytes",
    "param_trainable",
    "saved_bytes",
    "recomputed_bytes",
    "selective_recompute_s",
    "block_ranges",
    "block_input_bytes",
    "block_output_bytes",
)


def cache_key(
    graph: OpGraph, microbatch_size: int, device: torch.device, *, repeats: int, warmup: int
) -> tuple[str, dict[str, Any]]:
    """The cache key (hex sha256) and the readable parts it was made from."""
    import torch

    parts = {
        "format_version": FORMAT_VERSION,
        "fingerprint": graph.fingerprint,
        "microbatch_size": int(microbatch_size),
        "device": str(device),
        "hardware": hardware_model(device),
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "repeats": int(repeats),
        "warmup": int(warmup),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return digest, parts


def load(cache_dir: str | os.PathLike, key: str) -> CostTable | None:
    """The table stored under ``key``, or None when absent or unreadable (a miss, never an error)."""
    json_path, npz_path = _paths(cache_dir, key)
    try:
        with open(json_path) as f:
            meta = json.load(f)
        if meta.get("key") != key:
            return None
        with np.load(npz_path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in _ARRAY_FIELDS}
            uses_values, uses_offsets = data["param_uses_values"], data["param_uses_offsets"]
    except (OSError, ValueError, KeyError):
        return None
    param_uses = tuple(uses_values[uses_offsets[p] : uses_offsets[p + 1]] for p in range(len(uses_offsets) - 1))
    return CostTable(
        microbatch_size=int(meta["microbatch_size"]),
        device=meta["device"],
        source=meta["source"],
        param_names=tuple(meta["param_names"]),
        param_uses=param_uses,
        calibration={k: float(v) for k, v in meta["calibration"].items()},
        **arrays,
    )


def store(cache_dir: str | os.PathLike, key: str, table: CostTable, key_parts: dict[str, Any]) -> None:
    """Write ``table`` under ``key`` atomically (temporary file + ``os.replace``)."""
    os.makedirs(cache_dir, exist_ok=True)
    json_path, npz_path = _paths(cache_dir, key)
    uses = [np.asarray(u, dtype=np.int64) for u in table.param_uses]
    offsets = np.cumsum([0] + [len(u) for u in uses], dtype=np.int64)
    arrays = {name: np.asarray(getattr(table, name)) for name in _ARRAY_FIELDS}
    arrays["param_uses_values"] = np.concatenate(uses) if uses else np.zeros(0, dtype=np.int64)
    arrays["param_uses_offsets"] = offsets
    _write_atomically(npz_path, lambda f: np.savez(f, **arrays))
    meta = {
        "key": key,
        "key_parts": key_parts,
        "microbatch_size": table.microbatch_size,
        "device": table.device,
        "source": table.source,
        "param_names": list(table.param_names),
        "calibration": {k: float(v) for k, v in table.calibration.items()},
    }
    _write_atomically(json_path, lambda f: f.write(json.dumps(meta, indent=1, sort_keys=True).encode()))


def measure_once(cache_dir: str | os.PathLike | None, prefix: str, key: dict, measure: Callable[[], dict]) -> dict:
    """``measure()``, or what an earlier call stored under exactly ``key`` in ``cache_dir``
    (``<prefix>-<digest of key>.json``); no caching when ``cache_dir`` is None."""
    path = None
    if cache_dir is not None:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        path = Path(cache_dir) / f"{prefix}-{digest}.json"
    measured = _load_measurement(path, key)
    if measured is None:
        measured = measure()
        _store_measurement(path, key, measured)
    return measured


def _load_measurement(path: Path | None, key: dict) -> dict | None:
    """The measurement stored at ``path`` under exactly ``key``, else None."""
    if path is None or not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None  # a damaged cache entry is measured again and overwritten
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    return data.get("measured")


def _store_measurement(path: Path | None, key: dict, measured: dict) -> None:
    """Write ``{key, measured}`` as JSON to ``path`` atomically; nothing when ``path`` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"key": key, "measured": measured}, indent=2, sort_keys=True)
    _write_atomically(str(path), lambda f: f.write(text.encode()))


def _paths(cache_dir: str | os.PathLike, key: str) -> tuple[str, str]:
    base = os.path.join(os.fspath(cache_dir), f"costs-{key}")
    return base + ".json", base + ".npz"


def _write_atomically(path: str, write: Any) -> None:
    """Write through ``write(binary_file)`` to a temporary file beside ``path``, then rename it."""
    fd, tmp_path = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise
