"""Pipeline schedules and their simulator: torch's orders, classic formulas, comm, memory peaks.

Orders are compared with torch 2.13's own schedule objects, built on fake stages (no process
group): GPipe and 1F1B by running their ``_step_microbatches`` with a stage that records what it
computes (the order the runtime executes), interleaved 1F1B and ZBV by their ``pipeline_order``.
"""

import itertools
import random

import numpy as np
import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from partita.cost import comm
from partita.cost.memory import microbatches_in_flight
from partita.errors import InputError
from partita.planning.simulate import simulate
from partita.planning.simulator import KIND_CODES, compiled_orders, peak_activations, simulate_pipeline
from partita.report.timeline import timeline_text
from partita.types import CostTable, Plan, Schedule, StagePlan
from partita.types.cluster import Cluster
from partita.types.schedule_orders import Action, rank_orders, stage_rank_groups

GPIPE, ONE_F_ONE_B, INTERLEAVED, ZBV = Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B, Schedule.ZBV


# ----------------------------------------------------------------------------- torch's orders


class FakeStage:
    """What torch's schedule constructors read from a stage, and a log of what the runtime computes."""

    def __init__(self, stage_index, num_stages, group_size, group_rank):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.group_size, self.group_rank = group_size, group_rank
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.submod, self.output_chunks, self.log = None, [], []

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(f"{self.stage_index}F{i}")

    def backward_one_chunk(self, i, loss=None, last_backward=False):
        self.log.append(f"{self.stage_index}B{i}")

    def perform_reduce_grad(self, scale):
        pass

    def clear_runtime_states(self):
        pass


def torch_executed_single(cls, g, m, rank):
    """Run a single-stage torch schedule's step loop on a recording stage: the executed order."""
    stage = FakeStage(rank, g, g, rank)
    schedule = cls(stage, m)
    schedule._initialize_stage = lambda *args, **kwargs: None
    schedule._step_microbatches([()] * m, [{}] * m, None, None)
    return stage.log


def torch_pipeline_order(schedule, g, m, v):
    """torch's compute actions per rank for the multi-stage schedules."""
    n, out = g * v, []
    for r in range(g):
        if schedule is ZBV:
            obj = torch_schedules.ScheduleZBVZeroBubble([FakeStage(i, n, g, r) for i in (r, n - 1 - r)], m)
        else:
            obj = torch_schedules.ScheduleInterleaved1F1B([FakeStage(r + k * g, n, g, r) for k in range(v)], m)
        out.append([str(a) for a in obj.pipeline_order[r] if a is not None])
    return out


def ours(schedule, g, m, v):
    return [[str(a) for a in order] for order in rank_orders(schedule, m, g, g * v)]


@pytest.mark.parametrize("g,m", [(1, 3), (2, 2), (2, 5), (4, 4), (4, 9), (5, 12)])
@pytest.mark.parametrize(
    "schedule,cls", [(GPIPE, torch_schedules.ScheduleGPipe), (ONE_F_ONE_B, torch_schedules.Schedule1F1B)]
)
def test_single_stage_orders_match_what_torch_executes(schedule, cls, g, m):
    assert ours(schedule, g, m, 1) == [torch_executed_single(cls, g, m, r) for r in range(g)]


def test_1f1b_matches_torch_pipeline_order_except_its_last_rank():
    """Schedule1F1B.pipeline_order (an IR, not executed) numbers the last rank's forwards from 1 in
    torch 2.13 (``1F1 1B0 1F2 ...``); its ``_step_microbatches`` runs F0 B0 F1 B1 as we do."""
    g, m = 4, 7
    for r in range(g):
        ir = torch_schedules.Schedule1F1B(FakeStage(r, g, g, r), m).pipeline_order[r]
        ir = [str(a) for a in ir if a is not None and a.computation_type.value in "FB"]
        assert (ir == ours(ONE_F_ONE_B, g, m, 1)[r]) == (r < g - 1)


