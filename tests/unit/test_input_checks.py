"""Inputs that the newer features (precision, sharding, tensor parallelism, data sources, resumes,
multi-node flags, plan files) mishandled (issue 32): each is honoured, or refused with a typed
error naming the value, the cause and the fix, before work is lost.

Command-line cases call ``partita.cli.main.main`` in this process (exit code 2, the message on
stderr), with what would come next (loading, planning, launching) replaced by a failure where the
check must come first. Trainer cases run on a 1-rank gloo group in this process.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import partita
from partita import examples
from partita.capturing import flatten_call_inputs
from partita.cli.main import _plan_options, main
from partita.cli.model_spec import _as_example, load_model
from partita.cli.parser import build_parser
from partita.errors import InputError, ModelSpecError, PlanFileError
from partita.planning.api import check_sharding_applied
from partita.planning.manual import manual_plan
from partita.planning.options import PlanOptions
from partita.training.data_source import DataPosition, check_first_batch, training_batches
from partita.types import OptimizerKind, Precision, Schedule, Sharding
from partita.types.choices import ALIASES
from partita.units import fmt_bytes

CLI = importlib.import_module("partita.cli.main")
LAUNCH = importlib.import_module("partita.runtime.launch")


def _forbid(monkeypatch, *names: str) -> None:
    for name in names:

        def reached(*args, _name=name, **kwargs):
            raise AssertionError(f"{_name} ran before the bad input was refused")

        if name == "plan":
            monkeypatch.setattr(partita, "plan", reached)
        else:
            monkeypatch.setattr(LAUNCH if name == "launch_local" else CLI, name, reached)


@pytest.fixture(scope="module")
def mlp():
    ex = examples.build("mlp", batch_size=4)
    return ex, partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def h100s(n: int) -> partita.Cluster:
    return partita.Cluster(device="h100", num_devices=n, devices_per_node=8)


# ----------------------------------------------------------------------------- planner flags with --plan


@pytest.fixture(scope="module")
def plan_file(mlp, tmp_path_factory):
    """A 2-stage 1F1B fp32 plan of the zoo mlp for 2 devices, made for Adam-like optimizer state."""
    _, graph = mlp
    options = PlanOptions(num_stages=2, replicas=1, schedules="1f1b", precision="fp32", tensor_parallel=1)
    plan = partita.plan(graph, cluster=h100s(2), global_batch_size=16, options=options)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(str(path))
    return str(path), plan


def test_planner_flags_that_disagree_with_the_plan_file_are_refused(plan_file, monkeypatch, capsys, tmp_path):
    path, plan = plan_file
    _forbid(monkeypatch, "launch_local")
    m = plan.num_microbatches
    cases = [
        (["--precision", "bf16"], "--precision bf16 disagrees with the plan .*, which has precision fp32"),
        (["--sharding", "full_shard"], "--sharding full_shard disagrees .* which has sharding replicate replicate"),
        (["--tensor-parallel", "2"], "--tensor-parallel 2 disagrees .* which has tensor parallel 1"),
        (["--num-stages", "1"], "--num-stages 1 disagrees .* which has num stages 2"),
        (["--schedule", "zbv"], "--schedule zbv disagrees .* which has schedule 1f1b"),
        (["--replicas", "2"], "--replicas 2 disagrees .* which has replicas 1"),
        (["--microbatches", str(2 * m)], f"--microbatches {2 * m} disagrees .* which has microbatches {m}"),
        (
            ["--memory", "1GiB"],
            f"--memory {fmt_bytes(2**30)} disagrees .* which has memory {fmt_bytes(plan.cluster.memory_bytes)}",
        ),
        (["--cache-dir", str(tmp_path)], "--cache-dir .* with --plan .*: --cache-dir is where planning writes"),
        (["--plan-out", str(tmp_path / "p.json")], "--plan-out .* with --plan"),
    ]
    for flags, message in cases:
        assert main(["train", "mlp", "--plan", path, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert re.search(message, err), (flags, err)
        if "disagrees" in message:
            assert "drop --" in err and "re-plan with --" in err, err


def test_planner_flags_that_agree_with_the_plan_file_train_as_it_says(plan_file, monkeypatch, capsys):
    path, plan = plan_file
    launched = []
    monkeypatch.setattr(LAUNCH, "launch_local", lambda argv, **kw: launched.append(kw["nproc"]))
    agreeing = ["--precision", "float32", "--schedule", "1F1B", "--num-stages", "2", "--replicas", "1"]
    agreeing += ["--tensor-parallel", "1", "--sharding", "ddp", "--microbatches", str(plan.num_microbatches)]
    assert main(["train", "mlp", "--plan", path, *agreeing, "--optimizer", "sgd"]) == 0, capsys.readouterr().err
    assert launched == [2]


def test_an_optimizer_keeping_more_state_than_the_plan_counted_is_refused(mlp, tmp_path, monkeypatch, capsys):
    _, graph = mlp
    plan = partita.plan(graph, cluster=h100s(2), global_batch_size=16, options=PlanOptions(optimizer="sgd"))
    plan.save(str(tmp_path / "sgd.json"))
    _forbid(monkeypatch, "launch_local")
    assert main(["train", "mlp", "--plan", str(tmp_path / "sgd.json"), "--optimizer", "adamw"]) == 2
    err = capsys.readouterr().err
    assert "--optimizer adamw keeps 2 state tensor(s) per parameter, but the plan" in err
    assert "was made for optimizer 'none' (0)" in err and "re-plan with --optimizer adamw" in err


# ----------------------------------------------------------------------------- plan files: records and executed fields


def test_plan_file_options_must_agree_with_the_executed_fields(mlp, tmp_path):
    _, graph = mlp
    plan = partita.plan(
        graph, cluster=h100s(4), global_batch_size=16, options=PlanOptions(tensor_parallel=2, precision="fp32")
    )
    data = json.loads(open(_saved(plan, tmp_path)).read())
    partita.Plan.load(_write(tmp_path, data))  # as written: they agree
    edits = [
        (("tensor_parallel", 4), r"options.tensor_parallel is 4, but the plan's stages run 2: options only record"),
        (("precision", "bf16"), r"options.precision is 'bf16', but the plan's stages run 'fp32'"),
        (("num_microbatches", plan.num_microbatches + 1), r"options.num_microbatches is"),
    ]
    for (field, value), message in edits:
        edited = json.loads(json.dumps(data))
        edited["options"][field] = value
        with pytest.raises(PlanFileError, match=message):
            partita.Plan.load(_write(tmp_path, edited))
    replicated = partita.plan(
        graph, cluster=h100s(2), global_batch_size=16, options=PlanOptions(replicas=2, sharding="replicate")
    )
    data = json.loads(open(_saved(replicated, tmp_path)).read())
    data["options"]["sharding"] = "full_shard"
    with pytest.raises(
        PlanFileError, match=r"options.sharding is 'full_shard', but the plan's stages run \['replicate'"
    ):
        partita.Plan.load(_write(tmp_path, data))
    n = graph.num_nodes
    manual = manual_plan(
        graph, [0, n // 2, n], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=8
    )
    data = json.loads(open(_saved(manual, tmp_path)).read())
    partita.Plan.load(_write(tmp_path, data))
    data["options"]["boundaries"][1] += 1
    with pytest.raises(PlanFileError, match=r"options.boundaries is .* edit those instead, or re-plan"):
        partita.Plan.load(_write(tmp_path, data))


def _saved(plan, tmp_path) -> str:
    path = str(tmp_path / "saved.json")
    plan.save(path)
    return path


def _write(tmp_path, data: dict) -> str:
    path = str(tmp_path / "edited.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return path


# ----------------------------------------------------------------------------- one vocabulary


@pytest.mark.parametrize(
    "cls, flag, field",
    [
        (Schedule, "--schedule", "schedules"),
        (Precision, "--precision", "precision"),
        (Sharding, "--sharding", "sharding"),
        (OptimizerKind, "--optimizer", "optimizer"),
    ],
)
def test_plan_options_and_the_command_line_accept_the_same_spellings(cls, flag, field, capsys):
    spellings = [m.value for m in cls] + list(ALIASES[cls]) + [m.value.upper().replace("_", "-") for m in cls]
    for text in spellings:
        args = build_parser().parse_args(["plan", "mlp", "--devices", "2", "--global-batch", "8", flag, text])
        assert getattr(_plan_options(args), field) == getattr(PlanOptions(**{field: text}), field), text
    for bogus in ("zero4", "fp8", "adagrad", "1f2b"):
        if any(bogus == s.lower() for s in spellings):
            continue
        with pytest.raises(InputError, match="is not one of"):
            PlanOptions(**{field: bogus})
        with pytest.raises(SystemExit):
            build_parser().parse_args(["plan", "mlp", "--devices", "2", "--global-batch", "8", flag, bogus])
        assert "is not one of" in capsys.readouterr().err
    if cls is not OptimizerKind:  # train's --optimizer names the torch optimizer to build
        args = build_parser().parse_args(["train", "mlp", flag, spellings[-1]])
        assert getattr(_plan_options(args), field) == getattr(PlanOptions(**{field: spellings[-1]}), field)


# ----------------------------------------------------------------------------- pinned sharding


def test_a_pinned_sharding_level_is_applied_or_refused(mlp, capsys):
    _, graph = mlp
    plan = partita.plan(graph, cluster=h100s(2), global_batch_size=16, options=PlanOptions(sharding="full_shard"))
    assert any(s.sharding is Sharding.FULL_SHARD for s in plan.stages), plan.summary()
    argv = ["plan", "mlp", "--devices", "2", "--global-batch", "16", "--device-type", "h100", "--sharding", "zero2"]
    assert main(argv) == 0
    assert "grads+opt" in capsys.readouterr().out.split("efficiency")[0]  # the plan's table, not only a baseline's
    with pytest.raises(
        InputError, match=r"sharding='full_shard' shards a stage over its replicas, but the cluster has one"
    ):
        partita.plan(graph, cluster=h100s(1), global_batch_size=16, options=PlanOptions(sharding="full_shard"))
    n = graph.num_nodes
    unsharded = manual_plan(
        graph, [0, n // 2, n], schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=8
    )
    with pytest.raises(InputError, match=r"sharding='full_shard' is pinned, but no plan that fits shards a stage"):
        check_sharding_applied(unsharded, PlanOptions(sharding="full_shard"))


# ----------------------------------------------------------------------------- pinned schedules


@pytest.mark.parametrize(
    ("devices", "pins", "why"),
    [
        (1, {"schedules": ("zbv",)}, "the cluster has one device"),
        (1, {"schedules": ("interleaved1f1b",), "recompute": "full"}, "the cluster has one device"),
        (4, {"schedules": ("zbv", "interleaved1f1b"), "num_stages": 1}, "num_stages=1 pins one rank group"),
        (2, {"schedules": ("zbv",), "replicas": 2}, "replicas=2 makes all 2 devices one rank group"),
        (2, {"schedules": ("zbv",), "tensor_parallel": 2}, "tensor_parallel=2 makes all 2 devices one rank group"),
    ],
)
def test_schedules_of_several_stages_per_group_on_one_rank_group_are_refused(gpt2_graph, devices, pins, why):
    """Interleaved 1F1B and ZB-V need a pipeline of 2 or more rank groups: on one, the request is
    refused for that reason (before, the memory bound's error blamed memory for a 150 K-parameter
    model: "no pipeline of stages that fit covers the model")."""
    with pytest.raises(InputError, match=re.escape(why) + r": allow 'gpipe' or '1f1b'"):
        partita.plan(gpt2_graph, cluster=h100s(devices), global_batch_size=8, options=PlanOptions(**pins))


@pytest.mark.parametrize(
    ("pins", "text"),
    [
        ({"num_stages": 4}, "num_stages=4 needs at least 4 devices"),
        ({"num_stages": 2, "replicas": 2}, "num_stages=2 x replicas=2 needs at least 4 devices"),
    ],
)
def test_stages_and_replicas_pinned_past_the_devices_are_refused(mlp_graph, pins, text):
    """Without a pinned degree too (``check_degree`` checks that case): before, the search's error
    blamed memory ("every split the search tried exceeds 75.7 GiB") for a 15 K-parameter model."""
    with pytest.raises(InputError, match=re.escape(text) + r" .* but the cluster has 2"):
        partita.plan(mlp_graph, cluster=h100s(2), global_batch_size=32, options=PlanOptions(**pins))


def test_pins_that_leave_no_pipeline_shape_name_the_pins_not_memory(gpt2_graph):
    """Interleaved 1F1B (2+ rank groups) and full_shard (2+ replicas per group) on 2 units of
    tensor_parallel=2: no shape at any memory. Before, the error said every split the search tried
    exceeded 75.7 GiB, for a 150 K-parameter model."""
    options = PlanOptions(schedules=("interleaved1f1b",), tensor_parallel=2, sharding="full_shard")
    with pytest.raises(partita.InfeasiblePlanError, match="the pinned options allow no pipeline") as caught:
        partita.plan(gpt2_graph, cluster=h100s(4), global_batch_size=8, options=options)
    err = caught.value
    assert err.binding == "pins" and "exceeds" not in str(err), str(err)
    assert {f.option for f in err.fixes} >= {"sharding", "schedules"}, [f.text for f in err.fixes]


def test_schedules_of_several_stages_per_group_plan_over_two_rank_groups(gpt2_graph):
    plan = partita.plan(gpt2_graph, cluster=h100s(2), global_batch_size=8, options=PlanOptions(schedules=("zbv",)))
    assert plan.schedule.value == "zbv" and plan.num_rank_groups == 2, plan.summary()
    mixed = PlanOptions(schedules=("zbv", "gpipe"))  # one schedule of one stage per group: planned
    assert partita.plan(gpt2_graph, cluster=h100s(1), global_batch_size=8, options=mixed).schedule.value == "gpipe"


# ----------------------------------------------------------------------------- resumes and checkpoints


def test_resume_at_or_past_the_last_step_is_refused_before_launch(tmp_path, monkeypatch, capsys):
    from partita.runtime.checkpoint_dir import METADATA_FILE, checkpoint_path

    done = tmp_path / "ckpt"
    step = done / checkpoint_path("", 8).lstrip("/")
    step.mkdir(parents=True)
    (step / METADATA_FILE).write_bytes(b"meta")
    _forbid(monkeypatch, "_load", "_plan_for_training", "launch_local")
    for steps in ("8", "5"):
        assert main(["train", "mlp", "--checkpoint-dir", str(done), "--resume", "--steps", steps]) == 2
        err = capsys.readouterr().err
        assert f"is at step 8, and --steps {steps} would train nothing more" in err, err
        assert "give --steps above 8, or drop --resume" in err


def test_a_checkpoint_of_a_model_with_other_shapes_is_named(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from partita.runtime.checkpoint import load_into_model

    written = nn.Linear(4, 3)
    path = str(tmp_path / "step-000001")
    state = {f"model.{name}": t.detach() for name, t in written.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP: "assuming the intent is to save in a single process" (it is)
        dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    with pytest.warns(UserWarning, match="cannot be verified"):  # no manifest: written by hand here
        with pytest.raises(InputError, match=r"holds weight with shape \[3, 4\], but this model's has shape \[3, 6\]"):
            load_into_model(nn.Linear(6, 3), path)


# ----------------------------------------------------------------------------- the command line itself


def test_a_factory_imports_the_modules_beside_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "issue32_tiny.py").write_text("import torch\nclass Tiny(torch.nn.Linear):\n    pass\n")
    (tmp_path / "factory.py").write_text(
        textwrap.dedent(
            """
            import torch
            from issue32_tiny import Tiny

            def build():
                return Tiny(4, 2), (torch.randn(8, 4),), torch.nn.functional.cross_entropy, torch.zeros(8, dtype=torch.long)
            """
        )
    )
    example = load_model(f"{tmp_path / 'factory.py'}:build")
    assert type(example.model).__name__ == "Tiny"


def test_a_negative_number_in_scientific_notation_reaches_its_flag(monkeypatch, capsys):
    _forbid(monkeypatch, "_load", "_plan_for_training", "launch_local")
    assert main(["train", "mlp", "--lr-schedule", "cosine", "--min-lr", "-1e-3"]) == 2
    assert "--min-lr must be between 0 and --lr" in capsys.readouterr().err


def test_plan_options_cache_dir_must_be_a_path():
    with pytest.raises(InputError, match=r"cache_dir must be a folder path .* got 123 of type int"):
        PlanOptions(cache_dir=123)


# ----------------------------------------------------------------------------- batches given to the trainer


def test_inputs_of_another_structure_are_described_in_words(mlp):
    ex, graph = mlp
    (x,), y = ex.args, ex.target
    with pytest.raises(InputError) as caught:
        flatten_call_inputs(graph, (x.tolist(),), {}, y)
    assert "args[0] is a list of 4 item(s), the example's was a tensor of shape" in str(caught.value)
    assert "TreeSpec" not in str(caught.value)
    with pytest.raises(InputError, match=r"0 positional input\(s\) given, the example had 1; no target= given"):
        flatten_call_inputs(graph)


@pytest.fixture(scope="module")
def one_rank_trainer():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
    graph = partita.capture(model, (x[:8],), loss_fn=nn.functional.cross_entropy, target=y[:8])
    plan = manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=16
    )
    trainer = partita.Trainer(model, plan, graph=graph, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    yield trainer, x, y
    dist.destroy_process_group()


def test_batches_of_other_dtypes_or_unsupported_shapes_are_named(one_rank_trainer, capfd):
    trainer, x, y = one_rank_trainer
    trainer.step(x, target=y)
    cases = [
        (lambda: trainer.step(x.double(), target=y), r"step 2: args\[0\] is float64, but the model was captured with "
         r"float32 there: .* pass float32 tensors \(args\[0\].float\(\)\)"),
        (lambda: trainer.step(x, target=y.int()), r"step 2: target is int32, but the model was captured with int64"),
        (lambda: trainer.step(x, target=y.float()), r"step 2: target is float32, but the model was captured with int64"),
        (lambda: trainer.evaluate(x[:, :8], target=y), r"evaluate: the model cannot run on this batch, whose shapes "
         r"differ from the example .*: args\[0\] \[8\] \(the example: \[16\]\)\. Capturing it at these shapes failed"),
        (lambda: trainer.step(torch.randn(16, 15), target=y), r"step 2: the model cannot run on this batch.*args\[0\] "
         r"\[15\] \(the example: \[16\]\).*give batches shaped like the example inputs"),
        (lambda: trainer.evaluate(x.tolist(), target=y), r"args\[0\] is a list of 16 item\(s\)"),
        (lambda: trainer.evaluate(), r"0 positional input\(s\) given"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(InputError, match=message):
            call()
    assert trainer.num_steps == 1, "no refused batch was trained on"
    assert "failed while attempting to run meta" not in capfd.readouterr().err, "torch's log of the failed capture"


def test_a_checkpoint_of_other_shapes_is_refused_by_the_trainer(one_rank_trainer, tmp_path):
    trainer, x, y = one_rank_trainer
    trainer.save_checkpoint(str(tmp_path / "step-000001"))
    wider = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 4))  # the same names, other shapes
    graph = partita.capture(wider, (x[:8],), loss_fn=nn.functional.cross_entropy, target=y[:8])
    plan = manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=16
    )
    other = partita.Trainer(wider, plan, graph=graph, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(
        InputError, match=r"holds 0.weight with shape \[32, 16\], but this model's has shape \[48, 16\]"
    ):
        other.load_checkpoint(str(tmp_path / "step-000001"))


# ----------------------------------------------------------------------------- data sources, before launch


def _classifier_example(**fields):
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return _as_example(
        "test.py:factory",
        {"model": model, "inputs": (x,), "loss_fn": nn.functional.cross_entropy, "target": y} | fields,
    )


@pytest.fixture(scope="module")
def classifier():
    ex = _classifier_example()
    return ex, partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)


def _with(example, **fields):
    import dataclasses

    return dataclasses.replace(example, **fields)


def test_the_first_batch_of_each_source_is_checked_before_launch(classifier):
    ex, graph = classifier
    good = [(torch.randn(16, 16), torch.randint(0, 4, (16,)))]
    check_first_batch(_with(ex, data=good, eval_data=good), graph, batch_size=16, held_out=True)
    cases = [
        (dict(data=[(torch.randn(16, 15), torch.randint(0, 4, (16,)))]),
         r"batch 0 of data: the model cannot run on this batch, .*args\[0\] \[15\] \(the example: \[16\]\)"),
        (dict(data=[(torch.randn(16, 16), torch.randint(0, 4, (16,)).float())]),
         r"batch 0 of data: target is float32, but the model was captured with int64"),
        (dict(data=good, eval_data=[(torch.randn(16, 15), torch.randint(0, 4, (16,)))]),
         r"batch 0 of eval_data: the model cannot run on this batch"),
        (dict(data=[(torch.randn(16, 16), torch.randint(4, 9, (16,)))]),
         r"batch 0 of data: target holds label \d, but the loss scores 4 classes"),
        (dict(data=[(torch.randn(3, 16), torch.randint(0, 4, (3,)))]), "data holds 3 samples, fewer than the 16 samples of one step"),
        (dict(data=good, eval_data=[]), "eval_data holds 0 samples, fewer than the 16 samples of one step"),
        (dict(data=[{"x": torch.randn(16, 16)}]), r"batch 0 of data is a dict, but the model takes 1 positional input"),
    ]  # fmt: skip
    for fields, message in cases:
        with pytest.raises(InputError, match=message):
            check_first_batch(_with(ex, **fields), graph, batch_size=16, held_out=True)


def test_a_one_shot_iterator_is_refused_when_the_factory_returns_it():
    batches = iter([(torch.randn(16, 16), torch.randint(0, 4, (16,)))])
    with pytest.raises(ModelSpecError, match=r"is a one-shot iterator .* give a list, a DataLoader, or a function"):
        _classifier_example(data=batches)
    _classifier_example(data=lambda: iter([]))  # a function returning a fresh iterator is fine


FACTORY = """
import torch
from torch import nn

