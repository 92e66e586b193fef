"""Human-readable numbers and plain-text tables."""

from __future__ import annotations

from collections.abc import Sequence

from partita.units import counted, fmt_bytes, fmt_count, fmt_flops, fmt_seconds

__all__ = [
    "fmt_bytes",
    "fmt_count",
    "fmt_flops",
    "fmt_layout",
    "fmt_microbatches",
    "fmt_ranks",
    "fmt_replicas",
    "fmt_seconds",
    "fmt_sharding",
    "table",
]

_SHARDING_NAMES = {"replicate": "replicate", "shard_grads_and_optimizer": "grads+opt", "full_shard": "full"}


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, align: str | None = None) -> str:
    """A plain-text table; ``align`` has one 'l' or 'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(row, widths, align)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def fmt_sharding(level) -> str:
    """A sharding level in a table cell: 'replicate', 'grads+opt' (shard_grads_and_optimizer), 'full'."""
    value = getattr(level, "value", level)
    return _SHARDING_NAMES.get(value, value)


def fmt_replicas(plan) -> str:
    """Replicas per rank group: '4', or with uneven counts '2+1+4'."""
    counts = [s.num_replicas for s in plan.stages[: plan.num_rank_groups]]
    return str(counts[0]) if plan.uniform_replicas else "+".join(map(str, counts))


def fmt_layout(plan) -> str:
    """'4 rank groups x 2 replicas (8 devices)', with uneven replica counts '3 rank groups with
    2+1+4 replicas (7 devices)', with tensor parallelism '2 rank groups x 2 replicas x 2-way
    tensor parallel (8 devices)', and sequence parallelism '... x 2-way tensor + sequence parallel'
    (stages of different degrees: '1/2-way')."""
    joint = "x" if plan.uniform_replicas else "with"
    replicas = "replica" if plan.uniform_replicas and plan.stages[0].num_replicas == 1 else "replicas"
    degrees = sorted({s.tensor_parallel for s in plan.stages})
    t = "/".join(map(str, degrees))
    sequence = " + sequence" if any(getattr(s, "sequence_parallel", False) for s in plan.stages) else ""
    tensor_parallel = f" x {t}-way tensor{sequence} parallel" if degrees[-1] > 1 else ""
    return (
        f"{counted(plan.num_rank_groups, 'rank group')} {joint} {fmt_replicas(plan)} {replicas}{tensor_parallel} "
        f"({counted(plan.num_devices, 'device')})"
    )


def fmt_ranks(stage) -> str:
    """A stage's ranks in a table cell: '0,1,2', '0..7', or with tensor parallelism its
    replicas' groups '0-1,2-3' ('0-3,4-7..12-15' beyond four)."""
    t = stage.tensor_parallel
    if t == 1:
        return ",".join(map(str, stage.ranks)) if len(stage.ranks) <= 4 else f"{stage.ranks[0]}..{stage.ranks[-1]}"
    blocks = [f"{stage.ranks[j * t]}-{stage.ranks[j * t + t - 1]}" for j in range(stage.num_replicas)]
    return ",".join(blocks) if len(blocks) <= 4 else f"{blocks[0]},{blocks[1]}..{blocks[-1]}"


def fmt_microbatches(plan) -> str:
    """'8 micro-batches of 4 per replica', or with uneven replica counts '8 micro-batches of 8
    (4/8/2 per replica of each stage)'."""
    if plan.uniform_replicas:
        return f"{counted(plan.num_microbatches, 'micro-batch', 'micro-batches')} of {plan.microbatch_size} per replica"
    samples = plan.global_batch_size // plan.num_microbatches
    per_replica = "/".join(str(samples // s.num_replicas) for s in plan.stages)
    return f"{counted(plan.num_microbatches, 'micro-batch', 'micro-batches')} of {samples} ({per_replica} per replica of each stage)"
