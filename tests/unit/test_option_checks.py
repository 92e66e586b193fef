"""Pins checked against the cluster before the model is captured (issue 54, items 8 and 12).

Pins that no plan on the cluster can honour, whatever the model (``partita.planning.context.
check_options``), are refused before the capture, which takes seconds to minutes on a large model;
on a mixed cluster they count the devices of every group, not one group's."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import partita
from partita import examples
from partita.cli.main import main
from partita.errors import InputError
from partita.planning.context import check_options
from partita.planning.options import PlanOptions
from partita.types import DeviceGroup

CLI = importlib.import_module("partita.cli.main")


def mixed(*groups: tuple[str, int]) -> partita.Cluster:
    return partita.Cluster(groups=[DeviceGroup(device, n, n) for device, n in groups])


@pytest.fixture
def no_capture(monkeypatch):
    """Every way planning captures a model fails the test."""

    def captured(*args, **kwargs):
        raise AssertionError("the model was captured before the contradictory pins were refused")

    for module in ("partita.capturing", "partita.planning.context", "partita.planning.device_groups"):
        monkeypatch.setattr(importlib.import_module(module), "capture", captured)
    monkeypatch.setattr(CLI, "_load", captured)


def _model() -> tuple[nn.Module, tuple]:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)), (torch.randn(4, 8),)


# ----------------------------------------------------------------------------- item 8: every group's devices


@pytest.mark.parametrize("order", [1, -1])
def test_a_mixed_cluster_counts_the_devices_of_every_group(order):
    cluster = mixed(*[("cpu", 2), ("cpu", 1)][::order])
    check_options(PlanOptions(num_stages=2), cluster, 8)  # 3 devices: room for 2 stages
    check_options(PlanOptions(num_stages=3), cluster, 8)
    with pytest.raises(InputError, match=r"num_stages=4 needs at least 4 devices .* but the cluster has 3 \("):
        check_options(PlanOptions(num_stages=4), cluster, 8)


@pytest.mark.parametrize("order", [1, -1])
def test_a_mixed_cluster_plans_more_stages_than_one_group_has(order):
    """2 + 1 devices with num_stages=2 was refused as "the cluster has 1" (each group's devices alone)."""
    ex = examples.build("mlp", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = mixed(*[("a100-80gb", 2), ("h100", 1)][::order])
    options = PlanOptions(num_stages=2, costs="analytic")
    plan = partita.plan(graph, cluster=cluster, global_batch_size=8, options=options)
    assert plan.num_rank_groups == 2


def test_the_command_line_counts_every_group(no_capture, capsys):
    for devices in ("2xcpu,1xcpu@2GiB", "1xcpu@2GiB,2xcpu"):
        assert main(["plan", "mlp", "--devices", devices, "--num-stages", "4", "--global-batch", "8"]) == 2
        err = capsys.readouterr().err
        assert "needs at least 4 devices" in err and "the cluster has 3 (" in err, err


# ----------------------------------------------------------------------------- item 12: before the capture


@pytest.mark.parametrize(
    "cluster, pins, message",
    [
        (
            partita.Cluster(device="h100", num_devices=2),
            dict(schedules="interleaved1f1b", num_stages=1),
            "num_stages=1 pins one rank group",
        ),
        (partita.Cluster(device="h100", num_devices=4), dict(sharding="full_shard", replicas=1), "replicas=1"),
        (partita.Cluster(device="h100", num_devices=2), dict(num_stages=3), "needs at least 3 devices"),
        (partita.Cluster(device="h100", num_devices=2), dict(tensor_parallel=4), "tensor_parallel=4"),
        (partita.Cluster(device="h100", num_devices=2), dict(costs="measured"), "costs='measured' is impossible"),
        (
            partita.Cluster(device="h100", num_devices=4),
            dict(schedules="zbv", replicas=2, tensor_parallel=2),
            "one rank group",
        ),
        (mixed(("h100", 2), ("a100-80gb", 1)), dict(num_stages=4), "the cluster has 3"),
        (mixed(("h100", 2), ("a100-80gb", 1)), dict(schedules="zbv", num_stages=1), "num_stages=1"),
    ],
)
def test_contradictory_pins_are_refused_before_the_capture(no_capture, cluster, pins, message):
    model, args = _model()
    with pytest.raises(InputError, match=message):
        partita.plan(model, args, cluster=cluster, global_batch_size=8, options=PlanOptions(**pins))


def test_measured_costs_of_a_model_on_meta_are_refused_before_the_capture(no_capture):
    with torch.device("meta"):
        model, _ = _model()
    cluster = partita.Cluster(device="cpu", num_devices=2)
    with pytest.raises(InputError, match="the model is on the meta device"):
        partita.plan(
            model, (torch.randn(4, 8),), cluster=cluster, global_batch_size=8, options=PlanOptions(costs="measured")
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sequence-parallel", "yes", "--tensor-parallel", "1"], "sequence_parallel=True"),
        (["--schedule", "interleaved1f1b", "--num-stages", "1"], "num_stages=1 pins one rank group"),
        (["--device-type", "h100", "--costs", "measured"], "costs='measured' is impossible"),
    ],
)
def test_the_command_line_refuses_them_before_loading_the_model(no_capture, flags, message, capsys):
    assert main(["plan", "mlp", "--devices", "2", "--global-batch", "8", *flags]) == 2
    assert message in capsys.readouterr().err


def test_train_refuses_them_before_loading_the_model(no_capture, capsys):
    assert main(["train", "mlp", "--schedule", "zbv", "--num-stages", "1"]) == 2
    assert "num_stages=1 pins one rank group" in capsys.readouterr().err
    assert main(["train", "mlp", "--nproc", "2", "--num-stages", "3"]) == 2
    assert "needs at least 3 devices" in capsys.readouterr().err
