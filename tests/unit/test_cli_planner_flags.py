"""`partita plan` and `partita train` share one declaration of the planner's flags (issue 54, item
10): train accepts every planner flag plan does (it had no --recompute nor --costs), and each reaches
the PlanOptions (``partita.cli.main._plan_options``, which reads them directly)."""

from __future__ import annotations

import argparse
import importlib
import re

import pytest

import partita
from partita import examples
from partita.cli.main import _plan_options, main
from partita.cli.parser import build_parser
from partita.planning.options import CostSource, PlanOptions
from partita.types import Recompute

LAUNCH = importlib.import_module("partita.runtime.launch")

# Flags of `plan` that describe the cluster or the files it writes; every other one is a planner flag.
PLAN_ONLY = {"--devices", "--device-type", "--nodes", "--out", "--png"}


def _flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in sub.choices[command]._actions for flag in action.option_strings}


def test_train_accepts_every_planner_flag_of_plan():
    missing = _flags("plan") - PLAN_ONLY - _flags("train")
    assert not missing, f"train lacks the planner flags {sorted(missing)}"


@pytest.mark.parametrize("command", ["plan", "train"])
def test_recompute_and_costs_reach_the_plan_options(command):
    extra = ["--devices", "2", "--global-batch", "8"] if command == "plan" else []
    args = build_parser().parse_args([command, "mlp", *extra, "--recompute", "full", "--costs", "analytic"])
    options = _plan_options(args)
    assert options.recompute is Recompute.FULL and options.costs is CostSource.ANALYTIC
    unset = _plan_options(build_parser().parse_args([command, "mlp", *extra]))
    assert unset.recompute is None and unset.costs is CostSource.AUTO


def test_plan_options_read_the_flags_directly():
    """No getattr default hides a flag that one command lacks: a missing one is an error here."""
    args = vars(build_parser().parse_args(["train", "mlp"]))
    for name in ("recompute", "costs", "precision", "sharding", "tensor_parallel", "sequence_parallel"):
        with pytest.raises(AttributeError, match=name):
            _plan_options(argparse.Namespace(**{k: v for k, v in args.items() if k != name}))


def test_train_with_a_plan_file_refuses_recompute_and_costs_it_disagrees_with(tmp_path, monkeypatch, capsys):
    ex = examples.build("mlp", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = partita.Cluster(device="h100", num_devices=2)
    options = PlanOptions(num_stages=2, replicas=1, schedules="1f1b", recompute="none", tensor_parallel=1)
    plan = partita.plan(graph, cluster=cluster, global_batch_size=16, options=options)
    path = str(tmp_path / "plan.json")
    plan.save(path)
    monkeypatch.setattr(LAUNCH, "launch_local", lambda *a, **k: pytest.fail("launched despite a disagreeing flag"))
    for flags, message in (
        (["--recompute", "full"], "--recompute full disagrees .* which has recompute none"),
        (["--costs", "measured"], "--costs measured disagrees .* which has costs analytic"),
    ):
        assert main(["train", "mlp", "--plan", path, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert re.search(message, err), (flags, err)
    launched = []
    monkeypatch.setattr(LAUNCH, "launch_local", lambda argv, **kw: launched.append(kw["nproc"]))
    assert main(["train", "mlp", "--plan", path, "--recompute", "none", "--costs", "auto"]) == 0
    assert launched == [2]
