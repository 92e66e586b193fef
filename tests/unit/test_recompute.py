"""Recomputation levels (none, selective, full): the op policy, its cost arrays, the memory formula
per level, the runtime's checkpoint contexts against the cost model, and the search's choice."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import partita
from partita import examples
from partita.capturing.recompute import keeps_dispatched, keeps_node
from partita.cost.analytic import analytic_costs
from partita.cost.memory import memory_from_totals
from partita.cost.partial_recompute import recomputed_ranges
from partita.planning.options import PlanOptions
from partita.runtime.pipeline import StageRunner
from partita.runtime.stages import flatten_inputs, split_graph
from partita.types import Cluster, OptimizerKind, Recompute

MiB = 2**20


@pytest.fixture(scope="module")
def captured():
    found = {}
    for name in ("gpt2", "llama", "bert"):
        ex = examples.build(name, batch_size=4, seq_len=16)
        found[name] = (ex, partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target))
    return found


def test_levels_parse_order_and_truth():
    assert Recompute.parse(True) is Recompute.FULL and Recompute.parse(False) is Recompute.NONE
    assert Recompute.parse("Selective") is Recompute.SELECTIVE and Recompute.parse("yes") is Recompute.FULL
    assert [level.order for level in Recompute] == [0, 1, 2]
    assert Recompute.most([Recompute.SELECTIVE, Recompute.NONE]) is Recompute.SELECTIVE
    assert Recompute.most([]) is Recompute.NONE
    assert not Recompute.NONE and Recompute.SELECTIVE and Recompute.FULL  # "none" would be a true str
    with pytest.raises(partita.InputError, match="recompute='some' is not one of 'none', 'selective', 'full'"):
        Recompute.parse("some")
    assert PlanOptions(recompute=True).recompute is Recompute.FULL
    assert PlanOptions(recompute="selective").recompute is Recompute.SELECTIVE


def test_policy_keeps_weight_matmuls_and_recomputes_attention_scores(captured):
    _, graph = captured["gpt2"]
    kept = {n.target for n in graph.nodes if keeps_node(graph, n)}
    assert kept == {"aten.addmm.default", "aten.linear.default"}  # Conv1D's addmm, the LM head
    scores = [n for n in graph.nodes if n.target == "aten.matmul.default"]  # Q Kᵀ and P V: batched
    assert scores and not any(keeps_node(graph, n) for n in scores)
    assert keeps_dispatched("mm") and keeps_dispatched("addmm") and not keeps_dispatched("bmm")
    assert not keeps_dispatched("native_layer_norm") and not keeps_dispatched("_softmax")


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_selective_arrays_are_consistent(captured, name):
    """S >= A - R per stage range (the kept outputs hold what is not rebuilt), R <= A, and the
    recomputed seconds are the forward of the nodes not kept."""
    _, graph = captured[name]
    table = analytic_costs(graph, "h100", 4)
    a, s, r = (
        np.asarray(x, dtype=np.int64) for x in (table.activation_bytes, table.saved_bytes, table.recomputed_bytes)
    )
    assert (r <= a).all() and s.sum() >= a.sum() - r.sum() and r.sum() < a.sum()
    kept = np.array([keeps_node(graph, n) for n in graph.nodes])
    np.testing.assert_allclose(table.selective_recompute_s, np.where(kept, 0.0, table.forward_s))


def test_memory_per_level():
    """in flight f = 3, A = 10, I = 2, S = 4 MiB (optimizer-free, nothing else). Selective: the
    micro-batch being rebuilt holds I + A, the others I + S; with S > A, I + S throughout."""
    totals = dict(
        param_bytes=0,
        trainable_bytes=0,
        activation_bytes=10 * MiB,
        saved_bytes=4 * MiB,
        stage_input_bytes=2 * MiB,
        boundary_bytes=0,
        largest_output_bytes=0,
        in_flight=3,
        optimizer=OptimizerKind.NONE,
    )
    kept = {level: memory_from_totals(recompute=level, **totals).activation_bytes for level in Recompute}
    assert kept[Recompute.NONE] == 30 * MiB  # f A
    assert kept[Recompute.SELECTIVE] == (3 * (2 + 4) + 10 - 4) * MiB  # f (I + S) + max(A - S, 0)
    many_kept = memory_from_totals(recompute="selective", **{**totals, "saved_bytes": 12 * MiB}).activation_bytes
    assert many_kept == 3 * (2 + 12) * MiB
    assert kept[Recompute.FULL] == (3 * 2 + 10) * MiB  # f I + A
    assert memory_from_totals(recompute=True, **totals).activation_bytes == kept[Recompute.FULL]


class _DispatchedOutputs(TorchDispatchMode):
    """Bytes of the outputs of every op the selective policy keeps, as dispatched below autograd."""

    def __init__(self):
        super().__init__()
        self.kept_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if keeps_dispatched(func.overloadpacket.__name__):
            leaves = out if isinstance(out, (tuple, list)) else (out,)
            self.kept_bytes += sum(t.nbytes for t in leaves if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_the_runtime_keeps_what_the_cost_model_counts(captured, name):
    """The policy the checkpoint contexts apply (``keeps_dispatched``, on the ops as dispatched)
    keeps outputs of exactly the bytes the cost model's ``saved_bytes`` counts on the graph's nodes
    (``keeps_node``, before composite ops are decomposed)."""
    ex, graph = captured[name]
    (stage,) = split_graph(graph, [0, graph.num_nodes])
    flat = flatten_inputs(graph, ex.args, ex.kwargs, ex.target)
    recorder = _DispatchedOutputs()
    with recorder:
        stage(*stage.graph_inputs(flat))
    assert recorder.kept_bytes == int(analytic_costs(graph, "cpu", 4).saved_bytes.sum())


def _dropout_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )


def test_recomputed_dropout_draws_the_same_masks():
    """With dropout on, every level gives the same loss and gradients, and leaves the RNG where it
    would be without recomputation (checkpoint restores its state for the recomputation)."""
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    found = []
    for level in Recompute:
        model = _dropout_mlp()
        graph = partita.capture(model, (x,), loss_fn=torch.nn.functional.cross_entropy, target=y)
        (stage,) = split_graph(graph, [0, graph.num_nodes])
        flat = flatten_inputs(graph, (x,), {}, y)
        torch.manual_seed(1)
        roots = {f"input_{j}": v for j, v in enumerate(flat)}
        loss = StageRunner(stage, level)(**roots)
        loss.backward()
        found.append((loss.detach(), [p.grad.clone() for p in model.parameters()], torch.get_rng_state()))
    for loss, grads, rng in found[1:]:
        assert torch.equal(loss, found[0][0]) and torch.equal(rng, found[0][2])
        assert all(torch.equal(a, b) for a, b in zip(grads, found[0][1]))


# GPipe keeps 4 micro-batches of 256 samples in flight: selective keeps less than none then (with
# one micro-batch it would keep more: S + R >= A).
OPTIONS = dict(costs="analytic", schedules="gpipe", num_microbatches=4)


def _memory_needed(graph, level: Recompute) -> int:
    cluster = Cluster(device="h100", num_devices=1, memory_bytes=80 * 2**30)
    plan = partita.plan(graph, cluster=cluster, global_batch_size=1024, options=PlanOptions(recompute=level, **OPTIONS))
    return plan.stages[0].memory_bytes


def test_the_search_recomputes_selectively_where_that_fits(captured):
    """A memory between selective's and none's need: the plan recomputes selectively (less time
    than full), and its backward includes the recomputed forward of the nodes not kept."""
    _, graph = captured["gpt2"]
    needs = {level: _memory_needed(graph, level) for level in Recompute}
    assert needs[Recompute.FULL] < needs[Recompute.SELECTIVE] < needs[Recompute.NONE], needs
    usable = (needs[Recompute.SELECTIVE] + needs[Recompute.NONE]) // 2
    cluster = Cluster(device="h100", num_devices=1, memory_bytes=int(usable / 0.9))  # usable: 90%
    plan = partita.plan(graph, cluster=cluster, global_batch_size=1024, options=PlanOptions(**OPTIONS))
    assert cluster.usable_memory_bytes < needs[Recompute.NONE]
    assert [s.recompute for s in plan.stages] == [Recompute.SELECTIVE]
    table = analytic_costs(graph, "h100", 256, precision=plan.precision, compiled=plan.compile)
    # the recomputed forward of the segments that recompute: the first blocks that need to for the
    # stage to fit (StagePlan.recompute_blocks), or every segment
    stage = plan.stages[0]
    recomputed = recomputed_ranges(table, stage.start, stage.stop, stage.recompute_blocks)
    expected = float(table.backward_s.sum() + sum(table.selective_recompute_s[a:b].sum() for a, b in recomputed))
    assert stage.backward_s == pytest.approx(expected, rel=1e-9)
    assert "selective" in plan.summary()


def test_plan_files_keep_the_level_and_read_schema_1_booleans(captured, tmp_path):
    _, graph = captured["gpt2"]
    options = PlanOptions(costs="analytic", recompute="selective", schedules="gpipe", num_stages=2)
    plan = partita.plan(graph, cluster=Cluster(device="h100", num_devices=2), global_batch_size=8, options=options)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    data = json.loads(path.read_text())
    assert {s["recompute"] for s in data["stages"]} == {"selective"} and data["options"]["recompute"] == "selective"
    assert partita.Plan.load(str(path)) == plan
    data["schema_version"] = 1
    data["options"]["recompute"] = None  # chosen by the search: the options pin nothing
    for stage, old in zip(data["stages"], (True, False)):
        stage["recompute"] = old
    path.write_text(json.dumps(data))
    assert [s.recompute for s in partita.Plan.load(str(path)).stages] == [Recompute.FULL, Recompute.NONE]
