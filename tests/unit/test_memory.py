"""Memory model: exact numbers for a hand-made MLP cost table, and in-flight counts per schedule."""

import dataclasses

import numpy as np
import pytest

from partita.cost.memory import (
    ALLREDUCE_BUCKET_BYTES,
    MemoryByInFlight,
    device_memory,
    memory_from_totals,
    microbatches_in_flight,
)
from partita.types import CostTable, OptimizerKind, Precision, Recompute, Schedule, Sharding

MiB = 2**20


def mlp_costs() -> CostTable:
    """Linear(1024->1024) -> GELU -> Linear(1024->10) -> loss at micro-batch 64, fp32.

    node 0 linear1: reads w1 (4 MiB) + b1, saves its input x (64x1024x4 = 256 KiB), writes 256 KiB
    node 1 gelu:    saves its input (256 KiB), writes 256 KiB
    node 2 linear2: reads w2 (40 KiB) + b2, saves its input (256 KiB), writes 64x10x4 = 2560 B
    node 3 loss:    saves logits (2560 B), writes 4 B
    """
    act = np.array([256 * 1024, 256 * 1024, 256 * 1024, 2560])
    out = np.array([256 * 1024, 256 * 1024, 2560, 4])
    return CostTable(
        microbatch_size=64,
        device="cpu",
        source="analytic",
        forward_s=np.ones(4),
        backward_s=2 * np.ones(4),
        backward_weight_s=np.ones(4),
        activation_bytes=act,
        output_bytes=out,
        cut_bytes=np.array([0, 256 * 1024, 256 * 1024, 2560, 0]),
        param_names=("w1", "b1", "w2", "b2", "running"),
        param_bytes=np.array([4 * MiB, 4096, 40960, 40, 8]),
        param_trainable=np.array([True, True, True, True, False]),
        param_uses=(np.array([0]), np.array([0]), np.array([2]), np.array([2]), np.array([1])),
    )


def test_whole_model_on_one_device_with_adam():
    mem = device_memory(mlp_costs(), [(0, 4)], in_flight=1, optimizer=OptimizerKind.ADAM)
    trainable = 4 * MiB + 4096 + 40960 + 40
    assert mem.param_bytes == trainable + 8
    assert mem.grad_bytes == trainable
    assert mem.optimizer_bytes == 2 * trainable
    assert mem.activation_bytes == 3 * 256 * 1024 + 2560
    assert mem.comm_buffer_bytes == 0
    assert mem.working_bytes == 2 * 256 * 1024
    assert mem.optimizer_step_bytes == 2 * 4 * MiB  # Adam's temporaries for w1, the largest parameter
    # The optimizer step (every gradient + 8 MiB of temporaries) peaks above backward.
    assert mem.total_bytes == (trainable + 8) + 2 * trainable + trainable + 8 * MiB


