"""Hill-climbing refinement of searched splits on the simulated step, with cheap bounds.

The DP (``partita.planning.search``) optimises a closed-form estimate of the step; ``refine``
moves stage boundaries by a block or two while the simulated step gets shorter, and
``BaselineSeeds`` also starts it from the baselines' splits, so that no baseline split beats the
refined plan under its config. ``split_bound`` bounds a split's step from prefix sums, so most
neighbours are rejected without simulating them; the rest are simulated without building their
Plans (``partita.planning.split_steps``), and only the neighbour each round keeps is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partita.cost.memory import microbatches_in_flight
from partita.cost.recompute import extra_backward_s
from partita.planning.baselines import baseline_splits, same_config
from partita.planning.build import block_to_node_boundaries, stage_tables
from partita.planning.configs import Candidate, Config
from partita.planning.context import PlanningContext
from partita.planning.plan_builder import cannot_beat, fit_with_recompute, plan_key, step_lower_bound_s
from partita.planning.sharding import accumulations, levels
from partita.planning.split_steps import SplitSteps
from partita.types import RECOMPUTE_LEVELS, Plan, Recompute

# A baseline's split whose step is at most this much above the best config's refined plan starts a
# refinement too (``BaselineSeeds``).
SEED_MARGIN = 0.05


class BaselineSeeds:
    """The baselines' splits under a config as extra starting points of the refinement.

    The DP's split and the hill-climb from it can end a few blocks away from a better split that a
    simple rule finds (equal FLOPs on Llama-7B). A baseline split (under ``same_config``) that
    beats the config's refined plan is refined too, from its boundaries snapped to the chain's
    blocks, so the plan is never slower than a baseline's split under its config
    (``baseline_plans``); for the best config (``margin``) also one within SEED_MARGIN of it: a
    hill-climb that starts a little behind can end ahead (Llama-7B on 24 A100-40GB: a seed 3%
    behind ended 0.6% ahead of the refined plan it did not beat at first). Only there: for every
    refined config it took 76B's search on 1,024 A100s from 14 to 25 s (64-stage ZB-V refinements).
    """

    def __init__(self, ctx: PlanningContext):
        self.ctx, self.splits = ctx, baseline_splits(ctx)

    def refined(self, config: Config, to_beat: Plan, *, margin: float = 0.0) -> list[Plan]:
        """The refinements of the baselines' splits under ``config`` that start at most ``margin``
        (a fraction) behind ``to_beat``; with none, only those that beat it."""
        same = same_config(config)
        found, limit = [], to_beat.predicted_step_s * (1 + margin)
        for boundaries in self.splits(same).values():
            if boundaries is None:
                continue
            seed = fit_with_recompute(
                self.ctx, same, boundaries, "partita", mode=same.recompute_mode, step_to_beat=limit
            )
            if seed is None:
                continue
            ahead = plan_key(seed) < plan_key(to_beat)
            if ahead or (margin > 0 and seed.predicted_step_s <= limit and plan_key(seed) != plan_key(to_beat)):
                start = Candidate(same, nearest_blocks(self.ctx.chain, boundaries), (), 0.0)
                found.append(refine(self.ctx, start, seed))
        return found


def nearest_blocks(chain: Sequence[int], node_boundaries: Sequence[int]) -> tuple[int, ...]:
    """Block boundaries nearest to ``node_boundaries`` (first 0, last K, strictly increasing)."""
    positions = np.asarray(chain)
    num_blocks, num_stages = len(positions) - 1, len(node_boundaries) - 1
    blocks = [0]
    for s, node in enumerate(node_boundaries[1:-1], start=1):
        low, high = blocks[-1] + 1, num_blocks - (num_stages - s)
        b = int(np.clip(np.searchsorted(positions, node), low, high))
        if b - 1 >= low and abs(positions[b - 1] - node) <= abs(positions[b] - node):
            b -= 1
        blocks.append(b)
    blocks.append(num_blocks)
    return tuple(blocks)


def neighbours(boundaries: list[int]) -> list[list[int]]:
    """Splits one move away: one inner boundary by 1 or 2 blocks, or a whole stage shifted by 1."""
    found = []
    inner = range(1, len(boundaries) - 1)
    moves = [((s,), d) for s in inner for d in (-2, -1, 1, 2)]
    moves += [((s, s + 1), d) for s in inner if s + 1 < len(boundaries) - 1 for d in (-1, 1)]
    for positions, delta in moves:
        moved = list(boundaries)
        for s in positions:
            moved[s] += delta
        if all(a < b for a, b in zip(moved, moved[1:])):
            found.append(moved)
    return found


def refine(ctx: PlanningContext, candidate: Candidate, start: Plan, *, max_rounds: int = 20) -> Plan:
    """Hill-climb on the simulated step: move a stage boundary by one or two blocks (or shift a
    whole stage) while that makes the step shorter. The DP optimises a closed-form estimate; this fixes what the
    estimate misses (transfers, all-reduce tails, the schedule's real order).

    Each round takes the best neighbour (steepest descent), trying them from the lowest bound on
    their step up, in chunks simulated side by side (``partita.planning.split_steps``, without
    building a Plan for each), until a bound shows that no neighbour left can beat the best
    found: neighbours not tried cannot be the best, so the chunks change how fast, not which
    neighbour wins."""
    config, best = candidate.config, start
    boundaries = list(candidate.boundaries)
    quick_bound = split_bound(ctx, config)
    steps = SplitSteps(ctx, config)
    # Splits tried in earlier rounds: (plan key, Fitted), or None when they do not fit. Steps only
    # improve, so a split that could not beat the step of then cannot beat a later one either.
    tried: dict[tuple[int, ...], tuple | None] = {}
    for _ in range(max_rounds):
        moves = neighbours(boundaries)
        splits = [block_to_node_boundaries(ctx.chain, moved) for moved in moves]
        bounds = quick_bound.neighbours(block_to_node_boundaries(ctx.chain, boundaries), splits)
        ranked = list(zip(bounds, moves, splits))
        ranked.sort(key=lambda item: (item[0], item[1]))  # most promising first: the step to beat drops fast
        step = _best_neighbour(steps, ranked, best, tried)
        if step is None:
            return best
        best, boundaries = step
    return best


# Neighbours tried side by side: the first chunk, and how much each next chunk grows.
_FIRST_CHUNK, _CHUNK_GROWTH = 64, 2


def _best_neighbour(steps: SplitSteps, ranked: list, best: Plan, tried: dict):
    """(plan, block boundaries) of the best neighbour of ``ranked`` ((bound, block boundaries,
    node boundaries), by bound) that beats ``best``; None when none does."""
    found = None  # (plan key, block boundaries, node boundaries, Fitted): the best neighbour so far
    chunk, position = _FIRST_CHUNK, 0
    while position < len(ranked):
        to_beat = found[3].result.step_s if found else best.predicted_step_s
        batch = []
        for bound, moved, nodes in ranked[position : position + chunk]:
            if cannot_beat(bound, to_beat):
                position = len(ranked)  # does not fit or cannot be faster, nor can any later one
                break
            batch.append((moved, nodes))
        else:
            position += chunk
        _try_all(steps, [(m, n) for m, n in batch if tuple(m) not in tried], tried)
        for moved, nodes in batch:
            trial = tried[tuple(moved)]
            if trial is not None and trial[0] < (found[0] if found else plan_key(best)):
                found = (trial[0], moved, nodes, trial[1])
        chunk *= _CHUNK_GROWTH
    return None if found is None else (steps.plan(found[2], found[3]), found[1])


def _try_all(steps: SplitSteps, splits: list, tried: dict) -> None:
    """Simulate each split (block boundaries, node boundaries) that fits, side by side; into
    ``tried`` (its plan key and ``Fitted``, or None)."""
    for (moved, nodes), fitted in zip(splits, steps.fitted([nodes for _, nodes in splits])):
        tried[tuple(moved)] = None if fitted is None else (steps.key(nodes, fitted), fitted)


def split_bound(ctx: PlanningContext, config) -> SplitBound:
    """``bound(node_boundaries)``: a step no plan of ``config`` with that split beats (``SplitBound``)."""
    return SplitBound(ctx, config)


class SplitBound:
    """``bound(node_boundaries)``: a step no plan of ``config`` with that split beats (inf: it does not fit).

    Cheap next to building the plan: prefix sums for the stage times, and with one stage per rank
    group the memory of each stage range (remembered: neighbouring splits share most stages),
    which decides, as ``fit_with_recompute`` does, the stages that recompute (at the least level
    with which they fit) and whether it fits. Otherwise stages recompute only when the config or
    the options say so (never more than the plan).
    ``neighbours`` bounds many splits near one at once.
    """

    def __init__(self, ctx: PlanningContext, config):
        self.config, self.options, self.memo = config, ctx.options, ctx.build_memo
        self.tables = tables = stage_tables(ctx.costs_at, config)
        prefix = {}  # id(table) -> (forward, forward + backward, selectively recomputed) prefix sums
        for t in tables:
            if id(t) not in prefix:
                prefix[id(t)] = (
                    np.concatenate([[0.0], np.cumsum(np.asarray(t.forward_s, dtype=np.float64))]),
                    np.concatenate([[0.0], np.cumsum(np.asarray(t.forward_s) + np.asarray(t.backward_s))]),
                    np.concatenate([[0.0], np.cumsum(np.asarray(t.selective_recompute_s, dtype=np.float64))]),
                )
        self.forward = [prefix[id(t)][0] for t in tables]
        self.compute = [prefix[id(t)][1] for t in tables]
        self.selective = [prefix[id(t)][2] for t in tables]
        self.mode = ctx.options.recompute if config.recompute_mode is None else config.recompute_mode
        self.in_flight = [
            microbatches_in_flight(
                config.schedule, config.num_microbatches, config.num_rank_groups, g, config.virtual_stages
            )
            for g in range(config.num_rank_groups)
        ]
        self._fits: dict[tuple, bool] = {}
        self._terms: dict[tuple, float] = {}

    def fits(self, start: int, stop: int, stage: int, recompute: Recompute) -> bool:
        """Whether some sharding level (and accumulation) the stage may take fits (``rank_group_memory`` picks it;
        the memories are the plans' own, ``BuildMemo.device_memory``)."""
        key = (start, stop, stage, recompute)
        if key not in self._fits:
            config, options = self.config, self.options
            replicas, m = config.replicas_of(stage), config.num_microbatches
            self._fits[key] = any(
                self.memo.device_memory(
                    self.tables[stage],
                    ((start, stop),),
                    in_flight=self.in_flight[stage],
                    recompute=recompute,
                    level=level,
                    replicas=replicas,
                    num_microbatches=m,
                    options=options,
                    accumulation=acc,
                ).total_bytes
                <= options.memory_limit_bytes
                for level in levels(options.sharding, replicas)
                for acc in accumulations(level, replicas, m)
            )
        return self._fits[key]

    def __call__(self, nodes: Sequence[int]) -> float:
        config, mode, compute, forward = self.config, self.mode, self.compute, self.forward
        stages = [(nodes[s], nodes[s + 1]) for s in range(config.num_stages)]
        if mode is not None or config.virtual_stages != 1:
            recompute = [mode or Recompute.NONE] * config.num_stages
        else:
            recompute = [self._least_level(a, b, s) for s, (a, b) in enumerate(stages)]
            if any(r is None for r in recompute):
                return float("inf")
        return step_lower_bound_s(
            config,
            [
                compute[s][b] - compute[s][a] + self._extra_s(s, a, b, r)
                for s, ((a, b), r) in enumerate(zip(stages, recompute))
            ],
            [forward[s][b] - forward[s][a] for s, (a, b) in enumerate(stages)],
        )

    def _least_level(self, start: int, stop: int, stage: int) -> Recompute | None:
        """The least recomputation level with which the stage fits (None: none does)."""
        return next((level for level in RECOMPUTE_LEVELS if self.fits(start, stop, stage, level)), None)

    def _extra_s(self, stage: int, start: int, stop: int, level: Recompute) -> float:
        """Seconds ``level`` adds to the stage's backward per micro-batch."""
        forward, selective = self.forward[stage], self.selective[stage]
        return float(extra_backward_s(level, forward[stop] - forward[start], selective[stop] - selective[start]))

    def neighbours(self, nodes: Sequence[int], splits: Sequence[Sequence[int]]) -> list[float]:
        """``[self(split) for split in splits]`` for splits that differ from ``nodes`` in a few
        stages: with one stage per rank group, only the changed stages' loads are looked up, and
        ``step_lower_bound_s``'s running sums run over all splits at once (the same sums)."""
        if self.config.virtual_stages != 1 or not splits:
            return [self(split) for split in splits]
        num_stages = self.config.num_stages
        loads = np.tile([self._load(s, nodes[s], nodes[s + 1]) for s in range(num_stages)], (len(splits), 1))
        moved, here = np.asarray(splits), np.asarray(nodes)
        changed = (moved[:, :-1] != here[:-1]) | (moved[:, 1:] != here[1:])
        for i, s in zip(*np.nonzero(changed)):
            loads[i, s] = self._load(int(s), int(moved[i, s]), int(moved[i, s + 1]))
        before = np.zeros_like(loads)  # the loads of the stages before, added in stage order
        before[:, 1:] = np.cumsum(loads[:, :-1], axis=1)
        return np.maximum(0.0, (before + self.config.num_microbatches * loads).max(axis=1)).tolist()

    def _load(self, stage: int, start: int, stop: int) -> float:
        """F + B of one stage (with its recomputed forward), inf when it fits in no way (one stage per group)."""
        key = (stage, start, stop)
        if key not in self._terms:
            level = self.mode or Recompute.NONE
            if self.mode is None:
                level = self._least_level(start, stop, stage)
                if level is None:
                    self._terms[key] = float("inf")
                    return self._terms[key]
            compute = self.compute[stage]
            self._terms[key] = compute[stop] - compute[start] + self._extra_s(stage, start, stop, level)
        return self._terms[key]