@pytest.mark.parametrize(
    "g,m", [(1, 2), (2, 2), (2, 4), (3, 6), (4, 4), (4, 8), (4, 12), (4, 3), (4, 6), (4, 10), (8, 16)]
)
@pytest.mark.parametrize("schedule,v", [(INTERLEAVED, 2), (INTERLEAVED, 3), (ZBV, 2)])
def test_multi_stage_orders_match_torch_pipeline_order(schedule, v, g, m):
    assert ours(schedule, g, m, v) == torch_pipeline_order(schedule, g, m, v)


@pytest.mark.parametrize("g,m", [(4, 9), (3, 7), (8, 17), (4, 13)])
def test_interleaved_rejects_what_torch_rejects(g, m):
    """torch 2.13 needs m % max(1, m // G) == 0: it accepts m < G, 6 on 4 and 10 on 4, rejects 9 on 4."""
    with pytest.raises(ValueError):
        torch_pipeline_order(INTERLEAVED, g, m, 2)
    with pytest.raises(ValueError, match=f"got {m} micro-batches on {g} rank groups: use a multiple of {g}"):
        rank_orders(INTERLEAVED, m, g, 2 * g)


def test_other_configurations_torch_cannot_run_raise():
    with pytest.raises(ValueError, match="got 3 micro-batches for 4 stages: use >= 4 micro-batches or gpipe"):
        rank_orders(ONE_F_ONE_B, 3, 4)  # torch's Schedule1F1B: m >= S
    with pytest.raises(ValueError, match="2 stages per rank group, got 6 stages.*use 8 stages"):
        rank_orders(ZBV, 8, 4, 6)
    with pytest.raises(ValueError, match="one stage per rank group, got 8 stages.*use interleaved1f1b"):
        rank_orders(GPIPE, 8, 4, 8)


def test_action_prints_and_parses_like_torch():
    assert str(Action(2, 0, "F")) == "2F0" and Action.parse("12W31") == Action(12, 31, "W")
    assert stage_rank_groups(ZBV, 3, 6) == (0, 1, 2, 2, 1, 0)
    assert stage_rank_groups(INTERLEAVED, 3, 6) == (0, 1, 2, 0, 1, 2)


CONFIGS = [
    (GPIPE, 3, 1, 5),
    (ONE_F_ONE_B, 4, 1, 6),
    (INTERLEAVED, 4, 2, 8),
    (INTERLEAVED, 2, 3, 6),
    (INTERLEAVED, 4, 2, 3),
    (ZBV, 3, 2, 7),
    (ZBV, 4, 2, 2),
]


@pytest.mark.parametrize("schedule,g,v,m", CONFIGS)
def test_every_stage_runs_each_microbatch_once_on_its_rank_group(schedule, g, v, m):
    orders = rank_orders(schedule, m, g, g * v)
    groups = stage_rank_groups(schedule, g, g * v)
    backward_kinds = ("I", "W") if schedule is ZBV else ("B",)
    seen = sorted((a.stage, a.microbatch, a.kind) for order in orders for a in order)
    assert seen == sorted(itertools.product(range(g * v), range(m), ("F",) + backward_kinds))
    for r, order in enumerate(orders):
        assert all(groups[a.stage] == r for a in order)
        position = {(a.stage, a.microbatch, a.kind): p for p, a in enumerate(order)}
        for (k, i, kind), p in position.items():  # local order: F before B/I, I before W
            if kind != "F":
                assert position[(k, i, "I" if kind == "W" else "F")] < p


def random_times(rng, s, split):
    fwd = [rng.uniform(0.5, 2.0) for _ in range(s)]
    bwd = [rng.uniform(1.0, 4.0) for _ in range(s)]
    wgt = [b * rng.uniform(0.2, 0.6) if split else 0.0 for b in bwd]
    return fwd, bwd, wgt, [rng.uniform(0.0, 0.5) for _ in range(s - 1)]


