"""What hardware this is, as a key of measurements: timings taken on other hardware must not be
reused (partita.cost.cache keys cost tables by it, partita.cost.local_machine its calibrations)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["cpu_model", "hardware_model"]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (a cache key for measurements)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def hardware_model(device: torch.device) -> str:
    """The GPU's name or the CPU's model name."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
