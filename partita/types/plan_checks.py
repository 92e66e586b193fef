"""Checks of a Plan read from a file: its fields against each other (ranks, rank groups, tensor
and sequence parallelism, sharding, batch), its ``options`` records against its executed fields
(field by field, wherever both say the same thing), and the plan against the graph and the cluster
it is loaded for. Each failure is a PlanFileError naming the field, the value, the cause and the fix
(``partita.types.plan_file`` says which fields execute)."""

from __future__ import annotations

from typing import Any

from partita.errors import InputError, PlanFileError
from partita.types.choices import Accumulation, Recompute, Schedule, Sharding
from partita.types.cluster import Cluster
from partita.types.graph import OpGraph
from partita.types.plan import Plan, StagePlan

__all__ = ["check_options_agree", "check_plan_consistency", "check_plan_matches_cluster", "check_plan_matches_graph"]


def check_plan_consistency(plan: Plan, source: str = "plan") -> None:
    """Invariants a valid plan satisfies whatever the model: contiguous stages, ranks, batch."""
    stages = plan.stages
    if stages[0].start != 0:
        raise PlanFileError(f"{source}: stages[0].start is {stages[0].start}, expected 0 (the first node)")
    for k, s in enumerate(stages):
        if s.index != k:
            raise PlanFileError(f"{source}: stages[{k}].index is {s.index}, expected {k}")
        if s.start >= s.stop:
            raise PlanFileError(f"{source}: stages[{k}] is empty or reversed (start {s.start}, stop {s.stop})")
        if k + 1 < len(stages) and stages[k + 1].start != s.stop:
            raise PlanFileError(
                f"{source}: stages[{k}] ends at node {s.stop} but stages[{k + 1}] starts at {stages[k + 1].start}: "
                "stages must be contiguous, without gaps or overlaps"
            )
    _check_rank_groups(plan, source)
    _check_tensor_parallel(plan, source)
    _check_stage_choices(plan, source)
    recomputed = [k for k, s in enumerate(stages) if s.recompute]
    if plan.schedule is Schedule.ZBV and recomputed and plan.method != "manual":
        # The planner never recomputes under ZBV (partita.planning.options.recompute_allowed): such a
        # file was edited, and its memory figures are wrong. manual_plan may ask for it (no predictions).
        level = stages[recomputed[0]].recompute.value
        raise PlanFileError(
            f"{source}: stages[{recomputed[0]}].recompute is {level!r}, but the schedule is zbv, under which partita "
            "never recomputes (the memory of a recomputed stage cannot be predicted): set it to 'none', or re-plan "
            "with another schedule"
        )
    check_options_agree(plan, source)
    num_devices = plan.cluster.num_devices
    used = sorted({r for s in stages for r in s.ranks})
    if used[-1] >= num_devices:
        raise PlanFileError(f"{source}: rank {used[-1]} is used but the cluster has {num_devices} devices")
    _check_batch(plan, source)


def _check_rank_groups(plan: Plan, source: str) -> None:
    groups: dict[int, tuple[int, ...]] = {}
    for k, s in enumerate(plan.stages):
        if groups.setdefault(s.rank_group, s.ranks) != s.ranks:
            raise PlanFileError(
                f"{source}: stages[{k}].ranks {list(s.ranks)} differ from other stages of rank group {s.rank_group}"
            )
    seen: dict[int, int] = {}
    for group, ranks in groups.items():
        for r in ranks:
            if seen.setdefault(r, group) != group:
                raise PlanFileError(
                    f"{source}: rank {r} is in rank groups {seen[r]} and {group}: a rank runs one group"
                )
    if sorted(groups) != list(range(len(groups))):
        raise PlanFileError(f"{source}: rank groups are {sorted(groups)}, expected 0..{len(groups) - 1}")


