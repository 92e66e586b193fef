"""What layouts the runtime runs: ``check_layout`` refuses a plan whose ranks it cannot place;
``stage_shares`` says how many samples of each micro-batch each replica of a stage runs."""

from __future__ import annotations

from partita.errors import InputError
from partita.types import Plan, StagePlan
from partita.types.schedule_orders import UNEVEN_SCHEDULES, stage_rank_groups

__all__ = ["check_layout", "replica_microbatch_samples", "stage_shares"]


def check_layout(plan: Plan) -> None:
    """InputError unless the runtime can run the plan's layout: a uniform pp x dp mesh with rank
    group g on ranks [g*dp, (g+1)*dp) (``Plan.on_mesh``), or a plan for partita's own executor
    (GPipe/1F1B, one stage per rank group, replica counts and sample shares of its own per stage)
    whose stages hold ranks 0 .. N-1 between them, each stage its own ascending ranks in any order
    of the stages (ranks follow the device groups of a mixed cluster: the first stage may run on
    the second group, also when every stage has as many replicas). Either may hold tensor-parallel
    groups: a replica is then ``tensor_parallel`` consecutive ranks (``StagePlan.replica_ranks``), of
    one degree on a mesh, of each stage's own on partita's executor."""
    if plan.on_mesh:
        _check_uniform_layout(plan)
    else:
        _check_uneven_layout(plan)


def stage_shares(stage: StagePlan, microbatch_samples: int) -> tuple[int, ...]:
    """Samples of each micro-batch of ``microbatch_samples`` that each replica of ``stage`` runs, in
    replica order: its ``replica_samples``, or an even split. InputError when they do not make the
    micro-batch (an even split that leaves a remainder, a share below one sample, a wrong sum)."""
    r = stage.num_replicas
    if stage.replica_samples is None:
        if microbatch_samples % r:
            raise InputError(
                f"a micro-batch of {microbatch_samples} samples does not split evenly over the {r} replicas of "
                f"stage {stage.index}: use a global batch that is a multiple of num_microbatches x every replica "
                "count, or give the stage's replicas their shares (replica_samples)"
            )
        return (microbatch_samples // r,) * r
    shares = tuple(stage.replica_samples)
    if len(shares) != r or sum(shares) != microbatch_samples or min(shares) < 1:
        raise InputError(
            f"stage {stage.index} gives its {r} replicas the shares {list(shares)} of a micro-batch of "
            f"{microbatch_samples} samples: give one share per replica, each at least one sample, summing to "
            f"{microbatch_samples}"
        )
    return shares


def replica_microbatch_samples(plan: Plan, rank_group: int, replica: int) -> int:
    """Samples of each micro-batch that replica ``replica`` of rank group ``rank_group`` runs (its
    stages': a uniform plan's replicas all run ``global_batch_size / (num_microbatches x dp)``)."""
    b = plan.global_batch_size // plan.num_microbatches
    stage = next(s for s in plan.stages if s.rank_group == rank_group)
    return stage_shares(stage, b)[replica]


def _check_uniform_layout(plan: Plan) -> None:
    dp, pp, t = plan.stages[0].num_replicas, plan.num_rank_groups, plan.tensor_parallel
    placement = stage_rank_groups(plan.schedule, pp, plan.num_stages)
    for s in plan.stages:
        expected = tuple(range(s.rank_group * dp * t, (s.rank_group + 1) * dp * t))
        if s.ranks != expected or s.rank_group != placement[s.index]:
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; {plan.schedule.value} "
                f"places it on rank group {placement[s.index]}, ranks {list(expected)}: build the plan with "
                "partita.plan or partita.planning.manual.manual_plan"
            )


def _check_uneven_layout(plan: Plan) -> None:
    counts, degrees = [s.num_replicas for s in plan.stages], [s.tensor_parallel for s in plan.stages]
    unequal = next((s for s in plan.stages if not s.even_shares), None)
    if len(set(counts)) > 1:
        what = f"different replica counts {counts}"
    elif len(set(degrees)) > 1:
        what = f"different tensor-parallel degrees {degrees}"
    elif unequal is not None:
        what = f"unequal sample shares (stage {unequal.index}: {list(unequal.replica_samples)})"
    else:
        what = f"stages on ranks {[list(s.ranks) for s in plan.stages]}, off the pp x dp mesh's order"
    if plan.schedule not in UNEVEN_SCHEDULES:
        raise InputError(
            f"the plan gives its stages {what} under {plan.schedule.value}, which the runtime runs on uniform "
            "pp x dp meshes only: use schedule gpipe or 1f1b, or the same replica count and equal shares for "
            "every stage"
        )
    if plan.num_rank_groups != plan.num_stages:
        raise InputError(
            f"the plan puts {plan.num_stages} stages on {plan.num_rank_groups} rank groups with {what}: such "
            "plans run one stage per rank group"
        )
    for s in plan.stages:
        if s.rank_group != s.index or list(s.ranks) != sorted(set(s.ranks)):
            raise InputError(
                f"stage {s.index} runs on rank group {s.rank_group}, ranks {list(s.ranks)}; with {what} it must run "
                f"on rank group {s.index}, on ascending ranks of its own: build the plan with partita.plan or "
                "partita.planning.manual.manual_plan"
            )
    used = sorted(r for s in plan.stages for r in s.ranks)
    if used != list(range(len(used))):
        missing = sorted(set(range(max(used) + 1)) - set(used))
        raise InputError(
            f"the stages run on ranks {used}, but a job's ranks are 0 .. {len(used) - 1}, each in one stage"
            + (f" (rank {missing[0]} runs no stage)" if missing else "")
            + ": build the plan with partita.plan or partita.planning.manual.manual_plan"
        )
    batch, m = plan.global_batch_size, plan.num_microbatches
    if batch % m:
        raise InputError(
            f"the global batch of {batch} samples does not split into {m} micro-batches of equal size: use a "
            f"global batch that is a multiple of num_microbatches ({m})"
        )
    for s in plan.stages:
        stage_shares(s, batch // m)
