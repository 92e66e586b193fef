"""One plan per job, checked: every rank compares a digest of what it will execute of its plan.

Ranks with different plans would create different process groups and hang, so ``check_same_plan``
runs before any group is made. The digest covers what the runtime executes (``plan_file.executed_part``),
never a plan's records (predicted times, versions), so plans made apart that agree on the job pass.
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist

from partita.errors import PlanFileError
from partita.types import Plan
from partita.types.plan_file import executed_part

__all__ = ["check_same_plan", "plan_digest"]


def plan_digest(plan: Plan) -> str:
    """sha256 of what the runtime executes of the plan (``plan_file.executed_part``: cuts, schedule,
    counts, ranks, recomputation, sharding, tensor parallelism, precision), not of its records
    (predicted times, versions, options): equal exactly when two ranks would run the same job."""
    text = json.dumps(executed_part(plan), sort_keys=True, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_same_plan(plan: Plan, group: dist.ProcessGroup | None = None) -> None:
    """PlanFileError on every rank unless every rank holds the same plan (one all-gather of digests)."""
    mine = (plan_digest(plan), _plan_summary(plan))
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    digests = {digest for digest, _ in gathered}
    if len(digests) == 1:
        return
    by_digest: dict[str, list[int]] = {}
    summaries = {}
    for rank, (digest, summary) in enumerate(gathered):
        by_digest.setdefault(digest, []).append(rank)
        summaries[digest] = summary
    listing = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: plan {digest[:12]} ({summaries[digest]})"
        for digest, ranks in by_digest.items()
    )
    raise PlanFileError(
        f"the ranks hold {len(digests)} different plans ({listing}). One plan per job: make it once, on rank 0, and "
        "give it to every rank: partita.plan does so by itself in a torchrun job, and partita.shared_plan(make_plan) "
        "does it for a planning function of your own; or save it once (plan.save('plan.json'), or `partita plan ... "
        "--out plan.json`) and load that same file on every rank (partita.Plan.load)"
    )


def _plan_summary(plan: Plan) -> str:
    replicas = sorted({s.num_replicas for s in plan.stages})
    return (
        f"{plan.num_stages} stages cut at nodes {list(plan.boundaries)}, {plan.schedule.value}, "
        f"{plan.num_microbatches} micro-batches, replicas {replicas[0] if len(replicas) == 1 else replicas}, "
        f"global batch {plan.global_batch_size}, {plan.num_devices} devices"
    )