def _check_tensor_parallel(plan: Plan, source: str) -> None:
    """Each stage's degree its own (a mixed cluster's stages take their device type's), sequence
    parallelism as ``_check_sequence_parallel`` says, and every replica's group a block of
    consecutive ranks in one node (its all-reduces run on the intra-node link)."""
    _check_sequence_parallel(plan, source)
    for k, s in enumerate(plan.stages):
        t = s.tensor_parallel
        for j in range(s.num_replicas):
            block = s.replica_ranks(j)
            consecutive = block == tuple(range(block[0], block[0] + t))
            nodes = {_node_of(plan.cluster, r) for r in block}
            if not consecutive or len(nodes) > 1:
                raise PlanFileError(
                    f"{source}: stages[{k}] replica {j} runs on ranks {list(block)}, which is not a tensor-parallel "
                    f"group of {t}: each replica's ranks are {t} consecutive ranks in one node"
                )


def _check_sequence_parallel(plan: Plan, source: str) -> None:
    """Sequence parallelism is on or off for every stage of a tensor-parallel degree above 1 (a stage
    of degree 1 has none: plan_file), as ``options.sequence_parallel`` records when it was pinned or
    given (true or false; null: searched, and absent in earlier files). It applies to those stages
    only, so a stage of degree 1 beside them under ``options.sequence_parallel`` true agrees."""
    recorded = plan.options.get("sequence_parallel")
    if recorded is not None and not isinstance(recorded, bool):
        raise PlanFileError(
            f"{source}: options.sequence_parallel is {recorded!r}, expected true, false or null (searched): "
            "re-plan, or restore the value the plan was made with"
        )
    split = [(k, s) for k, s in enumerate(plan.stages) if s.tensor_parallel > 1]
    for k, s in split:
        if isinstance(recorded, bool) and s.sequence_parallel != recorded:
            raise PlanFileError(
                f"{source}: stages[{k}].sequence_parallel is {_json(s.sequence_parallel)}, but "
                f"options.sequence_parallel is {_json(recorded)}: sequence parallelism applies to every stage of "
                f"a tensor-parallel degree above 1 (stages[{k}] has {s.tensor_parallel}), and options only record "
                f"how the plan was made, so they must agree; set stages[{k}].sequence_parallel back to "
                f"{_json(recorded)}, or re-plan with sequence_parallel={not recorded} "
                f"(`--sequence-parallel {'yes' if not recorded else 'no'}`)"
            )
    for k, s in split[1:]:  # searched (or not recorded): the first such stage says
        first, other = split[0]
        if s.sequence_parallel != other.sequence_parallel:
            raise PlanFileError(
                f"{source}: stages[{k}].sequence_parallel is {_json(s.sequence_parallel)}, but stages[{first}]'s is "
                f"{_json(other.sequence_parallel)}: sequence parallelism is on or off for every stage of a "
                "tensor-parallel degree above 1; set them alike, or re-plan"
            )


def _json(value: bool) -> str:
    """A boolean as the plan file spells it."""
    return "true" if value else "false"


def _node_of(cluster: Cluster, rank: int) -> int:
    """The node of ``rank`` (a rank past the cluster's devices is refused later, by name)."""
    return cluster.rank_to_node(rank) if rank < cluster.num_devices else rank // cluster.devices_per_node


def _check_stage_choices(plan: Plan, source: str) -> None:
    """Choices of a stage that would do nothing, refused (partita never changes a value it was
    given): a sharding level other than replicate with one replica to shard over, blocks to
    recompute at no recomputation level, sharded accumulation of an unsharded stage."""
    for k, s in enumerate(plan.stages):
        if s.sharding is not Sharding.REPLICATE and s.num_replicas == 1:
            raise PlanFileError(
                f"{source}: stages[{k}].sharding is {s.sharding.value!r}, but the stage has one replica, so there "
                "is nothing to shard over: set it to 'replicate', or give the stage several replicas"
            )
        if s.recompute_blocks is not None and s.recompute is Recompute.NONE:
            raise PlanFileError(
                f"{source}: stages[{k}].recompute_blocks is {s.recompute_blocks}, but its recompute is 'none': "
                "give the level those blocks recompute at, or drop recompute_blocks"
            )
        if s.accumulation is not Accumulation.WHOLE and s.sharding is Sharding.REPLICATE:
            raise PlanFileError(
                f"{source}: stages[{k}].accumulation is {s.accumulation.value!r}, but the stage is not sharded "
                "(sharding 'replicate'): only a sharded stage accumulates its gradients in shards; set it to "
                "'whole', or shard the stage"
            )


