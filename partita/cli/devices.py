"""``--devices``: a device count (of ``--device-type``), or device groups ``16xh100,32xa100-40gb``.

A group is ``COUNTxTYPE`` with an optional ``@MEMORY`` per device (``16xa100-80gb@40GiB``: a size with
a byte unit, ``partita.units.parse_bytes``; ``@40Gb``, gigabits, and a bare ``@40`` are refused);
``TYPE`` is a catalog name or a device file. A group fills nodes of 8 devices, or one node when
it holds fewer (``4xl4``). Several groups make a mixed cluster (``partita.types.cluster``); one
group is the same as ``--devices COUNT --device-type TYPE`` without ``--nodes`` (``default_nodes``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass

from partita.errors import InputError
from partita.types.cluster import Cluster, DeviceGroup
from partita.units import parse_bytes

__all__ = ["GroupSpec", "check_groups_flags", "default_nodes", "devices_argument", "groups_cluster"]

_GROUP = re.compile(r"^\s*(\d+)\s*x\s*([^@\s]+)\s*(?:@\s*(\S+))?\s*$", re.IGNORECASE)
NODE_SIZE = 8  # devices per node of a group of at least this many (HGX/DGX nodes)


@dataclass(frozen=True)
class GroupSpec:
    """One ``COUNTxTYPE[@MEMORY]`` of ``--devices``."""

    num_devices: int
    device: str
    memory: str | None  # as written, e.g. "40GiB"; None: the device's own


def devices_argument(text: str) -> int | tuple[GroupSpec, ...]:
    """argparse type of ``--devices``: an int, or the groups of ``16xh100,32xa100-40gb``."""
    if text.strip().isdigit():
        return int(text)
    groups = []
    for part in text.split(","):
        match = _GROUP.match(part)
        if match is None or int(match.group(1)) < 1:
            raise argparse.ArgumentTypeError(
                f"{part.strip()!r} is not a device group: write COUNTxTYPE[@MEMORY] groups separated by commas, "
                "e.g. 16xh100,32xa100-40gb or 8xh100,16xa100-80gb@40GiB (or a plain device count with --device-type)"
            )
        memory = match.group(3)
        if memory is not None:
            try:  # a unit is required, and a byte unit: "@40Gb" is gigabits, "@40" no size at all
                parse_bytes(memory, f"group {part.strip()!r}: memory")
            except InputError as e:
                raise argparse.ArgumentTypeError(str(e)) from None
        groups.append(GroupSpec(int(match.group(1)), match.group(2), memory))
    return tuple(groups)


def groups_cluster(groups: tuple[GroupSpec, ...], to_bytes: Callable[[str | None], int | None]) -> Cluster:
    """The cluster of ``--devices`` groups: nodes of NODE_SIZE devices (one node for a smaller group)."""
    made = []
    for spec in groups:
        per_node = min(spec.num_devices, NODE_SIZE)
        if spec.num_devices % per_node:
            lower = spec.num_devices // per_node * per_node
            raise InputError(
                f"--devices group {spec.num_devices}x{spec.device} does not fill nodes of {per_node} devices: "
                f"use {lower}x{spec.device} or {lower + per_node}x{spec.device}"
            )
        made.append(DeviceGroup(spec.device, spec.num_devices, per_node, memory_bytes=to_bytes(spec.memory)))
    return Cluster(groups=made)


def default_nodes(num_devices: int, device: str) -> int:
    """Nodes of ``num_devices`` catalog devices when ``--nodes`` is not given: nodes of NODE_SIZE (one
    node for fewer), as a device group fills them; InputError when they do not fill whole nodes."""
    if num_devices <= NODE_SIZE:
        return 1
    if num_devices % NODE_SIZE:
        lower = num_devices // NODE_SIZE * NODE_SIZE
        raise InputError(
            f"--devices {num_devices} of {device} do not fill nodes of {NODE_SIZE} devices (the default): give "
            f"--nodes (each node then holds --devices / --nodes), or use --devices {lower} or {lower + NODE_SIZE}"
        )
    return num_devices // NODE_SIZE


def check_groups_flags(args: argparse.Namespace) -> None:
    """InputError for the one-type flags beside ``--devices`` groups: they go into each group."""
    given = [
        flag
        for flag, value, default in (
            ("--device-type", args.device_type, "cpu"),
            ("--memory", args.memory, None),
            ("--nodes", args.nodes, None),
        )
        if value != default
    ]
    if given:
        raise InputError(
            f"--devices gives device groups, so {', '.join(given)} cannot apply to all of them: write each group "
            "as COUNTxTYPE[@MEMORY] (e.g. 16xh100,32xa100-80gb@40GiB); groups fill nodes of 8"
        )
