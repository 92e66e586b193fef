"""Random small mixed-cluster planning instances (two device types) and their brute-force optimum."""

import dataclasses
import functools

import numpy as np
from oracle import brute_force_mixed
from planning_instances import GiB, chain_instance

from partita.planning.context import PlanningContext
from partita.planning.device_groups import MixedRun
from partita.planning.hetero_build import mixed_draft
from partita.planning.hetero_search import MixedCandidate
from partita.planning.hetero_simulate import simulate_mixed
from partita.planning.options import PlanOptions
from partita.planning.plan_builder import with_result
from partita.planning.search import SearchOptions
from partita.types import RECOMPUTE_LEVELS
from partita.types.cluster import Cluster, DeviceGroup


def mixed_instance(
    seed: int, *, max_devices: int = 12, every_share: bool = False, activation_scale: float = 1.0
) -> MixedRun:
    """A chain of 2-5 nodes with random costs (planning_instances) on a fast group and a slow one
    (1.5-4x slower per node, with its own memory), 2-12 devices in all, a global batch of 2-8.
    ``every_share``: ``MixedRun``'s (default: the planner's search, a few balanced shares per stage).
    ``activation_scale`` multiplies the activation bytes (above 1: stages that must recompute)."""
    rng = np.random.default_rng(1000 + seed)
    k = int(rng.integers(2, 6))
    forward = rng.uniform(1e-3, 2e-2, size=k)
    param_bytes = rng.integers(1, 200, size=k) * 2**20
    activation = (rng.integers(1, 300, size=k) * 2**20 * activation_scale).astype(np.int64)
    cut = np.concatenate([[0], rng.integers(1, 50, size=k - 1) * 2**20, [0]])
    overhead = float(rng.uniform(0, 2e-3))
    batch = int(rng.choice([2, 4, 4, 4, 6, 8]))
    most = max_devices if batch <= 4 else 6  # larger batches: many more kinds per stage
    fast = int(rng.integers(1, min(6, most - 1) + 1))
    slow = int(rng.integers(1, min(6, most - fast) + 1))
    memory = int(rng.uniform(1.5, 8) * GiB)
    base = chain_instance(forward, param_bytes, activation, cut, overhead, fast, memory, f"mixed{seed}", batch)
    factor = float(rng.uniform(1.5, 4.0))
    slow_memory = int(memory * rng.uniform(0.4, 1.2))
    cluster = Cluster(
        groups=[
            DeviceGroup("h100", fast, 8, memory_bytes=memory),
            DeviceGroup("a100-40gb", slow, 8, memory_bytes=slow_memory),
        ]
    )

    @functools.cache
    def slow_costs(b: int):
        t = base.costs_at(b)
        return dataclasses.replace(
            t,
            device="a100-40gb",
            forward_s=t.forward_s * factor,
            backward_s=t.backward_s * factor,
            backward_weight_s=t.backward_weight_s * factor,
        )

    contexts = []
    for group, costs_at in zip(cluster.group_clusters, (base.costs_at, slow_costs)):
        options = dataclasses.replace(
            base.options, num_devices=group.num_devices, memory_limit_bytes=group.usable_memory_bytes
        )
        contexts.append(PlanningContext(base.graph, group, options, costs_at, base.chain, {}))
    return MixedRun(base.graph, cluster, tuple(contexts), PlanOptions(), batch, {}, every_share)


def mixed_oracle(run: MixedRun):
    """The best plan over every config, kind tuple, share and split (oracle.brute_force_mixed)."""
    options = run.contexts[0].options

    limits = [ctx.options.memory_limit_bytes for ctx in run.contexts]

    def evaluate(config, split):
        # each stage at the least level of none, selective, full at which all its replicas fit (a
        # stage's memory does not depend on the others' levels); a pinned level for every stage
        levels = [config.recompute_mode] if config.recompute_mode is not None else list(RECOMPUTE_LEVELS)
        chosen = [None] * config.num_stages
        for level in levels:
            candidate = MixedCandidate(config, tuple(split), tuple([level] * config.num_stages), 0.0)
            draft = mixed_draft(run, candidate, [level] * config.num_stages, "oracle")
            for p, stage in enumerate(draft.stages):
                if chosen[p] is None and all(m <= lim for m, lim in zip(stage.memory_bytes_by_group, limits)):
                    chosen[p] = level
        if None in chosen:
            return None
        draft = mixed_draft(run, MixedCandidate(config, tuple(split), tuple(chosen), 0.0), chosen, "oracle")
        return with_result(draft, simulate_mixed(draft, run.costs_at, keep_timeline=False))

    return brute_force_mixed(run, options.schedules, options.recompute, evaluate)


__all__ = ["SearchOptions", "mixed_instance", "mixed_oracle"]
