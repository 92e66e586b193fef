"""The runtime's single-process parts: manual plans, mesh layout checks, the pipeline wrappers.

The multi-process behaviour (schedules, gradient sums, checkpoints) is tested in tests/dist.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import partita
from partita import examples
from partita.errors import InputError
from partita.planning.manual import manual_plan
from partita.runtime.layout import check_layout
from partita.runtime.pipeline import StageRunner, root_chunk_spec, root_key, stage_metadata
from partita.runtime.process_groups import init_topology
from partita.runtime.stages import flatten_inputs, run_sequential, split_graph
from partita.types import Recompute
from partita.types.plan_file import plan_from_json


def _cuts(graph, num_stages: int) -> list[int]:
    return [graph.num_nodes * k // num_stages for k in range(num_stages + 1)]


def test_manual_plan_places_stages_like_torch(mlp):
    _, graph = mlp
    zbv = manual_plan(
        graph, _cuts(graph, 4), schedule="zbv", num_rank_groups=2, replicas=2, num_microbatches=2, global_batch_size=8
    )
    assert [s.rank_group for s in zbv.stages] == [0, 1, 1, 0]  # the V
    assert [s.ranks for s in zbv.stages] == [(0, 1), (2, 3), (2, 3), (0, 1)]
    assert zbv.microbatch_size == 2 and zbv.num_devices == 4 and zbv.method == "manual"
    looped = manual_plan(
        graph,
        _cuts(graph, 4),
        schedule="interleaved1f1b",
        num_rank_groups=2,
        num_microbatches=2,
        global_batch_size=8,
        recompute=[True, False, False, False],
    )
    assert [s.rank_group for s in looped.stages] == [0, 1, 0, 1]
    assert [s.recompute for s in looped.stages] == [Recompute.FULL, Recompute.NONE, Recompute.NONE, Recompute.NONE]
    assert plan_from_json(looped.to_json(), graph=graph) == looped  # a manual plan is a valid plan file
    check_layout(zbv)
    check_layout(looped)


@pytest.mark.parametrize(
    "bad",
    [
        dict(boundaries=[0, 1]),  # does not end at num_nodes
        dict(global_batch_size=7),  # not a multiple of micro-batches x replicas
        dict(num_microbatches=1),  # 1f1b needs >= num_stages micro-batches
        dict(schedule="zbv"),  # zbv needs 2 stages per rank group
        dict(recompute=[True]),  # one flag per stage
    ],
)
def test_manual_plan_rejects_inconsistent_choices(mlp, bad):
    _, graph = mlp
    choices = (
        dict(boundaries=_cuts(graph, 2), schedule="1f1b", num_rank_groups=2, num_microbatches=2, global_batch_size=8)
        | bad
    )
    with pytest.raises(InputError):
        manual_plan(graph, choices.pop("boundaries"), **choices)


def test_layout_check_refuses_misplaced_plans(mlp):
    """Stages in the other order of the ranks run on partita's own executor under GPipe and 1F1B (a
    mixed cluster's second device group first), and are refused where only a mesh runs the plan."""
    _, graph = mlp
    plan = manual_plan(
        graph, _cuts(graph, 2), schedule="gpipe", num_rank_groups=2, replicas=2, num_microbatches=2, global_batch_size=8
    )
    swapped = dataclasses.replace(
        plan,
        stages=(dataclasses.replace(plan.stages[0], ranks=(2, 3)), dataclasses.replace(plan.stages[1], ranks=(0, 1))),
    )
    assert plan.on_mesh and not swapped.on_mesh and swapped.uniform_replicas
    check_layout(swapped)  # partita.runtime.uneven runs it
    interleaved = manual_plan(
        graph, _cuts(graph, 4), schedule="interleaved1f1b", num_rank_groups=2, replicas=2, num_microbatches=2,
        global_batch_size=8,
    )  # fmt: skip
    moved = dataclasses.replace(
        interleaved,
        stages=tuple(dataclasses.replace(s, ranks=tuple(5 - r for r in s.ranks)) for s in interleaved.stages),
    )
    assert moved.on_mesh  # only a mesh runs interleaved plans
    with pytest.raises(InputError, match=r"interleaved1f1b places it on rank group 0, ranks \[0, 1\]"):
        check_layout(moved)
    gap = dataclasses.replace(swapped, stages=(swapped.stages[0], dataclasses.replace(swapped.stages[1], ranks=(0, 4))))
    with pytest.raises(InputError, match=r"ranks \[0, 2, 3, 4\].*\(rank 1 runs no stage\)"):
        check_layout(gap)


def test_topology_needs_torchrun_environment(mlp, monkeypatch):
    _, graph = mlp
    plan = manual_plan(
        graph, _cuts(graph, 2), schedule="gpipe", num_rank_groups=2, num_microbatches=2, global_batch_size=8
    )
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InputError, match="RANK, WORLD_SIZE.*not set: run the training script under `torchrun"):
        init_topology(plan)


def test_runners_feed_each_stage_its_root_inputs_and_metadata_restores_buffers(mlp):
    ex, graph = mlp
    stages = split_graph(graph, _cuts(graph, 3))
    flat = flatten_inputs(graph, ex.args, ex.kwargs, ex.target)
    expected = run_sequential(stages, flat).item()
    spec = root_chunk_spec(graph, range(len(flat)))
    assert [s.split_dim for s in spec.values()] == [g.tensor.batch_dim for g in graph.inputs]
    roots = {root_key(j): x for j, x in enumerate(flat)}
    received: tuple = ()
    for stage in stages:
        received = StageRunner(stage, recompute=stage.spec.index == 1)(*received, **roots)
    assert received.item() == pytest.approx(expected, abs=1e-6)
    before = torch.get_rng_state()
    metadata = stage_metadata(stages, flat, torch.device("cpu"))
    assert torch.equal(before, torch.get_rng_state())
    assert metadata[0].input_args == () and metadata[-1].output_args[0].dim() == 0
    for a, b in zip(metadata, metadata[1:]):
        assert all(x is y for x, y in zip(a.output_args, b.input_args))


