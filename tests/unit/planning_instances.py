"""Random small planning instances and their brute-force optimum, shared by the search tests
(test_search, test_uneven_search, test_plan_bounds)."""

import dataclasses
import functools
import os

import numpy as np
from oracle import brute_force

from partita.planning.build import build_plan
from partita.planning.chain import coarsen
from partita.planning.configs import SearchOptions
from partita.planning.context import PlanningContext
from partita.planning.options import PlanOptions
from partita.planning.plan_builder import finish_plan
from partita.types import CostTable, OpGraph, OpNode, OptimizerKind, ParamInfo, Precision, Schedule, TensorInfo
from partita.types.cluster import Cluster

GiB = 2**30

# How many random instances the brute-force checks of the searches solve (test_search,
# test_uneven_search: seeds 0..N-1; test_hetero_search: 3/20 as many mixed ones). ``make test``
# runs 80; the full sets run with PARTITA_BRUTE_FORCE_INSTANCES=200, and
# bench/results/brute_force.md records such a run (the oracle is minutes per hundred instances).
NUM_INSTANCES = int(os.environ.get("PARTITA_BRUTE_FORCE_INSTANCES", "80"))


def random_instance(seed: int, num_nodes: tuple[int, int] = (2, 8)) -> PlanningContext:
    """A chain of K nodes (K drawn from ``num_nodes``, high excluded) with random costs; node k reads parameter p{k}."""
    rng = np.random.default_rng(seed)
    k = int(rng.integers(*num_nodes))
    param_bytes = rng.integers(1, 200, size=k) * 2**20
    forward = rng.uniform(1e-3, 2e-2, size=k)
    activation = rng.integers(1, 300, size=k) * 2**20
    cut = np.concatenate([[0], rng.integers(1, 50, size=k - 1) * 2**20, [0]])
    overhead = rng.uniform(0, 2e-3)
    num_devices = int(rng.integers(1, 5))
    memory = int(rng.uniform(2, 12) * max(1.0, k / 8) * GiB)  # longer chains need more
    return chain_instance(forward, param_bytes, activation, cut, overhead, num_devices, memory, f"random{seed}")


def chain_instance(
    forward: np.ndarray,
    param_bytes: np.ndarray,
    activation: np.ndarray,
    cut: np.ndarray,
    overhead: float,
    num_devices: int,
    memory: int,
    name: str,
    global_batch_size: int = 8,
) -> PlanningContext:
    """A chain of len(forward) nodes with these costs at 8 samples (node k reads parameter p{k},
    ``cut``: bytes crossing each cut, first and last 0), on ``num_devices`` H100s of ``memory`` bytes.
    Selective recomputation keeps 45% of each node's activation bytes (its kept outputs), rebuilds
    60% of them (so S >= A - R, as in ``partita.cost.recompute``) and runs 35% of its forward again."""
    k = len(forward)
    nodes = tuple(
        OpNode(
            index=i,
            name=f"n{i}",
            target="aten.mm.default",
            module_path=f"layers.{i}",
            module_type="Linear",
            source="",
            outputs=(TensorInfo((8, 16), "float32", 512, 0),),
            inputs=(i - 1,) if i else (),
            params=(f"p{i}",),
            consumers=(i + 1,) if i + 1 < k else (),
        )
        for i in range(k)
    )
    params = {
        f"p{i}": ParamInfo(f"p{i}", (int(param_bytes[i]) // 4,), "float32", int(param_bytes[i])) for i in range(k)
    }
    graph = OpGraph(
        nodes=nodes,
        inputs=(),
        parameters=params,
        loss_node=k - 1,
        batch_size=8,
        dynamic_batch=True,
        fingerprint=name,
        graph_module=None,
        exported_program=None,
    )

    @functools.cache  # one table per size, as the planner's cost sources keep them (BuildMemo knows tables by identity)
    def costs_at(b: int) -> CostTable:
        scale = b / 8
        kept = (activation * scale).astype(np.int64)
        return CostTable(
            microbatch_size=b,
            device="h100",
            source="analytic",
            forward_s=forward * scale + overhead,
            backward_s=2 * forward * scale + overhead,
            backward_weight_s=forward * scale,
            activation_bytes=kept,
            saved_bytes=(kept * 0.45).astype(np.int64),
            recomputed_bytes=kept - (kept * 0.4).astype(np.int64),
            selective_recompute_s=0.35 * forward * scale + overhead,
            output_bytes=(cut[1:] * scale).astype(np.int64),
            cut_bytes=(cut * scale).astype(np.int64),
            param_names=tuple(params),
            param_bytes=param_bytes,
            param_trainable=np.ones(k, bool),
            param_uses=tuple(np.array([i]) for i in range(k)),
        )

    cluster = Cluster(device="h100", num_devices=num_devices, devices_per_node=8, memory_bytes=memory)
    options = SearchOptions.from_plan_options(
        PlanOptions(uniform_replicas=True, optimizer=OptimizerKind.ADAM),
        num_devices=num_devices,
        global_batch_size=global_batch_size,
        memory_limit_bytes=cluster.usable_memory_bytes,
        precision=Precision.FP32,
        max_microbatch_choices=16,
    )
    chain = coarsen(graph, costs_at(8))
    return PlanningContext(graph, cluster, options, costs_at, list(chain), {})


def head_heavy_instance(memory_gib: float, schedules=(Schedule.ZBV,)) -> PlanningContext:
    """40 equal layers whose last one holds a 1 GiB head: ZB-V's rank group 0 holds the first
    stage and the last, whose head the search's per-stage memory check sees apart from it."""
    k, MiB = 40, 2**20
    forward = np.full(k, 4e-3)
    forward[-1] = 6e-3
    params = np.full(k, 64 * MiB)
    params[-1] = 1024 * MiB
    activation = np.full(k, 96 * MiB)
    activation[-1] = 64 * MiB
    cut = np.concatenate([[0], np.full(k - 1, 8 * MiB), [0]])
    ctx = chain_instance(forward, params, activation, cut, 1e-4, 4, int(memory_gib * GiB), "head", global_batch_size=32)
    return dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, schedules=schedules))


def oracle(ctx: PlanningContext):
    """The best plan over every split, config and recomputation choice (oracle.py beside this file)."""

    def evaluate(config, nodes, recompute, method):
        return finish_plan(ctx, config, nodes, recompute, method)

    def stage_fits(config, nodes, recompute):
        p = build_plan(
            ctx.graph,
            ctx.costs_at,
            config,
            nodes,
            recompute,
            ctx.options,
            cluster=ctx.cluster,
            method="x",
            resolved_options={},
            versions=("", ""),
        )
        return [s.memory_bytes <= ctx.options.memory_limit_bytes for s in p.stages]

    return brute_force(ctx.options, ctx.chain, evaluate, stage_fits)
