"""Mixed clusters (several device groups): construction, topology, files, plan files, --devices."""

import dataclasses
import json

import pytest

import partita
from partita.cli.devices import GroupSpec, devices_argument, groups_cluster
from partita.cli.main import main
from partita.cli.parser import parse_bytes
from partita.errors import InputError, PlanFileError
from partita.types import Plan, Schedule, StagePlan
from partita.types.cluster import Cluster, DeviceGroup
from partita.types.devices import get_device
from partita.types.plan_file import executed_part, plan_from_json, plan_to_json


def mixed(**kwargs) -> Cluster:
    return Cluster(groups=[DeviceGroup("h100", 16), DeviceGroup("a100-40gb", 32)], **kwargs)


def test_a_mixed_cluster_holds_its_groups_and_a_conservative_one_type_view():
    c = mixed()
    assert c.is_mixed and c.num_devices == 48 and c.num_nodes == 6
    assert [g.device.name for g in c.groups] == ["h100", "a100-40gb"]
    # the one-type fields: the slowest device, the smallest memory, the slowest links
    assert c.device.name == "a100-40gb"
    assert c.memory_bytes == get_device("a100-40gb").memory_bytes
    assert c.intra_node_bandwidth_bytes_per_s == min(
        get_device(n).intra_node_bandwidth_bytes_per_s for n in ("h100", "a100-40gb")
    )
    assert c.inter_group_bandwidth_bytes_per_s == get_device("a100-40gb").inter_node_bandwidth_bytes_per_s
    assert [g.device.name for g in c.group_clusters] == ["h100", "a100-40gb"]
    assert not any(g.is_mixed for g in c.group_clusters)


def test_ranks_follow_the_groups_and_their_nodes():
    c = mixed()
    assert list(c.group_ranks(1)) == list(range(16, 48))
    assert [c.group_of_rank(r) for r in (0, 15, 16, 47)] == [0, 0, 1, 1]
    assert [c.rank_to_node(r) for r in (0, 7, 8, 16, 23, 24, 47)] == [0, 0, 1, 2, 2, 3, 5]
    h100, a100 = get_device("h100"), get_device("a100-40gb")
    assert c.link(0, 1) == (h100.intra_node_bandwidth_bytes_per_s, h100.intra_node_latency_s)
    assert c.link(0, 8) == (h100.inter_node_bandwidth_bytes_per_s, h100.inter_node_latency_s)
    assert c.link(16, 17) == (a100.intra_node_bandwidth_bytes_per_s, a100.intra_node_latency_s)
    assert c.link(0, 16) == (c.inter_group_bandwidth_bytes_per_s, c.inter_group_latency_s)
    assert c.assign_ranks([(4, 8), (12, 0)]) == [(0, 1, 2, 3, *range(16, 24)), tuple(range(4, 16))]
    with pytest.raises(InputError, match="takes? 17 devices of device group 0 \\(h100\\), which has 16"):
        c.assign_ranks([(9, 0), (8, 0)])


def test_one_group_is_a_one_type_cluster_serialised_as_today():
    one = Cluster(groups=[DeviceGroup("h100", 16)])
    assert one == Cluster(device="h100", num_devices=16) and not one.is_mixed
    assert list(one.to_dict()) == [
        "device",
        "num_devices",
        "devices_per_node",
        "memory_bytes",
        "intra_node_bandwidth_bytes_per_s",
        "inter_node_bandwidth_bytes_per_s",
        "intra_node_latency_s",
        "inter_node_latency_s",
        "reserved_memory_fraction",
        "compute_slowdown",
        "collective_efficiency",
    ]
    assert one.group_clusters == (one,) and one.assign_ranks([(3,), (2,)]) == [(0, 1, 2), (3, 4)]


def test_mixed_clusters_round_trip_and_bad_ones_are_named():
    c = mixed(inter_group_bandwidth_bytes_per_s=10e9, reserved_memory_fraction=0.1)
    data = json.loads(json.dumps(c.to_dict()))
    assert Cluster.from_dict(data) == c
    assert (
        Cluster.from_dict(
            {
                "groups": [
                    {"device": "l4", "num_devices": 8},
                    {"device": "v100", "num_devices": 4, "devices_per_node": 4},
                ]
            }
        ).num_devices
        == 12
    )
    with pytest.raises(InputError, match="groups \\(2 groups\\) and device, num_devices"):
        Cluster(device="h100", num_devices=8, groups=[DeviceGroup("h100", 8), DeviceGroup("l4", 8)])
    with pytest.raises(InputError, match="does not fill whole nodes"):
        Cluster(groups=[DeviceGroup("h100", 12), DeviceGroup("l4", 8)])
    with pytest.raises(InputError, match="Cluster needs device and num_devices"):
        Cluster()
    with pytest.raises(InputError, match="inter_group_bandwidth_bytes_per_s is for clusters of several"):
        Cluster(device="h100", num_devices=8, inter_group_bandwidth_bytes_per_s=1e9)
    with pytest.raises(InputError, match="unknown field"):
        Cluster.from_dict({"groups": [], "device": "h100"})
    with pytest.raises(InputError, match="inter_group_latency_s must be a finite number >= 0"):
        mixed(inter_group_latency_s=-1.0)


