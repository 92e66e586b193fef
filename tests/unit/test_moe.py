"""Mixture-of-experts models: expert matmuls (grouped matmuls) count their FLOPs."""

import pytest

import partita
from partita import examples
from partita.examples.hf import config_kwargs

pytestmark = pytest.mark.slow  # captures Mixtral


def test_mixtral_expert_matmuls_count_their_flops():
    batch, seq_len = 4, 32
    ex = examples.build("mixtral-tiny", batch_size=batch, seq_len=seq_len)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    config = config_kwargs("mixtral", "tiny")
    hidden, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    routed_tokens = batch * seq_len * config["num_experts_per_tok"]
    # per layer: gate+up (hidden -> 2 ffn) and down (ffn -> hidden) for every routed token
    expected = layers * (2 * routed_tokens * hidden * 2 * ffn + 2 * routed_tokens * ffn * hidden)
    grouped = [n for n in graph.nodes if "grouped_mm" in n.target]
    assert len(grouped) == 2 * layers
    assert sum(n.flops for n in grouped) == expected
    dense = sum(n.flops for n in graph.nodes if n.target == "aten.linear.default")
    assert expected > dense  # in this config the experts are most of the compute


def test_mixtral_plans_with_expert_compute_in_its_stages():
    ex = examples.build("mixtral-tiny", batch_size=4)
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cluster = partita.Cluster(device="h100", num_devices=2)
    plan = partita.plan(
        graph,
        cluster=cluster,
        global_batch_size=8,
        options=partita.PlanOptions(costs="analytic", num_stages=2, schedules="1f1b"),
    )
    assert plan.num_stages == 2 and all(s.forward_s > 0 for s in plan.stages)
    assert plan.total_compute_s > 0
