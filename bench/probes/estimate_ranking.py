"""How well the search's closed-form estimate ranks candidates: each of the best N, simulated.

Llama-7B (captured on meta, batch 2, sequence 2048) on 64 H100s in nodes of 8, global batch 512,
analytic costs, tensor-parallel degree 1: the uniform search's N best candidates by estimate
(``partita.planning.search.search``), each built into a plan and simulated on its schedule. Prints
the Spearman correlation of estimate and simulated step, the median and largest relative error,
and where the best simulated candidate stands in the estimate's order. The search simulates only
its best few (``driver.NUM_SIMULATED``), so the order is what matters.

Usage: python bench/probes/estimate_ranking.py [N]   (default 80)
"""

import functools
import sys

import numpy as np

import partita
from partita import examples
from partita.planning.chain import block_costs
from partita.planning.context import planning_context
from partita.planning.plan_builder import plan_from_candidate
from partita.planning.search import search


def main(num_candidates: int) -> None:
    ex = examples.build("llama-7b", batch_size=2, device="meta")
    graph = partita.capture(ex.model, ex.args, ex.kwargs)
    cluster = partita.Cluster(device="h100", num_devices=64, devices_per_node=8)
    options = partita.PlanOptions(costs="analytic", tensor_parallel=1)
    ctx = planning_context(graph, cluster=cluster, global_batch_size=512, options=options)
    blocks_at = functools.lru_cache(maxsize=None)(lambda b: block_costs(ctx.costs_at(b), ctx.chain))
    candidates = search(blocks_at, ctx.options, ctx.search_cluster, len(ctx.chain) - 1)[:num_candidates]
    pairs = [(c.estimate_s, p.predicted_step_s) for c in candidates if (p := plan_from_candidate(ctx, c))]
    estimate, simulated = np.array(pairs).T
    ranks = lambda x: np.argsort(np.argsort(x))  # noqa: E731
    rho = np.corrcoef(ranks(estimate), ranks(simulated))[0, 1]
    error = np.abs(simulated / estimate - 1)
    best = int(np.argmin(simulated))
    print(
        f"{len(pairs)} of the {num_candidates} best candidates fit: Spearman {rho:.2f}, median |error| "
        f"{np.median(error):.1%}, largest {error.max():.1%}; best simulated {simulated[best]:.3f} s, "
        f"estimate rank {best + 1}"
    )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 80)