def test_new_catalog_entries():
    for name in ("v100", "v100-16gb", "l4", "a100-40gb"):
        spec = get_device(name)
        assert spec.memory_bytes > 0 and spec.peak_flops["float32"] > 0
    assert "bfloat16" not in get_device("v100").peak_flops  # Volta has no bf16: planned at its fp32 rate
    assert get_device("l4").peak_flops["bfloat16"] == 121e12  # dense, not the datasheet's sparse 242


def _mixed_plan(**stage0) -> Plan:
    """Two stages on a 4 h100 + 4 a100-40gb cluster: stage 0 on 2 h100 + 1 a100 with unequal shares."""
    cluster = Cluster(groups=[DeviceGroup("h100", 4, 4), DeviceGroup("a100-40gb", 4, 4)])
    ranks = cluster.assign_ranks([(2, 1), (0, 2)])
    common = dict(
        module_range="m",
        rank_group=0,
        recompute=False,
        forward_s=1.0,
        backward_s=2.0,
        memory_bytes=10,
        param_bytes=1,
        cut_bytes=0,
    )
    stages = (
        StagePlan(
            index=0,
            start=0,
            stop=3,
            first_node="a",
            last_node="c",
            ranks=ranks[0],
            **{**common, **dict(replica_samples=(3, 3, 2), memory_bytes_by_group=(10, 9)), **stage0},
        ),
        StagePlan(
            index=1, start=3, stop=5, first_node="d", last_node="e", ranks=ranks[1], **{**common, "rank_group": 1}
        ),
    )
    return Plan("fp", cluster, stages, Schedule.ONE_F_ONE_B, 16, 2, 3, {})


def test_plan_files_record_groups_and_shares():
    plan = _mixed_plan()
    assert not plan.uniform_replicas and plan.stages[0].samples_of_replicas(8) == (3, 3, 2)
    assert plan.stages[1].samples_of_replicas(8) == (4, 4)
    text = plan_to_json(plan)
    again = plan_from_json(text)
    assert again == plan and plan_to_json(again) == text
    data = json.loads(text)
    assert "replica_samples" not in data["stages"][1] and data["stages"][0]["replica_samples"] == [3, 3, 2]
    executed = executed_part(plan)
    assert executed["cluster"] == {"groups": [{"num_devices": 4, "devices_per_node": 4}] * 2}
    assert executed["stages"][0]["replica_samples"] == [3, 3, 2] and "replica_samples" not in executed["stages"][1]
    changed = dataclasses.replace(
        plan, stages=(dataclasses.replace(plan.stages[0], replica_samples=(4, 2, 2)), plan.stages[1])
    )
    assert executed_part(changed) != executed


@pytest.mark.parametrize(
    "shares, message",
    [
        ((3, 3, 3), "sum to 9, but a micro-batch holds 8"),
        ((4, 4), "2 entries for 3 replicas"),
        ((8, 0, 0), "integers >= 1"),
    ],
)
def test_bad_shares_are_named(shares, message):
    data = json.loads(plan_to_json(_mixed_plan()))
    data["stages"][0]["replica_samples"] = list(shares)
    with pytest.raises(PlanFileError, match=message):
        plan_from_json(json.dumps(data))


def test_devices_argument_and_its_cluster():
    assert devices_argument("8") == 8
    groups = devices_argument("16xh100, 32xa100-40gb,8xmi300x@100GiB")
    assert groups == (GroupSpec(16, "h100", None), GroupSpec(32, "a100-40gb", None), GroupSpec(8, "mi300x", "100GiB"))
    c = groups_cluster(groups, parse_bytes)
    assert c.num_devices == 56 and c.groups[2].memory_bytes == 100 * 2**30
    assert groups_cluster(devices_argument("4xl4,2xh100"), parse_bytes).groups[0].devices_per_node == 4
    with pytest.raises(InputError, match="12xh100 does not fill nodes of 8"):
        groups_cluster(devices_argument("12xh100,8xl4"), parse_bytes)
    for bad in ("16h100", "0xh100", "x", "16xh100,"):
        with pytest.raises(Exception, match="not a device group"):
            devices_argument(bad)


def test_cli_refuses_one_type_flags_beside_groups(capsys):
    assert main(["plan", "mlp", "--devices", "8xh100,8xl4", "--device-type", "h100", "--global-batch", "8"]) == 2
    assert "--device-type cannot apply to all of them" in capsys.readouterr().err


def test_partita_exports_device_groups():
    assert partita.DeviceGroup is DeviceGroup


def test_a_groups_replicas_with_unequal_shares_wait_for_the_largest():
    """A hand-made plan whose two H100 replicas take 4 and 2 samples (the mixed search gives a group's
    replicas equal shares): the group runs at its largest share."""
    from partita.planning.hetero_simulate import stage_groups

    plan = _mixed_plan(replica_samples=(4, 2, 2))
    groups = stage_groups(plan.stages[0], plan.cluster, 8)
    assert [(g.group, g.ranks, g.samples) for g in groups] == [(0, (0, 1), 4), (1, (4,), 2)]
