"""Wrong requests fail at once with a typed error naming the value, the cause and the fix, not
late (after planning, or after the whole run) or as a raw traceback (issue 15, and issue 16's
baselines that cannot make the stage count).

The command-line cases call ``partita.cli.main.main`` in this process: exit code 2 and the
message on stderr. Where the old behaviour was to carry on, the test replaces what would come
next (loading the model, planning, launching torchrun) with a failure, so that it fails fast.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch
from clusters import h100s

import partita
from partita import examples
from partita.cli.main import main
from partita.errors import InputError, PlanFileError
from partita.planning.manual import manual_plan
from partita.planning.options import PlanOptions
from partita.types import Schedule

CLI = importlib.import_module("partita.cli.main")  # the module (partita.cli.main is also its function)
LAUNCH = importlib.import_module("partita.runtime.launch")


def _forbid(monkeypatch, *names: str) -> None:
    """Make ``names`` (of partita.cli.main, or launch_local) fail the test if reached: the check
    must come first."""
    for name in names:

        def reached(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran before the bad flag was refused")

        monkeypatch.setattr(LAUNCH if name == "launch_local" else CLI, name, reached)


def _error(capsys) -> str:
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- train: checked at start


def test_unwritable_checkpoint_dir_is_refused_before_planning(tmp_path, monkeypatch, capsys):
    _forbid(monkeypatch, "_load", "_plan_for_training", "launch_local")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    assert main(["train", "mlp", "--checkpoint-dir", str(blocker / "ckpt")]) == 2
    err = _error(capsys)
    assert f"--checkpoint-dir '{blocker / 'ckpt'}' is not writable (Not a directory)" in err
    assert "choose a folder" in err
    assert main(["train", "mlp", "--losses-out", str(blocker / "losses.json")]) == 2
    assert "the folder of --losses-out" in _error(capsys)


def test_writable_checkpoint_dir_is_created_and_left_clean(tmp_path):
    from partita.runtime.checkpoint_dir import check_writable

    target = tmp_path / "new" / "ckpt"
    check_writable(target, "--checkpoint-dir")
    assert target.is_dir() and list(target.iterdir()) == []


def test_negative_max_restarts_and_nproc_are_refused(monkeypatch, capsys):
    from partita.runtime.launch import launch_local

    _forbid(monkeypatch, "_load", "_plan_for_training", "launch_local")
    assert main(["train", "mlp", "--max-restarts", "-1"]) == 2
    assert "--max-restarts must be >= 0 (restarts after a failure), got -1" in _error(capsys)
    assert main(["train", "mlp", "--nproc", "0"]) == 2
    assert "--nproc must be >= 1, got 0" in _error(capsys)
    with pytest.raises(InputError, match="max_restarts must be >= 0"):
        launch_local([], nproc=1, max_restarts=-1)


def test_global_batch_other_than_the_plan_files_is_refused(mlp, tmp_path, monkeypatch, capsys):
    _, graph = mlp
    path = tmp_path / "plan.json"
    manual_plan(
        graph, [0, graph.num_nodes], schedule="1f1b", num_rank_groups=1, num_microbatches=2, global_batch_size=8
    ).save(str(path))
    _forbid(monkeypatch, "launch_local")
    assert main(["train", "mlp", "--plan", str(path), "--global-batch", "12"]) == 2
    err = _error(capsys)
    assert f"--global-batch 12 differs from the global batch 8 of the plan {path}" in err
    assert "drop --global-batch" in err
    launched = []
    monkeypatch.setattr(LAUNCH, "launch_local", lambda argv, **kw: launched.append(kw))
    assert main(["train", "mlp", "--plan", str(path), "--global-batch", "8"]) == 0  # the same: fine
    assert main(["train", "mlp", "--plan", str(path)]) == 0  # the plan's
    assert launched == [{"nproc": 1, "max_restarts": 0}] * 2


# ----------------------------------------------------------------------------- batch divisibility


def test_global_batch_not_divisible_by_microbatches_names_the_cause(monkeypatch, capsys):
    _forbid(monkeypatch, "_load", "_plan_for_training")
    assert (
        main(["plan", "mlp", "--devices", "2", "--device-type", "h100", "--global-batch", "10", "--microbatches", "4"])
        == 2
    )
    err = _error(capsys)
    assert "--global-batch 10 is not divisible by --microbatches 4" in err
    assert "use --global-batch 8 or 12, or --microbatches 1, 2, 5, 10" in err
    assert "memory" not in err
    assert main(["train", "mlp", "--global-batch", "12", "--microbatches", "4", "--replicas", "2"]) == 2
    assert "--global-batch 12 is not divisible by --microbatches 4 x --replicas 2 = 8" in _error(capsys)


def test_planner_checks_divisibility_before_searching(mlp):
    _, graph = mlp
    with pytest.raises(
        InputError,
        match=r"global_batch_size 10 is not divisible by num_microbatches 4: .*"
        r"use global_batch_size 8 or 12, or num_microbatches 1, 2, 5, 10",
    ):
        partita.plan(graph, cluster=h100s(2), global_batch_size=10, options=PlanOptions(num_microbatches=4))
    with pytest.raises(InputError, match=r"global_batch_size 9 is not divisible by replicas 2: .*8 or 10"):
        partita.plan(graph, cluster=h100s(2), global_batch_size=9, options=PlanOptions(replicas=2))


# ----------------------------------------------------------------------------- plan: --nodes


def test_nodes_must_be_positive_and_divide_the_devices(monkeypatch, capsys):
    _forbid(monkeypatch, "_load")
    assert main(["plan", "mlp", "--devices", "2", "--device-type", "h100", "--global-batch", "8", "--nodes", "0"]) == 2
    assert "--nodes must be >= 1, got 0" in _error(capsys)
    assert main(["plan", "mlp", "--devices", "8", "--device-type", "h100", "--global-batch", "8", "--nodes", "3"]) == 2
    assert "--nodes 3 does not divide --devices 8" in _error(capsys)
    assert main(["plan", "mlp", "--devices", "2", "--global-batch", "8", "--nodes", "3"]) == 2
    assert "--nodes 3 with --device-type cpu: cpu plans are for this machine, one node" in _error(capsys)
    # without --nodes, catalog devices fill nodes of 8 as a device group does: 12 do not
    assert main(["plan", "mlp", "--devices", "12", "--device-type", "h100", "--global-batch", "12"]) == 2
    assert "--devices 12 of h100 do not fill nodes of 8 devices (the default): give --nodes" in _error(capsys)


def test_catalog_devices_fill_nodes_of_8_without_nodes(tmp_path):
    """``--devices 16 --device-type h100`` is the cluster of ``--devices 16xh100``: two nodes of 8 (it
    was one node of 16, NVLink between all of them, where HGX nodes hold 8)."""
    from partita.types.plan_file import load_plan

    paths = {}
    for name, devices in (("count", ["--devices", "16", "--device-type", "h100"]), ("group", ["--devices", "16xh100"])):
        paths[name] = tmp_path / f"{name}.json"
        argv = ["plan", "mlp", *devices, "--global-batch", "16", "--costs", "analytic", "--out", str(paths[name])]
        assert main(argv) == 0
    count, group = (load_plan(str(paths[n])) for n in ("count", "group"))
    assert count.cluster.devices_per_node == 8 and count.cluster.num_devices == 16
    assert group.cluster.group_clusters[0].devices_per_node == 8


# ----------------------------------------------------------------------------- ids and labels

FACTORY = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, ids):
        return self.head(self.emb(ids)).mean(1)

def big_ids():
    return M(), (torch.tensor([[1, 2, 3], [4, 5, 17], [0, 1, 2], [3, 4, 5]]),), nn.functional.cross_entropy, torch.arange(4)

def big_labels():
    return M(), (torch.randint(0, 10, (4, 3)),), nn.functional.cross_entropy, torch.tensor([0, 1, 12, 3])
"""


