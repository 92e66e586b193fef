"""partita.plan() end to end on a real captured model, plan files, and infeasible requests."""

import json

import pytest
from clusters import h100s

import partita
from partita import examples
from partita.cli import main
from partita.errors import InfeasiblePlanError, PlanFileError
from partita.planning.options import PlanOptions
from partita.types import Schedule


@pytest.mark.slow  # plans with measured costs
def test_plan_fits_and_round_trips(gpt2, tmp_path):
    _, graph = gpt2
    cluster = h100s(4)
    p = partita.plan(graph, cluster=cluster, global_batch_size=32)
    assert p.num_devices <= 4 and p.global_batch_size == 32
    assert all(s.memory_bytes <= cluster.usable_memory_bytes for s in p.stages)
    assert p.boundaries[0] == 0 and p.boundaries[-1] == graph.num_nodes
    path = tmp_path / "plan.json"
    p.save(path)
    again = partita.Plan.load(path, graph=graph, cluster=cluster)
    assert again.to_json() == p.to_json()
    assert partita.plan(graph, cluster=cluster, global_batch_size=32).to_json() == p.to_json()  # deterministic


def test_pinned_options(gpt2):
    _, graph = gpt2
    options = PlanOptions(schedules="1f1b", num_stages=2, replicas=2, num_microbatches=4, recompute=True)
    p = partita.plan(graph, cluster=h100s(4), global_batch_size=32, options=options)
    assert (p.schedule.value, p.num_rank_groups, p.stages[0].num_replicas, p.num_microbatches) == ("1f1b", 2, 2, 4)
    assert all(s.recompute for s in p.stages)
    assert p.options["schedules"] == ["1f1b"] and p.options["num_stages"] == 2 and p.options["recompute"] == "full"


def test_plan_file_for_another_model_or_cluster_is_rejected(gpt2, tmp_path):
    _, graph = gpt2
    p = partita.plan(graph, cluster=h100s(2), global_batch_size=8)
    path = tmp_path / "plan.json"
    p.save(path)
    other = examples.build("gpt2", batch_size=8, seq_len=16)
    with pytest.raises(PlanFileError, match="another model or input shape.*re-plan for this model"):
        partita.Plan.load(path, graph=partita.capture(other.model, other.args, other.kwargs))
    with pytest.raises(PlanFileError, match=r"another cluster \(fields differ: num_devices\): re-plan"):
        partita.Plan.load(path, cluster=h100s(4))


@pytest.mark.parametrize(
    "edit, pattern",
    [
        (lambda d: d.update(schema_version=99), "'schema_version' is 99.*reads schema 1 or 2: re-create the plan"),
        (
            lambda d: (
                d["stages"][0].update(stop=d["stages"][0]["stop"] + 1) if len(d["stages"]) > 1 else d.update(stages=[])
            ),
            "contiguous|empty",
        ),
        (lambda d: d.pop("schedule"), "'schedule' is missing"),
        (lambda d: d["stages"][0].update(ranks=[999]), "rank|999"),
        (lambda d: d.update(num_microbatches=-1), "'num_microbatches' is -1, expected a finite number >= 0"),
    ],
)
def test_invalid_plan_files(gpt2, tmp_path, edit, pattern):
    _, graph = gpt2
    p = partita.plan(graph, cluster=h100s(2), global_batch_size=8, options=PlanOptions(num_stages=2))
    data = json.loads(p.to_json())
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match=pattern):
        partita.Plan.load(path)


def test_truncated_plan_file(gpt2, tmp_path):
    _, graph = gpt2
    text = partita.plan(graph, cluster=h100s(2), global_batch_size=8).to_json()
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(PlanFileError, match="cut.json is not valid JSON.*truncated\\? Re-create it"):
        partita.Plan.load(path)