@pytest.mark.slow  # captures and splits T5
def test_split_backward_check_finds_t5_parameters_off_the_input_path():
    """T5's decoder embedding (reads labels) and relative position bias (reads positions) lose
    gradients under torch's input/weight backward split; GPT-2's parameters do not."""
    found = {}
    for name in ("t5", "gpt2"):
        ex = examples.build(name, batch_size=4, seq_len=16)
        graph = partita.capture(ex.model, ex.args, ex.kwargs)
        stages = split_graph(graph, _cuts(graph, 4))
        flat = flatten_inputs(graph, ex.args, ex.kwargs)
        found[name] = [m.split_backward_complete for m in stage_metadata(stages, flat, torch.device("cpu"))]
    assert found["gpt2"] == [True] * 4
    assert found["t5"][0] and not all(found["t5"][1:3])


def test_load_into_model_refuses_an_incomplete_checkpoint(tmp_path):
    (tmp_path / "ckpt.partial").mkdir()
    with pytest.raises(InputError, match=r"ckpt'.*only a \.partial directory.*latest_checkpoint"):
        partita.load_into_model(torch.nn.Linear(2, 2), tmp_path / "ckpt")


def test_trainer_refuses_a_plan_for_another_graph_or_a_graph_of_another_model(mlp):
    ex, graph = mlp
    plan = manual_plan(
        graph, _cuts(graph, 2), schedule="gpipe", num_rank_groups=2, num_microbatches=2, global_batch_size=8
    )
    other = examples.build("mlp", batch_size=8, seed=1)  # same architecture, other weights and objects
    other_graph = partita.capture(other.model, other.args, other.kwargs, loss_fn=other.loss_fn, target=other.target)
    with pytest.raises(InputError, match="another model object; capture it from the model you pass"):
        partita.Trainer(ex.model, plan, optimizer=torch.optim.SGD, graph=other_graph)
    made_for_another = dataclasses.replace(plan, graph_fingerprint="0" * 16)
    with pytest.raises(partita.PlanFileError, match="fingerprint 0000000000000000.*re-plan for this model"):
        partita.Trainer(ex.model, made_for_another, optimizer=torch.optim.SGD, graph=graph)


# ----------------------------------------------------------------------------- meta models and seeds


@pytest.mark.slow  # builds, captures and runs models twice
def test_stages_of_a_meta_model_run_from_a_seed_like_the_real_model(tmp_path):
    """llama: a non-persistent buffer (rotary frequencies), and ops captured on meta that name the meta
    device inside a higher-order op (export's device assertions): the seed fills the first, and
    retarget_device rewrites the second."""
    from partita.capturing import canonical_names
    from partita.runtime.materialize import materialize, on_meta, retarget_device, save_seed

    real = examples.build("llama", batch_size=4, seq_len=16)
    save_seed(real.model, tmp_path / "seed")
    meta = examples.build("llama", batch_size=4, seq_len=16, device="meta")
    graph = partita.capture(meta.model, meta.args, meta.kwargs)
    stages = split_graph(graph, _cuts(graph, 2))
    assert on_meta(meta.model) and not on_meta(real.model)
    first = set(stages[0].spec.param_names)
    materialize(meta.model, [*stages, graph.graph_module], first, torch.device("cpu"), tmp_path / "seed")
    assert {n for n, p in meta.model.named_parameters() if not p.is_meta} <= first  # only what stage 0 reads
    materialize(
        meta.model,
        [*stages, graph.graph_module],
        set(canonical_names(meta.model).values()) - first,
        torch.device("cpu"),
        tmp_path / "seed",
    )
    for stage in stages:
        retarget_device(stage.graph_module, torch.device("cpu"))
    flat = flatten_inputs(graph, real.args, real.kwargs)
    assert torch.equal(run_sequential(stages, flat), real.model(*real.args, **real.kwargs).loss)


def test_seeds_refuse_meta_models_and_models_they_were_not_written_for(tmp_path):
    from partita.runtime.materialize import materialize, save_seed

    meta = examples.build("mlp", batch_size=4, device="meta")
    with pytest.raises(InputError, match="needs the model's real weights.*meta device: build it on"):
        save_seed(meta.model, tmp_path / "seed")
    with pytest.raises(InputError, match="seed' is not a complete seed checkpoint: write one with .*save_seed"):
        materialize(meta.model, [], {"layers.0.weight"}, torch.device("cpu"), tmp_path / "seed")
    save_seed(torch.nn.Linear(2, 2), tmp_path / "seed")
    name = next(n for n, _ in meta.model.named_parameters())
    with pytest.raises(InputError, match=rf"lacks \['\S*{name}'\] and holds .*: it was written for another model"):
        materialize(meta.model, [], {name}, torch.device("cpu"), tmp_path / "seed")


def test_trainer_refuses_a_meta_model_without_a_seed(mlp):
    ex, graph = mlp
    meta = examples.build("mlp", batch_size=8, device="meta")
    plan = manual_plan(
        graph, [0, graph.num_nodes], schedule="gpipe", num_rank_groups=1, num_microbatches=1, global_batch_size=8
    )
    with pytest.raises(InputError, match="meta device.*pass init_from=.*save_seed"):
        partita.Trainer(meta.model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), graph=graph)
