"""Uneven plans (stages with different replica counts), single-process parts: manual plans, the
layout check, the slice/overlap routing math of partita.runtime.uneven, and the refusal of
merged batch dims. The executor itself runs in tests/dist/test_uneven.py."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

import partita
from partita.errors import InputError
from partita.planning.manual import manual_plan
from partita.runtime.layout import check_layout, stage_shares
from partita.runtime.numerics import NonFinitePolicy, describe, loss_findings
from partita.runtime.stages import split_graph
from partita.runtime.uneven import Layout, Transfer, boundary_layouts, check_uneven_boundaries, replica_slice, transfers
from partita.types.plan_file import plan_from_json


def _half(graph) -> list[int]:
    return [0, graph.num_nodes // 2, graph.num_nodes]


# ----------------------------------------------------------------------------- manual plans and layout


def test_manual_plan_gives_each_rank_group_its_replicas_on_consecutive_ranks(mlp_graph):
    plan = manual_plan(
        mlp_graph,
        _half(mlp_graph),
        schedule="1f1b",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=8,
    )
    assert [s.ranks for s in plan.stages] == [(0, 1), (2,)]
    assert [s.rank_group for s in plan.stages] == [0, 1]
    assert not plan.uniform_replicas and plan.num_devices == 3
    assert plan.microbatch_size == 4  # B / (m * fewest replicas) = 8 / (2 * 1)
    assert plan.options["replicas"] == [2, 1]
    assert plan_from_json(plan.to_json(), graph=mlp_graph) == plan
    check_layout(plan)
    gpipe = manual_plan(
        mlp_graph,
        _half(mlp_graph),
        schedule="gpipe",
        num_rank_groups=2,
        replicas=[1, 3],
        num_microbatches=2,
        global_batch_size=12,
    )
    assert [s.ranks for s in gpipe.stages] == [(0,), (1, 2, 3)] and gpipe.microbatch_size == 6
    check_layout(gpipe)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(replicas=(2, 1), schedule="interleaved1f1b", num_stages=4), r"replicas=\[2, 1\] differ.*gpipe or 1f1b"),
        (dict(replicas=(2, 1, 1)), r"replicas=\[2, 1, 1\] has 3 entries for 2 rank groups: give one"),
        (dict(replicas=(3, 1)), r"global_batch_size=8.*2 x 3.*multiple of 6"),
        (dict(replicas=(0, 1)), r"replicas must be an int >= 1, got 0"),
        (dict(replicas="2"), r"replicas must be an int or a sequence.*got '2'"),
    ],
)
def test_manual_plan_refuses_replica_counts_the_runtime_cannot_run(mlp_graph, bad, match):
    choices = dict(schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=8) | bad
    num_stages = choices.pop("num_stages", 2)
    cuts = [mlp_graph.num_nodes * k // num_stages for k in range(num_stages + 1)]
    with pytest.raises(InputError, match=match):
        manual_plan(mlp_graph, cuts, **choices)


def test_manual_plan_gives_replicas_unequal_shares(mlp_graph):
    choices = dict(schedule="1f1b", num_rank_groups=2, replicas=(2, 2), num_microbatches=2, global_batch_size=8)
    plan = manual_plan(mlp_graph, _half(mlp_graph), replica_samples=[(3, 1), None], **choices)
    assert [s.replica_samples for s in plan.stages] == [(3, 1), None]
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    assert not plan.uniform_replicas and plan.microbatch_size == 3  # the largest share
    assert plan.options["replica_samples"] == [[3, 1], None]
    assert plan_from_json(plan.to_json(), graph=mlp_graph) == plan
    check_layout(plan)
    even = manual_plan(mlp_graph, _half(mlp_graph), replica_samples=[(2, 2), None], **choices)
    assert even == manual_plan(mlp_graph, _half(mlp_graph), **choices)  # equal shares are the even split


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(replica_samples=[(3, 1)]), r"replica_samples has 1 entries for 2 rank groups"),
        (dict(replica_samples=[(2, 1), None]), r"replica_samples\[0\] is \(2, 1\).*2 ints >= 1 summing to .* 4"),
        (dict(replica_samples=[(4, 0), None]), r"replica_samples\[0\] is \(4, 0\)"),
        (dict(replica_samples=[None, (1, 1, 2)]), r"rank group 1 has 2 replicas, so give 2 ints"),
        (dict(replica_samples="31"), r"replica_samples must be a sequence"),
        (
            dict(replica_samples=[(3, 1), None], schedule="interleaved1f1b", num_stages=4),
            r"unequal shares, which run under schedule gpipe or 1f1b.*got interleaved1f1b, 4 stages on 2",
        ),
    ],
)
def test_manual_plan_refuses_shares_the_runtime_cannot_run(mlp_graph, bad, match):
    choices = dict(schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=8, replicas=(2, 2)) | bad
    num_stages = choices.pop("num_stages", 2)
    cuts = [mlp_graph.num_nodes * k // num_stages for k in range(num_stages + 1)]
    with pytest.raises(InputError, match=match):
        manual_plan(mlp_graph, cuts, **choices)


def test_layout_check_refuses_uneven_plans_it_cannot_run(mlp_graph):
    plan = manual_plan(
        mlp_graph,
        _half(mlp_graph),
        schedule="gpipe",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=8,
    )
    gap = dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(plan.stages[1], ranks=(3,))))
    with pytest.raises(InputError, match=r"ranks \[0, 1, 3\], but a job's ranks are 0 .. 2.*rank 2 runs no stage"):
        check_layout(gap)
    unsorted = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], ranks=(1, 0)), plan.stages[1]))
    with pytest.raises(InputError, match=r"stage 0 runs on rank group 0, ranks \[1, 0\].*ascending ranks"):
        check_layout(unsorted)
    # a stage may run on later ranks than the next one (ranks follow a mixed cluster's device groups)
    check_layout(
        dataclasses.replace(
            plan, stages=tuple(dataclasses.replace(s, ranks=r) for s, r in zip(plan.stages, [(1, 2), (0,)]))
        )
    )
    split = manual_plan(
        mlp_graph,
        _half(mlp_graph),
        schedule="1f1b",
        num_rank_groups=2,
        replicas=2,
        num_microbatches=2,
        global_batch_size=8,
        tensor_parallel=2,
    )
    shared = dataclasses.replace(
        split, stages=(dataclasses.replace(split.stages[0], replica_samples=(3, 1)), split.stages[1])
    )
    check_layout(shared)  # tensor-parallel replicas of unequal shares: partita's executor runs them
    assert split.on_mesh and not shared.on_mesh
    with pytest.raises(InputError, match=r"\[2, 1\] under zbv.*gpipe or 1f1b"):
        check_layout(dataclasses.replace(plan, schedule=partita.Schedule.ZBV))


# ----------------------------------------------------------------------------- routing math


def test_transfers_of_a_worked_example():
    # b = 6: senders hold [0, 3) and [3, 6); receivers [0, 2), [2, 4), [4, 6).
    assert transfers((3, 3), (2, 2, 2)) == (
        Transfer(sender=0, receiver=0, sender_offset=0, receiver_offset=0, num_samples=2, carries_whole=True),
        Transfer(sender=0, receiver=1, sender_offset=2, receiver_offset=0, num_samples=1, carries_whole=True),
        Transfer(sender=1, receiver=1, sender_offset=0, receiver_offset=1, num_samples=1, carries_whole=False),
        Transfer(sender=1, receiver=2, sender_offset=1, receiver_offset=0, num_samples=2, carries_whole=True),
    )
    assert replica_slice((2, 2, 2), 2) == (4, 2)
    # unequal shares: a fast replica [0, 5) and a slow one [5, 6) feeding [0, 2), [2, 4), [4, 6)
    assert transfers((5, 1), (2, 2, 2))[-2:] == (
        Transfer(sender=0, receiver=2, sender_offset=4, receiver_offset=0, num_samples=1, carries_whole=True),
        Transfer(sender=1, receiver=2, sender_offset=0, receiver_offset=1, num_samples=1, carries_whole=False),
    )
    assert replica_slice((5, 1), 1) == (5, 1)


def test_stage_shares_split_a_microbatch_or_say_why_not(mlp_graph):
    plan = manual_plan(
        mlp_graph,
        _half(mlp_graph),
        schedule="1f1b",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=12,
        replica_samples=[(5, 1), None],
    )
    assert [stage_shares(s, 6) for s in plan.stages] == [(5, 1), (6,)]
    with pytest.raises(
        InputError, match=r"micro-batch of 7 samples does not split evenly over the 2 replicas of stage 0"
    ):
        stage_shares(dataclasses.replace(plan.stages[0], replica_samples=None), 7)
    with pytest.raises(InputError, match=r"stage 0 gives its 2 replicas the shares \[6, 0\].*at least one sample"):
        stage_shares(dataclasses.replace(plan.stages[0], replica_samples=(6, 0)), 6)


SHARES = [(1, 5), (5, 1), (2, 3, 1), (1, 1, 4), (4, 2), (1, 2, 1, 2)]


@pytest.mark.parametrize(
    "sender_shares, receiver_shares",
    [((6 // s,) * s, (6 // r,) * r) for s, r in itertools.product([1, 2, 3, 6], repeat=2)]
    + [((12,) * 18, (4,) * 54), ((4,) * 54, (12,) * 18), ((6,) * 36, (3,) * 72)]  # counts of plans beyond 64 devices
    + list(itertools.product(SHARES, [(6,), (3, 3), (2, 2, 2), *SHARES])),  # unequal shares on one side or both
)
def test_routing_rebuilds_every_slice_and_returns_every_gradient(sender_shares, receiver_shares):
    """Route a (b, 5) activation and its gradient as the executor does (narrow on one side, cat on
    the other); a tensor without batch dim reaches every receiver once, from its owner."""
    b = sum(sender_shares)
    activation, gradient = torch.randn(b, 5), torch.randn(b, 5)
    routes = transfers(sender_shares, receiver_shares)

    def own(x, shares, replica):
        start, size = replica_slice(shares, replica)
        return x[start : start + size]

    for receiver in range(len(receiver_shares)):
        mine = [t for t in routes if t.receiver == receiver]
        assert [t.sender for t in mine] == sorted(t.sender for t in mine)
        pieces = [own(activation, sender_shares, t.sender).narrow(0, t.sender_offset, t.num_samples) for t in mine]
        assert torch.equal(torch.cat(pieces), own(activation, receiver_shares, receiver))
        assert sum(t.carries_whole for t in mine) == 1, "exactly one owner sends the whole tensors"
    for sender in range(len(sender_shares)):
        mine = [t for t in routes if t.sender == sender]
        pieces = [own(gradient, receiver_shares, t.receiver).narrow(0, t.receiver_offset, t.num_samples) for t in mine]
        assert torch.equal(torch.cat(pieces), own(gradient, sender_shares, sender))


# ----------------------------------------------------------------------------- boundary layouts


def _after_first(graph, target: str) -> int:
    """The cut right after the first node with this target."""
    return next(n.index for n in graph.nodes if n.target == target) + 1


def _two_replicas_then_one(graph, cut: int):
    """A 1F1B plan cut at ``cut``, stage 0 on 2 replicas and stage 1 on 1, and its stage modules."""
    plan = manual_plan(
        graph,
        [0, cut, graph.num_nodes],
        schedule="1f1b",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=8,
    )
    return plan, split_graph(graph, plan.boundaries)


def test_merged_batch_dims_are_refused_between_different_replica_counts(gpt2_graph):
    cut = _after_first(gpt2_graph, "aten.addmm.default")  # GPT-2's Conv1D: (B*T, 3C) before the view
    plan, stages = _two_replicas_then_one(gpt2_graph, cut)
    sent = gpt2_graph.node(stages[0].spec.output_names[-1])
    assert sent.target == "aten.addmm.default" and sent.outputs[0].shape[0] == 8 * 32  # batch x sequence
    expected = rf"'{sent.name}' \(256, 192\) between stage 0 \(2 replicas\) and stage 1.*cut the model elsewhere"
    with pytest.raises(InputError, match=expected):
        check_uneven_boundaries(gpt2_graph, plan, stages)
    layouts = boundary_layouts(gpt2_graph, stages[0].spec.output_names, 0, (2, 2), (2, 2))
    assert layouts[-1] is Layout.WHOLE  # equal shares: both sides hold the same samples
    with pytest.raises(InputError, match=r"stage 0 \(2 replicas with shares \[3, 1\]\) and stage 1 \(2 replicas\)"):
        boundary_layouts(gpt2_graph, stages[0].spec.output_names, 0, (3, 1), (2, 2))


def test_per_sample_and_batchless_boundary_tensors_are_routed(gpt2_graph):
    cut = gpt2_graph.num_nodes // 3
    stages = split_graph(gpt2_graph, [0, cut, gpt2_graph.num_nodes])
    names = stages[0].spec.output_names
    layouts = boundary_layouts(gpt2_graph, names, 0, (2, 2), (4,))
    infos = [gpt2_graph.node(name).outputs[0] for name in names]
    assert layouts == tuple(Layout.SLICED if i.batch_dim is not None else Layout.WHOLE for i in infos)


class _AuxLoss(torch.nn.Module):
    """A regulariser over the batch computed in the first layers and added to the loss at the end,
    as a load-balancing loss summed across layers is: a 0-dim value that reads every sample."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 1)

    def forward(self, x, y):
        h = torch.relu(self.first(x))
        aux = h.pow(2).mean()
        out = self.head(torch.relu(self.second(h)))
        return torch.nn.functional.mse_loss(out, y) + 0.01 * aux