def check_options_agree(plan: Plan, source: str = "plan") -> None:
    """PlanFileError when a choice that ``options`` records differs from what the executed fields
    say (see the module docstring): the options of a searched plan (``partita.plan``: what was
    pinned) and of a manual one (``manual_plan``: what was given) alike; None means searched."""
    for field, recorded, executed in _recorded_and_executed(plan):
        if recorded is not None and recorded != executed:
            raise PlanFileError(
                f"{source}: options.{field} is {recorded!r}, but the plan's stages run {executed!r}: options only "
                "record how the plan was made (editing them changes nothing that runs), so they must agree with "
                "the executed fields (stages, schedule, num_microbatches, precision); edit those instead, or "
                f"re-plan with {field} pinned"
            )


def _recorded_and_executed(plan: Plan) -> list[tuple[str, Any, Any]]:
    """(options field, its recorded value or None when not recorded or searched, the executed one).
    ``sequence_parallel``, recorded for some stages only, is ``_check_sequence_parallel``'s."""
    options, stages = plan.options, plan.stages
    found: list[tuple[str, Any, Any]] = []

    def add(field: str, recorded: Any, executed: Any) -> None:
        found.append((field, recorded, executed))

    degrees = plan.tensor_parallel if plan.uniform_tensor_parallel else [s.tensor_parallel for s in stages]
    add("tensor_parallel", options.get("tensor_parallel"), degrees)
    add("precision", options.get("precision"), plan.precision.value)
    add("compile", options.get("compile"), plan.compile)
    add("num_microbatches", options.get("num_microbatches"), plan.num_microbatches)
    add("num_stages", options.get("num_stages"), plan.num_rank_groups)
    add("num_rank_groups", options.get("num_rank_groups"), plan.num_rank_groups)
    if "boundaries" in options:
        add("boundaries", options["boundaries"], list(plan.boundaries))
    schedules = options.get("schedules")
    if isinstance(schedules, list) and plan.schedule.value not in schedules:
        add("schedules", schedules, plan.schedule.value)
    if options.get("uniform_replicas") is True:
        add("uniform_replicas", True, plan.uniform_replicas)
    replicas, counts = options.get("replicas"), [s.num_replicas for s in stages]
    if isinstance(replicas, int):
        add("replicas", replicas, counts[0] if len(set(counts)) == 1 else counts)
    elif isinstance(replicas, list):  # manual: one count per rank group
        add(
            "replicas",
            replicas,
            [next(s.num_replicas for s in stages if s.rank_group == g) for g in range(len(replicas))],
        )
    shares = options.get("replica_samples")
    if isinstance(shares, list):  # manual: per rank group, each replica's samples or None (even)
        group_shares = {s.rank_group: s.replica_samples for s in stages}
        add(
            "replica_samples",
            shares,
            [None if group_shares[g] is None else list(group_shares[g]) for g in sorted(group_shares)],
        )
    levels = [Recompute.parse(s.recompute).value for s in stages]
    recompute = _recompute_record(options.get("recompute"))
    if isinstance(recompute, str):  # one pinned level (schema 1: a bool) for every stage
        add("recompute", recompute, levels[0] if len(set(levels)) == 1 else levels)
    elif isinstance(recompute, list):  # manual: one level per stage
        add("recompute", recompute, levels)
    add("sharding", *_sharding_agreement(options.get("sharding"), stages))
    return found


