"""report.plots: a plan and its simulated step drawn to a PNG (and an SVG) file."""

import pytest

import partita
from partita import examples
from partita.cost.analytic import analytic_costs
from partita.planning.api import plan_with_baselines

pytest.importorskip("matplotlib")
from partita.report.plots import plan_figure  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def planned():
    ex = examples.build("gpt2", batch_size=8)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cluster = partita.Cluster(device="h100", num_devices=4)
    planned = plan_with_baselines(
        graph,
        cluster=cluster,
        global_batch_size=32,
        options=partita.PlanOptions(
            schedules="1f1b", num_stages=2, replicas=2, uniform_replicas=True, costs="analytic"
        ),
    )
    result = partita.simulate(
        planned.plan, lambda b: analytic_costs(graph, "h100", b, precision=planned.plan.precision), cluster
    )
    return planned.plan, result, planned.baselines


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