def test_infeasible_request_says_what_would_fit_and_that_it_does(gpt2):
    _, graph = gpt2
    with pytest.raises(InfeasiblePlanError, match="no plan fits 1 device.*use at least .* devices") as info:
        partita.plan(graph, cluster=h100s(1, memory=2**20), global_batch_size=8)
    err = info.value
    assert err.min_devices is not None and err.min_memory_bytes is not None
    assert f"at least {err.min_devices} devices" in str(err)
    # Verified by planning again with the suggested numbers.
    assert (
        partita.plan(graph, cluster=h100s(err.min_devices, memory=2**20), global_batch_size=8).num_devices
        <= err.min_devices
    )
    enough = h100s(1, memory=err.min_memory_bytes)
    fitting = partita.plan(graph, cluster=enough, global_batch_size=8)
    assert fitting.num_devices == 1 and fitting.predicted_step_s > 0
    assert all(s.memory_bytes <= enough.usable_memory_bytes for s in fitting.stages)
    with pytest.raises(InfeasiblePlanError):
        partita.plan(graph, cluster=h100s(1, memory=err.min_memory_bytes * 9 // 10), global_batch_size=8)


def test_cli_plan_prints_the_table_and_baselines(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    assert (
        main(
            [
                "plan",
                "gpt2",
                "--devices",
                "4",
                "--device-type",
                "h100",
                "--global-batch",
                "32",
                "--out",
                str(out),
                "--png",
                str(png),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    for word in ("stage", "memory/device", "partita", "uniform", "parameters", "equal_flops", "bubble"):
        assert word in text
    assert json.loads(out.read_text())["schema_version"] == 2


@pytest.mark.slow  # the CLI profiles a model
def test_cli_inspect_prints_tables_and_costs(capsys):
    assert main(["inspect", "gpt2", "--costs", "--device", "h100"]) == 0
    text = capsys.readouterr().out
    assert "Largest activations" in text and "Per module" in text and "Costs (analytic on h100" in text
    assert main(["inspect", "gpt2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["num_parameters"] > 0 and data["modules"][0]["path"] == ""


def test_a_graph_with_a_static_batch_is_refused():
    ex = examples.build("mlp", batch_size=1)  # a batch of 1 is widened to 2 (tests/unit/test_batch_dims.py)
    graph = partita.capture(ex.model, ex.args, loss_fn=ex.loss_fn, target=ex.target, dynamic_batch=False)
    assert not graph.dynamic_batch
    with pytest.raises(partita.InputError, match="static batch dimension.*dynamic_batch=True"):
        partita.plan(graph, cluster=h100s(2), global_batch_size=8)


def _fits(graph, memory, batch=8, **pins):
    from partita.planning.context import planning_context
    from partita.planning.driver import best_plan

    options = PlanOptions(uniform_replicas=True, costs="analytic", **pins)
    ctx = planning_context(graph, cluster=h100s(2, memory=memory), global_batch_size=batch, options=options)
    return best_plan(ctx) is not None


def _smallest_memory(graph, batch=8, **pins) -> int:
    """Smallest memory per device (to 1%) with which a plan fits 2 devices."""
    low, high = 2**16, 2**16
    while not _fits(graph, high, batch, **pins):
        low, high = high, high * 2
    while high > low * 1.01:
        mid = (low + high) // 2
        low, high = (low, mid) if _fits(graph, mid, batch, **pins) else (mid, high)
    return high


@pytest.mark.parametrize("schedules", ["zbv", ["zbv"]])
def test_zbv_with_recompute_is_refused(gpt2, schedules):
    _, graph = gpt2
    with pytest.raises(partita.InputError, match=r"'zbv' with recompute='full'.*1f1b.*recompute='none'"):
        partita.plan(
            graph, cluster=h100s(2), global_batch_size=8, options=PlanOptions(schedules=schedules, recompute=True)
        )


@pytest.mark.slow  # searches every schedule
def test_zbv_never_recomputes_and_says_so_when_nothing_fits_without(gpt2):
    """ZBV keeps recomputed activations alive between its I and W passes (bench/results/e2e_memory.md),
    so the search never recomputes under it; with only ZBV allowed, a memory that needs
    recomputation is infeasible, and the error points to 1F1B with recomputation. (Replicated fp32
    stages: ZBV's two virtual stages per rank group could fit by full sharding instead.) A batch of
    256: activations, not the optimizer step (one copy of the parameters on a GPU), set the peak."""
    _, graph = gpt2
    pins, batch = dict(sharding="replicate", precision="fp32"), 256
    with_recompute = _smallest_memory(graph, batch, schedules=["1f1b"], recompute=True, **pins)
    zbv = _smallest_memory(graph, batch, schedules=["zbv"], **pins)
    assert with_recompute < zbv / 1.02
    memory = (with_recompute + zbv) // 2
    cluster = h100s(2, memory=memory)
    p = partita.plan(graph, cluster=cluster, global_batch_size=batch, options=PlanOptions(recompute=True, **pins))
    assert p.schedule is not Schedule.ZBV and any(s.recompute for s in p.stages)
    with pytest.raises(InfeasiblePlanError, match="'1f1b' or 'interleaved1f1b' with recomputation") as info:
        partita.plan(graph, cluster=cluster, global_batch_size=batch, options=PlanOptions(schedules="zbv", **pins))
    assert info.value.min_memory_bytes > memory


def test_train_refuses_a_seed_for_a_factory_model(tmp_path, capsys):
    """--init-from builds the model on meta, which only zoo models can do: refused before any process starts."""
    factory = tmp_path / "mymodel.py"
    factory.write_text("import torch\ndef make():\n    return torch.nn.Linear(2, 2), (torch.randn(4, 2),)\n")
    assert main(["train", f"{factory}:make", "--init-from", str(tmp_path / "seed")]) == 2
    assert "--init-from works with zoo models" in capsys.readouterr().err


def test_train_with_a_plan_file_starts_one_process_per_device_of_the_plan(tmp_path, capsys):
    """A plan for 3 devices with --nproc 2 is refused before any process starts (the ranks would
    fail one by one); without --nproc the job takes the plan's count."""
    from partita.cli.main import _processes_for_plan_file
    from partita.planning.manual import manual_plan

    ex = examples.build("gpt2", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    path = tmp_path / "plan.json"
    manual_plan(
        graph,
        [0, graph.num_nodes // 2, graph.num_nodes],
        schedule="1f1b",
        num_rank_groups=2,
        replicas=(2, 1),
        num_microbatches=2,
        global_batch_size=8,
    ).save(str(path))
    assert _processes_for_plan_file(str(path), None) == 3
    assert _processes_for_plan_file(str(path), 3) == 3
    assert main(["train", "gpt2", "--plan", str(path), "--nproc", "2"]) == 2
    assert "is a plan for 3 devices, but --nproc is 2" in capsys.readouterr().err


@pytest.mark.slow  # the CLI plans twice
def test_cli_plan_gives_stages_uneven_replica_counts_unless_told_otherwise(tmp_path, capsys):
    """3 devices, 2 pinned 1F1B stages: only 2 + 1 or 1 + 2 replicas use all three; with
    --uniform-replicas the plan is a 2 x 1 mesh on 2 of them."""
    out = tmp_path / "p.json"
    pinned = [
        "plan",
        "gpt2",
        "--devices",
        "3",
        "--device-type",
        "h100",
        "--global-batch",
        "24",
        "--schedule",
        "1f1b",
        "--num-stages",
        "2",
        "--out",
        str(out),
    ]
    assert main(pinned) == 0
    text = capsys.readouterr().out
    p = partita.Plan.load(str(out))
    counts = [s.num_replicas for s in p.stages]
    assert sorted(counts) == [1, 2]
    assert f"2 rank groups with {counts[0]}+{counts[1]} replicas (3 devices)" in text
    assert main([*pinned, "--uniform-replicas"]) == 0
    assert "2 rank groups x 1 replica (2 devices)" in capsys.readouterr().out
    assert partita.Plan.load(str(out)).uniform_replicas