def _recompute_record(recorded: Any) -> Any:
    """The recorded recompute pin as level names: schema 1 wrote booleans (full / none), one or one
    per stage; None (searched) and values of other kinds stay as they are."""
    try:
        if isinstance(recorded, (bool, str)):
            return Recompute.parse(recorded).value
        if isinstance(recorded, list) and all(isinstance(r, (bool, str)) for r in recorded):
            return [Recompute.parse(r).value for r in recorded]
    except InputError:  # not a level: compared as written, and refused as disagreeing
        pass
    return recorded


def _sharding_agreement(recorded: Any, stages: tuple[StagePlan, ...]) -> tuple[Any, Any]:
    """(recorded, executed) sharding, equal when they agree. A pinned level applies to the stages with
    several replicas that share no weight with another stage (those replicate), so the plan agrees
    when every stage has the pinned level or replicate and at least one the pinned level -- or when
    no stage has several replicas (nothing to shard: earlier planners dropped such a pin without a
    word, and their plan files still load)."""
    executed = [s.sharding.value for s in stages]
    if isinstance(recorded, list):  # manual: one level per stage
        return recorded, executed
    if not isinstance(recorded, str):
        return None, executed
    levels = set(executed)
    applied = levels <= {recorded, Sharding.REPLICATE.value} and recorded in levels
    if applied or all(s.num_replicas == 1 for s in stages):
        return recorded, recorded
    return recorded, executed


def _check_batch(plan: Plan, source: str) -> None:
    b, m, mb = plan.global_batch_size, plan.num_microbatches, plan.microbatch_size
    fewest = min(s.num_replicas for s in plan.stages)
    shares = [x for s in plan.stages for x in s.replica_samples or ()]
    if shares and (m < 1 or b % m or mb != max(shares)):
        raise PlanFileError(
            f"{source}: with unequal sample shares, num_microbatches {m} must divide global_batch_size {b} and "
            f"microbatch_size {mb} must be the largest share of a replica ({max(shares)})"
        )
    if not shares and (m < 1 or mb < 1 or b != m * mb * fewest):
        raise PlanFileError(
            f"{source}: global_batch_size {b} != num_microbatches {m} x microbatch_size {mb} x the fewest replicas of "
            f"a stage ({fewest})"
        )
    for k, s in enumerate(plan.stages):
        if s.replica_samples is not None:
            if sum(s.replica_samples) != b // m:
                raise PlanFileError(
                    f"{source}: stages[{k}].replica_samples {list(s.replica_samples)} sum to {sum(s.replica_samples)}, "
                    f"but a micro-batch holds {b // m} samples"
                )
        elif (b // m) % s.num_replicas:
            raise PlanFileError(
                f"{source}: stages[{k}] has {s.num_replicas} replicas, which do not divide the micro-batch of {b // m} samples"
            )


def check_plan_matches_graph(plan: Plan, graph: OpGraph, source: str = "plan") -> None:
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanFileError(
            f"{source} was made for another model or input shape (graph fingerprint {plan.graph_fingerprint}, "
            f"this model's is {graph.fingerprint}): re-plan for this model"
        )
    if plan.stages[-1].stop != graph.num_nodes:
        raise PlanFileError(
            f"{source}: the last stage ends at node {plan.stages[-1].stop}, but the graph has {graph.num_nodes} nodes"
        )
    for k, s in enumerate(plan.stages):
        if graph.nodes[s.start].name != s.first_node or graph.nodes[s.stop - 1].name != s.last_node:
            raise PlanFileError(
                f"{source}: stages[{k}] should run nodes {s.first_node}..{s.last_node}, but positions "
                f"{s.start}..{s.stop - 1} are {graph.nodes[s.start].name}..{graph.nodes[s.stop - 1].name}"
            )


def check_plan_matches_cluster(plan: Plan, cluster: Cluster, source: str = "plan") -> None:
    expected, planned = cluster.to_dict(), plan.cluster.to_dict()
    if planned != expected:
        differing = sorted(k for k in set(expected) | set(planned) if expected.get(k) != planned.get(k))
        raise PlanFileError(
            f"{source} was made for another cluster (fields differ: {', '.join(differing)}): re-plan for this cluster"
        )