@pytest.mark.parametrize("replicas", [1, 4])
def test_on_a_gpu_the_optimizer_step_makes_one_state_at_once(replicas):
    """torch's default step on GPUs is foreach: Adam's ``_foreach_sqrt`` of the second moments is one
    copy of every trainable parameter (of the shard when sharded), as measured on an H100
    (bench/results/gpu/README.md); on the CPU, single-tensor, about twice the largest parameter."""
    import dataclasses

    from partita.cost.memory import steps_foreach

    trainable = 4 * MiB + 4096 + 40960 + 40
    sharding = Sharding.SHARD_GRADS_AND_OPTIMIZER if replicas > 1 else Sharding.REPLICATE
    cpu, gpu = mlp_costs(), dataclasses.replace(mlp_costs(), device="h100")
    on = {
        table.device: device_memory(
            table, [(0, 4)], in_flight=1, optimizer=OptimizerKind.ADAM, sharding=sharding, num_replicas=replicas
        )
        for table in (cpu, gpu)
    }
    assert on["h100"].optimizer_step_bytes == -(-trainable // replicas)
    assert on["cpu"].optimizer_step_bytes == 2 * 4 * MiB // replicas
    if replicas == 1:  # the step peaks above backward here: the total follows the temporaries
        assert on["h100"].total_bytes - on["cpu"].total_bytes == trainable - 2 * 4 * MiB
    assert steps_foreach("a100-80gb") and steps_foreach("my-gpu-file") and not steps_foreach("cpu")
    assert device_memory(gpu, [(0, 4)], in_flight=1, optimizer=OptimizerKind.NONE).optimizer_step_bytes == 0


def test_backward_peak_wins_when_activations_dominate():
    mem = device_memory(mlp_costs(), [(1, 4)], in_flight=8, optimizer=OptimizerKind.ADAM)
    backward = mem.activation_bytes + mem.comm_buffer_bytes + mem.working_bytes + mem.grad_bytes
    assert backward > mem.grad_bytes + mem.optimizer_step_bytes == 40960 + 40 + 2 * 40960
    assert mem.total_bytes == mem.param_bytes + mem.optimizer_bytes + backward


def test_gradients_at_the_backward_peak_depend_on_a_steady_state():
    """Gradients are set to None between steps. With as many micro-batches as in flight, every
    forward runs before the first backward: at the activation peak only the first gradients
    exist, those of the last node that reads parameters (linear2: w2 + b2, not the 4 MiB w1) --
    unless the start of the second micro-batch's backward is higher: one micro-batch fewer kept,
    every gradient made (here: 15 micro-batches of 0.77 MiB and 4 MiB of gradients, against 16 and
    40 KiB). With more micro-batches, a backward ran before the peak (1F1B's steady state): every
    gradient is alive."""
    costs = mlp_costs()
    trainable = 4 * MiB + 4096 + 40960 + 40
    per_microbatch = 3 * 256 * 1024 + 2560
    fill = device_memory(costs, [(0, 4)], in_flight=16, optimizer=OptimizerKind.ADAM, num_microbatches=16)
    steady = device_memory(costs, [(0, 4)], in_flight=16, optimizer=OptimizerKind.ADAM, num_microbatches=32)
    unknown = device_memory(costs, [(0, 4)], in_flight=16, optimizer=OptimizerKind.ADAM)
    assert fill.backward_grad_bytes == trainable and fill.activation_bytes == 15 * per_microbatch
    assert steady.backward_grad_bytes == trainable and steady.activation_bytes == 16 * per_microbatch
    assert steady.total_bytes == unknown.total_bytes  # not knowing m is the conservative case
    work = 2 * 256 * 1024  # an activation-sized output and its gradient
    persistent = (trainable + 8) + 2 * trainable
    step = trainable + 2 * 4 * MiB  # every gradient + Adam's temporaries for w1
    assert fill.total_bytes == persistent + max(15 * per_microbatch + work + trainable, step)
    assert steady.total_bytes == persistent + max(16 * per_microbatch + work + trainable, step)
    assert fill.total_bytes < steady.total_bytes
    # without w1 (linear2 and the loss: 40 KiB of gradients, all made first) the first backward is the peak
    head = device_memory(costs, [(2, 4)], in_flight=16, optimizer=OptimizerKind.ADAM, num_microbatches=16)
    assert head.backward_grad_bytes == 40960 + 40 and head.activation_bytes == 16 * (256 * 1024 + 2560)


def test_plain_sgd_has_no_step_temporaries():
    assert device_memory(mlp_costs(), [(0, 4)], in_flight=1, optimizer=OptimizerKind.NONE).optimizer_step_bytes == 0


def test_second_stage_of_two_under_gpipe_with_four_microbatches():
    costs = mlp_costs()
    in_flight = microbatches_in_flight(Schedule.GPIPE, 4, 2, 1)
    mem = device_memory(costs, [(2, 4)], in_flight=in_flight, optimizer=OptimizerKind.SGD_MOMENTUM)
    assert in_flight == 4
    assert mem.param_bytes == 40960 + 40
    assert mem.optimizer_bytes == 40960 + 40
    assert mem.activation_bytes == 4 * (256 * 1024 + 2560)
    assert mem.comm_buffer_bytes == 256 * 1024 + 0  # received input, no output gradient on the last stage


def test_recompute_keeps_stage_inputs_plus_one_microbatch():
    costs = mlp_costs()
    mem = device_memory(costs, [(1, 4)], in_flight=3, optimizer=OptimizerKind.NONE, recompute=True)
    assert mem.activation_bytes == 3 * 256 * 1024 + (2 * 256 * 1024 + 2560)
    assert mem.optimizer_bytes == 0


def test_a_selective_group_rebuilds_one_stage_at_a_time():
    """Two selective ranges on one device (a rank group's stages): each micro-batch in flight keeps
    I + S of both, and the one being rebuilt holds max(A - S, 0) more, of one range: the largest."""
    costs = dataclasses.replace(mlp_costs(), saved_bytes=np.array([256 * 1024, 0, 2560, 0]))
    ranges = [(0, 2), (2, 4)]
    mem = device_memory(costs, ranges, in_flight=2, optimizer=OptimizerKind.NONE, recompute="selective")
    kept = 2 * ((0 + 256 * 1024) + (256 * 1024 + 2560))  # 2 x (I + S) of both ranges
    rebuilt = max(2 * 256 * 1024 - 256 * 1024, (256 * 1024 + 2560) - 2560)  # max over ranges of A - S
    assert mem.activation_bytes == kept + rebuilt


def test_bf16_keeps_fp32_master_weights_and_one_bf16_copy_of_the_weights_per_step():
    kw = dict(optimizer=OptimizerKind.ADAM, precision=Precision.BF16)
    mem = device_memory(mlp_costs(), [(2, 3)], in_flight=1, **kw)
    three = device_memory(mlp_costs(), [(2, 3)], in_flight=3, **kw)
    master = 40960 + 40  # bytes of w2, b2 in fp32 (the table holds the parameters' own bytes)
    assert mem.param_bytes == master  # the fp32 parameters are the master weights
    assert mem.optimizer_bytes == 2 * master  # Adam m, v
    assert mem.grad_bytes == master  # fp32 gradients (the reduce dtype)
    # autocast's bf16 copy of the weights, cast once per step and shared by the micro-batches in flight
    fp32 = device_memory(mlp_costs(), [(2, 3)], in_flight=1, optimizer=OptimizerKind.ADAM)
    assert mem.activation_bytes - fp32.activation_bytes == master // 2
    assert three.activation_bytes == 3 * (mem.activation_bytes - master // 2) + master // 2
    # sharded: the weights are gathered in bf16 (half the fp32 copy) and autocast casts nothing
    sharded = dict(sharding=Sharding.FULL_SHARD, num_replicas=2)
    for recompute in (Recompute.NONE, Recompute.FULL):
        bf16 = device_memory(mlp_costs(), [(2, 3)], in_flight=3, recompute=recompute, **sharded, **kw)
        full = device_memory(
            mlp_costs(), [(2, 3)], in_flight=3, recompute=recompute, **sharded, optimizer=OptimizerKind.ADAM
        )
        assert bf16.activation_bytes == full.activation_bytes
        assert 2 * bf16.gathered_param_bytes == full.gathered_param_bytes == master


def test_replicas_add_an_allreduce_bucket():
    one = device_memory(mlp_costs(), [(0, 2)], in_flight=1)
    two = device_memory(mlp_costs(), [(0, 2)], in_flight=1, num_replicas=2)
    assert two.comm_buffer_bytes - one.comm_buffer_bytes == min(4 * MiB + 4096, ALLREDUCE_BUCKET_BYTES)


def test_a_tied_parameter_counts_once_per_device_that_holds_it():
    costs = mlp_costs()
    tied = CostTable(**{**vars(costs), "param_uses": (np.array([0, 3]),) + costs.param_uses[1:]})
    both = device_memory(tied, [(0, 1), (3, 4)], in_flight=1)
    first = device_memory(tied, [(0, 1)], in_flight=1)
    last = device_memory(tied, [(3, 4)], in_flight=1)
    assert both.param_bytes == first.param_bytes == 4 * MiB + 4096
    assert last.param_bytes == 4 * MiB


@pytest.mark.parametrize(
    "schedule, m, ranks, v, expected",
    [
        (Schedule.GPIPE, 8, 4, 1, [8, 8, 8, 8]),
        (Schedule.ONE_F_ONE_B, 8, 4, 1, [4, 3, 2, 1]),
        (Schedule.ONE_F_ONE_B, 2, 4, 1, [2, 2, 2, 1]),
        (Schedule.INTERLEAVED_1F1B, 8, 4, 2, [(4 + 6 + 1) / 2, (4 + 4 + 1) / 2, (4 + 2 + 1) / 2, (4 + 0 + 1) / 2]),
        # torch runs m // max(1, m // S) = 6 micro-batches per round when m = 6 on 4 ranks
        (Schedule.INTERLEAVED_1F1B, 6, 4, 2, [6, (6 + 4 + 1) / 2, (6 + 2 + 1) / 2, (6 + 0 + 1) / 2]),
        (Schedule.ZBV, 8, 4, 2, [4, 4, 4, 4]),
        (Schedule.ZBV, 2, 4, 2, [2, 2, 2, 2]),
    ],
)
def test_microbatches_in_flight(schedule, m, ranks, v, expected):
    assert [microbatches_in_flight(schedule, m, ranks, r, v) for r in range(ranks)] == expected


@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("sharding", list(Sharding))
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("foreach_step", [False, True])
def test_memory_by_in_flight_equals_the_formula_byte_for_byte(precision, sharding, recompute, foreach_step):
    rng = np.random.default_rng(7)
    shape = (9, 9)
    trainable = rng.integers(0, 2**33, shape)
    totals = dict(
        param_bytes=trainable + rng.integers(0, 2**20, shape),
        trainable_bytes=trainable,
        activation_bytes=rng.integers(0, 2**31, shape) + 0.5,  # odd halves: the ceilings matter
        stage_input_bytes=rng.integers(0, 2**25, shape),
        boundary_bytes=rng.integers(0, 2**26, shape),
        largest_output_bytes=rng.integers(0, 2**27, shape),
        largest_param_bytes=rng.integers(0, 2**28, shape),
        first_grad_bytes=rng.integers(0, 2**28, shape),
        optimizer=OptimizerKind.ADAM,
        recompute=recompute,
        precision=precision,
        sharding=sharding,
        num_replicas=3,
        num_microbatches=6,
        foreach_step=foreach_step,
    )
    by_in_flight = MemoryByInFlight(**totals)
    for in_flight in (0, 1, 2.5, 5, 6, 7.25, 12):  # below, at and above the micro-batch count
        expected = memory_from_totals(in_flight=in_flight, **totals).total_bytes
        np.testing.assert_array_equal(by_in_flight.total_bytes(in_flight), expected)
