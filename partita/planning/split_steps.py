"""Simulated steps of many splits of one config, without building a Plan for each.

The refinement (``partita.planning.refine``) tries thousands of splits that differ from the one it
stands on by a stage boundary or two, and keeps one per round. Building each as a Plan (names,
module ranges, memory breakdowns of every stage) cost more than simulating it. ``SplitSteps``
takes what the simulation needs from the same functions the Plan would: the memory and sharding
level of each rank group (``build.rank_group_memory``), recomputation where a rank group does not
fit without it, at the least level with which it fits (as ``plan_builder.fitting_draft`` decides it) and the simulator's inputs of each stage
(``simulate.stages_pipeline_inputs``), so the step it gives a split is the step of that split's
Plan, bit for bit (tests/unit/test_split_steps.py); ``plan`` builds the Plan of the split kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from partita.planning.build import fewest_recomputed_blocks, group_ranges, rank_group_memory, stage_tables
from partita.planning.context import PlanningContext
from partita.planning.plan_builder import draft_plan, routable, with_result
from partita.planning.simulate import stages_pipeline_inputs
from partita.planning.simulate_batch import simulate_pipelines
from partita.types import RECOMPUTE_LEVELS, Accumulation, Plan, Recompute, Sharding, SimResult
from partita.types.schedule_orders import stage_rank_groups


class _Stage(NamedTuple):
    """What the simulator's inputs read of a StagePlan (``simulate.SimulatedStage``)."""

    start: int
    stop: int
    recompute: Recompute
    sharding: Sharding
    ranks: tuple[int, ...]
    num_replicas: int
    tensor_parallel: int
    accumulation: Accumulation = Accumulation.WHOLE
    recompute_blocks: int | None = None  # the refinement recomputes whole stages


class Fitted(NamedTuple):
    """A split that fits: its recomputation per stage and its simulated step."""

    recompute: tuple[Recompute, ...]
    result: SimResult


class SplitSteps:
    """The simulated steps of splits (node boundaries) of ``config`` in ``ctx`` (see the module docstring)."""

    def __init__(self, ctx: PlanningContext, config):
        self.ctx, self.config = ctx, config
        self.tables = stage_tables(ctx.costs_at, config)
        self.ranks = ctx.build_memo.layout(config, ctx.options, ctx.cluster)[0]
        self.groups = stage_rank_groups(config.schedule, config.num_rank_groups, config.num_stages)
        self.num_devices = len(set().union(*self.ranks))
        self.optimizer = ctx.resolved.get("optimizer", "adam")

    def fitted(self, splits: Sequence[Sequence[int]]) -> list[Fitted | None]:
        """Each split's recomputation and simulated step (the splits of one config run side by
        side, ``simulate_batch``); None where it does not fit (or cannot be routed)."""
        layouts = [self._fitting(nodes) for nodes in splits]
        inputs = [
            stages_pipeline_inputs(
                stages,
                self.tables,
                self.groups,
                self.config.schedule,
                self.config.num_microbatches,
                self.ctx.options.precision,
                self.optimizer,
                self.ctx.cluster,
                self.ctx.build_memo,
            )
            for _, stages in filter(None, layouts)
        ]
        results = iter(simulate_pipelines(inputs, activation_peaks=False))
        return [None if layout is None else Fitted(layout[0], next(results)) for layout in layouts]

    def key(self, nodes: Sequence[int], fitted: Fitted) -> tuple:
        """``plan_builder.plan_key`` of the split's Plan."""
        return (round(fitted.result.step_s, 12), self.num_devices, tuple(int(x) for x in nodes))

    def plan(self, nodes: Sequence[int], fitted: Fitted) -> Plan:
        """The split's Plan, with its simulated step."""
        return with_result(
            draft_plan(self.ctx, self.config, list(nodes), list(fitted.recompute), "partita"), fitted.result
        )

    def _fitting(self, nodes: Sequence[int]) -> tuple[tuple[Recompute, ...], list[_Stage]] | None:
        """(recompute per stage, the stages) of the split as ``fitting_draft`` builds it: every
        stage recomputes as pinned, or else those of rank groups that do not fit without, at the
        least level with which they fit; None when it does not fit."""
        ctx, config = self.ctx, self.config
        if not routable(ctx, config, nodes):
            return None
        pinned = ctx.options.recompute if config.recompute_mode is None else config.recompute_mode
        limit = ctx.options.memory_limit_bytes
        recompute = [pinned or Recompute.NONE] * config.num_stages
        memory, by_group = self._memory(nodes, recompute)
        if any(m.total_bytes > limit for m in memory.values()):
            if pinned is not None:
                return None
            for level in RECOMPUTE_LEVELS[1:]:
                recompute = [
                    Recompute.most([r, level]) if memory[g].total_bytes > limit else r
                    for g, r in zip(self.groups, recompute)
                ]
                memory, by_group = self._memory(nodes, recompute)
                if all(m.total_bytes <= limit for m in memory.values()):
                    break
            else:
                return None
        t = ctx.options.tensor_parallel
        per_group = ctx.build_memo.layout(self.config, ctx.options, ctx.cluster)[1]
        alone = len(self.groups) == len(set(self.groups))  # one stage per rank group: some blocks may recompute
        partial = {
            g: fewest_recomputed_blocks(
                self.tables[g],
                (int(nodes[s]), int(nodes[s + 1])),
                by_group[g],
                memory[g],
                per_group[g][:2],
                self.config,
                ctx.options,
                ctx.build_memo,
            )
            if alone
            else None
            for s, g in enumerate(self.groups)
        }
        stages = [
            _Stage(
                int(nodes[s]),
                int(nodes[s + 1]),
                by_group[g],
                memory[g].level,
                self.ranks[g],
                len(self.ranks[g]) // t,
                t,
                memory[g].accumulation,
                None if partial[g] is None else partial[g][0],
            )
            for s, g in enumerate(self.groups)
        ]
        return tuple(by_group[g] for g in self.groups), stages

    def _memory(self, nodes: Sequence[int], recompute: Sequence[Recompute]) -> tuple[dict, dict[int, Recompute]]:
        """``rank_group_memory`` of the split, as ``build_plan`` asks for it, and each rank group's
        recomputation level."""
        ctx = self.ctx
        ranges, by_group = group_ranges(self.config, nodes, recompute)
        memory = rank_group_memory(self.tables, self.config, ctx.options, ranges, by_group, ctx.cluster, ctx.build_memo)
        return memory, by_group
