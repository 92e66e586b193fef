"""Clusters the unit tests plan for."""

from __future__ import annotations

import partita


def h100s(num_devices: int, memory: int | None = None, **cluster) -> partita.Cluster:
    """``num_devices`` H100s, 8 to a node (or ``devices_per_node=...``), with ``memory`` bytes each
    (None: the H100's own)."""
    return partita.Cluster(device="h100", num_devices=num_devices, memory_bytes=memory, **cluster)
