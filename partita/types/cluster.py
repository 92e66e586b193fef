"""The machines a plan runs on: devices in nodes, of one type or of several (device groups).

The topology has two levels: devices in one node talk over the intra-node link (NVLink, or
loopback TCP for CPU ranks), devices in different nodes over the network. Ranks fill nodes in
order, as ``torchrun`` assigns them: rank ``r`` sits in node ``r // devices_per_node``.

A *mixed* cluster holds several device groups (``DeviceGroup``: one device type, its count, memory,
node size and links), e.g. 16 H100s beside 32 A100-40GBs. Ranks follow the groups: group 0's
devices are ranks ``[0, n_0)``, group 1's ``[n_0, n_0 + n_1)``, ... and each group's nodes follow
the earlier groups' nodes. Devices of different groups talk over the inter-group link (by default
the slower of the two groups' networks). A cluster of one group is a one-type cluster, the same
object (and plan file) as ``Cluster(device=..., num_devices=...)``.

Seen through the one-type fields (``device``, ``memory_bytes``, the link bandwidths), a mixed cluster
is its most conservative member: the slowest group's device, the smallest memory, the slowest
links. Code that plans for one type and reads only those fields thus never promises more than
the slowest device gives; the planner for mixed clusters (``partita.planning.hetero``) reads the
groups (``group_clusters``).
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from partita.checks import positive_int
from partita.errors import InputError
from partita.types.devices import DeviceSpec, device_from_dict, device_to_dict, resolve_device

__all__ = ["Cluster", "DeviceGroup"]

_LINK_FIELDS = (
    "intra_node_bandwidth_bytes_per_s",
    "inter_node_bandwidth_bytes_per_s",
    "intra_node_latency_s",
    "inter_node_latency_s",
)
# The fields of one device type's nodes: a DeviceGroup's, and a one-type Cluster's.
_GROUP_FIELDS = ("device", "num_devices", "devices_per_node", "memory_bytes", *_LINK_FIELDS)
# A mixed cluster's own fields besides its groups (the rest belong to each group).
_SHARED_FIELDS = ("reserved_memory_fraction", "compute_slowdown", "collective_efficiency")
_INTER_GROUP_FIELDS = ("inter_group_bandwidth_bytes_per_s", "inter_group_latency_s")


@dataclass(frozen=True)
class DeviceGroup:
    """``num_devices`` devices of one type, ``devices_per_node`` to a node: one group of a mixed
    ``Cluster``. ``device`` is a catalog name, a device-file path or a DeviceSpec; every field left
    None takes the device's value, as ``Cluster``'s do (``memory_bytes`` per device, bandwidths in
    bytes/s per device and direction, latencies in s). After construction every field holds a
    concrete value (``device`` a DeviceSpec)."""

    device: DeviceSpec | str
    num_devices: int
    devices_per_node: int = 8
    memory_bytes: int | None = None
    intra_node_bandwidth_bytes_per_s: float | None = None
    inter_node_bandwidth_bytes_per_s: float | None = None
    intra_node_latency_s: float | None = None
    inter_node_latency_s: float | None = None

    def __post_init__(self) -> None:
        for name, value in _resolved_group_fields({f: getattr(self, f) for f in _GROUP_FIELDS}).items():
            object.__setattr__(self, name, value)

    @property
    def num_nodes(self) -> int:
        return -(-self.num_devices // self.devices_per_node)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict with the DeviceSpec inlined."""
        data = {f: getattr(self, f) for f in _GROUP_FIELDS}
        data["device"] = device_to_dict(self.device)
        return data

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "device group") -> DeviceGroup:
        """The inverse of ``to_dict``; ``device`` may also be a catalog name. Validates every field."""
        if isinstance(data, DeviceGroup):
            return data
        if not isinstance(data, Mapping):
            raise InputError(f"{source} must be a DeviceGroup or a dict of its fields, got {type(data).__name__}")
        _check_keys(data, set(_GROUP_FIELDS), ("device", "num_devices"), source)
        values = dict(data)
        if isinstance(values["device"], Mapping):
            values["device"] = device_from_dict(values["device"], source=f"{source} field 'device'")
        return cls(**values)


