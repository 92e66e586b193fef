"""Device catalog, Cluster, communication model, shared CostTable parts and the analytic roofline."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import partita
from partita.cost import comm, local_machine
from partita.cost.analytic import analytic_costs
from partita.cost.local_machine import (
    LOCAL_RESERVED_MEMORY_FRACTION,
    local_cluster,
    local_cpu_spec,
    machine_memory_bytes,
    measure_gloo,
)
from partita.cost.table import activation_bytes, contended, cut_bytes, is_inplace, param_arrays, requires_grad
from partita.errors import InputError
from partita.types import DeviceSpec, GraphInput, OpGraph, OpNode, ParamInfo, TensorInfo
from partita.types.cluster import Cluster
from partita.types.devices import get_device, known_devices, load_device_file, resolve_device

# ----------------------------------------------------------------------------- helpers


def _tensor(shape, dtype="float32", batch_dim=0):
    itemsize = {"float32": 4, "int64": 8, "bool": 1}[dtype]
    return TensorInfo(tuple(shape), dtype, int(np.prod(shape)) * itemsize, batch_dim)


def _node(index, target, outputs, **fields):
    return OpNode(
        index=index,
        name=f"n{index}",
        target=target,
        module_path="",
        module_type="",
        source="",
        outputs=tuple(outputs),
        **fields,
    )


def _param(name, shape, requires_grad=True):
    return ParamInfo(name, tuple(shape), "float32", int(np.prod(shape)) * 4, requires_grad=requires_grad)


def _graph(nodes, parameters=(), inputs=(), batch_size=4):
    return OpGraph(
        nodes=tuple(nodes),
        inputs=tuple(inputs),
        parameters={p.name: p for p in parameters},
        loss_node=len(nodes) - 1,
        batch_size=batch_size,
        dynamic_batch=True,
        fingerprint="x",
        graph_module=None,
        exported_program=None,
    )


def _toy_device(**changes):
    """1 TFLOP/s, 1 GB/s, perfect efficiency and no per-op overhead: times are easy to compute."""
    spec = DeviceSpec(
        "toy", 10**9, {"float32": 1e12}, 1e9, 1e9, 1e8, compute_efficiency=1.0, memory_efficiency=1.0, op_overhead_s=0.0
    )
    return dataclasses.replace(spec, **changes)


def _skip_graph():
    """x -> a=linear(x) -> b=gelu(a) -> c=linear(b) -> d=add(a, c) -> loss=mean(d); batch 4.

    ``a`` skips over b and c: it crosses cuts 1..3.
    """
    x = GraphInput("x", "args[0]", _tensor((4, 8)), consumers=(0,))
    nodes = [
        _node(
            0, "aten.linear.default", [_tensor((4, 8))], graph_inputs=(0,), params=("w0",), consumers=(1, 3), flops=512
        ),
        _node(1, "aten.gelu.default", [_tensor((4, 16))], inputs=(0,), consumers=(2,)),
        _node(2, "aten.linear.default", [_tensor((4, 8))], inputs=(1,), params=("w1",), consumers=(3,), flops=1024),
        _node(3, "aten.add.Tensor", [_tensor((4, 8))], inputs=(0, 2), consumers=(4,)),
        _node(4, "aten.mean.default", [_tensor((), batch_dim=None)], inputs=(3,)),
    ]
    return _graph(nodes, [_param("w0", (8, 8)), _param("w1", (8, 16))], [x])


@pytest.fixture(scope="module")
def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=256,
        n_positions=64,
        use_cache=False,
        attn_implementation="eager",
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 256, (4, 32))
    kwargs = {"input_ids": ids, "labels": ids.clone()}
    return model, kwargs, partita.capture(model, kwargs=kwargs)


# ----------------------------------------------------------------------------- devices


def test_catalog_has_the_devices_and_aliases():
    for name in ("a100-40gb", "a100-80gb", "h100", "h100-sxm", "h200", "b200", "mi300x", "cpu"):
        spec = get_device(name)
        assert spec.memory_bytes > 0 and spec.memory_bandwidth_bytes_per_s > 0
        assert spec.inter_node_bandwidth_bytes_per_s < spec.intra_node_bandwidth_bytes_per_s
        if name != "cpu":
            assert spec.peak_flops["bfloat16"] > spec.peak_flops["tfloat32"] > spec.peak_flops["float32"]
    assert get_device(" H100-SXM ") == get_device("h100")
    assert get_device("h100").peak_flops["bfloat16"] == 989.4e12
    assert get_device("h100").inter_node_bandwidth_bytes_per_s == 50e9
    assert get_device("cpu").memory_bytes == machine_memory_bytes() > 0
    assert "h100-sxm" in known_devices()


def test_catalog_hands_out_copies():
    get_device("h100").peak_flops["bfloat16"] = 1.0
    assert get_device("h100").peak_flops["bfloat16"] == 989.4e12


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(InputError, match="unknown device 'h1000'.*a100-40gb.*mi300x"):
        get_device("h1000")


def test_device_file_json_and_toml(tmp_path):
    full = {
        "name": "mygpu",
        "memory_bytes": 2**34,
        "peak_flops": {"float32": 1e13, "bfloat16": 1e14},
        "memory_bandwidth_bytes_per_s": 1e12,
        "intra_node_bandwidth_bytes_per_s": 1e11,
        "inter_node_bandwidth_bytes_per_s": 1e10,
        "compute_efficiency": 0.5,
    }
    (tmp_path / "gpu.json").write_text(json.dumps(full))
    spec = load_device_file(tmp_path / "gpu.json")
    assert spec.name == "mygpu" and spec.memory_bytes == 2**34 and spec.peak_flops["bfloat16"] == 1e14
    assert spec.compute_efficiency == 0.5 and spec.memory_efficiency == DeviceSpec.memory_efficiency

    (tmp_path / "small.toml").write_text('name = "h100-64gb"\nbase = "H100"\nmemory_bytes = 68719476736\n')
    spec = resolve_device(str(tmp_path / "small.toml"))
    assert spec.name == "h100-64gb" and spec.memory_bytes == 2**36
    assert spec.peak_flops == get_device("h100").peak_flops


@pytest.mark.parametrize(
    "text, suffix, message",
    [
        ('{"name": "x"}', ".json", "lacks the required field.*memory_bytes"),
        ('{"base": "h100", "memory_bytes": -5}', ".json", "'memory_bytes'.*positive.*got -5"),
        ('{"base": "h100", "memory_efficency": 0.5}', ".json", "unknown field.*memory_efficency"),
        ('{"base": "h100", "compute_efficiency": 1.5}', ".json", "'compute_efficiency'.*\\(0, 1\\], got 1.5"),
        (
            '{"base": "h100", "memory_bandwidth_bytes_per_s": 0}',
            ".json",
            "'memory_bandwidth_bytes_per_s'.*positive.*got 0",
        ),
        ('{"base": "h100", "intra_node_latency_s": -1}', ".json", "'intra_node_latency_s'.*>= 0, got -1"),
        ('{"base": "h100", "peak_flops": {"float32": "fast"}}', ".json", "'peak_flops.float32'.*positive.*got 'fast'"),
        ('{"base": "h100", "peak_flops": {}}', ".json", "'peak_flops'.*non-empty.*got \\{\\}"),
        ('{"base": "nope"}', ".json", "unknown device 'nope'"),
        ("[1, 2]", ".json", "must be a table/object"),
        ("name = ", ".toml", "not valid TOML"),
        ("{", ".json", "not valid JSON"),
    ],
)
def test_device_file_errors_name_the_field(tmp_path, text, suffix, message):
    path = tmp_path / f"dev{suffix}"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        load_device_file(path)


def test_missing_device_file(tmp_path):
    with pytest.raises(InputError, match="cannot read device file"):
        load_device_file(tmp_path / "none.toml")


def _count_calls(monkeypatch, module, name):
    """Replace ``module.name`` by a wrapper that counts its calls; returns the list of calls."""
    calls, real = [], getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.slow  # measures this CPU
def test_local_cpu_spec_is_measured_and_cached(tmp_path, monkeypatch):
    measurements = _count_calls(monkeypatch, local_machine, "_calibrate_cpu")
    spec = local_cpu_spec(tmp_path, memory_bytes=2**30)
    assert spec.name == "cpu" and spec.memory_bytes == 2**30
    assert all(v > 1e8 for v in spec.peak_flops.values()) and spec.memory_bandwidth_bytes_per_s > 1e8
    assert 1e-7 < spec.op_overhead_s < 1e-3  # a tiny op with autograd recording
    assert len(measurements) == 1 and len(list(tmp_path.glob("cpu-calibration-*.json"))) == 1
    again = local_cpu_spec(tmp_path)  # read back, not measured again
    assert len(measurements) == 1
    assert again.peak_flops == spec.peak_flops and again.memory_bytes == machine_memory_bytes()
    assert again.op_overhead_s == spec.op_overhead_s


# ----------------------------------------------------------------------------- cluster


def test_cluster_defaults_and_topology():
    cluster = Cluster(device="h100", num_devices=64, devices_per_node=8)
    h100 = get_device("h100")
    assert cluster.device == h100 and cluster.memory_bytes == h100.memory_bytes
    assert (
        cluster.inter_node_bandwidth_bytes_per_s == 50e9 and cluster.intra_node_latency_s == h100.intra_node_latency_s
    )
    assert cluster.num_nodes == 8
    assert cluster.usable_memory_bytes == int(h100.memory_bytes * 0.95)
    assert cluster.rank_to_node(7) == 0 and cluster.rank_to_node(8) == 1 and cluster.rank_to_node(63) == 7
    assert cluster.link(0, 7) == (450e9, 5e-6)
    assert cluster.link(7, 8) == (50e9, 20e-6)
    assert Cluster("a100-40gb", 4).num_nodes == 1
    small = Cluster(get_device("h200"), 16, 8, memory_bytes=2**35, inter_node_bandwidth_bytes_per_s=25e9)
    assert small.memory_bytes == 2**35 and small.link(0, 8)[0] == 25e9 and small.num_nodes == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_devices": 0}, "num_devices must be an int >= 1, got 0"),
        ({"num_devices": 12}, "num_devices=12.*devices_per_node=8: use num_devices=8 or 16"),
        ({"num_devices": 8, "devices_per_node": 0}, "devices_per_node must be an int >= 1"),
        ({"num_devices": 8, "memory_bytes": -1}, "memory_bytes must be a positive int.*got -1: pass e.g."),
        ({"num_devices": 8, "memory_bytes": 1.5e9}, "memory_bytes.*got 1500000000.0"),
        ({"num_devices": 8, "intra_node_bandwidth_bytes_per_s": 0}, "intra_node_bandwidth_bytes_per_s.*> 0, got 0"),
        ({"num_devices": 8, "inter_node_latency_s": -1e-6}, "inter_node_latency_s.*>= 0, got -1e-06"),
        (
            {"num_devices": 8, "reserved_memory_fraction": 1.0},
            "reserved_memory_fraction must be in \\[0, 1\\), got 1.0",
        ),
        ({"num_devices": 8, "device": "tpu"}, "unknown device 'tpu'"),
        ({"num_devices": 8, "compute_slowdown": 0.0}, "compute_slowdown.*> 0, got 0.0"),
        ({"num_devices": 8, "collective_efficiency": 1.5}, "collective_efficiency must be in \\(0, 1\\], got 1.5"),
        ({"num_devices": 8, "compute_slowdown": float("nan")}, "compute_slowdown.*> 0, got nan"),
    ],
)
def test_cluster_validation(kwargs, message):
    kwargs = {"device": "h100"} | kwargs
    with pytest.raises(InputError, match=message):
        Cluster(**kwargs)


def test_cluster_rank_out_of_range():
    with pytest.raises(InputError, match="rank must be an int in \\[0, 16\\)"):
        Cluster("h100", 16).rank_to_node(16)


def test_cluster_dict_round_trip():
    cluster = Cluster("mi300x", 32, 8, memory_bytes=10**11, reserved_memory_fraction=0.1)
    data = json.loads(json.dumps(cluster.to_dict()))
    assert data["device"]["name"] == "mi300x" and data["device"]["peak_flops"]["bfloat16"] == 1307.4e12
    assert Cluster.from_dict(data) == cluster
    assert Cluster.from_dict({"device": "h100", "num_devices": 8}) == Cluster("h100", 8)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_devices": None}, "missing field\\(s\\) \\['num_devices'\\]"),
        ({"colour": "red"}, "unknown field\\(s\\) \\['colour'\\]"),
        ({"device": {"name": "x"}}, "cluster field 'device' lacks the required field"),
        ({"num_devices": "8"}, "num_devices must be an int >= 1"),
    ],
)
def test_cluster_from_dict_errors(change, message):
    data = Cluster("h100", 8).to_dict() | change
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(InputError, match=message):
        Cluster.from_dict(data)


@pytest.mark.slow  # a gloo probe in subprocesses
def test_local_cluster_measures_gloo(tmp_path, monkeypatch):
    probes = {
        name: _count_calls(monkeypatch, local_machine, name)
        for name in ("_calibrate_cpu", "_run_gloo_probe", "_probe_rounds")
    }
    cluster = Cluster.local(num_devices=2, memory_bytes=2**30, cache_dir=tmp_path)
    assert cluster.num_devices == 2 and cluster.num_nodes == 1 and cluster.memory_bytes == 2**30
    assert cluster.device.name == "cpu" and cluster.intra_node_bandwidth_bytes_per_s > 1e7
    assert 0 < cluster.intra_node_latency_s < 0.01 and 0 < cluster.collective_efficiency <= 1
    assert len(list(tmp_path.glob("gloo-*.json"))) == 1
    assert measure_gloo(tmp_path)["collective_efficiency"] == cluster.collective_efficiency  # from the cache
    assert cluster.compute_slowdown >= 1.0 and len(list(tmp_path.glob("contention-*.json"))) == 1
    # glibc keeps freed memory: the planner leaves CPU ranks a larger share than accelerators
    assert (
        cluster.reserved_memory_fraction == LOCAL_RESERVED_MEMORY_FRACTION > Cluster("h100", 8).reserved_memory_fraction
    )
    assert Cluster.local(num_devices=2, memory_bytes=2**30, cache_dir=tmp_path) == cluster  # from the cache
    assert local_cluster(2, 2**30, cache_dir=tmp_path) == cluster
    assert {name: len(calls) for name, calls in probes.items()} == {name: 1 for name in probes}  # each measured once
    assert (
        Cluster.local(num_devices=2, memory_bytes=2**30, cache_dir=tmp_path, compute_slowdown=1.25).compute_slowdown
        == 1.25
    )
    assert Cluster.local(num_devices=1, cache_dir=tmp_path).compute_slowdown == 1.0  # one rank: nothing to share


def test_free_port_lies_below_the_ephemeral_range_and_skips_taken_ports(monkeypatch):
    """A rendezvous port from bind(0) can be taken by another process's outgoing connection before
    the ranks listen on it (CI once failed so: EADDRINUSE); free_port draws below that range."""
    import socket

    low, _ = local_machine._ephemeral_range()
    ports = {local_machine.free_port() for _ in range(20)}
    assert all(max(1024, low - 12000) <= p < low for p in ports) and len(ports) > 1, ports
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", min(ports)))
        taken.listen()
        monkeypatch.setattr(local_machine, "_ephemeral_range", lambda: (min(ports) + 1, 60999))
        monkeypatch.setattr(local_machine.random, "SystemRandom", lambda: _Reversed())
        assert local_machine.free_port() == min(ports) - 1  # the taken one (drawn first) is skipped


class _Reversed:
    """A stand-in for random.SystemRandom whose sample is the candidates from the top down."""

    def sample(self, population, k):
        return list(reversed(population))[:k]


def test_compute_slowdown_scales_every_compute_time_of_a_plan(tiny_gpt2):
    _, _, graph = tiny_gpt2
    costs = analytic_costs(graph, "h100", 2)
    slowed = contended(costs, 1.5)
    for name in ("forward_s", "backward_s", "backward_weight_s"):
        np.testing.assert_allclose(getattr(slowed, name), 1.5 * getattr(costs, name))
    np.testing.assert_array_equal(slowed.activation_bytes, costs.activation_bytes)
    assert contended(costs, 1.0) is costs and slowed.calibration["compute_slowdown"] == 1.5
    assert contended(slowed, 1.5) is slowed  # never slowed twice
    np.testing.assert_allclose(contended(slowed, 1.0).forward_s, costs.forward_s)
    # one device, no communication: the predicted step is the compute, 1.5x
    options = partita.PlanOptions(costs="analytic", schedules="gpipe", num_microbatches=2, recompute=False)
    steps = [
        partita.plan(
            graph, cluster=Cluster("h100", 1, compute_slowdown=f), global_batch_size=4, options=options
        ).predicted_step_s
        for f in (1.0, 1.5)
    ]
    assert steps[1] == pytest.approx(1.5 * steps[0], rel=1e-6)


# ----------------------------------------------------------------------------- communication


def _comm_cluster():
    return Cluster(
        _toy_device(),
        16,
        8,
        intra_node_bandwidth_bytes_per_s=100e9,
        intra_node_latency_s=1e-5,
        inter_node_bandwidth_bytes_per_s=10e9,
        inter_node_latency_s=5e-5,
    )


def test_p2p_time():
    cluster = _comm_cluster()
    assert comm.p2p_time_s(1e9, cluster, same_node=True) == pytest.approx(1e-5 + 0.01)
    assert comm.p2p_time_s(1e9, cluster, same_node=False) == pytest.approx(5e-5 + 0.1)
    assert comm.p2p_time_s(0, cluster, same_node=True) == pytest.approx(1e-5)


def test_ring_collectives():
    cluster = _comm_cluster()
    # 4 ranks, 1 GB: 2·3/4 · 1e9 / 100e9 + 2·3 · 1e-5
    assert comm.allreduce_time_s(1e9, 4, cluster, spans_nodes=False) == pytest.approx(0.015 + 6e-5)
    # spanning nodes runs at the slower link: 2·3/4 · 1e9 / 10e9 + 2·3 · 5e-5
    assert comm.allreduce_time_s(1e9, 4, cluster, spans_nodes=True) == pytest.approx(0.15 + 3e-4)
    assert comm.allreduce_time_s(1e9, 1, cluster, spans_nodes=True) == 0.0
    assert comm.reduce_scatter_time_s(1e9, 4, cluster, spans_nodes=False) == pytest.approx((0.015 + 6e-5) / 2)
    assert comm.all_gather_time_s(8e9, 8, cluster, spans_nodes=False) == pytest.approx(7 / 8 * 0.08 + 7e-5)
    assert not comm.spans_nodes([0, 3, 7], cluster) and comm.spans_nodes([7, 8], cluster)
    # a library that reaches half the link's bandwidth in collectives (gloo), not in send/recv
    half = dataclasses.replace(cluster, collective_efficiency=0.5)
    assert comm.allreduce_time_s(1e9, 4, half, spans_nodes=False) == pytest.approx(0.03 + 6e-5)
    assert comm.p2p_time_s(1e9, half, same_node=True) == comm.p2p_time_s(1e9, cluster, same_node=True)
    with pytest.raises(InputError, match="num_ranks must be an int >= 1"):
        comm.allreduce_time_s(1.0, 0, cluster, spans_nodes=False)
    with pytest.raises(InputError, match="num_bytes must be a number >= 0"):
        comm.p2p_time_s(-1, cluster, same_node=True)


# ----------------------------------------------------------------------------- table parts


def test_cut_bytes_counts_skip_connections():
    graph = _skip_graph()
    # a=128 B crosses cuts 1..3; b=256 B cut 2; c=128 B cut 3; d=128 B cut 4; the input x is excluded.
    assert cut_bytes(graph, 4).tolist() == [0, 128, 128 + 256, 128 + 128, 128, 0]
    assert cut_bytes(graph, 2).tolist() == [0, 64, 64 + 128, 64 + 64, 64, 0]


def test_param_arrays_in_order_of_first_use():
    nodes = list(_skip_graph().nodes)
    nodes[3] = dataclasses.replace(nodes[3], params=("w0",))  # w0 read again, like a tied weight
    graph = _graph(nodes, [_param("w1", (8, 16)), _param("w0", (8, 8)), _param("unused", (2,), requires_grad=False)])
    params = param_arrays(graph)
    assert params.names == ("w0", "w1", "unused")
    assert params.num_bytes.tolist() == [256, 512, 8] and params.trainable.tolist() == [True, True, False]
    assert [u.tolist() for u in params.uses] == [[0, 3], [2], []]


def test_activation_bytes_rule():
    graph = _skip_graph()
    # linear0 keeps its input x (128 B, data); gelu keeps a (128 B); linear2 keeps b (256 B);
    # add and mean keep nothing.
    assert activation_bytes(graph, 4).tolist() == [128, 128, 256, 0, 0]
    assert activation_bytes(graph, 2).tolist() == [64, 64, 128, 0, 0]
    assert requires_grad(graph).tolist() == [True] * 5


def test_activation_bytes_count_shared_storage_once():
    nodes = [
        _node(0, "aten.mm.default", [_tensor((4, 4))], params=("w",), consumers=(1,), flops=128),
        _node(1, "aten.softmax.int", [_tensor((4, 4))], inputs=(0,), consumers=(2,)),  # keeps its output
        _node(2, "aten.view.default", [_tensor((16,))], inputs=(1,), is_view=True, consumers=(3, 4)),
        _node(3, "aten.mul.Tensor", [_tensor((16,))], inputs=(2,), consumers=(5,)),  # x * 0.5 keeps nothing
        _node(4, "aten.dropout.default", [_tensor((16,))], inputs=(2,), consumers=(5,)),  # 1-byte mask
        _node(5, "aten.matmul.default", [_tensor((16,))], inputs=(3, 4, 2), consumers=(6,), flops=32),
        _node(6, "aten.argmax.default", [_tensor((), "int64", None)], inputs=(5,)),  # no gradient
    ]
    graph = _graph(nodes, [_param("w", (4, 4))])
    # matmul keeps mul's (64) and dropout's (64) outputs; the softmax storage is already kept.
    assert activation_bytes(graph, 4).tolist() == [0, 64, 0, 0, 16, 128, 0]
    assert requires_grad(graph).tolist() == [True] * 6 + [False]


def test_products_keep_an_operand_only_for_another_operands_gradient():
    nodes = [
        _node(0, "aten.cos.default", [_tensor((4, 2))], consumers=(2,)),  # a constant: no gradient
        _node(1, "aten.linear.default", [_tensor((4, 2))], params=("w",), consumers=(2, 3)),
        _node(2, "aten.mul.Tensor", [_tensor((4, 2))], inputs=(1, 0), consumers=(3,)),  # keeps cos, not q
        _node(3, "aten.mul.Tensor", [_tensor((4, 2))], inputs=(2, 1)),  # both need grad: keeps both
    ]
    graph = _graph(nodes, [_param("w", (2, 2))])
    assert requires_grad(graph).tolist() == [False, True, True, True]
    assert activation_bytes(graph, 4).tolist() == [0, 0, 32, 64]


def test_activation_bytes_match_saved_tensors(tiny_gpt2):
    """The rule against what autograd really keeps (distinct storages, parameters excluded)."""
    model, kwargs, graph = tiny_gpt2
    storages = {}
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        graph.loss((), kwargs)
    saved = sum(n for ptr, n in storages.items() if ptr not in param_ptrs)
    estimate = int(activation_bytes(graph, graph.batch_size).sum())
    assert estimate == pytest.approx(saved, rel=0.05)


# ----------------------------------------------------------------------------- analytic


def test_roofline_picks_the_max():
    nodes = [
        # compute-bound: 1e12 FLOPs -> 1 s; moves 8 + 4 + 4 = 16 B
        _node(0, "aten.mm.default", [_tensor((1,))], params=("w",), consumers=(1,), flops=10**12),
        # memory-bound: reads 4 B, writes 10**9 B -> ~1 s; 1e3 FLOPs -> 1 ns
        _node(1, "aten.mul.Tensor", [TensorInfo((1,), "float32", 10**9, 0)], inputs=(0,), flops=1000),
    ]
    graph = _graph(nodes, [_param("w", (2,))])
    table = analytic_costs(graph, _toy_device(), 4)
    assert table.forward_s[0] == pytest.approx(1.0)
    assert table.forward_s[1] == pytest.approx((10**9 + 4) / 1e9)
    overhead = analytic_costs(graph, _toy_device(op_overhead_s=1e-3), 4)
    assert overhead.forward_s.tolist() == pytest.approx((table.forward_s + 1e-3).tolist())


def test_backward_rule():
    graph = _skip_graph()
    device = _toy_device(memory_bandwidth_bytes_per_s=1e15)  # everything compute-bound
    table = analytic_costs(graph, device, 4)
    flops = np.array([512, 0, 1024, 0, 0]) / 1e12
    assert table.forward_s[[0, 2]].tolist() == pytest.approx(flops[[0, 2]].tolist())
    # linear0 reads data: weight gradient only (1×). linear2: input + weight gradient (2×).
    assert table.backward_s[0] == pytest.approx(flops[0])
    assert table.backward_weight_s[0] == pytest.approx(flops[0])
    assert table.backward_s[2] == pytest.approx(2 * flops[2])
    assert table.backward_weight_s[2] == pytest.approx(flops[2])
    # gelu is memory-bound: reads b's gradient (256 B) and its saved input a (128 B), writes a's
    # gradient (128 B): 1.5x its forward traffic (reads a, writes b).
    assert table.backward_s[1] == pytest.approx(512 / 1e15, rel=1e-9, abs=0) and table.backward_weight_s[1] == 0


def _memory_bound_graph():
    """x -> a=linear(x) -> b=a*0.5 -> c=softmax(b) -> d=a+c -> e=d+bias -> loss=mean(e); batch 4,
    every value (4, 8) float32 = 128 B. ``a`` has two readers that need its gradient."""
    x = GraphInput("x", "args[0]", _tensor((4, 8)), consumers=(0,))
    nodes = [
        _node(
            0, "aten.linear.default", [_tensor((4, 8))], graph_inputs=(0,), params=("w",), consumers=(1, 3), flops=512
        ),
        _node(1, "aten.mul.Tensor", [_tensor((4, 8))], inputs=(0,), consumers=(2,)),  # a * 0.5
        _node(2, "aten.softmax.int", [_tensor((4, 8))], inputs=(1,), consumers=(3,)),
        _node(3, "aten.add.Tensor", [_tensor((4, 8))], inputs=(0, 2), consumers=(4,)),
        _node(4, "aten.add.Tensor", [_tensor((4, 8))], inputs=(3,), params=("bias",), consumers=(5,)),
        _node(5, "aten.mean.default", [_tensor((), batch_dim=None)], inputs=(4,)),
    ]
    return _graph(nodes, [_param("w", (8, 8)), _param("bias", (8,))], [x])


def test_backward_traffic_is_what_autograd_moves():
    """The memory side of the backward, per op (toy device: 1 GB/s, so bytes read as nanoseconds)."""
    table = analytic_costs(_memory_bound_graph(), _toy_device(), 4)
    backward_bytes = table.backward_s * 1e9
    forward_bytes = table.forward_s * 1e9
    # linear: reads a's gradient and the saved x, writes w's gradient (128 + 128 + 256 B), and sums
    # the gradients a gets from its two readers (two reads and a write of 128 B).
    assert backward_bytes[0] == pytest.approx(512 + 3 * 128)
    assert backward_bytes[1] == pytest.approx(256) == pytest.approx(forward_bytes[1])  # a * 0.5: dy in, dx out
    assert backward_bytes[2] == pytest.approx(384)  # softmax: dy and its output in, dx out
    assert backward_bytes[3] == 0  # a + c: both operands get the output gradient as it is, no kernel
    assert backward_bytes[4] == pytest.approx(128 + 32)  # d + bias: the bias's gradient sums dy over the batch
    assert backward_bytes[5] == pytest.approx(4 + 128)  # mean: the scalar gradient spread over e
    assert (table.backward_weight_s[[1, 2, 3, 5]] == 0).all()
    assert table.backward_weight_s[4] == pytest.approx(table.backward_s[4] / 2)  # W: one of its two gradients


def test_times_scale_linearly_with_microbatch():
    graph = _skip_graph()
    device = _toy_device(memory_bandwidth_bytes_per_s=1e15)
    one, two = analytic_costs(graph, device, 1), analytic_costs(graph, device, 2)
    four = analytic_costs(graph, device, 4)
    for name in ("forward_s", "backward_s", "backward_weight_s"):
        assert getattr(two, name)[[0, 2]] == pytest.approx(2 * getattr(one, name)[[0, 2]])
        assert getattr(four, name)[[0, 2]] == pytest.approx(4 * getattr(one, name)[[0, 2]])
    assert four.activation_bytes.tolist() == (4 * one.activation_bytes).tolist()
    assert four.output_bytes.tolist()[:4] == (4 * one.output_bytes).tolist()[:4]


def test_analytic_costs_on_captured_gpt2(tiny_gpt2):
    _, _, graph = tiny_gpt2
    table = analytic_costs(graph, "h100", 2)
    n = graph.num_nodes
    assert table.source == "analytic" and table.device == "h100" and table.microbatch_size == 2
    for name in ("forward_s", "backward_s", "backward_weight_s", "activation_bytes", "output_bytes"):
        assert len(getattr(table, name)) == n and (getattr(table, name) >= 0).all()
    assert len(table.cut_bytes) == n + 1 and table.cut_bytes[0] == 0 and table.cut_bytes[n] == 0
    assert (table.backward_weight_s <= table.backward_s).all()
    views = np.array([node.is_view and not is_inplace(node) for node in graph.nodes])
    assert (table.forward_s[views] == 0).all() and (table.output_bytes[views] == 0).all()
    assert table.param_names[0] == "transformer.wte.weight"  # the embedding reads it first
    assert table.param_uses[0].tolist() == [graph.node("embedding").index, graph.node("linear").index]  # tied lm_head
    assert sum(table.param_bytes) == sum(p.num_bytes for p in graph.parameters.values())
    with pytest.raises(InputError, match="dtype 'tfloat32'.*device 'cpu': choose one of"):
        analytic_costs(graph, get_device("cpu"), 2, dtype="tfloat32")
    with pytest.raises(InputError, match="microbatch_size must be an int >= 1"):
        analytic_costs(graph, "h100", 0)


@pytest.fixture(scope="module")
def gpt2_xl_on_meta():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=48,
        n_embd=1600,
        n_head=25,
        vocab_size=50257,
        n_positions=1024,
        use_cache=False,
        attn_implementation="eager",
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
        ids = torch.randint(0, 50257, (8, 1024))
    return partita.capture(model, kwargs={"input_ids": ids, "labels": ids.clone()})


@pytest.mark.slow
def test_analytic_costs_on_gpt2_xl(gpt2_xl_on_meta):
    """1.5B parameters, ~2,300 nodes on the meta device: sane totals.

    In float32 on an H100 the model is matmul-bound: the summed forward time must lie between
    the pure-compute bound total_flops / (peak · efficiency) and twice that.
    """
    graph = gpt2_xl_on_meta
    assert graph.num_nodes > 2000 and graph.num_parameters > 1.5e9
    table = analytic_costs(graph, "h100", 8)
    h100 = get_device("h100")
    compute_bound_s = graph.total_flops / (h100.peak_flops["float32"] * h100.compute_efficiency)
    assert compute_bound_s <= table.forward_s.sum() <= 2 * compute_bound_s
    assert 1.5 <= table.backward_s.sum() / table.forward_s.sum() <= 2.5
    assert table.cut_bytes.max() >= 8 * 1024 * 50257 * 4  # the logits reach the loss
