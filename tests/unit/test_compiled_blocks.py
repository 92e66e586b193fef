"""Compiled blocks (``Plan.compile``): which segments share a compiled function, how the choice is
made, pinned and recorded. Training with compiled blocks against the unsplit eager model:
tests/dist/test_compiled_exact.py; speed and compile time: bench/compiled_blocks.py."""

from __future__ import annotations

import json

import pytest

import partita
from partita import examples
from partita.errors import InputError, PlanFileError
from partita.planning.options import PlanOptions, resolve_compile
from partita.runtime.compiled_segments import structure_of
from partita.runtime.plan_digest import plan_digest
from partita.runtime.segments import SegmentedStage
from partita.runtime.stages import split_graph
from partita.types import Plan
from partita.types.cluster import Cluster
from partita.types.devices import resolve_device
from partita.types.plan_file import plan_from_json, plan_to_dict


@pytest.fixture(scope="module")
def gpt2_small():
    ex = examples.build("gpt2-small", batch_size=4, seq_len=32)  # 8 layers
    return partita.capture(ex.model, ex.args, ex.kwargs)


def _plan(graph, **kwargs) -> Plan:
    return partita.manual_plan(
        graph,
        [0, graph.num_nodes],
        schedule="gpipe",
        num_rank_groups=1,
        num_microbatches=1,
        global_batch_size=4,
        **kwargs,
    )


def test_the_repeated_layers_of_a_stage_share_one_structure(gpt2_small):
    graph = gpt2_small
    (stage,) = split_graph(graph, [0, graph.num_nodes])
    split = SegmentedStage(stage, graph, compiled=True)
    structures = [structure_of(getattr(split.split, f"submod_{k}")) for k in range(split.num_segments)]
    assert split.num_segments == 10  # before the layers, 8 layers, after them
    assert len(set(structures)) == 3
    assert len(set(structures[1:9])) == 1, "the 8 layers compute one function of their weights"


def test_a_stage_without_a_whole_block_is_one_compiled_segment(gpt2_small):
    graph = gpt2_small
    first = graph.blocks[0].start if graph.blocks else graph.num_nodes // 2
    stage = split_graph(graph, [0, first, graph.num_nodes])[0]
    assert SegmentedStage(stage, graph, compiled=True).num_segments == 1


def test_the_plan_records_compiled_blocks_in_its_file_digest_and_summary(gpt2_small):
    eager, compiled = _plan(gpt2_small), _plan(gpt2_small, compile=True)
    assert not eager.compile and compiled.compile
    assert "compile" not in plan_to_dict(eager), "files without compiled blocks read as before"
    assert plan_to_dict(compiled)["compile"] is True
    assert plan_from_json(compiled.to_json()).compile
    assert plan_digest(eager) != plan_digest(compiled)
    assert "compiled blocks" in compiled.summary() and "compiled blocks" not in eager.summary()


def test_a_plan_file_with_a_bad_compile_field_is_refused(gpt2_small):
    data = plan_to_dict(_plan(gpt2_small, compile=True))
    with pytest.raises(PlanFileError, match="'compile' is 'yes'"):
        plan_from_json(json.dumps({**data, "compile": "yes"}))
    data["compile"] = False  # the executed field edited, the record left saying compiled
    with pytest.raises(PlanFileError, match="options.compile is True"):
        plan_from_json(json.dumps(data))


def test_compile_is_a_bool_or_unpinned(gpt2_small):
    with pytest.raises(InputError, match="compile must be True, False or None"):
        PlanOptions(compile="yes")
    with pytest.raises(InputError, match="compile must be True or False"):
        _plan(gpt2_small, compile=1)


def test_compiled_blocks_are_on_for_gpus_and_off_on_the_cpu_unless_pinned():
    assert resolve_compile(None, resolve_device("h100")) is True
    assert resolve_compile(None, resolve_device("cpu")) is False
    assert resolve_compile(False, resolve_device("h100")) is False
    assert resolve_compile(True, resolve_device("cpu")) is True


def test_a_searched_plan_takes_the_resolved_choice(gpt2_small):
    cluster = Cluster(device="h100", num_devices=1)
    plan = partita.plan(gpt2_small, cluster=cluster, global_batch_size=4, options=PlanOptions(costs="analytic"))
    assert plan.compile and plan.options["compile"] is True
    pinned = PlanOptions(costs="analytic", compile=False)
    assert not partita.plan(gpt2_small, cluster=cluster, global_batch_size=4, options=pinned).compile


def test_a_segment_inductor_cannot_compile_is_a_compile_error_naming_it(gpt2_small, monkeypatch):
    import torch

    from partita.errors import CompileError
    from partita.runtime import compiled_segments
    from partita.types import Recompute

    def failing(*args, **kwargs):
        def run(*values):
            raise torch._dynamo.exc.BackendCompilerFailed(None, RuntimeError("no compiler"), None)

        return run

    monkeypatch.setattr(compiled_segments, "_compile", failing)
    graph = gpt2_small
    (stage,) = split_graph(graph, [0, graph.num_nodes])
    split = SegmentedStage(stage, graph, compiled=True)
    submodule = split.split.submod_0
    args = [torch.zeros(1, 3, 3, dtype=torch.float64)]  # a signature no other test compiles
    with pytest.raises(CompileError, match="segment 0 .* failed to compile.*compile=False"):
        split.compiled.call(0, submodule, args, Recompute.NONE, None)
    assert compiled_segments.compiled_count() == 0 or all(
        sig[2][2] != compiled_segments._inputs_signature(args)[2] for sig in compiled_segments._COMPILED
    ), "the failed function is not kept"
