"""Planning over a mixed cluster (several device types): partita's plan and the two baselines.

``partita.plan`` hands a cluster of several device groups here (``partita.planning.api``). Three
kinds of plan compete, and the fastest simulated step wins (ties: the order below):

- **mixed** (``best_mixed``): stages placed on device groups with per-stage replica counts and
  unequal sample shares (``partita.planning.hetero_search``), at every tensor-parallel degree that
  tiles every device group (``device_groups.degree_runs``: a replica is then a group of ``t``
  devices of one type), then with each type at a degree of its own next to the best plan's
  (``device_groups.per_type_degree_runs``), built and checked per device type (``hetero_build``)
  and simulated with every replica at its own type's speed (``hetero_simulate``);
- **fastest type only**: the one-type planner's best plan on the fastest group's devices alone
  (every schedule, tensor-parallel degree and sharding level it searches); a plan for that
  group's cluster, the other groups idle;
- **slowest type everywhere**: the one-type planner's best plan over all devices, each taken as
  the slowest group's device with the smallest memory and slowest links of all
  (``device_groups.slowest_cluster``), then simulated on the real cluster.

The last two are also the baselines that ``plan_with_baselines`` prints beside partita's plan.
"Fastest" and "slowest" are by the cost model: a type's seconds for a micro-batch of the whole
model (``MixedRun.seconds_per_sample``). The one-type planner is passed in (``plan_one_type``:
``partita.planning.api.plan``), which keeps the import graph one-way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from partita.errors import InfeasiblePlanError, InputError
from partita.planning.device_groups import MixedRun, degree_runs, mixed_run, per_type_degree_runs, slowest_cluster
from partita.planning.hetero_build import fitting_mixed_draft
from partita.planning.hetero_search import SMALL_DEVICES, MixedCandidate, search_mixed
from partita.planning.hetero_simulate import simulate_mixed
from partita.planning.options import PlanOptions
from partita.planning.plan_builder import plan_key, with_result
from partita.planning.sharding import shards_as_pinned
from partita.types import OpGraph, Plan, SimResult
from partita.types.cluster import Cluster

__all__ = ["FASTEST_ONLY", "SLOWEST_EVERYWHERE", "MixedOutcome", "best_mixed", "plan_mixed"]

# How many of the mixed search's best-estimated candidates are simulated (on clusters of at most
# SMALL_DEVICES devices: all of them), best estimates first, until a candidate's estimate exceeds
# the best simulated step by ESTIMATE_MARGIN: the estimate is not the simulation (it takes each
# stage at its slowest group's pace, the tail after the drain in closed form), so a candidate estimated
# above a simulated step rarely simulates below it (the oracle test, tests/unit/test_hetero_search.py,
# checks the result).
NUM_SIMULATED = 32
ESTIMATE_MARGIN = 1.3
# The best simulated plans of this many configs are refined by moving boundaries, at most
# REFINE_STEPS moves each.
NUM_REFINED = 4
REFINE_STEPS = 64

FASTEST_ONLY = "fastest type only"
SLOWEST_EVERYWHERE = "slowest type everywhere"


@dataclass(frozen=True)
class MixedOutcome:
    """The plan, the two baselines' plans (None: nothing fits) and why not, and the run (degree 1)
    with ``runs``, the run of each tensor-parallel degree searched (``MixedRun.key``: a degree, or a
    degree per device group)."""

    plan: Plan
    baselines: dict[str, Plan | None]
    run: MixedRun
    baseline_reasons: dict[str, str] = field(default_factory=dict)
    runs: dict[int | tuple[int, ...], MixedRun] = field(default_factory=dict)

    def simulate(self, plan: Plan, *, keep_timeline: bool = True) -> SimResult | None:
        """Simulate one of the outcome's plans on its own cluster (mixed: ``simulate_mixed`` with the
        costs of its tensor-parallel degree, ``_run_of``); None for a plan of a degree the outcome holds
        no costs for, or a one-type plan with tensor parallelism (a baseline's: its predicted step is
        its one-type search's)."""
        costs = _run_of(plan, {1: self.run, **self.runs})
        if plan.cluster.is_mixed and costs is not None:
            return simulate_mixed(plan, costs.costs_at, keep_timeline=keep_timeline)
        if plan.tensor_parallel > 1:
            return None
        from partita.planning.simulate import simulate  # one-type plans: the plain simulator

        group = next(g for g, c in enumerate(self.run.cluster.group_clusters) if c == plan.cluster)
        return simulate(plan, self.run.contexts[group].costs_at, keep_timeline=keep_timeline)


def plan_mixed(
    model: torch.nn.Module | OpGraph,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    cluster: Cluster,
    global_batch_size: int,
    plan_one_type: Callable[..., Plan],
    loss_fn: Callable | None = None,
    target: Any = None,
    options: PlanOptions = PlanOptions(),
    batch_dims: Any = None,
    every_share: bool = False,
) -> MixedOutcome:
    """The best plan over ``cluster``'s device groups and both baselines (module docstring);
    InfeasiblePlanError naming each device type when none of the three fits.
    ``every_share=True`` tries every split of a micro-batch over a stage's replicas
    (``MixedRun.every_share``), for planning studies."""
    run = mixed_run(
        model,
        args,
        kwargs,
        cluster=cluster,
        global_batch_size=global_batch_size,
        loss_fn=loss_fn,
        target=target,
        options=options,
        batch_dims=batch_dims,
        every_share=every_share,
    )
    call = dict(args=args, kwargs=kwargs, loss_fn=loss_fn, target=target, batch_dims=batch_dims)
    try:
        runs, refused = degree_runs(run), ""
    except InputError as e:  # a pinned degree that does not tile some group: the baselines may still plan
        runs, refused = [], f"placing stages on device types was not searched: {e}"
    by_degree = {r.key: r for r in runs}
    baselines, reasons = {}, {}
    speeds = _seconds_per_microbatch(run)
    fastest, slowest = min(speeds, key=lambda g: (speeds[g], g)), max(speeds, key=lambda g: (speeds[g], -g))
    names = [c.device.name for c in cluster.group_clusters]
    fastest_name, slowest_name = f"{FASTEST_ONLY} ({names[fastest]})", f"{SLOWEST_EVERYWHERE} ({names[slowest]})"
    baselines[fastest_name], reasons[fastest_name] = _one_type(
        run, by_degree, plan_one_type, cluster.group_clusters[fastest], call, recast=fastest == 0
    )
    everywhere = slowest_cluster(cluster, cluster.group_clusters[slowest].device)
    baselines[slowest_name], reasons[slowest_name] = _one_type(
        run, by_degree, plan_one_type, everywhere, call, recast=True
    )
    found_mixed = [best_mixed(r) for r in runs]
    mixed = min((p for p, _ in found_mixed if p is not None), key=plan_key, default=None)
    if mixed is not None:  # then each device type at a degree of its own, next to the best one's
        per_type = per_type_degree_runs(run, mixed.tensor_parallel)
        by_degree.update({r.key: r for r in per_type})
        found_mixed += [best_mixed(r) for r in per_type]
        mixed = min((p for p, _ in found_mixed if p is not None), key=plan_key)
    why_not = refused or "; ".join(dict.fromkeys(why for p, why in found_mixed if why))
    found = [p for p in (mixed, baselines[fastest_name], baselines[slowest_name]) if p is not None]
    if not found:
        raise _infeasible(run, names, why_not, reasons)
    best = min(found, key=plan_key)
    named = {name: None if p is None else dataclasses.replace(p, method=_method(name)) for name, p in baselines.items()}
    return MixedOutcome(best, named, run, {k: v for k, v in reasons.items() if v}, by_degree)


def best_mixed(run: MixedRun) -> tuple[Plan | None, str]:
    """The best simulated plan of the mixed search at ``run``'s tensor-parallel degree (None when it
    finds none, and why)."""
    options, small = run.contexts[0].options, run.search_cluster.num_devices <= SMALL_DEVICES
    user = run.options
    if user.replicas is not None or user.uniform_replicas:
        pinned = [
            f"{name}={value}"
            for name, value in (("replicas", user.replicas), ("uniform_replicas", user.uniform_replicas))
            if value not in (None, False)
        ]
        return None, (
            f"placing stages on device types was not searched: {', '.join(pinned)} pins what it cannot honour "
            "(its stages have their own replica counts and sample shares)"
        )
    plans: list[Plan] = []
    candidate_of = {}
    best_s = float("inf")
    unsharded = 0  # candidates that fit but shard no stage under a pinned level (tied weights)
    for candidate in search_mixed(run, options):
        if candidate.estimate_s > best_s * ESTIMATE_MARGIN:
            break  # sorted by estimate: no later candidate is likely to beat the best simulated step
        found = _simulated(run, candidate, any_sharding=True)
        if found is not None and not shards_as_pinned(found, user.sharding):
            unsharded, found = unsharded + 1, None
        if found is None:
            continue
        plans.append(found)
        best_s = min(best_s, found.predicted_step_s)
        candidate_of[id(found)] = candidate
        if not small and len(plans) >= NUM_SIMULATED:
            break
    if not plans:
        at = f" at tensor-parallel degree {run.tensor_parallel}" if run.tensor_parallel > 1 else ""
        if run.degrees is not None:
            at = f" at tensor-parallel degrees {list(run.degrees)} (by device group)"
        if unsharded:
            return None, (
                f"no placement of stages on the device types{at} that fits has a stage with "
                f"sharding={user.sharding.value!r} (stages that share a weight with another stage replicate)"
            )
        return None, f"no placement of stages on the device types fits every device's memory{at}"
    return min((_refined(run, candidate_of[id(p)], p) for p in _best_per_config(plans, candidate_of)), key=plan_key), ""


def _best_per_config(plans: list[Plan], candidate_of: dict) -> list[Plan]:
    """The best simulated plan of each of the NUM_REFINED best configs."""
    best: dict = {}
    for p in sorted(plans, key=plan_key):
        best.setdefault(candidate_of[id(p)].config, p)
    return list(best.values())[:NUM_REFINED]


def _refined(run: MixedRun, candidate: MixedCandidate, plan: Plan) -> Plan:
    """Hill-climb the stage boundaries of ``candidate`` block by block, each move simulated, while the
    step improves: the estimate that proposed the split is not the simulation, and the stage DP
    leaves out the collectives and the optimizer step (``partita.planning.refine`` does the same for
    one-type plans)."""
    cuttable, k = run.cuttable, run.num_blocks
    kinds = candidate.config.kinds
    best, boundaries = plan, list(candidate.boundaries)
    for _ in range(REFINE_STEPS):
        improved = None
        for p in range(1, len(boundaries) - 1):
            for step in (-1, 1):
                moved = list(boundaries)
                moved[p] += step
                if not boundaries[p - 1] < moved[p] < boundaries[p + 1] or not 0 < moved[p] < k:
                    continue
                if kinds[p - 1].shares != kinds[p].shares and not cuttable[moved[p]]:
                    continue
                tried = _simulated(run, dataclasses.replace(candidate, boundaries=tuple(moved)))
                if tried is not None and plan_key(tried) < plan_key(improved or best):
                    improved, chosen = tried, moved
        if improved is None:
            break
        best, boundaries = improved, chosen
    return best


def _simulated(run: MixedRun, candidate: MixedCandidate, *, any_sharding: bool = False) -> Plan | None:
    """The candidate's plan, simulated; None when it does not fit, or (unless ``any_sharding``) when
    it shards no stage under a pinned sharding level: a pin is never dropped (stages sharing a weight
    with another replicate under any level, so a slower plan that shards must win)."""
    draft = fitting_mixed_draft(run, candidate)
    if draft is None or not (any_sharding or shards_as_pinned(draft, run.options.sharding)):
        return None
    return with_result(draft, simulate_mixed(draft, run.costs_at, keep_timeline=False))


def _one_type(
    run: MixedRun, runs: dict, plan_one_type, cluster: Cluster, call: dict, *, recast: bool
) -> tuple[Plan | None, str]:
    """The one-type planner's best plan on ``cluster`` (None and the reason when nothing fits);
    ``recast``: as a plan on the mixed cluster (its ranks are the mixed cluster's first ones),
    simulated there at each rank's own type, with the costs of its tensor-parallel degree
    (``runs``: the mixed search's run of each degree). A plan whose degree or sequence parallelism
    no run has keeps its one-type prediction: exact for the fastest group when it holds the first
    ranks, and for the slowest type everywhere the step with every device that slow."""
    try:
        found = plan_one_type(
            run.graph,
            call["args"],
            call["kwargs"],
            cluster=cluster,
            global_batch_size=run.global_batch_size,
            loss_fn=call["loss_fn"],
            target=call["target"],
            options=run.options,
            batch_dims=call["batch_dims"],
        )
    except (InfeasiblePlanError, InputError) as e:  # the baseline has no plan; the others may
        return None, str(e)
    if not recast:
        return found, ""
    on_mixed = dataclasses.replace(found, cluster=run.cluster)
    costs = _run_of(on_mixed, {1: run, **runs})
    if costs is None:
        return on_mixed, ""
    return with_result(on_mixed, simulate_mixed(on_mixed, costs.costs_at, keep_timeline=False)), ""


def _run_of(plan: Plan, runs: dict) -> MixedRun | None:
    """The run among ``runs`` (by ``MixedRun.key``) whose costs are ``plan``'s: its degree (or each
    device group's, where its stages' degrees differ), splitting the same regions (with or without
    sequence parallelism); None when none is."""
    if plan.uniform_tensor_parallel:
        found = runs.get(plan.tensor_parallel)
    else:
        used = _group_degrees(plan)
        found = next(
            (r for r in runs.values() if r.degrees is not None and all(r.degrees[g] == d for g, d in used.items())),
            None,
        )
    if found is None or (found.layout is not None and found.sequence_parallel != plan.sequence_parallel):
        return None
    return found


def _group_degrees(plan: Plan) -> dict[int, int]:
    """Device group -> the tensor-parallel degree of the plan's stages on it (the groups it uses)."""
    return {plan.cluster.group_of_rank(r): s.tensor_parallel for s in plan.stages for r in s.ranks}


def _seconds_per_microbatch(run: MixedRun) -> dict[int, float]:
    """Each group's seconds for a micro-batch of the whole model (the cost model's speed ranking)."""
    reference = max(1, run.global_batch_size // max(1, run.cluster.num_devices))
    found = {}
    for g in range(run.num_groups):
        fixed, per_sample = run.seconds_per_sample(g, max(2, reference))
        found[g] = fixed + per_sample * reference
    return found


def _method(name: str) -> str:
    return "fastest_only" if name.startswith(FASTEST_ONLY) else "slowest_everywhere"


def _infeasible(run: MixedRun, names: list[str], why_not: str, reasons: dict[str, str]) -> InfeasiblePlanError:
    groups = ", ".join(f"{c.num_devices} x {c.device.name}" for c in run.cluster.group_clusters)
    parts = [f"{name}: {why}" for name, why in reasons.items()]
    return InfeasiblePlanError(
        f"no plan fits the mixed cluster ({groups}, device types {', '.join(names)}): {why_not}; " + "; ".join(parts)
    )
