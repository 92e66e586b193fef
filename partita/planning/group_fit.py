"""Moving stage boundaries until every rank group of an interleaved or ZB-V split fits.

The search checks each stage's memory alone (``partita.planning.search.StageCosts``): it cannot
see a rank group's stages together, which with v stages per group (interleaved 1F1B: stages g,
g + G, ...; ZB-V: g and 2G - 1 - g) are far apart in the chain. Its best splits then often
overfill a group that the plan's exact check (``partita.planning.build.rank_group_memory``)
rejects, although a split a few blocks away fits: on Llama-7B on 16 A100s at 32 GiB, ZB-V's group
0 holds the embedding and first layers with the last layers and the 32000-word head, and every
split the search proposed for 16 groups overfilled it by up to 17%; the plan that gives the head
a stage of its own fits and was 5% faster than the best plan found.

``fitting_split`` moves one inner boundary at a time by one or two blocks, each move the one that
most reduces the sum of the squared overflows of the rank groups (the exact memories of the
plans: ``BuildMemo.device_memory``), ties going to the smallest busiest-group load, until every
group fits or no move reduces that sum. Squares let an overflow travel over full groups to
groups with room: a move that hands part of one group's overflow to a neighbour reduces them.
Only boundaries of a group that overflows move (a move between two groups that fit cannot reduce
the sum). It gives up as soon as the groups overflow by more than the others have left: a move
hands a block's bytes from one group to another, changing their total only by the difference of
the two groups' activations in flight, and such splits were never repaired where it was tried (the
175B row of bench/plan_time.py: the 84 repairs that failed took 0.2 s each on average and up to
40 rounds; the 10 that succeeded all started with more room left than overflow).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from partita.planning.build import block_to_node_boundaries, group_levels, groups_sharing_parameters, stage_tables
from partita.planning.configs import Candidate
from partita.planning.context import PlanningContext
from partita.types import Recompute

MOVES = (-2, -1, 1, 2)  # blocks one inner boundary moves by


def fitting_candidate(ctx: PlanningContext, candidate: Candidate) -> Candidate | None:
    """``candidate`` with its split moved until every rank group fits (``fitting_split``), its
    estimate kept (the simulation ranks plans); None when it has one stage per group, already
    fits, or no split reached that way fits."""
    if candidate.config.virtual_stages == 1:
        return None
    split = GroupFit(ctx, candidate).fitting_split()
    return None if split is None or split == candidate.boundaries else dataclasses.replace(candidate, boundaries=split)


class GroupFit:
    """The rank groups' memory under the splits near one candidate's (its config and recomputation)."""

    def __init__(self, ctx: PlanningContext, candidate: Candidate):
        config = candidate.config
        self.ctx, self.config, self.boundaries = ctx, config, tuple(candidate.boundaries)
        self.tables = stage_tables(ctx.costs_at, config)
        self.group_of = [config.rank_group_of(s) for s in range(config.num_stages)]
        self.stages_of = [
            [s for s, g in enumerate(self.group_of) if g == group] for group in range(config.num_rank_groups)
        ]
        recompute = candidate.recompute or (Recompute.NONE,) * config.num_stages
        self.recompute = [Recompute.most([recompute[s] for s in stages]) for stages in self.stages_of]
        _, self.per_group = ctx.build_memo.layout(config, ctx.options, None)
        nodes = block_to_node_boundaries(ctx.chain, self.boundaries)
        ranges = {g: [(nodes[s], nodes[s + 1]) for s in stages] for g, stages in enumerate(self.stages_of)}
        # which groups replicate for tied weights, as in the starting split (moves of a block or two
        # rarely change it; the plan's exact check decides in the end)
        self.shared = groups_sharing_parameters(self.tables, ranges, ctx.build_memo)
        self.work = np.concatenate([[0.0], np.cumsum(self._block_work())])
        self._bytes: dict[tuple, int] = {}

    def _block_work(self) -> np.ndarray:
        """F + B of each block at the first stage's micro-batch size (the loads' tie-break)."""
        table, chain = self.tables[0], np.asarray(self.ctx.chain)
        compute = np.concatenate([[0.0], np.cumsum(np.asarray(table.forward_s) + np.asarray(table.backward_s))])
        return np.diff(compute[chain])

    def group_bytes(self, group: int, boundaries: Sequence[int]) -> int:
        """The least memory any level the group may take needs, its stages at ``boundaries``."""
        ranges = tuple(
            (int(self.ctx.chain[boundaries[s]]), int(self.ctx.chain[boundaries[s + 1]])) for s in self.stages_of[group]
        )
        key = (group, ranges)
        if key not in self._bytes:
            in_flight, replicas, _ = self.per_group[group]
            allowed = group_levels(self.ctx.options, replicas, shares_parameters=group in self.shared)
            self._bytes[key] = min(
                int(
                    self.ctx.build_memo.device_memory(
                        self.tables[self.stages_of[group][0]],
                        ranges,
                        in_flight=in_flight,
                        recompute=self.recompute[group],
                        level=level,
                        replicas=replicas,
                        num_microbatches=self.config.num_microbatches,
                        options=self.ctx.options,
                    ).total_bytes
                )
                for level in allowed
            )
        return self._bytes[key]

    def overflow(self, group: int, boundaries: Sequence[int]) -> float:
        """GiB the group's memory exceeds the limit by (0 when it fits)."""
        return max(0, self.group_bytes(group, boundaries) - self.ctx.options.memory_limit_bytes) / 2**30

    def slack(self, boundaries: Sequence[int]) -> float:
        """GiB the groups that fit have left, together."""
        limit = self.ctx.options.memory_limit_bytes
        return sum(max(0, limit - self.group_bytes(g, boundaries)) for g in range(self.config.num_rank_groups)) / 2**30

    def busiest_load(self, boundaries: Sequence[int]) -> float:
        loads = np.zeros(self.config.num_rank_groups)
        for s, g in enumerate(self.group_of):
            loads[g] += self.work[boundaries[s + 1]] - self.work[boundaries[s]]
        return float(loads.max())

    def fitting_split(self) -> tuple[int, ...] | None:
        """Block boundaries near the candidate's whose every rank group fits (module docstring),
        or None when the moves stop short of that."""
        split = list(self.boundaries)
        over = [self.overflow(g, split) for g in range(self.config.num_rank_groups)]
        for _ in range(4 * (len(split) - 1) * max(MOVES)):  # a bound: each round lowers the overflow
            if not any(over):
                return tuple(split)
            if sum(over) > self.slack(split):
                return None
            best = None
            for s in range(1, len(split) - 1):
                if not (over[self.group_of[s - 1]] or over[self.group_of[s]]):
                    continue  # a move between two groups that fit cannot reduce the overflow
                for delta in MOVES:
                    moved = split[s] + delta
                    if not split[s - 1] < moved < split[s + 1]:
                        continue
                    trial = split[:s] + [moved] + split[s + 1 :]
                    changed = {self.group_of[s - 1], self.group_of[s]}
                    trial_over = [self.overflow(g, trial) if g in changed else o for g, o in enumerate(over)]
                    key = (sum(o * o for o in trial_over), self.busiest_load(trial))
                    if best is None or key < best[0]:
                        best = (key, trial, trial_over)
            if best is None or best[0][0] >= sum(o * o for o in over):
                return None
            _, split, over = best
        return tuple(split) if not any(over) else None
