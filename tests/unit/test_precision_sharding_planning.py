"""Precision and sharding on the planning side: memory model, costs, plan files, options, search."""

import dataclasses
import json

import numpy as np
import pytest

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.cost.memory import device_memory
from partita.errors import InputError, PlanFileError
from partita.planning.baselines import fsdp_plan
from partita.planning.chain import block_costs, coarsen
from partita.planning.configs import SearchOptions, enumerate_configs
from partita.planning.context import PlanningContext, planning_context
from partita.planning.degree_contexts import degree_contexts
from partita.planning.driver import best_plan
from partita.planning.options import PlanOptions, resolve_precision
from partita.planning.search import SearchCache
from partita.planning.simulator import simulate_pipeline
from partita.types import (
    CostTable,
    MemoryBreakdown,
    OpGraph,
    OpNode,
    OptimizerKind,
    ParamInfo,
    Plan,
    Precision,
    Schedule,
    Sharding,
    StagePlan,
    TensorInfo,
)
from partita.types.cluster import Cluster
from partita.types.devices import get_device
from partita.types.plan_file import plan_from_json

MiB, GiB = 2**20, 2**30


# ----------------------------------------------------------------------------- memory model


def one_layer_costs() -> CostTable:
    """One node reading a 64 MiB weight (fp32) and a 1 KiB buffer; 256 MiB activations, 1 MiB output."""
    return CostTable(
        microbatch_size=8,
        device="h100",
        source="analytic",
        forward_s=np.ones(1),
        backward_s=2 * np.ones(1),
        backward_weight_s=np.ones(1),
        activation_bytes=np.array([256 * MiB]),
        output_bytes=np.array([MiB]),
        cut_bytes=np.array([0, 0]),
        param_names=("w", "buf"),
        param_bytes=np.array([64 * MiB, 1024]),
        param_trainable=np.array([True, False]),
        param_uses=(np.array([0]), np.array([0])),
    )


@pytest.mark.parametrize(
    "precision, sharding, params, grads_step, optimizer, gathered, copies",
    [
        # T = 64 MiB of fp32 weights, N = 1 KiB buffer, r = 4, Adam (2 states). The fp32 parameters of
        # a replicated stage are their own master copy; a sharded stage's fp32 shard is its master.
        # bf16: a replicated stage keeps autocast's bf16 copies of the weights (T/2), saved for backward,
        # with the activations; a sharded stage gathers its weights in bf16 (T/2) and casts nothing.
        (Precision.FP32, Sharding.REPLICATE, 64 * MiB + 1024, 64 * MiB, 2 * 64 * MiB, 0, 0),
        (Precision.BF16, Sharding.REPLICATE, 64 * MiB + 1024, 64 * MiB, 2 * 64 * MiB, 0, 32 * MiB),
        (Precision.FP32, Sharding.SHARD_GRADS_AND_OPTIMIZER, 1024, 16 * MiB, 3 * 16 * MiB, 64 * MiB, 0),
        (Precision.BF16, Sharding.SHARD_GRADS_AND_OPTIMIZER, 1024, 16 * MiB, 3 * 16 * MiB, 32 * MiB, 0),
        (Precision.BF16, Sharding.FULL_SHARD, 1024, 16 * MiB, 3 * 16 * MiB, 32 * MiB, 0),  # one unit: the stage
    ],
)
def test_memory_per_precision_and_sharding_level(precision, sharding, params, grads_step, optimizer, gathered, copies):
    mem = device_memory(
        one_layer_costs(),
        [(0, 1)],
        in_flight=1,
        optimizer=OptimizerKind.ADAM,
        precision=precision,
        sharding=sharding,
        num_replicas=4,
    )
    assert mem.param_bytes == params
    assert mem.optimizer_bytes == optimizer  # states (+ master copy where it is one of its own)
    assert mem.gathered_param_bytes == gathered
    assert mem.grad_bytes == 64 * MiB  # fp32 gradients accumulate unsharded during the step
    assert (mem.step_grad_bytes or mem.grad_bytes) == grads_step
    breakdown = mem.breakdown()
    assert breakdown.total_bytes == mem.total_bytes
    assert breakdown.activations_bytes == 256 * MiB + copies  # the backward peak is the larger one here


def test_sharding_needs_several_replicas_to_change_anything():
    costs = one_layer_costs()
    alone = device_memory(costs, [(0, 1)], in_flight=1, sharding=Sharding.FULL_SHARD, num_replicas=1)
    assert alone == device_memory(costs, [(0, 1)], in_flight=1, num_replicas=1)