@pytest.fixture(scope="module")
def aux_graph():
    return partita.capture(_AuxLoss(), (torch.randn(8, 8), torch.randn(8, 1)))


def test_a_batch_reduced_value_without_batch_dim_is_not_sent_between_other_slices(aux_graph):
    """Sent whole, replica 0's mean over its own samples would reach a stage holding all of them:
    a wrong loss and no gradient for replica 1's samples through it, silently."""
    from partita.planning.chain import per_sample_cuts
    from partita.types.graph import reads_samples

    aux = next(n for n in aux_graph.nodes if n.target == "aten.mean.default")
    assert aux.outputs[0].batch_dim is None and reads_samples(aux_graph)[aux.index]
    cut = aux.index + 1  # aux crosses every cut up to the final add
    assert not per_sample_cuts(aux_graph)[cut]  # the planner never changes replica counts there
    plan, stages = _two_replicas_then_one(aux_graph, cut)
    assert aux.name in stages[0].spec.output_names
    expected = rf"'{aux.name}' \(\) between stage 0 \(2 replicas\) and stage 1 \(1 replica\) has no batch dim but is computed from the samples"
    with pytest.raises(InputError, match=expected):
        check_uneven_boundaries(aux_graph, plan, stages)
    layouts = boundary_layouts(aux_graph, stages[0].spec.output_names, 0, (2, 2), (2, 2))
    assert layouts[stages[0].spec.output_names.index(aux.name)] is Layout.WHOLE  # same samples on both sides