def test_ids_and_labels_out_of_range_are_named_before_planning(tmp_path, capsys):
    factory = tmp_path / "model.py"
    factory.write_text(FACTORY)
    common = ["--devices", "1", "--device-type", "h100", "--global-batch", "4"]
    assert main(["plan", f"{factory}:big_ids", *common]) == 2
    err = _error(capsys)
    assert "args[0] holds id 17, but the embedding emb has 10 rows: ids must be in [0, 10)" in err
    assert main(["plan", f"{factory}:big_labels", *common]) == 2
    err = _error(capsys)
    assert "target holds label 12, but the loss scores 10 classes: labels must be in [0, 10) or -100" in err


def test_batch_values_check_dtype_and_range(mlp):
    from partita.runtime.batch_values import check_batch_values, index_uses
    from partita.runtime.stages import flatten_inputs

    ex = examples.build("gpt2", batch_size=2)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    uses = {u.kind: u for u in index_uses(graph)}
    assert uses["embedding"].where == "transformer.wte" and uses["target"].ignore_index == -100
    ids = ex.kwargs["input_ids"]
    vocab = uses["embedding"].bound
    check_batch_values(graph, flatten_inputs(graph, ex.args, ex.kwargs), "step 1")
    bad = flatten_inputs(graph, ex.args, {**ex.kwargs, "input_ids": torch.full_like(ids, vocab)})
    with pytest.raises(
        InputError,
        match=rf"step 1: kwargs\['input_ids'\] holds id {vocab}, but the embedding "
        rf"transformer.wte has {vocab} rows",
    ):
        check_batch_values(graph, bad, "step 1")
    floats = flatten_inputs(graph, ex.args, {**ex.kwargs, "input_ids": ids.float()})
    with pytest.raises(InputError, match=r"input_ids'\] is float32, but it holds the ids .*\(torch.long\)"):
        check_batch_values(graph, floats, "step 1")
    ignored = flatten_inputs(graph, ex.args, {**ex.kwargs, "labels": torch.full_like(ids, -100)})
    check_batch_values(graph, ignored, "step 1")  # the loss's ignore_index is allowed
    _, mlp_graph = mlp
    x, y = mlp[0].args[0], mlp[0].target
    with pytest.raises(InputError, match="target holds label -1"):
        check_batch_values(mlp_graph, [x, torch.full_like(y, -1)], "step 2")


