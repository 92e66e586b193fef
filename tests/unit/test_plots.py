"""report.plots: a plan and its simulated step drawn to a PNG (and an SVG) file."""

import pytest

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.planner import baseline_plans, best_plan, planning_context

pytest.importorskip("matplotlib")
from partita.report.plots import plan_figure  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def planned():
    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cluster = partita.Cluster(device="h100", num_devices=4)
    ctx = planning_context(graph, (), None, cluster=cluster, global_batch_size=32, loss_fn=None, target=None,
                           optimizer="adam", schedules=None, schedule="1f1b", num_stages=2, replicas=2,
                           num_microbatches=None, recompute=None, uniform_replicas=True, mixed_precision=False,
                           costs="analytic", max_blocks=128, cache_dir=None)
    plan = best_plan(ctx)
    result = partita.simulate(plan, lambda b: analytic_costs(graph, "h100", b), cluster)
    return plan, result, baseline_plans(ctx, plan)


def test_png_is_written(planned, tmp_path):
    plan, result, baselines = planned
    path = tmp_path / "plan.png"
    plan_figure(plan, result, path, baselines=baselines)
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 5_000


def test_svg_by_extension_and_deterministic(planned, tmp_path):
    plan, result, _ = planned
    first, second = tmp_path / "a.svg", tmp_path / "b.svg"
    plan_figure(plan, result, first)
    plan_figure(plan, result, second)
    assert first.read_text().lstrip().startswith("<?xml")
    assert first.read_bytes() == second.read_bytes()