def test_in_the_zoo_models_only_the_loss_reads_samples_without_a_batch_dim(gpt2_graph):
    """Position ids from ``arange(seq_len)``, masks and tables made from sizes do not read the
    samples, so the planner keeps every cut it had (the golden plans are unchanged)."""
    from partita import examples
    from partita.types.graph import reads_samples

    ex = examples.build("llama", batch_size=8)
    llama = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    for graph in (gpt2_graph, llama):
        reads = reads_samples(graph)
        batchless = [n.index for n in graph.nodes if n.outputs and n.outputs[0].batch_dim is None and reads[n.index]]
        assert batchless == [graph.loss_node]
        assert not reads[next(n.index for n in graph.nodes if n.target == "aten.arange.default")]


# ----------------------------------------------------------------------------- messages


def test_nonfinite_loss_message_names_the_slice_of_an_uneven_plan():
    # Micro-batch 1 of replica 1 of a last stage with 2 replicas, b = 4: samples 6-7.
    findings = loss_findings(
        [torch.tensor(1.0), torch.tensor(float("nan"))], stage_index=1, replica=1, rank=2, samples=[(2, 2), (6, 2)]
    )
    text = describe(findings, step=1, replicas=2, policy=NonFinitePolicy.RAISE)
    assert "micro-batch 1 of replica 1 (samples 6-7 of the global batch) gave nan on stage 1" in text


