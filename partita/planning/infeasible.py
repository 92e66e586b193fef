"""What would fit when nothing does: the ``InfeasiblePlanError``, its binding constraint, verified fixes.

``partita.plan`` asks the memory bound (``partita.planning.memory_bound``) of every tensor-parallel
degree's context first and searches only the degrees it lets through, so a request that cannot
fit is answered in seconds, whatever the model's size. ``infeasible_error`` then says why
nothing fits and what would: each change it names (more devices, finer blocks, another
tensor-parallel degree or sharding level, unpinned recomputation or pipeline shape, a smaller
global batch, more memory per device, bf16, a lighter optimizer) is checked before it is named:

    the bound      re-run with the change applied lets the request through (the bound is below
                   every plan's memory, so what it refuses can never fit);
    the search     where searching is cheap (``_SEARCH_CHECKED_UNITS``, ``_SEARCH_CHECKED_WORK``),
                   or where the bound does not apply (measured costs) or already let the request
                   through: planning with the change finds a plan. Beyond the cheap ones, only
                   variants no larger than the largest degree's request searched (its devices
                   times blocks squared) are searched, and only while the checks have spent less than
                   ``_CHECKS_BUDGET_S`` or twice the failed search's time, whichever is more; a
                   variant the bound cannot answer (it let the request through, or does not
                   apply) is then not offered, and the error says how many went unchecked.
                   Finer blocks or more devices for a 1T GPT on 3,072 GPUs take minutes each to
                   plan (listing them took over 15 minutes), and the error must come first.

Options the search already tried (recomputation when not pinned, every sharding level, every
tensor-parallel degree) are never offered as fixes.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from partita.errors import InfeasiblePlanError
from partita.planning.build import module_range
from partita.planning.chain import block_costs
from partita.planning.configs import enumerate_configs
from partita.planning.context import PlanningContext
from partita.planning.driver import best_plan
from partita.planning.infeasible_variants import (
    max_blocks_of,
    memory_for_usable,
    valid_device_count,
    with_batch,
    with_blocks,
    with_degree,
    with_devices,
    with_memory,
    with_options,
    with_precision,
)
from partita.planning.memory_bound import BlockNeed, MemoryBound
from partita.planning.options import recompute_allowed
from partita.planning.search import spread_state_bytes
from partita.planning.tensor_parallel import DEGREES
from partita.planning.uneven import enumerate_shapes
from partita.types import OptimizerKind, Precision, Recompute, Schedule
from partita.units import fmt_bytes

__all__ = ["Fix", "has_shape", "infeasible_error", "memory_bound"]

# Fixes are also checked by planning with them when the search is cheap: at most this many devices
# (tensor-parallel groups), and this many devices times blocks of the chain.
_SEARCH_CHECKED_UNITS = 64
_SEARCH_CHECKED_WORK = 1024
# Seconds the checks may spend searching variants that are not cheap (at least; module docstring).
_CHECKS_BUDGET_S = 60.0
# The most devices (a multiple of today's) and memory a fix may ask for.
_MOST_DEVICES_FACTOR = 1024


@dataclass(frozen=True)
class Fix:
    """One change that lets a plan fit. ``changes`` maps what to change to its new value: a
    ``PlanOptions`` field (None: leave it unpinned, searched), ``num_devices`` or ``memory_bytes``
    (Cluster fields) or ``global_batch_size``; ``option`` and ``value`` are the first of them.
    ``checked_by``: "search" (planning with it found a plan) or "bound" (the memory bound, re-run
    with it, lets the request through; planning was too costly to try)."""

    changes: dict
    text: str
    checked_by: str

    @property
    def option(self) -> str:
        return next(iter(self.changes))

    @property
    def value(self) -> Any:
        return next(iter(self.changes.values()))


def memory_bound(ctx: PlanningContext) -> MemoryBound:
    """The memory bound of one planning context (``partita.planning.memory_bound``)."""
    return MemoryBound(ctx.graph, ctx.chain, ctx.costs_at, ctx.options)


def infeasible_error(
    contexts: Sequence[PlanningContext],
    bounds: Sequence[MemoryBound] | None = None,
    *,
    searched_s: float = 0.0,
    shapeless: bool = False,
) -> InfeasiblePlanError:
    """Why no context (one per tensor-parallel degree) has a plan, and what would fit, checked.
    ``searched_s``: seconds the search that found nothing took (the checks may spend twice as long).
    ``shapeless``: no context has a pipeline shape the pins allow (``has_shape``), so memory is not
    the cause.

    Attributes of the error: ``refused_by_bound`` (True: answered without searching),
    ``binding`` ("block", "pipeline", "search" or "pins": which constraint binds), ``fixes`` (``Fix``),
    ``min_devices`` and ``min_memory_bytes`` (the fewest devices and the least memory per device
    found to fit, None when not found)."""
    bounds = list(bounds) if bounds is not None else [memory_bound(c) for c in contexts]
    refused = all(b.applies and not b.may_fit() for b in bounds)
    checker = _Checker(list(contexts), bounds, refused, budget_s=max(_CHECKS_BUDGET_S, 2 * searched_s))
    # describe the degree with the most savings (the largest): the one closest to fitting
    ctx, bound = contexts[-1], bounds[-1]
    binding, cause = ("pins", _PINS_SENTENCE) if shapeless else _cause(ctx, bound, refused, checker)
    fixes = _fixes(checker)
    base = contexts[0]
    units = ", ".join(str(c.options.tensor_parallel) for c in contexts)
    degree_text = f"tensor-parallel degree {units}" if len(contexts) == 1 else f"tensor-parallel degrees {units}"
    head = (
        f"no plan {'of' if shapeless else 'fits'} {base.cluster.num_devices:,} device(s) with "
        f"{fmt_bytes(base.options.memory_limit_bytes)} usable each ({base.cluster.device.name}; "
        f"{base.graph.num_parameters:,} parameters, optimizer "
        f"{base.options.optimizer.value}, {base.options.precision.value}, {degree_text}, global batch "
        f"{base.options.global_batch_size})"
    )
    how = (
        "the pinned options allow no pipeline of these devices"
        if shapeless
        else "the memory bound refuses it without searching"
        if refused
        else "the search found no split that fits"
    )
    if fixes:
        advice = "would fit, each checked" + (
            " (by planning with it)"
            if all(f.checked_by == "search" for f in fixes)
            else " (by the memory bound re-run with it, as planning would take long here)"
            if all(f.checked_by == "bound" for f in fixes)
            else " (by planning with it, or by the bound: marked)"
        )
        mixed = len({f.checked_by for f in fixes}) > 1
        advice += ": " + "; ".join(f.text + (" [bound]" if mixed and f.checked_by == "bound" else "") for f in fixes)
    elif checker.unchecked:
        advice = (
            f"would fit is not known: {checker.unchecked} change(s) were not checked, since planning with them "
            "takes long here (larger than this request, or past the checks' time); try one at a time"
        )
    else:
        advice = "no single change checked here makes it fit (a smaller model, or several changes together)"
    err = InfeasiblePlanError(f"{head}: {how}. {cause[:1].upper()}{cause[1:]}. What {advice}")
    err.refused_by_bound, err.binding, err.fixes = refused, binding, tuple(fixes)
    err.min_devices = next((f.value for f in fixes if f.option == "num_devices"), None)
    err.min_memory_bytes = next((f.value for f in fixes if f.option == "memory_bytes"), None)
    return err


# ----------------------------------------------------------------------------- the cause

_PINS_SENTENCE = (
    "together they leave no pipeline shape to search, whatever the memory per device (a schedule of several "
    "stages per rank group needs 2 or more groups, a pinned sharding level 2 or more replicas in a group, "
    "1F1B as many micro-batches as stages, each pinned count its own devices)"
)


def has_shape(ctx: PlanningContext) -> bool:
    """Whether the context's options allow any pipeline shape to search, memory aside: a uniform
    config (``enumerate_configs``) or, where the replicas may differ, an uneven shape."""
    num_blocks = len(ctx.chain) - 1
    if next(enumerate_configs(ctx.options, num_blocks), None) is not None:
        return True
    return not ctx.options.uniform_replicas and next(enumerate_shapes(ctx.options, num_blocks), None) is not None


def _cause(ctx: PlanningContext, bound: MemoryBound, refused: bool, checker: _Checker) -> tuple[str, str]:
    """(binding constraint, its sentence) for ``ctx``."""
    limit, units = ctx.options.memory_limit_bytes, ctx.options.num_devices
    need = bound.largest_block_need(units) if bound.applies else None
    if need is not None and need.needed_bytes > limit:
        return "block", _block_sentence(ctx, need)
    if refused:
        return "pipeline", _pipeline_sentence(ctx, bound, need, checker.fewest_devices_by_bound)
    largest = f"; the largest block needs at least {fmt_bytes(need.needed_bytes)}" if need else ""
    return "search", (
        f"every split the search tried exceeds {fmt_bytes(limit)} on some device (the memory bound lets the "
        f"request through{largest}: what it cannot see, such as micro-batches in flight in deep pipelines, "
        "binds)"
    )


def _pipeline_sentence(ctx: PlanningContext, bound: MemoryBound, need: BlockNeed | None, fewest: int | None) -> str:
    """Every block fits somewhere, yet no pipeline does: at its deepest (one block per stage) the
    replicas per stage are fewest, so each replica runs the most samples and shards the least."""
    limit, units, t, k = (
        ctx.options.memory_limit_bytes,
        ctx.options.num_devices,
        ctx.options.tensor_parallel,
        bound.num_blocks,
    )
    largest = (
        f" (the neediest in its cheapest stage: {fmt_bytes(need.needed_bytes)} of {fmt_bytes(limit)})" if need else ""
    )
    text = f"every block fits a device in some stage{largest}, but no pipeline of stages that fit covers the model"
    deep = [r for r in bound.replica_counts(units) if r * k <= units]
    if deep:
        r = max(deep)
        needs = bound.needs_at(r)
        block = int(np.argmax(needs))
        chain = np.asarray(ctx.chain)
        name = module_range(ctx.graph, int(chain[block]), int(chain[block + 1]))
        text += (
            f": its most stages ({k}, one block each) leave {r} replica(s) per stage "
            f"({'groups of ' + str(t) + ' devices, ' if t > 1 else ''}{ctx.options.global_batch_size // r} samples "
            f"per replica per step), and then one block ({name}) needs at least {fmt_bytes(needs[block])}; fewer "
            "stages hold several blocks each"
        )
    devices = f"at least {fewest:,} devices" if fewest else f"over {_MOST_DEVICES_FACTOR}x the devices"
    return text + f". By the bound a plan needs {devices} here (interleaved 1F1B and ZB-V included)"


def _block_sentence(ctx: PlanningContext, need: BlockNeed) -> str:
    graph, chain, t = ctx.graph, np.asarray(ctx.chain), ctx.options.tensor_parallel
    start, stop = int(chain[need.block]), int(chain[need.block + 1])
    table = ctx.costs_at(1)
    held = table.params_in_range(start, stop)
    params = sum(int(table.param_bytes[p]) for p in held)
    trainable = sum(int(table.param_bytes[p]) for p in held if table.param_trainable[p])
    state = params + trainable * (1 + ctx.options.optimizer.states_per_parameter)
    split = f", on each device of a group of {t}: split {t} ways" if t > 1 else ""
    where = "as a stage of its own" if (need.start, need.stop) == (need.block, need.block + 1) else "in any stage"
    b = need.breakdown
    return (
        f"one block ({module_range(graph, start, stop)}, {fmt_bytes(state)} of parameters + gradients + optimizer "
        f"state{split}) needs at least {fmt_bytes(need.needed_bytes)} on a device, more than the "
        f"{fmt_bytes(ctx.options.memory_limit_bytes)} usable, even {where} with every saving the search has: "
        f"{need.replicas} replica(s) ({need.sharding.value}), {f'{need.recompute.value} recomputation' if need.recompute else 'no recomputation'}, "
        f"micro-batch 1 (parameters {fmt_bytes(b.params_bytes)}, gradients {fmt_bytes(b.grads_bytes)}, optimizer "
        f"{fmt_bytes(b.optimizer_bytes)}, activations {fmt_bytes(b.activations_bytes)}, buffers "
        f"{fmt_bytes(b.buffers_bytes)})"
    )


# ----------------------------------------------------------------------------- the fixes


def _fixes(checker: _Checker) -> list[Fix]:
    base = checker.contexts[0]
    o, cluster = base.options, base.cluster
    fixes: list[Fix] = []
    pinned_degree = base.resolved.get("tensor_parallel")
    if pinned_degree is not None:
        fixes += checker.other_degree(pinned_degree)
    if o.sharding is not None:  # full_shard too: a pinned level needs several replicas per rank group
        fixes += checker.option("sharding", None, f"unpin sharding={o.sharding.value!r} (the search tries every level)")
    if o.recompute in (Recompute.NONE, Recompute.SELECTIVE):
        fixes += checker.option(
            "recompute",
            None,
            f"unpin recompute={o.recompute.value!r} (each stage recomputes as much as it needs to fit, up to full)",
        )
    if not any(recompute_allowed(s) for s in o.schedules):
        fixes += checker.option(
            "schedules",
            (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B),
            "schedule '1f1b' or 'interleaved1f1b' with recomputation (ZBV never recomputes)",
            extra={"recompute": None},
        )
    elif set(o.schedules) != set(Schedule):
        fixes += checker.option("schedules", tuple(Schedule), "unpin schedules (every schedule searched)")
    for name in ("num_stages", "replicas", "num_microbatches"):
        if getattr(o, name) is not None and not base.graph.couples_samples:
            fixes += checker.option(name, None, f"unpin {name}={getattr(o, name)}")
    if checker.state_spreads:  # else neither finer blocks nor a smaller batch can make it fit
        fixes += checker.finer_blocks()
    fixes += checker.more_devices()
    fixes += checker.more_memory()
    if checker.state_spreads:
        fixes += checker.smaller_batch()
    if o.precision is Precision.FP32 and cluster.device.name != "cpu":
        fixes += checker.precision_bf16()
    if o.optimizer is OptimizerKind.ADAM:
        fixes += checker.option(
            "optimizer", OptimizerKind.SGD_MOMENTUM, "optimizer='sgd-momentum' (one state per parameter)"
        )
    return fixes


class _Checker:
    """Variants of the contexts with one change, and whether they fit (module docstring). Bounds
    of variants that keep a context's chain and costs reuse its tables."""

    def __init__(self, contexts: list[PlanningContext], bounds: list[MemoryBound], refused: bool, *, budget_s: float):
        self.contexts, self.bounds, self.refused = contexts, bounds, refused
        self._known = list(bounds)
        self._deadline = time.monotonic() + budget_s
        searched = [c for c, b in zip(contexts, bounds) if not b.applies or b.may_fit()]
        self._largest_work = max((_work(c) for c in searched), default=0)  # of the contexts searched
        self.unchecked = 0  # variants neither the bound nor a search within the budget could answer

    def bound(self, ctx: PlanningContext) -> MemoryBound:
        like = next((b for b in self._known if b.costs_at is ctx.costs_at and np.array_equal(b.chain, ctx.chain)), None)
        found = MemoryBound(ctx.graph, ctx.chain, ctx.costs_at, ctx.options, like=like)
        self._known.append(found)
        return found

    # -- checking

    def _verdict(self, make: Callable[[], PlanningContext | None], bound: Callable[[], tuple[bool, bool]]):
        """How a variant fits ("search", "bound") or None. ``bound()`` -> (whether the memory bound
        applies, whether it lets the variant through), asked only where its answer counts: a bound
        over a finer chain can take minutes itself."""
        variant = make()
        if variant is None:
            return None
        searchable = _cheap(variant) or (_work(variant) <= self._largest_work and time.monotonic() < self._deadline)
        if not searchable and not self.refused:  # the bound let the request through: it cannot tell
            self.unchecked += 1
            return None
        applies, lets_through = bound()
        if applies and not lets_through:
            return None
        if applies and self.refused and not _cheap(variant):
            return "bound"
        if not searchable:
            self.unchecked += 1
            return None
        return "search" if best_plan(variant, num_simulated=4) is not None else None

    def fits(self, variants: Sequence[PlanningContext | None]) -> str | None:
        """ "search" or "bound" when some variant fits (checked as the module docstring says), else None."""
        for variant in (v for v in variants if v is not None):

            def bound(v: PlanningContext = variant) -> tuple[bool, bool]:
                found = self.bound(v)
                return found.applies, not found.applies or found.may_fit()

            how = self._verdict(lambda v=variant: v, bound)
            if how:
                return how
        return None

    def fits_scaled(self, *, devices: int | None = None, usable: int | None = None) -> str | None:
        """``fits`` for more devices or memory: the contexts' own bounds answer at the new sizes."""
        for ctx, bound in zip(self.contexts, self.bounds):
            if devices is not None:
                make = lambda c=ctx: with_devices(c, devices)  # noqa: E731
                if make() is None:
                    continue
                units = devices // ctx.options.tensor_parallel
            else:
                make, units = (lambda c=ctx: with_memory(c, usable)), None  # noqa: E731
            answer = lambda b=bound, u=units: (b.applies, not b.applies or b.may_fit(u, usable))  # noqa: E731
            how = self._verdict(make, answer)
            if how:
                return how
        return None

    def option(self, name: str, value: Any, text: str, *, extra: dict | None = None) -> list[Fix]:
        changes = {name: value, **(extra or {})}
        how = self.fits([with_options(c, **changes) for c in self.contexts])
        return [Fix(changes, text, how)] if how else []

    @functools.cached_property
    def state_spreads(self) -> bool:
        """Whether in some context the whole model's parameters, gradients and optimizer state,
        spread over all its units at some replica count and sharded wherever that saves memory,
        fit a device (``search.spread_state_bytes``, the search's first check of every config).
        When not, nothing that keeps the model, units, memory, degree, precision and optimizer
        fits: the blocks and the batch change neither these totals nor that check."""
        for ctx in self.contexts:
            blocks = block_costs(ctx.costs_at(1), ctx.chain)
            k, units, o = blocks.num_blocks, ctx.options.num_devices, ctx.options
            params, trainable = int(blocks.param_bytes_matrix[0, k]), int(blocks.trainable_bytes_matrix[0, k])
            if any(
                spread_state_bytes(params, trainable, units // r, r, r > 1, o, foreach_step=blocks.foreach_step)
                <= o.memory_limit_bytes
                for r in range(1, units + 1)
            ):
                return True
        return False

    # -- fixes with a number

    def other_degree(self, pinned: int) -> list[Fix]:
        """The largest other degree that fits (the most saving: the likeliest to fit in full)."""
        base = self.contexts[0].unsharded or self.contexts[0]
        for degree in sorted((d for d in DEGREES if d != pinned), reverse=True):
            how = self.fits([with_degree(base, degree)])
            if how:
                text = f"tensor_parallel={degree} (or leave it unpinned: the search tries every degree)"
                return [Fix({"tensor_parallel": degree}, text, how)]
        return []

    def finer_blocks(self) -> list[Fix]:
        base = self.contexts[0]
        finest = int(np.count_nonzero(base.legal_cuts)) - 1
        current = max_blocks_of(base)
        candidates = [b for b in (current * 2, current * 4, current * 8) if b < finest] + [finest]
        for blocks in candidates:
            if blocks <= current:
                continue
            how = self.fits([with_blocks(c, blocks) for c in self.contexts])
            if how:
                return [Fix({"max_blocks": blocks}, f"max_blocks={blocks} (finer blocks; today {current})", how)]
        return []

    @functools.cached_property
    def fewest_devices_by_bound(self) -> int | None:
        found = [_fewest_devices(c, b) for c, b in zip(self.contexts, self.bounds)]
        found = [f for f in found if f is not None]
        return min(found) if found else None

    def more_devices(self) -> list[Fix]:
        base = self.contexts[0]
        start = self.fewest_devices_by_bound if self.refused else None
        valid = valid_device_count(base.cluster, max(c.options.tensor_parallel for c in self.contexts))
        start = start or valid(base.cluster.num_devices + 1)
        most = base.cluster.num_devices * _MOST_DEVICES_FACTOR
        fits = lambda n: self.fits_scaled(devices=n)  # noqa: E731
        unchecked = self.unchecked
        found = _smallest_fitting(fits, start, most, valid)
        if found is None:
            return []
        count, how = found
        nodes = -(-count // base.cluster.devices_per_node)
        if self.unchecked > unchecked:  # some smaller count went unchecked: not the least
            return [Fix({"num_devices": count}, f"use {count:,} devices ({nodes:,} node(s); fewer not checked)", how)]
        return [Fix({"num_devices": count}, f"use at least {count:,} devices ({nodes:,} node(s))", how)]

    def more_memory(self) -> list[Fix]:
        base = self.contexts[0]
        limits = [b.least_limit() for b in self.bounds] if self.refused else []
        start = min((x for x in limits if x), default=base.options.memory_limit_bytes + 1)
        fits = lambda b: self.fits_scaled(usable=b)  # noqa: E731
        unchecked = self.unchecked
        found = _smallest_fitting(fits, start, base.options.memory_limit_bytes * _MOST_DEVICES_FACTOR, None)
        if found is None:
            return []
        usable, how = found
        memory = memory_for_usable(base.cluster, usable)
        text = f"use devices with at least {fmt_bytes(memory)} ({memory} bytes) of memory"
        if self.unchecked > unchecked:  # some smaller size went unchecked: not the least
            text = f"use devices with {fmt_bytes(memory)} ({memory} bytes) of memory (less not checked)"
        return [Fix({"memory_bytes": memory}, text, how)]

    def smaller_batch(self) -> list[Fix]:
        base = self.contexts[0]
        batch, o = base.options.global_batch_size, base.options
        unit = (o.num_microbatches or 1) * (o.replicas or 1)
        candidate = batch // 2 // unit * unit
        while candidate >= unit and candidate > 0:
            how = self.fits([with_batch(c, candidate) for c in self.contexts])
            if how:
                return [Fix({"global_batch_size": candidate}, f"a global batch of {candidate} (today {batch})", how)]
            candidate = candidate // 2 // unit * unit
        return []

    def precision_bf16(self) -> list[Fix]:
        how = self.fits([with_precision(c) for c in self.contexts])
        return [Fix({"precision": Precision.BF16}, "precision='bf16' (half-size activations)", how)] if how else []


def _cheap(ctx: PlanningContext) -> bool:
    units = ctx.options.num_devices
    return units <= _SEARCH_CHECKED_UNITS and units * (len(ctx.chain) - 1) <= _SEARCH_CHECKED_WORK


def _work(ctx: PlanningContext) -> int:
    """What a search of ``ctx`` grows with: its configs grow with the devices (tensor-parallel
    groups), each config's stage costs are blocks x blocks matrices. 1T on 3,072 A100s, 1F1B and
    full_shard pinned, TP 8: 4.6 s at 130 blocks, 142 s at 257."""
    return ctx.options.num_devices * (len(ctx.chain) - 1) ** 2


def _smallest_fitting(fits: Callable[[int], str | None], start: int, most: int, valid) -> tuple[int, str] | None:
    """Smallest value from ``start`` (below which nothing fits) up to ``most`` for which ``fits``
    answers, and its answer: ``start`` itself, else doubling, then bisection to 1/256."""
    valid = valid or (lambda x: x)
    low, high = start - 1, valid(start)
    how = fits(high) if high <= most else None
    while how is None:
        low, high = high, valid(high * 2)
        if high > most:
            return None
        how = fits(high)
    while high - low > max(1, high // 256):
        mid = valid((low + high) // 2)
        if mid <= low or mid >= high:
            break
        answer = fits(mid)
        low, high, how = (low, mid, answer) if answer else (mid, high, how)
    return high, how


def _fewest_devices(ctx: PlanningContext, bound: MemoryBound) -> int | None:
    """The fewest devices (more than today's) with which ``bound`` lets ``ctx`` through."""
    t, cluster = ctx.options.tensor_parallel, ctx.cluster
    valid = valid_device_count(cluster, t)

    def valid_units(units: int, r: int) -> int | None:
        count = -(-units // r) * r
        for _ in range(cluster.devices_per_node + 1):
            devices = count * t
            if count > ctx.options.num_devices and valid(devices) == devices:
                return count
            count += r
        return None

    most = ctx.options.num_devices * _MOST_DEVICES_FACTOR
    units = bound.fewest_units(ctx.options.memory_limit_bytes, valid_units, most)
    return None if units is None else units * t