# ----------------------------------------------------------------------------- plan files


def test_a_binary_plan_file_is_a_plan_file_error(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    with pytest.raises(PlanFileError, match=r"is not a plan file: byte 0 is not UTF-8 text"):
        partita.Plan.load(str(path))
    assert main(["train", "mlp", "--plan", str(path)]) == 2
    assert "is not a plan file" in _error(capsys)


def test_a_zbv_plan_edited_to_recompute_is_refused(mlp, tmp_path):
    _, graph = mlp
    plan = partita.plan(
        graph, cluster=h100s(2), global_batch_size=8, options=PlanOptions(schedules="zbv", num_stages=2)
    )
    assert plan.schedule is Schedule.ZBV and not any(s.recompute for s in plan.stages)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    data = json.loads(path.read_text())
    for level in (True, "selective", "full"):  # schema 1's true is full
        data["stages"][1]["recompute"] = level
        path.write_text(json.dumps(data))
        with pytest.raises(
            PlanFileError, match=r"stages\[1\]\.recompute is '(selective|full)', but the schedule is zbv"
        ):
            partita.Plan.load(str(path))
    # manual plans may ask the runtime for it (no memory predictions): still loadable
    manual = manual_plan(
        graph,
        [0, graph.num_nodes // 2, graph.num_nodes],
        schedule="zbv",
        num_rank_groups=1,
        num_microbatches=2,
        global_batch_size=8,
        recompute=True,
    )
    manual.save(str(path))
    assert partita.Plan.load(str(path)).stages[0].recompute


# ----------------------------------------------------------------------------- baselines (issue 16)


def test_a_baseline_that_cannot_make_the_stage_count_is_not_reported_as_out_of_memory(mlp, capsys):
    from partita.planning.api import plan_with_baselines

    _, graph = mlp
    result = plan_with_baselines(graph, cluster=h100s(8), global_batch_size=16, options=PlanOptions(num_stages=8))
    assert result.baselines["uniform"] is None  # backwards compatible: None for no plan
    assert result.baseline_reasons["uniform"] == "cannot split into 8 stages: the model has 4 repeated layers"
    assert set(result.baseline_reasons) == {name for name, p in result.baselines.items() if p is None}
    assert (
        main(["plan", "mlp", "--devices", "8", "--device-type", "h100", "--global-batch", "16", "--num-stages", "8"])
        == 0
    )
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("uniform"))
    assert row.split()[1] == "n/a", row
    assert "n/a: uniform cannot split into 8 stages: the model has 4 repeated layers" in out


def test_plan_text_tells_no_split_from_no_fit(mlp):
    from partita.report.plan import plan_text

    _, graph = mlp
    plan = partita.plan(graph, cluster=h100s(2), global_batch_size=8)
    rows = plan_text(
        plan,
        baselines={"uniform": None, "parameters": None},
        baseline_reasons={
            "uniform": "cannot split into 2 stages: the model has 1 repeated layers",
            "parameters": "does not fit",
        },
    ).splitlines()
    fits = {line.split()[0]: line.split()[1] for line in rows if line.split()[:1] in (["uniform"], ["parameters"])}
    assert fits == {"uniform": "n/a", "parameters": "no"}
    row = next(line for line in plan_text(plan, baselines={"uniform": None}).splitlines() if line.startswith("uniform"))
    assert row.split()[1] == "no"  # without reasons: as before