def test_layout_check_refuses_several_stages_per_group_and_a_batch_that_does_not_split(mlp_graph):
    cuts = [mlp_graph.num_nodes * k // 3 for k in range(4)]
    plan = manual_plan(
        mlp_graph,
        cuts,
        schedule="gpipe",
        num_rank_groups=3,
        replicas=(2, 1, 1),
        num_microbatches=2,
        global_batch_size=8,
    )
    first, second, third = plan.stages
    shared = dataclasses.replace(plan, stages=(first, second, dataclasses.replace(third, ranks=(0, 1), rank_group=0)))
    with pytest.raises(InputError, match=r"3 stages on 2 rank groups.*\[2, 1, 2\]: such plans run one stage"):
        check_layout(shared)
    with pytest.raises(
        InputError, match=r"micro-batch of 3 samples does not split evenly over the 2 replicas of stage 0"
    ):
        check_layout(dataclasses.replace(plan, global_batch_size=6, microbatch_size=3))


def test_the_trainer_refuses_shares_that_do_not_make_the_microbatch_before_any_work(mlp):
    """A plan file edited to shares that do not sum to the micro-batch: refused by name before any
    process group starts or the model is captured."""
    import torch.distributed

    ex, graph = mlp
    plan = manual_plan(
        graph,
        _half(graph),
        schedule="gpipe",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=8,
        replica_samples=[(3, 1), None],
    )
    edited = dataclasses.replace(
        plan, stages=(dataclasses.replace(plan.stages[0], replica_samples=(3, 3)), plan.stages[1])
    )
    with pytest.raises(InputError, match=r"stage 0 gives its 2 replicas the shares \[3, 3\] of a micro-batch of 4"):
        partita.Trainer(ex.model, edited, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert not torch.distributed.is_initialized()


# ----------------------------------------------------------------------------- stages of different tensor-parallel degrees


@pytest.mark.parametrize("degrees", [(2, 1), (1, 2), (2, 4), (4, 2), (2, 2)])
def test_every_rank_across_a_boundary_of_two_degrees_gets_each_message_once(gpt2_graph, degrees):
    """Stages of different degrees (a mixed cluster's types): what each rank receives (its view of the
    plan, ``local_plan``) is exactly what the ranks on the other side send it (``send_peers``),
    forward and backward, and every rank of both sides takes part."""
    from partita.runtime.tensor_parallel import local_plan
    from partita.runtime.uneven import send_peers

    plan = manual_plan(
        gpt2_graph,
        [0, 80, gpt2_graph.num_nodes],
        schedule="1f1b",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=8,
        tensor_parallel=degrees,
    )
    assert [s.tensor_parallel for s in plan.stages] == list(degrees) and not plan.on_mesh
    check_layout(plan)
    sender, receiver = plan.stages
    shares = [stage_shares(s, 4) for s in plan.stages]
    pairs = transfers(*shares)
    sent = {"forward": set(), "backward": set()}
    received = {"forward": set(), "backward": set()}
    for stage, forward in ((sender, True), (receiver, False)):
        for position, rank in enumerate(stage.ranks):
            index, replica = position % stage.tensor_parallel, position // stage.tensor_parallel
            view = local_plan(plan, index)
            mine = [t for t in pairs if (t.sender if forward else t.receiver) == replica]
            for t, peers in zip(mine, send_peers(plan, 0, mine, index, forward=forward)):
                sent["forward" if forward else "backward"].update((rank, peer, t) for peer in peers)
            other = view.stages[1 if forward else 0]  # whom this rank receives from: its view says
            for t in mine:
                source = other.ranks[t.receiver if forward else t.sender]
                received["backward" if forward else "forward"].add((source, rank, t))
    assert sent == received
    every = set(sender.ranks) | set(receiver.ranks)
    assert {r for _, r, _ in received["forward"]} == set(receiver.ranks)
    assert {r for _, r, _ in received["backward"]} == set(sender.ranks)
    assert {r for r, _, _ in sent["forward"]} | {r for r, _, _ in sent["backward"]} <= every


def _tp2_then_two_replicas(graph, schedule: str = "gpipe"):
    """A TP-2 sequence-parallel stage, then a stage of two replicas of degree 1."""
    return manual_plan(
        graph,
        [0, 80, graph.num_nodes],
        schedule=schedule,
        num_rank_groups=2,
        replicas=(1, 2),
        num_microbatches=2,
        global_batch_size=8,
        tensor_parallel=(2, 1),
        sequence_parallel=True,
    )


def test_manual_plans_take_a_degree_per_rank_group_under_gpipe_and_1f1b_only(gpt2_graph):
    from partita.planning.simulate import simulate

    plan = _tp2_then_two_replicas(gpt2_graph)
    with pytest.raises(InputError, match=r"different tensor-parallel degrees \[2, 1\] .*simulate_mixed"):
        simulate(plan, lambda samples: pytest.fail("no cost table is read"))
    assert [s.ranks for s in plan.stages] == [(0, 1), (2, 3)]
    assert [(s.tensor_parallel, s.sequence_parallel) for s in plan.stages] == [(2, True), (1, False)]
    assert plan.tensor_parallel == 2 and plan.sequence_parallel and not plan.uniform_tensor_parallel
    assert plan.options["tensor_parallel"] == [2, 1]
    assert plan_from_json(plan.to_json()) == plan
    common = dict(num_rank_groups=2, replicas=1, num_microbatches=2, global_batch_size=8)
    with pytest.raises(InputError, match=r"tensor_parallel=\[2, 1, 1\] has 3 entries for 2 rank groups"):
        manual_plan(gpt2_graph, [0, 80, gpt2_graph.num_nodes], schedule="1f1b", tensor_parallel=(2, 1, 1), **common)
    with pytest.raises(InputError, match=r"differs between rank groups, which runs under schedule gpipe or 1f1b"):
        manual_plan(
            gpt2_graph,
            [0, 40, 80, 120, gpt2_graph.num_nodes],
            schedule="interleaved1f1b",
            tensor_parallel=(2, 1),
            **common,
        )
    nodes = partita.Cluster(device="cpu", num_devices=4, devices_per_node=2)
    with pytest.raises(InputError, match=r"ranks \[1, 2\] does not lie in one node"):
        manual_plan(
            gpt2_graph, [0, 80, gpt2_graph.num_nodes], schedule="1f1b", tensor_parallel=(1, 2), cluster=nodes, **common
        )


def test_plan_files_refuse_sequence_parallelism_at_degree_1(gpt2_graph):
    from partita.errors import PlanFileError
    from partita.types.plan_file import plan_to_dict

    data = plan_to_dict(_tp2_then_two_replicas(gpt2_graph, "1f1b"))
    data["stages"][1]["sequence_parallel"] = True
    with pytest.raises(PlanFileError, match=r"stages\[1\].sequence_parallel is true, but its tensor_parallel is 1"):
        plan_from_json(__import__("json").dumps(data))