def test_full_shard_gathers_one_virtual_stage_at_a_time():
    costs = dataclasses.replace(
        one_layer_costs(),
        forward_s=np.ones(2),
        backward_s=2 * np.ones(2),
        backward_weight_s=np.ones(2),
        activation_bytes=np.array([8 * MiB, 8 * MiB]),
        output_bytes=np.array([MiB, MiB]),
        cut_bytes=np.array([0, MiB, 0]),
        param_names=("w0", "w1"),
        param_bytes=np.array([64 * MiB, 16 * MiB]),
        param_trainable=np.array([True, True]),
        param_uses=(np.array([0]), np.array([1])),
    )
    kw = dict(in_flight=1, precision=Precision.BF16, num_replicas=2)
    zero2 = device_memory(costs, [(0, 1), (1, 2)], sharding=Sharding.SHARD_GRADS_AND_OPTIMIZER, **kw)
    zero3 = device_memory(costs, [(0, 1), (1, 2)], sharding=Sharding.FULL_SHARD, **kw)
    assert zero2.gathered_param_bytes == 40 * MiB  # both stages' parameters stay gathered (in bf16)
    assert zero3.gathered_param_bytes == 32 * MiB  # the larger stage's only


# ----------------------------------------------------------------------------- costs


def test_bf16_costs_halve_float_bytes_and_run_at_the_bf16_peak():
    ex = examples.build("mlp-tiny", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    fp32 = analytic_costs(graph, "h100", 8)
    bf16 = analytic_costs(graph, "h100", 8, precision="bf16")
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16")
    inner = slice(1, graph.num_nodes)  # cuts between nodes (float activations only in this MLP)
    assert np.array_equal(bf16.cut_bytes[inner], fp32.cut_bytes[inner] // 2) and fp32.cut_bytes[inner].any()
    assert bf16.activation_bytes.sum() < fp32.activation_bytes.sum()
    assert np.array_equal(bf16.param_bytes, fp32.param_bytes)  # the master weights' own bytes
    assert bf16.forward_s.sum() < fp32.forward_s.sum()


def test_default_precision_is_bf16_on_accelerators_and_fp32_on_the_cpu():
    assert resolve_precision(None, get_device("h100")) is Precision.BF16
    assert resolve_precision(None, get_device("a100-80gb")) is Precision.BF16
    assert resolve_precision(None, get_device("cpu")) is Precision.FP32
    assert resolve_precision(Precision.FP32, get_device("h100")) is Precision.FP32


# ----------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "kw, pattern",
    [
        (dict(precision="fp16"), "precision='fp16' is not one of 'fp32', 'bf16'"),
        (dict(sharding="zero4"), "sharding='zero4' is not one of 'replicate'"),
    ],
)
def test_invalid_options_are_refused(kw, pattern):
    with pytest.raises(InputError, match=pattern):
        PlanOptions(**kw)


def test_options_parse_aliases():
    options = PlanOptions(precision="bfloat16", sharding="zero2")
    assert options.precision is Precision.BF16 and options.sharding is Sharding.SHARD_GRADS_AND_OPTIMIZER


def test_a_pinned_sharding_level_without_replicas_is_refused():
    ex = examples.build("mlp-tiny", batch_size=8)
    with pytest.raises(InputError, match="sharding='full_shard' shards a stage over its replicas, but replicas=1"):
        partita.plan(
            ex.model,
            ex.args,
            ex.kwargs,
            loss_fn=ex.loss_fn,
            target=ex.target,
            cluster=Cluster(device="h100", num_devices=2),
            global_batch_size=8,
            options=PlanOptions(sharding="full_shard", replicas=1, costs="analytic"),
        )


def test_a_pinned_sharding_level_is_honoured_by_a_slower_plan_when_the_fastest_cannot_shard():
    """GPT-2 (tied embedding and LM head), TP 2, two rank groups of two replicas on 12 H100s: the
    fastest plan (1F1B, two stages, both holding the tied weight) replicates every stage; a ZB-V plan
    whose middle stages hold no tied weight shards them. Before, the search took the fastest and the
    pin was refused ("the best plan that fits shards no stage"), while the infeasible checker had found
    the ZB-V plan."""
    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    # eager costs: with compiled blocks' the balanced ZB-V cut falls before the token embedding,
    # so the tied weight lies on both rank groups and no plan among those searched can shard
    options = PlanOptions(costs="analytic", tensor_parallel=2, sharding="full_shard", num_stages=2, compile=False)
    plan = partita.plan(graph, cluster=Cluster(device="h100", num_devices=12, devices_per_node=2),
                        global_batch_size=32, options=options)  # fmt: skip
    assert any(s.sharding is Sharding.FULL_SHARD for s in plan.stages), plan.summary()
    assert plan.num_rank_groups == 2 and plan.tensor_parallel == 2


def test_measured_costs_in_bf16_are_refused():
    ex = examples.build("mlp-tiny", batch_size=8)
    with pytest.raises(InputError, match="profiler measures the captured dtype"):
        partita.plan(
            ex.model,
            ex.args,
            ex.kwargs,
            loss_fn=ex.loss_fn,
            target=ex.target,
            cluster=Cluster(device="cpu", num_devices=1, memory_bytes=8 * GiB),
            global_batch_size=8,
            options=PlanOptions(precision="bf16", costs="measured"),
        )


# ----------------------------------------------------------------------------- plan files


def _plan(sharding=Sharding.SHARD_GRADS_AND_OPTIMIZER, replicas=2) -> Plan:
    stages = tuple(
        StagePlan(
            index=k,
            start=10 * k,
            stop=10 * (k + 1),
            first_node=f"n{10 * k}",
            last_node=f"n{10 * k + 9}",
            module_range=f"layers.{k}",
            ranks=tuple(range(replicas * k, replicas * (k + 1))),
            rank_group=k,
            recompute=False,
            forward_s=0.01,
            backward_s=0.02,
            memory_bytes=15,
            param_bytes=2**20,
            cut_bytes=4096,
            sharding=sharding,
            memory_breakdown=MemoryBreakdown(1, 2, 3, 4, 5),
        )
        for k in range(2)
    )
    return Plan(
        graph_fingerprint="abc",
        cluster=Cluster(device="h100", num_devices=4, devices_per_node=4),
        stages=stages,
        schedule=Schedule.ONE_F_ONE_B,
        global_batch_size=16,
        num_microbatches=4,
        microbatch_size=16 // (4 * replicas),
        options={},
        precision=Precision.BF16,
    )


def test_plan_file_round_trips_precision_sharding_and_breakdown():
    p = _plan()
    loaded = plan_from_json(p.to_json())
    assert loaded == p
    assert loaded.precision is Precision.BF16
    assert [s.sharding for s in loaded.stages] == [Sharding.SHARD_GRADS_AND_OPTIMIZER] * 2
    assert loaded.stages[0].memory_breakdown.total_bytes == 15


def test_old_plan_files_load_as_fp32_and_replicate():
    data = json.loads(_plan(Sharding.REPLICATE).to_json())
    del data["precision"]
    for stage in data["stages"]:
        del stage["sharding"], stage["memory_breakdown"]
    loaded = plan_from_json(json.dumps(data))
    assert loaded.precision is Precision.FP32
    assert all(s.sharding is Sharding.REPLICATE and s.memory_breakdown is None for s in loaded.stages)


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda d: d.update(precision="fp8"), "field 'precision': precision='fp8' is not one of"),
        (lambda d: d["stages"][0].update(sharding="zero9"), r"stages\[0\].sharding'.*is not one of"),
        (lambda d: d["stages"][1].update(memory_breakdown={"params_bytes": 1}), "grads_bytes' is missing"),
    ],
)
def test_invalid_precision_or_sharding_in_a_plan_file(edit, pattern):
    data = json.loads(_plan().to_json())
    edit(data)
    with pytest.raises(PlanFileError, match=pattern):
        plan_from_json(json.dumps(data))