@pytest.mark.parametrize("schedule,g,v,m", CONFIGS)
def test_simulated_timeline_respects_every_dependency(schedule, g, v, m):
    rng, s = random.Random(7), g * v
    fwd, bwd, wgt, send = random_times(rng, s, schedule is ZBV)
    res = simulate_pipeline(
        schedule=schedule,
        num_microbatches=m,
        num_rank_groups=g,
        forward_s=fwd,
        backward_s=bwd,
        backward_weight_s=wgt,
        send_s=send,
        allreduce_s=[0.0] * s,
    )
    end = {(e.stage, e.microbatch, e.kind): e.end_s for e in res.timeline}
    eps = 1e-9
    for e in res.timeline:
        k, i = e.stage, e.microbatch
        if e.kind == "F" and k:
            assert e.start_s >= end[(k - 1, i, "F")] + send[k - 1] - eps
        if e.kind in "BI":
            assert e.start_s >= end[(k, i, "F")] - eps
            if k < s - 1:
                assert e.start_s >= end[(k + 1, i, e.kind)] + send[k] - eps
        if e.kind == "W":
            assert e.start_s >= end[(k, i, "I")] - eps
    for r in range(g):  # one action at a time, in schedule order
        mine = [e for e in res.timeline if e.rank_group == r]
        assert [f"{e.stage}{e.kind}{e.microbatch}" for e in mine] == [str(a) for a in rank_orders(schedule, m, g, s)[r]]
        assert all(a.end_s <= b.start_s + eps for a, b in zip(mine, mine[1:]))
    fast = simulate_pipeline(
        schedule=schedule,
        num_microbatches=m,
        num_rank_groups=g,
        forward_s=fwd,
        backward_s=bwd,
        backward_weight_s=wgt,
        send_s=send,
        allreduce_s=[0.0] * s,
        keep_timeline=False,
    )
    assert fast.step_s == res.step_s and fast.rank_busy_s == res.rank_busy_s and fast.timeline == ()


# ----------------------------------------------------------------------------- formulas


def uniform(schedule, g, m, *, v=1, f=1.0, b=2.0, w=0.0, send=0.0, allreduce=0.0, act=1, keep=True):
    s = g * v
    return simulate_pipeline(
        schedule=schedule,
        num_microbatches=m,
        num_rank_groups=g,
        forward_s=[f] * s,
        backward_s=[b] * s,
        backward_weight_s=[w] * s,
        send_s=[send] * (s - 1),
        allreduce_s=[allreduce] * s,
        activation_bytes=[act] * s,
        keep_timeline=keep,
    )


@pytest.mark.parametrize("schedule", [GPIPE, ONE_F_ONE_B])
@pytest.mark.parametrize("s,m", [(1, 1), (2, 2), (4, 4), (4, 16), (8, 32)])
def test_gpipe_and_1f1b_step_is_m_plus_s_minus_1_stage_times(schedule, s, m):
    f, b = 1.0, 2.5
    res = uniform(schedule, s, m, f=f, b=b)
    assert res.step_s == pytest.approx((m + s - 1) * (f + b))
    assert res.bubble_fraction == pytest.approx((s - 1) / (m + s - 1))
    assert res.rank_busy_s == pytest.approx([m * (f + b)] * s)


@pytest.mark.parametrize("g,v,m", [(4, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 32)])
def test_interleaving_divides_the_bubble_by_v(g, v, m):
    """Megatron-LM (Narayanan et al. 2021, sec. 2.2.2): bubble time / ideal time = (p - 1) / (v·m), with
    f, b the times of one virtual stage; torch's order reaches it exactly when G divides m."""
    f, b = 1.0, 2.0
    res = uniform(INTERLEAVED, g, m, v=v, f=f, b=b)
    ideal = m * v * (f + b)
    assert (res.step_s - ideal) / ideal == pytest.approx((g - 1) / (v * m))
    plain = uniform(ONE_F_ONE_B, g, m, f=v * f, b=v * b)  # same model on the same ranks, one stage each
    assert (plain.step_s - ideal) / ideal == pytest.approx((g - 1) / m)


