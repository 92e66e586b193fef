"""Communication times on a Cluster: point-to-point transfers and ring collectives.

The alpha-beta model: a message of ``b`` bytes over a link of latency ``α`` (s) and bandwidth
``β`` (bytes/s) takes ``α + b / β``.

Ring collectives over ``n`` ranks (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms
for clusters of workstations", JPDC 2009; Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005): the buffer is cut into ``n``
chunks that travel ``n − 1`` steps around the ring, each step one chunk per rank.

    reduce-scatter   (n − 1)·α + (n − 1)/n · b / β
    all-gather       (n − 1)·α + (n − 1)/n · b / β
    all-reduce       = reduce-scatter + all-gather = 2(n − 1)·α + 2(n − 1)/n · b / β

The ring's bandwidth term is optimal (each rank must send and receive 2(n − 1)/n · b bytes);
``Cluster.collective_efficiency`` scales β for collectives whose library reaches less of the link
(gloo on CPUs: it also sums and copies every chunk; measured by ``Cluster.local``).
Every step waits for the slowest link of the ring, so a group that spans nodes runs at the
inter-node bandwidth and latency. NCCL switches to trees for small messages at large ``n``;
the ring's 2(n − 1)·α latency term therefore over-estimates tiny all-reduces on big groups.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable

from partita.checks import positive_int
from partita.errors import InputError
from partita.types.cluster import Cluster

__all__ = [
    "all_gather_time_s",
    "allreduce_time_s",
    "p2p_time_s",
    "reduce_scatter_time_s",
    "ring_pass_coefficients",
    "spans_nodes",
]


def p2p_time_s(num_bytes: float, cluster: Cluster, *, same_node: bool) -> float:
    """Seconds to send ``num_bytes`` from one device to another: latency + bytes / bandwidth."""
    _check_bytes(num_bytes)
    bandwidth, latency = _link(cluster, spans_nodes=not same_node)
    return latency + num_bytes / bandwidth


def allreduce_time_s(num_bytes: float, num_ranks: int, cluster: Cluster, *, spans_nodes: bool) -> float:
    """Seconds for a ring all-reduce of ``num_bytes`` per rank over ``num_ranks`` ranks (0 for one rank)."""
    return 2.0 * _ring_pass_s(num_bytes, num_ranks, cluster, spans_nodes)


def reduce_scatter_time_s(num_bytes: float, num_ranks: int, cluster: Cluster, *, spans_nodes: bool) -> float:
    """Seconds for a ring reduce-scatter of a ``num_bytes`` buffer per rank (0 for one rank)."""
    return _ring_pass_s(num_bytes, num_ranks, cluster, spans_nodes)


def all_gather_time_s(num_bytes: float, num_ranks: int, cluster: Cluster, *, spans_nodes: bool) -> float:
    """Seconds for a ring all-gather whose gathered result is ``num_bytes`` (0 for one rank)."""
    return _ring_pass_s(num_bytes, num_ranks, cluster, spans_nodes)


def spans_nodes(ranks: Iterable[int], cluster: Cluster) -> bool:
    """Whether the ranks of a group sit in more than one node. Ranks fill nodes in order, so
    the lowest and the highest rank tell (a group of a stage holds hundreds of ranks)."""
    ranks = tuple(ranks)
    return bool(ranks) and cluster.rank_to_node(min(ranks)) != cluster.rank_to_node(max(ranks))


def ring_pass_coefficients(num_ranks: int, cluster: Cluster, *, spans_nodes: bool) -> tuple[float, float]:
    """(seconds, seconds per byte) of one ring pass over ``num_ranks`` ranks: a pass over ``b``
    bytes takes ``seconds + b · seconds per byte`` (both 0 for one rank). For arrays of sizes."""
    positive_int(num_ranks, "num_ranks")
    if num_ranks == 1:
        return 0.0, 0.0
    bandwidth, latency = _link(cluster, spans_nodes)
    steps = int(num_ranks) - 1
    return steps * latency, steps / num_ranks / (bandwidth * cluster.collective_efficiency)


def _ring_pass_s(num_bytes: float, num_ranks: int, cluster: Cluster, spans: bool) -> float:
    """(n − 1)·α + (n − 1)/n · b / β: one trip of every chunk around the ring."""
    _check_bytes(num_bytes)
    latency_s, per_byte_s = ring_pass_coefficients(num_ranks, cluster, spans_nodes=spans)
    return latency_s + num_bytes * per_byte_s if num_ranks > 1 else 0.0


def _link(cluster: Cluster, spans_nodes: bool) -> tuple[float, float]:
    if spans_nodes:
        return cluster.inter_node_bandwidth_bytes_per_s, cluster.inter_node_latency_s
    return cluster.intra_node_bandwidth_bytes_per_s, cluster.intra_node_latency_s


def _check_bytes(num_bytes: float) -> None:
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, numbers.Real) or not num_bytes >= 0:
        raise InputError(f"num_bytes must be a number >= 0, got {num_bytes!r}")