def test_a_sharded_stage_with_one_replica_is_refused():
    with pytest.raises(PlanFileError, match=r"stages\[0\].sharding is 'full_shard', but the stage has one replica"):
        plan_from_json(_plan(Sharding.FULL_SHARD, replicas=1).to_json())


def test_manual_plans_take_precision_and_sharding():
    from partita.planning.manual import manual_plan

    ex = examples.build("mlp-tiny", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    kw = dict(schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=8)
    p = manual_plan(graph, [0, graph.num_nodes], replicas=2, precision="bf16", sharding="full_shard", **kw)
    assert p.precision is Precision.BF16 and p.stages[0].sharding is Sharding.FULL_SHARD
    assert plan_from_json(p.to_json()) == p
    with pytest.raises(InputError, match="stage 0 has one replica, so sharding='full_shard'"):
        manual_plan(graph, [0, graph.num_nodes], sharding="full_shard", **kw)


# ----------------------------------------------------------------------------- simulator


def test_a_sharded_stage_gathers_before_its_first_forward_and_reduce_scatters_after_its_last_backward():
    result = simulate_pipeline(
        schedule="gpipe",
        num_microbatches=1,
        num_rank_groups=1,
        forward_s=[1.0],
        backward_s=[2.0],
        backward_weight_s=[1.0],
        send_s=[],
        allreduce_s=[0.5],
        gather_s=[0.25],
        optimizer_s=[0.1],
    )
    assert result.step_s == pytest.approx(0.25 + 1 + 2 + 0.5 + 0.1)
    events = {e.kind: (e.start_s, e.end_s) for e in result.timeline}
    assert events["allgather"] == (0.0, 0.25) and events["F"][0] == 0.25


def test_ddp_all_reduce_overlaps_the_last_backward_up_to_its_last_bucket():
    kw = dict(
        schedule="gpipe",
        num_microbatches=1,
        num_rank_groups=1,
        forward_s=[1.0],
        backward_s=[2.0],
        backward_weight_s=[1.0],
        send_s=[],
    )
    assert simulate_pipeline(**kw, allreduce_s=[1.5]).step_s == pytest.approx(4.5)  # no tail: after the backward
    assert simulate_pipeline(**kw, allreduce_s=[1.5], allreduce_tail_s=[0.1]).step_s == pytest.approx(3.1)
    assert simulate_pipeline(**kw, allreduce_s=[2.5], allreduce_tail_s=[0.1]).step_s == pytest.approx(3.5)


# ----------------------------------------------------------------------------- search


def chain_context(
    *,
    num_blocks: int = 4,
    param_mib: int,
    activation_mib: int = 16,
    cut_mib: int = 8,
    forward_s: float = 5e-3,
    num_devices: int = 2,
    memory_gib: float,
    precision: Precision = Precision.FP32,
    sharding: Sharding | None = None,
) -> PlanningContext:
    """A chain of ``num_blocks`` equal matmul nodes, each reading a ``param_mib`` weight."""
    k = num_blocks
    nodes = tuple(
        OpNode(
            index=i,
            name=f"n{i}",
            target="aten.mm.default",
            module_path=f"layers.{i}",
            module_type="Linear",
            source="",
            outputs=(TensorInfo((8, 16), "float32", 512, 0),),
            inputs=(i - 1,) if i else (),
            params=(f"p{i}",),
            consumers=(i + 1,) if i + 1 < k else (),
        )
        for i in range(k)
    )
    param_bytes = np.full(k, param_mib * MiB)
    params = {f"p{i}": ParamInfo(f"p{i}", (param_mib * MiB // 4,), "float32", param_mib * MiB) for i in range(k)}
    graph = OpGraph(
        nodes=nodes,
        inputs=(),
        parameters=params,
        loss_node=k - 1,
        batch_size=8,
        dynamic_batch=True,
        fingerprint="chain",
        graph_module=None,
        exported_program=None,
    )
    cut = np.concatenate([[0], np.full(k - 1, cut_mib * MiB), [0]])

    def costs_at(b: int) -> CostTable:
        scale = b / 8
        return CostTable(
            microbatch_size=b,
            device="h100",
            source="analytic",
            precision=precision.value,
            forward_s=np.full(k, forward_s * scale),
            backward_s=np.full(k, 2 * forward_s * scale),
            backward_weight_s=np.full(k, forward_s * scale),
            activation_bytes=np.full(k, int(activation_mib * MiB * scale)),
            output_bytes=np.full(k, int(MiB * scale)),
            cut_bytes=(cut * scale).astype(np.int64),
            param_names=tuple(params),
            param_bytes=param_bytes,
            param_trainable=np.ones(k, bool),
            param_uses=tuple(np.array([i]) for i in range(k)),
        )

    cluster = Cluster(device="h100", num_devices=num_devices, memory_bytes=int(memory_gib * GiB))
    options = SearchOptions.from_plan_options(
        PlanOptions(uniform_replicas=True, optimizer=OptimizerKind.ADAM, sharding=sharding),
        num_devices=num_devices,
        global_batch_size=8,
        memory_limit_bytes=cluster.usable_memory_bytes,
        precision=precision,
    )
    return PlanningContext(graph, cluster, options, costs_at, list(coarsen(graph, costs_at(8))), {})


def test_search_shards_when_replicating_does_not_fit():
    # one 2 GiB fp32 weight on 2 devices: replicated with Adam 10 GiB per device (the step's
    # temporaries included), sharded 9 GiB (FSDP2's flat copy of the gradient to reduce-scatter included)
    ctx = chain_context(num_blocks=1, param_mib=2048, memory_gib=9.5, num_devices=2)
    p = best_plan(ctx)
    assert p is not None and p.num_stages == 1 and p.stages[0].num_replicas == 2
    assert p.stages[0].sharding is Sharding.SHARD_GRADS_AND_OPTIMIZER  # full_shard gathers as much, and costs more
    assert p.stages[0].memory_bytes <= ctx.options.memory_limit_bytes
    pinned = dataclasses.replace(ctx, options=dataclasses.replace(ctx.options, sharding=Sharding.REPLICATE))
    assert best_plan(pinned) is None


def test_search_replicates_when_that_fits_and_is_faster():
    # large weights and long backwards: DDP hides its all-reduce behind the last backward, a sharded
    # stage exposes its all-gather and reduce-scatter
    ctx = chain_context(param_mib=256, forward_s=0.05, memory_gib=60.0, num_devices=2)
    p = best_plan(ctx)
    assert p is not None and all(s.num_replicas == 2 for s in p.stages)
    assert all(s.sharding is Sharding.REPLICATE for s in p.stages)


def test_plain_sharded_data_parallelism_is_found_when_best():
    # huge boundary tensors make every pipeline slow; only sharded replicas hold the whole model
    ctx = chain_context(param_mib=512, cut_mib=64 * 1024, activation_mib=64, memory_gib=7.0, num_devices=4)
    p = best_plan(ctx)
    assert p is not None and p.num_stages == 1 and p.stages[0].num_replicas == 4
    assert p.stages[0].sharding is not Sharding.REPLICATE
    fsdp, why = fsdp_plan(ctx)
    assert fsdp is not None and not why
    assert fsdp.stages[0].sharding is Sharding.FULL_SHARD and fsdp.method == "fsdp"
    assert p.predicted_step_s <= fsdp.predicted_step_s + 1e-12


def test_bf16_plans_say_so_and_pin_every_replicated_stage():
    ctx = chain_context(
        param_mib=64, memory_gib=60.0, num_devices=4, precision=Precision.BF16, sharding=Sharding.FULL_SHARD
    )
    p = best_plan(ctx)
    assert p is not None and p.precision is Precision.BF16
    assert all(s.sharding is (Sharding.FULL_SHARD if s.num_replicas > 1 else Sharding.REPLICATE) for s in p.stages)
    assert all(s.memory_breakdown is not None and s.memory_breakdown.total_bytes == s.memory_bytes for s in p.stages)


@pytest.mark.slow  # searches with sharding pinned
def test_stages_sharing_a_tied_weight_replicate_even_when_sharding_is_pinned():
    """GPT-2's input embedding is its output head: the runtime shards no parameter two stages read.
    Where that leaves no stage to shard (2 stages, both holding the tied weight), the pin is refused
    with the reason, never dropped without a word (issue 32)."""
    cluster = Cluster(device="h100", num_devices=4, devices_per_node=4)
    options = PlanOptions(
        schedules="1f1b", num_stages=2, replicas=2, uniform_replicas=True, sharding="full_shard", costs="analytic"
    )
    for name, tied in (("gpt2-tiny", True), ("mlp-tiny", False)):
        ex = examples.build(name, batch_size=8)
        graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
        if tied:
            gpt2 = graph
            with pytest.raises(
                InputError, match=r"sharding='full_shard' is pinned, but no plan that fits shards a stage"
            ):
                partita.plan(graph, cluster=cluster, global_batch_size=16, options=options)
            continue
        plan = partita.plan(graph, cluster=cluster, global_batch_size=16, options=options)
        assert {s.sharding for s in plan.stages} == {Sharding.FULL_SHARD}, name
    # three stages: the middle one holds no tied weight and takes the pin, the others replicate
    six = Cluster(device="h100", num_devices=6, devices_per_node=6)
    three = dataclasses.replace(options, num_stages=3)
    plan = partita.plan(gpt2, cluster=six, global_batch_size=16, options=three)
    assert [s.sharding for s in plan.stages] == [Sharding.REPLICATE, Sharding.FULL_SHARD, Sharding.REPLICATE]
    # and the search itself times a tied stage as replicated: it gave such a stage no level under a
    # pin, so on long chains (GPT 145B on 1,536 A100s) no split fitted and the error blamed memory
    (ctx,) = degree_contexts(planning_context(gpt2, cluster=six, global_batch_size=16, options=three), 1)
    blocks = block_costs(ctx.costs_at(2), ctx.chain)
    config = next(c for c in enumerate_configs(ctx.options, blocks.num_blocks) if c.microbatch_size == 2)
    costs = SearchCache().stage_costs(blocks, config, ctx.options, ctx.search_cluster)
    time_s, _ = costs.cost_at(1.0)
    first = [i for i in range(1, blocks.num_blocks) if blocks.tied_matrix[0, i]]  # stages holding the embedding
    assert first and np.isfinite(time_s[0, first[: len(first) // 2]]).all()