@pytest.mark.parametrize("g,m", [(2, 4), (4, 8), (4, 13), (8, 16), (8, 33)])
def test_zbv_reaches_the_lower_bound_when_f_equals_i_equals_w(g, m):
    """ZB-V (Qi et al., ICLR 2024, sec. 6) is "zero bubble" for T_F = T_B = T_W and m >= 2p. Derivation:
    rank group G-1 cannot start before micro-batch 0 has passed the G-1 chunk-0 forwards upstream,
    (G-1)·t, and then has 2 chunks x (F + I + W) = 6t per micro-batch to run: step >= 6·m·t + (G-1)·t.
    The simulated torch order meets this bound exactly: no idle time beyond the unavoidable fill."""
    t = 1.0
    res = uniform(ZBV, g, m, v=2, f=t, b=2 * t, w=t)
    assert res.step_s == pytest.approx(6 * m * t + (g - 1) * t)
    assert res.bubble_fraction == pytest.approx((g - 1) / (6 * m + g - 1))
    one_f_one_b = uniform(ONE_F_ONE_B, g, m, f=2 * t, b=4 * t)  # the same work, one stage per rank group
    assert res.step_s - 6 * m * t == pytest.approx((one_f_one_b.step_s - 6 * m * t) / 6)  # 6x less idle time


def test_a_split_backward_lengthens_only_the_input_passes_of_schedules_that_split_it():
    """``split_backward_s``: collectives a stage's weight gradient hides when its backward runs whole
    (a fused column-parallel matmul's reduce-scatter) wait in its input pass when the two are apart."""
    g, m, f, b, w, x = 4, 8, 1.0, 2.0, 1.0, 0.25
    whole = dict(num_microbatches=m, num_rank_groups=g, send_s=[0.0] * (2 * g - 1), allreduce_s=[0.0] * 2 * g)
    times = dict(forward_s=[f] * 2 * g, backward_s=[b] * 2 * g, backward_weight_s=[w] * 2 * g)
    split = simulate_pipeline(schedule=ZBV, **whole, **times, split_backward_s=[x] * 2 * g)
    durations = {(e.kind, round(e.end_s - e.start_s, 9)) for e in split.timeline if e.kind in "IW"}
    assert durations == {("I", b - w + x), ("W", w)}
    assert split.step_s > simulate_pipeline(schedule=ZBV, **whole, **times).step_s
    with pytest.raises(InputError, match="split_backward_s needs"):
        simulate_pipeline(schedule=ZBV, **whole, **times, split_backward_s=[-x] * 2 * g)
    interleaved = dict(whole, schedule=INTERLEAVED, **times)
    assert (
        simulate_pipeline(**interleaved, split_backward_s=[x] * 2 * g).step_s == simulate_pipeline(**interleaved).step_s
    )


# ----------------------------------------------------------------------------- communication


@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_sends_add_two_transfers_to_a_two_stage_gpipe(m):
    """S = 2: F(0, 0) -> send -> F(1, 0) starts the pipeline, B(1, m-1) -> send -> B(0, m-1) ends it;
    GPipe queues every forward, so no other transfer is ever waited for."""
    f, b, c = 1.0, 2.0, 0.25
    assert uniform(GPIPE, 2, m, f=f, b=b).step_s == pytest.approx((m + 1) * (f + b))
    assert uniform(GPIPE, 2, m, f=f, b=b, send=c).step_s == pytest.approx((m + 1) * (f + b) + 2 * c)