@dataclass(frozen=True)
class Cluster:
    """The devices a plan runs on: ``num_devices`` of one kind, ``devices_per_node`` to a node, or
    several device groups (a mixed cluster).

    One type: ``Cluster(device="h100", num_devices=64, devices_per_node=8)``; ``device`` is a
    catalog name, a device-file path or a DeviceSpec. Every field left None takes the device's
    value: ``memory_bytes`` (per device) and the link bandwidths (bytes/s, per device and
    direction) and latencies (s).

    Several types: ``Cluster(groups=[DeviceGroup("h100", 16), DeviceGroup("a100-40gb", 32)])``
    (dicts of DeviceGroup fields also serve); then the one-type fields above are left None and
    derived (module docstring: the slowest group's device, the smallest memory, the slowest
    links; ``num_devices`` the total), and ``inter_group_bandwidth_bytes_per_s`` /
    ``inter_group_latency_s`` say how devices of different groups talk (default: the slower
    group's network). One group is a one-type cluster.

    ``reserved_memory_fraction`` is the share of each device's memory the planner leaves free
    (allocator fragmentation, CUDA context, workspace). ``compute_slowdown`` multiplies every
    compute time of a cost table used with this cluster: how much slower one device computes
    while all of them do (1 for accelerators; CPU ranks sharing one host's memory system, measured
    by ``Cluster.local``). ``collective_efficiency`` is the share of the link bandwidth a ring
    collective reaches (1: the ring model as is; gloo on CPUs reaches less, measured by
    ``Cluster.local``). After construction every field holds a concrete value (``device`` a
    DeviceSpec).
    """

    device: DeviceSpec | str | None = None
    num_devices: int | None = None
    devices_per_node: int | None = None  # one type: 8 (HGX/DGX nodes); mixed: the smallest group's
    memory_bytes: int | None = None
    intra_node_bandwidth_bytes_per_s: float | None = None
    inter_node_bandwidth_bytes_per_s: float | None = None
    intra_node_latency_s: float | None = None
    inter_node_latency_s: float | None = None
    reserved_memory_fraction: float = 0.05
    compute_slowdown: float = 1.0
    collective_efficiency: float = 1.0
    groups: tuple[DeviceGroup, ...] = ()  # mixed clusters only: () for one type
    inter_group_bandwidth_bytes_per_s: float | None = None  # mixed clusters only
    inter_group_latency_s: float | None = None  # mixed clusters only

    def __post_init__(self) -> None:
        groups = self.groups
        if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Sequence):
            raise InputError(f"groups must be a list of DeviceGroup (or dicts of their fields), got {groups!r}")
        groups = tuple(DeviceGroup.from_dict(g, source=f"groups[{k}]") for k, g in enumerate(groups))
        if len(groups) >= 2:
            self._set_mixed(groups)
        else:
            self._set_one_type(groups[0] if groups else None)
        _check_shared(self)

    def _set_one_type(self, group: DeviceGroup | None) -> None:
        """A one-type cluster: the fields given, or the one group's."""
        given = {f: getattr(self, f) for f in _GROUP_FIELDS}
        if group is not None:
            _refuse_beside_groups(self, "one group")
            given = {f: getattr(group, f) for f in _GROUP_FIELDS}
        elif given["device"] is None or given["num_devices"] is None:
            missing = [f for f in ("device", "num_devices") if given[f] is None]
            raise InputError(
                f"Cluster needs {' and '.join(missing)}: e.g. Cluster(device='h100', num_devices=8), or "
                "groups=[DeviceGroup('h100', 16), DeviceGroup('a100-40gb', 32)] for several device types"
            )
        if given["devices_per_node"] is None:
            given["devices_per_node"] = 8  # HGX/DGX nodes hold 8 GPUs
        for name in _INTER_GROUP_FIELDS:
            if getattr(self, name) is not None:
                raise InputError(f"{name} is for clusters of several device groups; this one has one device type")
        for name, value in _resolved_group_fields(given).items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "groups", ())

    def _set_mixed(self, groups: tuple[DeviceGroup, ...]) -> None:
        """A mixed cluster: the groups, the inter-group link, and the conservative one-type view."""
        _refuse_beside_groups(self, f"{len(groups)} groups")
        set_ = functools.partial(object.__setattr__, self)
        set_("groups", groups)
        bandwidth = self.inter_group_bandwidth_bytes_per_s
        latency = self.inter_group_latency_s
        bandwidth = min(g.inter_node_bandwidth_bytes_per_s for g in groups) if bandwidth is None else bandwidth
        latency = max(g.inter_node_latency_s for g in groups) if latency is None else latency
        set_("inter_group_bandwidth_bytes_per_s", _link_value("inter_group_bandwidth_bytes_per_s", bandwidth, True))
        set_("inter_group_latency_s", _link_value("inter_group_latency_s", latency, False))
        set_("device", min(groups, key=lambda g: _speed_key(g.device)).device)
        set_("num_devices", sum(g.num_devices for g in groups))
        set_("devices_per_node", min(g.devices_per_node for g in groups))
        set_("memory_bytes", min(g.memory_bytes for g in groups))
        set_("intra_node_bandwidth_bytes_per_s", min(g.intra_node_bandwidth_bytes_per_s for g in groups))
        set_(
            "inter_node_bandwidth_bytes_per_s",
            min(self.inter_group_bandwidth_bytes_per_s, *(g.inter_node_bandwidth_bytes_per_s for g in groups)),
        )
        set_("intra_node_latency_s", max(g.intra_node_latency_s for g in groups))
        set_("inter_node_latency_s", max(self.inter_group_latency_s, *(g.inter_node_latency_s for g in groups)))

    # ------------------------------------------------------------------ topology

    @property
    def is_mixed(self) -> bool:
        """Whether the cluster holds several device groups."""
        return bool(self.groups)

    @property
    def num_nodes(self) -> int:
        if self.groups:
            return sum(g.num_nodes for g in self.groups)
        return -(-self.num_devices // self.devices_per_node)

    @property
    def usable_memory_bytes(self) -> int:
        """Bytes per device the planner may fill: memory less the reserved fraction (mixed: the smallest memory's)."""
        return int(self.memory_bytes * (1.0 - self.reserved_memory_fraction))

    @functools.cached_property
    def group_clusters(self) -> tuple[Cluster, ...]:
        """One one-type Cluster per device group (with this cluster's reserved fraction, slowdown and
        collective efficiency); ``(self,)`` for a one-type cluster."""
        if not self.groups:
            return (self,)
        shared = {f: getattr(self, f) for f in _SHARED_FIELDS}
        return tuple(Cluster(**{f: getattr(g, f) for f in _GROUP_FIELDS}, **shared) for g in self.groups)

    @functools.cached_property
    def group_first_ranks(self) -> tuple[int, ...]:
        """The first rank of each device group (``(0,)`` for one type)."""
        counts = [g.num_devices for g in self.groups] or [self.num_devices]
        return tuple(sum(counts[:k]) for k in range(len(counts)))

    def group_ranks(self, group: int) -> range:
        """The ranks of device group ``group``."""
        clusters = self.group_clusters
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < len(clusters):
            raise InputError(f"group must be an int in [0, {len(clusters)}), got {group!r}")
        first = self.group_first_ranks[group]
        return range(first, first + clusters[group].num_devices)

    def group_of_rank(self, rank: int) -> int:
        """The device group of ``rank`` (0 for a one-type cluster)."""
        self.rank_to_node(rank)  # validates the rank
        return sum(1 for first in self.group_first_ranks[1:] if first <= rank)

    def rank_to_node(self, rank: int) -> int:
        """The node index of ``rank`` (ranks fill nodes in order, group after group)."""
        if not self.groups and type(rank) is int and 0 <= rank < self.num_devices:  # the common case, fast
            return rank // self.devices_per_node
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or not 0 <= rank < self.num_devices:
            raise InputError(f"rank must be an int in [0, {self.num_devices}), got {rank!r}")
        if not self.groups:
            return int(rank) // self.devices_per_node
        node = 0
        for group, first in zip(self.groups, self.group_first_ranks):
            if rank < first + group.num_devices:
                return node + (int(rank) - first) // group.devices_per_node
            node += group.num_nodes
        raise AssertionError("unreachable: the rank was checked against num_devices")

    def link(self, rank_a: int, rank_b: int) -> tuple[float, float]:
        """(bandwidth in bytes/s, latency in s) between two ranks; (inf, 0) for a rank with itself."""
        if rank_a == rank_b:
            self.rank_to_node(rank_a)
            return math.inf, 0.0
        same_node = self.rank_to_node(rank_a) == self.rank_to_node(rank_b)
        if not self.groups:
            if same_node:
                return self.intra_node_bandwidth_bytes_per_s, self.intra_node_latency_s
            return self.inter_node_bandwidth_bytes_per_s, self.inter_node_latency_s
        group_a, group_b = self.group_of_rank(rank_a), self.group_of_rank(rank_b)
        if group_a != group_b:
            return self.inter_group_bandwidth_bytes_per_s, self.inter_group_latency_s
        return self.group_clusters[group_a].link(
            rank_a - self.group_first_ranks[group_a], rank_b - self.group_first_ranks[group_a]
        )

    def assign_ranks(self, counts: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
        """The ranks of rank groups with ``counts[k][g]`` devices of device group ``g`` each: per
        device group, its devices in order, rank group after rank group; a rank group's ranks
        list its devices group by group (one type: ``counts[k] = (n_k,)``, consecutive ranks).
        InputError when a group has fewer devices than the rank groups take of it."""
        num_groups = len(self.group_clusters)
        taken = [0] * num_groups
        found = []
        for k, row in enumerate(counts):
            if len(row) != num_groups:
                raise InputError(f"counts[{k}] is {list(row)}: it needs one count per device group ({num_groups})")
            ranks: list[int] = []
            for g, n in enumerate(row):
                ranks.extend(self.group_ranks(g)[taken[g] : taken[g] + n])
                taken[g] += n
            found.append(tuple(ranks))
        over = [g for g in range(num_groups) if taken[g] > self.group_clusters[g].num_devices]
        if over:
            g = over[0]
            raise InputError(
                f"the rank groups take {taken[g]} devices of device group {g} "
                f"({self.group_clusters[g].device.name}), which has {self.group_clusters[g].num_devices}"
            )
        return found

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict with the DeviceSpecs inlined, so that a plan file is self-contained. A one-type
        cluster writes its fields; a mixed one its groups, the inter-group link and the shared fields."""
        if self.groups:
            return {
                "groups": [g.to_dict() for g in self.groups],
                **{f: getattr(self, f) for f in _INTER_GROUP_FIELDS},
                **{f: getattr(self, f) for f in _SHARED_FIELDS},
            }
        data = {f: getattr(self, f) for f in (*_GROUP_FIELDS, *_SHARED_FIELDS)}
        data["device"] = device_to_dict(self.device)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Cluster:
        """The inverse of ``to_dict``; ``device`` may also be a catalog name. Validates every field."""
        if not isinstance(data, Mapping):
            raise InputError(f"a cluster description must be a dict, got {type(data).__name__}")
        if "groups" in data:
            _check_keys(data, {"groups", *_INTER_GROUP_FIELDS, *_SHARED_FIELDS}, ("groups",), "cluster description")
            groups = data["groups"]
            if not isinstance(groups, list):
                raise InputError(f"cluster description: 'groups' must be a list, got {type(groups).__name__}")
            values = dict(data)
            values["groups"] = [DeviceGroup.from_dict(g, source=f"cluster groups[{k}]") for k, g in enumerate(groups)]
            return cls(**values)
        _check_keys(data, {*_GROUP_FIELDS, *_SHARED_FIELDS}, ("device", "num_devices"), "cluster description")
        values = dict(data)
        if isinstance(values["device"], Mapping):
            values["device"] = device_from_dict(values["device"], source="cluster field 'device'")
        return cls(**values)

    # ------------------------------------------------------------------ this machine

    @classmethod
    def local(
        cls,
        num_devices: int = 2,
        memory_bytes: int | None = None,
        *,
        cache_dir: str | os.PathLike | None = None,
        num_threads: int | None = None,
        compute_slowdown: float | None = None,
        reserved_memory_fraction: float | None = None,
    ) -> Cluster:
        """``num_devices`` CPU ranks on this machine, one node, calibrated by measurement:
        ``partita.cost.local_machine.local_cluster``, which documents the arguments.
        ``reserved_memory_fraction`` None is its default, ``LOCAL_RESERVED_MEMORY_FRACTION``."""
        from partita.cost import local_machine  # measuring code stays out of the data class's module

        if reserved_memory_fraction is None:
            reserved_memory_fraction = local_machine.LOCAL_RESERVED_MEMORY_FRACTION
        return local_machine.local_cluster(
            num_devices,
            memory_bytes,
            cache_dir=cache_dir,
            num_threads=num_threads,
            compute_slowdown=compute_slowdown,
            reserved_memory_fraction=reserved_memory_fraction,
        )


# ----------------------------------------------------------------------------- validation


def _resolved_group_fields(given: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of one device type's nodes (``_GROUP_FIELDS``) validated, Nones filled from the device."""
    device = resolve_device(given["device"])
    num_devices = positive_int(given["num_devices"], "num_devices")
    per_node = positive_int(given["devices_per_node"], "devices_per_node")
    if num_devices > per_node and num_devices % per_node:
        lower, upper = num_devices // per_node * per_node, (num_devices // per_node + 1) * per_node
        raise InputError(
            f"num_devices={num_devices} does not fill whole nodes of devices_per_node={per_node}: "
            f"use num_devices={lower} or {upper}, or a devices_per_node that divides {num_devices}"
        )
    memory = device.memory_bytes if given["memory_bytes"] is None else given["memory_bytes"]
    if isinstance(memory, bool) or not isinstance(memory, numbers.Integral) or memory <= 0:
        raise InputError(
            f"memory_bytes must be a positive int (bytes per device), got {memory!r}: "
            "pass e.g. memory_bytes=40 * 2**30, or None for the device's own"
        )
    resolved = {"device": device, "num_devices": num_devices, "devices_per_node": per_node, "memory_bytes": int(memory)}
    for name in _LINK_FIELDS:
        value = getattr(device, name) if given[name] is None else given[name]
        resolved[name] = _link_value(name, value, not name.endswith("latency_s"))
    return resolved


def _link_value(name: str, value: Any, positive: bool) -> float:
    """A bandwidth (> 0) or latency (>= 0) as a float; InputError otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (positive and value == 0)
    ):
        raise InputError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _check_shared(cluster: Cluster) -> None:
    """Validate (and store as floats) the fields every cluster has whatever its groups."""
    fraction = cluster.reserved_memory_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 <= fraction < 1:
        raise InputError(f"reserved_memory_fraction must be in [0, 1), got {fraction!r}: e.g. 0.05 leaves 5% free")
    object.__setattr__(cluster, "reserved_memory_fraction", float(fraction))
    slowdown = cluster.compute_slowdown
    if (
        isinstance(slowdown, bool)
        or not isinstance(slowdown, numbers.Real)
        or not math.isfinite(slowdown)
        or slowdown <= 0
    ):
        raise InputError(
            f"compute_slowdown must be a finite number > 0, got {slowdown!r}: 1.0 for devices "
            "that do not slow each other down"
        )
    object.__setattr__(cluster, "compute_slowdown", float(slowdown))
    efficiency = cluster.collective_efficiency
    if isinstance(efficiency, bool) or not isinstance(efficiency, numbers.Real) or not 0 < efficiency <= 1:
        raise InputError(
            f"collective_efficiency must be in (0, 1], got {efficiency!r}: the share of the link "
            "bandwidth a ring all-reduce reaches (1.0 for NCCL-class libraries)"
        )
    object.__setattr__(cluster, "collective_efficiency", float(efficiency))


def _refuse_beside_groups(cluster: Cluster, what: str) -> None:
    """InputError when one-type fields are given beside ``groups``: they belong to each group."""
    given = [f for f in _GROUP_FIELDS if getattr(cluster, f) is not None]
    if given:
        raise InputError(
            f"Cluster got groups ({what}) and {', '.join(given)}: with groups, give the device, its count, "
            "node size, memory and links per DeviceGroup, e.g. DeviceGroup('a100-40gb', 32, memory_bytes=...)"
        )


def _check_keys(data: Mapping[str, Any], fields: set[str], required: tuple[str, ...], source: str) -> None:
    unknown = sorted(set(data) - fields)
    missing = [f for f in required if f not in data]
    if unknown or missing:
        raise InputError(
            f"{source}: unknown field(s) {unknown or 'none'}, missing field(s) {missing or 'none'}; "
            f"valid fields are {', '.join(sorted(fields))}"
        )


def _speed_key(device: DeviceSpec) -> tuple[float, float]:
    """Orders devices slowest first: by their bf16 peak (fp32 where they have none), then memory bandwidth."""
    peaks = device.peak_flops
    return (peaks.get("bfloat16", peaks.get("float32", 0.0)), device.memory_bandwidth_bytes_per_s)