def build():
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    data = [(torch.randn(16, {features}), torch.randint(0, 4, (16,))) for _ in range(4)]
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return {{"model": model, "inputs": (x,), "loss_fn": nn.functional.cross_entropy, "target": y, "data": data}}
"""


def test_a_bad_data_batch_stops_the_command_before_planning_or_launch(tmp_path, monkeypatch, capsys):
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY.format(features=15))
    _forbid(monkeypatch, "plan", "launch_local", "_cluster")
    assert main(["train", f"{factory}:build", "--global-batch", "16"]) == 2
    err = capsys.readouterr().err
    assert "batch 0 of data: the model cannot run on this batch" in err and "args[0] [15] (the example: [16])" in err
    good = tmp_path / "good.py"
    good.write_text(FACTORY.format(features=16))
    ex = load_model(f"{good}:build")
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    plan = manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=16
    )
    plan.save(str(tmp_path / "plan.json"))
    assert main(["train", f"{factory}:build", "--plan", str(tmp_path / "plan.json")]) == 2  # with --plan too
    assert "batch 0 of data: the model cannot run on this batch" in capsys.readouterr().err


# ----------------------------------------------------------------------------- where the data stands


def test_a_resume_continues_at_the_data_position_with_any_step_size():
    ex = _classifier_example()
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    x, y = torch.randn(20, 16), torch.randint(0, 4, (20,))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=6)  # 6, 6, 6, 2
    source = _with(ex, data=loader)
    batches = training_batches(source, graph, 8, note=lambda text: None)
    positions = []
    for _ in range(3):
        next(batches)
        positions.append(batches.position)
    assert positions == [DataPosition(0, 8), DataPosition(0, 16), DataPosition(1, 8)]  # 4 dropped at the end of epoch 1
    resumed = training_batches(source, graph, 4, position=DataPosition(0, 8), note=lambda text: None)
    starts = [0] * 4
    for k in range(4):
        (args, _, target), starts[k] = next(resumed), resumed.position
        first = 8 + 4 * k if k < 3 else 0
        assert torch.equal(args[0], x[first : first + 4]) and torch.equal(target, y[first : first + 4]), k
    assert starts == [DataPosition(0, 12), DataPosition(0, 16), DataPosition(0, 20), DataPosition(1, 4)]


def test_a_dataset_of_rows_resumes_at_its_row_with_any_step_size(classifier):
    ex, graph = classifier
    x, y = torch.randn(10, 16), torch.randint(0, 4, (10,))

    class Rows:
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return x[i], y[i]

    source = _with(ex, data=Rows())
    resumed = training_batches(source, graph, 2, start_step=2, position=DataPosition(0, 4), note=lambda text: None)
    firsts = []
    for _ in range(4):
        (args, _, _), position = next(resumed), resumed.position
        firsts.append((int(torch.nonzero((x == args[0][0]).all(dim=1))[0]), position))
    assert firsts == [
        (4, DataPosition(0, 6)),
        (6, DataPosition(0, 8)),
        (8, DataPosition(0, 10)),
        (0, DataPosition(1, 2)),
    ]