@pytest.mark.parametrize("m", [2, 3, 5, 8])
def test_1f1b_exposes_a_round_trip_every_second_microbatch_on_two_stages(m):
    """torch's 1F1B needs m >= S, so m = 2 is its smallest two-stage step: +2c as for GPipe. In steady
    state rank 0 runs F(0, i+2) only after B(0, i), which waits for B(1, i) + c; rank 1's next forward
    then waits F(0, i+2) + c: the chain c + b + f + c against rank 1's own f + b leaves it idle 2c
    every second micro-batch, 2c·ceil(m / 2) in all (warm-up S - r keeps no slack for transfers)."""
    f, b, c = 1.0, 2.0, 0.25
    extra = uniform(ONE_F_ONE_B, 2, m, f=f, b=b, send=c).step_s - (m + 1) * (f + b)
    assert extra == pytest.approx(2 * c * -(-m // 2))


def test_sends_with_one_microbatch_in_detail():
    f, b, c = 1.0, 2.0, 0.25
    res = uniform(GPIPE, 2, 1, f=f, b=b, send=c)
    assert [(e.kind, e.stage, e.start_s) for e in res.timeline] == [
        ("F", 0, 0.0),
        ("F", 1, f + c),
        ("B", 1, 2 * f + c),
        ("B", 0, 2 * f + b + 2 * c),
    ]


def test_allreduce_overlaps_compute_and_the_step_ends_at_the_later_of_both():
    """1F1B, S = 2, m = 4, f = 1, b = 2: rank 1 finishes its backwards at 13 s, rank 0 at 15 s."""
    base = uniform(ONE_F_ONE_B, 2, 4)
    assert base.step_s == 15.0
    compute_end = {r: max(e.end_s for e in base.timeline if e.rank_group == r) for r in (0, 1)}
    assert compute_end == {0: 15.0, 1: 13.0}
    hidden = simulate_pipeline(
        schedule=ONE_F_ONE_B,
        num_microbatches=4,
        num_rank_groups=2,
        forward_s=[1.0, 1.0],
        backward_s=[2.0, 2.0],
        backward_weight_s=[0, 0],
        send_s=[0.0],
        allreduce_s=[0.0, 0.5],
    )
    assert hidden.step_s == 15.0  # rank 1's all-reduce runs 13 - 13.5 s, while rank 0 still computes
    assert [(e.start_s, e.end_s) for e in hidden.timeline if e.kind == "allreduce"] == [(13.0, 13.5)]
    longer = simulate_pipeline(
        schedule=ONE_F_ONE_B,
        num_microbatches=4,
        num_rank_groups=2,
        forward_s=[1.0, 1.0],
        backward_s=[2.0, 2.0],
        backward_weight_s=[0, 0],
        send_s=[0.0],
        allreduce_s=[3.0, 0.5],
    )
    assert longer.step_s == 18.0  # max(compute end 15, rank 0's all-reduce 15 + 3)
    assert longer.rank_busy_s == base.rank_busy_s


def test_allreduces_of_one_rank_group_share_its_stream():
    """ZBV rank group 0 holds stages 0 and 3; its two all-reduces run one after the other."""
    res = uniform(ZBV, 2, 4, v=2, f=1.0, b=2.0, w=1.0, allreduce=5.0)
    mine = sorted((e.start_s, e.end_s) for e in res.timeline if e.kind == "allreduce" and e.rank_group == 0)
    assert mine[1][0] == mine[0][1]
    assert res.step_s == max(e.end_s for e in res.timeline)


# ----------------------------------------------------------------------------- memory


def torch_in_flight(schedule, m, g, r, v):
    """In-flight count (rank's whole share) implied by torch 2.13's orders, in closed form.

    Interleaved: torch's warm-up is (v-1)·per_round + 2(G-1-r) forwards with per_round = m // max(1, m // G),
    which is G only when G divides m (memory.py's formula uses G). ZBV: G once m >= 2G - 1.
    """
    if schedule is INTERLEAVED:
        per_round = m // max(1, m // g)
        return min(m * v, (v - 1) * per_round + 2 * (g - 1 - r) + 1) / v
    return microbatches_in_flight(schedule, m, g, r, v)


@pytest.mark.parametrize(
    "schedule,v,g,m",
    [
        (GPIPE, 1, 4, 3),
        (GPIPE, 1, 4, 8),
        (ONE_F_ONE_B, 1, 4, 4),
        (ONE_F_ONE_B, 1, 4, 9),
        (ONE_F_ONE_B, 1, 8, 32),
        (INTERLEAVED, 2, 4, 4),
        (INTERLEAVED, 2, 4, 8),
        (INTERLEAVED, 3, 4, 16),
        (INTERLEAVED, 4, 8, 32),
        (ZBV, 2, 2, 3),
        (ZBV, 2, 4, 8),
        (ZBV, 2, 4, 13),
        (ZBV, 2, 8, 16),
    ],
)
def test_peak_activations_agree_with_the_memory_model(schedule, v, g, m):
    act = 1000
    res = uniform(schedule, g, m, v=v, act=act, keep=False)
    expected = [act * v * microbatches_in_flight(schedule, m, g, r, v) for r in range(g)]
    assert list(res.rank_peak_activation_bytes) == expected
    if schedule is ONE_F_ONE_B:
        assert expected == [act * min(m, g - r) for r in range(g)]
    if schedule is GPIPE:
        assert expected == [act * m] * g


@pytest.mark.parametrize("schedule,v,g,m", [(INTERLEAVED, 2, 4, 6), (INTERLEAVED, 2, 4, 3)])
def test_interleaved_memory_model_follows_torchs_rounds(schedule, v, g, m):
    # torch runs m // max(1, m // G) micro-batches per round, not G, when G does not divide m
    res = uniform(schedule, g, m, v=v, act=1, keep=False)
    simulated = [p / v for p in res.rank_peak_activation_bytes]
    assert simulated == [microbatches_in_flight(schedule, m, g, r, v) for r in range(g)]


def test_zbv_memory_model_is_an_upper_bound_for_few_microbatches():
    # m < 2G - 1: memory.py's min(m, G) over-estimates torch's order, which is safe
    res = uniform(ZBV, 4, 4, v=2, act=1, keep=False)
    simulated = [p / 2 for p in res.rank_peak_activation_bytes]
    memory_py = [microbatches_in_flight(ZBV, 4, 4, r, 2) for r in range(4)]
    assert memory_py == [4.0] * 4 and simulated == [2.5, 3.0, 3.5, 4.0]


def test_interleaved_peak_follows_torchs_warmup_for_every_accepted_microbatch_count():
    for v, g, m in itertools.product((1, 2, 3), range(1, 7), range(1, 25)):
        if m % max(1, m // g):
            continue  # torch rejects it
        res = uniform(INTERLEAVED, g, m, v=v, keep=False)
        simulated = [p / v for p in res.rank_peak_activation_bytes]
        assert simulated == [torch_in_flight(INTERLEAVED, m, g, r, v) for r in range(g)]
        if m % g == 0:
            assert simulated == [microbatches_in_flight(INTERLEAVED, m, g, r, v) for r in range(g)]


def test_zbv_peak_is_the_same_whether_i_or_w_frees_the_activations():
    """The simulator frees a stage's activations at W (torch's I keeps the autograd graph for W). In
    torch's ZBV order a W directly follows its I whenever another F follows (the W's deferred to the
    cool-down come after the last F), so the peak does not depend on that choice."""
    for g, m in [(2, 3), (4, 4), (4, 8), (5, 17)]:
        orders = compiled_orders(ZBV, m, g, 2 * g)
        act = [random.Random(g * m).randint(1, 100) for _ in range(2 * g)]
        at_w = simulate_pipeline(
            schedule=ZBV,
            num_microbatches=m,
            num_rank_groups=g,
            forward_s=[1.0] * 2 * g,
            backward_s=[2.0] * 2 * g,
            backward_weight_s=[1.0] * 2 * g,
            send_s=[0.0] * (2 * g - 1),
            allreduce_s=[0.0] * 2 * g,
            activation_bytes=act,
            keep_timeline=False,
        )
        assert at_w.rank_peak_activation_bytes == peak_activations(orders, act, 2 * g, free_kind=KIND_CODES["I"])


# ----------------------------------------------------------------------------- text, plans (speed: bench/simulate_speed.py)


def test_timeline_text_is_an_exact_grid():
    res = uniform(GPIPE, 2, 2, f=1.0, b=2.0)  # step 9 s: one column per second
    text = timeline_text(res, width=9)
    assert text.splitlines()[1:3] == ["rank 0 |01...aabb|", "rank 1 |.01aabb..|"]
    assert "bubble 33.3%" in text and text == timeline_text(res, width=9)
    zbv = timeline_text(uniform(ZBV, 2, 4, v=2, f=1.0, b=2.0, w=1.0, allreduce=1.0), width=60)
    assert " stage |" in zbv and "  comm |" in zbv and "A" in zbv and "k" in zbv


def tiny_costs(microbatch_size):
    """Four nodes whose times and bytes scale with the micro-batch size; one 1 MB parameter per node."""
    scale = microbatch_size / 8
    return CostTable(
        microbatch_size=microbatch_size,
        device="h100",
        source="analytic",
        forward_s=scale * np.array([1.0, 2.0, 3.0, 4.0]),
        backward_s=scale * np.array([2.0, 4.0, 6.0, 8.0]),
        backward_weight_s=scale * np.array([1.0, 2.0, 3.0, 4.0]),
        activation_bytes=(scale * np.array([100, 200, 300, 400])).astype(int),
        output_bytes=np.array([10] * 4),
        cut_bytes=(scale * np.array([0, 1e6, 2e6, 3e6, 0])).astype(int),
        param_names=("w0", "w1", "w2", "w3"),
        param_bytes=np.array([10**6] * 4),
        param_trainable=np.array([True, True, False, True]),
        param_uses=tuple(np.array([n]) for n in range(4)),
    )


def tiny_plan(cluster, replicas=(1, 2), recompute=(False, True)):
    ranks = [tuple(range(replicas[0])), tuple(range(replicas[0], replicas[0] + replicas[1]))]
    stages = tuple(
        StagePlan(
            index=k,
            start=2 * k,
            stop=2 * k + 2,
            first_node="a",
            last_node="b",
            module_range="",
            ranks=ranks[k],
            rank_group=k,
            recompute=recompute[k],
            forward_s=0.0,
            backward_s=0.0,
            memory_bytes=0,
            param_bytes=0,
            cut_bytes=0,
        )
        for k in range(2)
    )
    return Plan(
        graph_fingerprint="x",
        cluster=cluster,
        stages=stages,
        schedule=GPIPE,
        global_batch_size=32,
        num_microbatches=2,
        microbatch_size=8,
        options={},
    )


def test_plan_simulation_sums_stage_costs_and_prices_comm_with_the_cluster():
    cluster = Cluster(device="h100", num_devices=4, devices_per_node=2)
    plan = tiny_plan(cluster)  # stage 0: rank 0, micro-batch 16; stage 1: ranks 1, 2 (two nodes), micro-batch 8
    sizes = []
    res = simulate(plan, lambda size: sizes.append(size) or tiny_costs(size), cluster, keep_timeline=False)
    assert sorted(sizes) == [8, 16]
    f0, b0 = 2 * (1 + 2), 2 * (2 + 4)  # micro-batch 16: twice the tabled times
    f1, b1 = 3 + 4, 6 + 8 + (3 + 4)  # recompute adds the forward to the backward
    send = comm.p2p_time_s(2 * 2e6, cluster, same_node=True)  # cut 2 at micro-batch 16; ranks 0 and 1 share node 0
    allreduce = comm.allreduce_time_s(10**6, 2, cluster, spans_nodes=True)  # only w3 is trainable in stage 1
    assert allreduce > 0
    # Adam moves 7 tensors' worth of the trainable bytes over the H100's memory bandwidth
    h100 = cluster.device
    optimizer = [
        7 * trainable / (h100.memory_bandwidth_bytes_per_s * h100.memory_efficiency)
        for trainable in _trainable_per_stage(plan)
    ]
    assert optimizer[1] > 0
    expected = simulate_pipeline(
        schedule=GPIPE,
        num_microbatches=2,
        num_rank_groups=2,
        forward_s=[f0, f1],
        backward_s=[b0, b1],
        backward_weight_s=[2 * 3, 7],
        send_s=[send],
        allreduce_s=[0.0, allreduce],
        activation_bytes=[2 * 300, 2 * 10**6],
        keep_timeline=False,
        optimizer_s=optimizer,
    )
    assert res == expected
    assert simulate(plan, tiny_costs, keep_timeline=False) == expected  # the plan's own cluster


def _trainable_per_stage(plan) -> list[int]:
    table = tiny_costs(8)
    return [
        sum(int(table.param_bytes[p]) for p in table.params_in_range(st.start, st.stop) if table.param_trainable[p])
        for st in plan.stages
    ]


def test_optimizer_steps_end_each_rank_groups_step():
    """Each rank group steps its optimizer once its backward and all-reduce are done: the step
    grows by the slowest group's optimizer time, and the timeline shows it."""
    common = dict(
        schedule=GPIPE,
        num_microbatches=2,
        num_rank_groups=2,
        forward_s=[1.0, 1.0],
        backward_s=[2.0, 2.0],
        backward_weight_s=[1.0, 1.0],
        send_s=[0.0],
        allreduce_s=[0.0, 0.0],
    )
    plain = simulate_pipeline(**common)
    stepped = simulate_pipeline(**common, optimizer_s=[0.5, 0.25])
    # group 0 finishes its last backward last (it waits for group 1's gradients), then steps for 0.5 s
    assert stepped.step_s == pytest.approx(plain.step_s + 0.5)
    assert [e.kind for e in stepped.timeline if e.kind == "optimizer"] == ["optimizer", "optimizer"]
    with pytest.raises(ValueError, match=r"optimizer_s needs 2 values.*got \[0.5\]"):
        simulate_pipeline(**common, optimizer_s=[0.5])


def test_plan_simulation_rejects_a_table_at_the_wrong_microbatch_size():
    cluster = Cluster(device="h100", num_devices=4, devices_per_node=2)
    with pytest.raises(ValueError, match="16 per replica, but the cost table is for 8: pass a function"):
        simulate(tiny_plan(cluster), tiny_costs(8), cluster)
    uniform_plan = tiny_plan(cluster, replicas=(1, 1))
    assert simulate(uniform_plan, tiny_costs(16), cluster).step_s > 0


def test_unequal_shares_simulate_at_the_largest_share():
    """Stage 1's replicas take 12 and 4 samples of each micro-batch of 16 (a manual plan on one type):
    the stage waits for the replica with 12, so its costs are those at 12 samples."""
    import dataclasses

    cluster = Cluster(device="h100", num_devices=4, devices_per_node=2)
    plan = tiny_plan(cluster)
    shared = dataclasses.replace(
        plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], replica_samples=(12, 4)))
    )
    sizes = []
    res = simulate(shared, lambda size: sizes.append(size) or tiny_costs(size), cluster, keep_timeline=False)
    assert sorted(sizes) == [12, 16]
    even = simulate(plan, tiny_costs, cluster, keep_timeline=False)
    assert res.step_s > even.step_s
