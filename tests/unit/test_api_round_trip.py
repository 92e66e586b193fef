"""The README's main form: capture once, then plan the graph alone (costs measured on this CPU)."""

import partita
from partita import examples


def test_a_graph_alone_plans_with_measured_costs(tmp_path):
    ex = examples.build("gpt2-tiny", batch_size=8)
    graph = partita.capture(ex.model, kwargs=ex.kwargs)
    cluster = partita.Cluster(device="cpu", num_devices=2)  # this machine's CPU: costs are measured
    plan = partita.plan(
        graph, cluster=cluster, global_batch_size=8, options=partita.PlanOptions(cache_dir=str(tmp_path))
    )
    assert plan.cost_source == "measured"
    assert plan.predicted_step_s > 0 and plan.total_compute_s > 0
    assert list(tmp_path.glob("costs-*")), "the profile of the captured inputs should be cached"
