"""End-to-end training throughput on this machine: partita's plan vs the baselines' splits vs no split.

For each model, on 2 ranks x 1 thread (gloo, separate processes, torchrun-style environment):

  partita          ``partita.plan`` for ``Cluster.local(num_devices=2)`` with measured costs, global
                   batch 16 (the plan the user gets);
  partita pp=2     the same, pinned to 2 pipeline rank groups (``num_stages=2``) when the free plan is
                   plain data parallelism, so that the quality of the split itself is visible;
  uniform, parameters, equal_flops
                   each baseline's split under the pipelined plan's configuration (schedule,
                   micro-batches, stages per rank; ``planning.baselines.baseline_plans``);
  unsplit 1t / 2t  the unsplit model, plain PyTorch (forward, backward, AdamW on the whole batch) in one
                   process with 1 and with 2 intra-op threads (the other rank waits in a gloo barrier,
                   which costs no CPU: its CPU time over those steps is reported).

All configurations of one model run in the SAME two processes, interleaved step by step: every round
runs one step of each configuration, in an order rotated every round, so that the machine's drift
(other jobs on the shared cores) hits all of them alike. ``--warmup`` rounds are dropped (pipeline
build, allocator warm-up), then ``--rounds`` rounds are timed; numbers are medians over rounds, and
ratios are medians of within-round ratios. Every trainer trains the same Parameter objects (timing
only: the loss values are not compared here; tests/dist checks exactness).

Efficiency = unsplit-1-thread step / (2 ranks x step): 1.0 would be perfect 2-way speed-up of the
single-thread run. Predicted = the plan's simulated step (``plan.predicted_step_s``: the solo 1-thread
profile slowed by ``Cluster.local``'s measured contention factor, ``compute_slowdown``; the unsplit
1-thread step from the solo profile alone); error = (predicted - measured) / measured.

Usage: python bench/e2e_throughput.py [--models gpt2-small,...] [--rounds 6] [--warmup 2]
                                      [--global-batch 16] [--out bench/results/e2e_throughput.md]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _e2e_common import (  # noqa: E402
    REPO,
    build_example,
    command_line,
    config_text,
    loss_of,
    machine_line,
    now_utc,
    run_ranks,
    step_kwargs,
)

DEFAULT_MODELS = ["gpt2-small", "gpt2-small-v50k", "bert-small", "llama-small", "cnn-small"]
LR = 1e-4
QUIET = 0.10  # a round is quiet when other jobs used < 10% of the machine during each of its steps


# ----------------------------------------------------------------------------- planning (parent)


def plan_model(name: str, global_batch: int, cache_dir: str, work: Path) -> dict:
    """Plans (saved as JSON under ``work``) and their predictions for one model."""
    import partita
    from partita.cost.table import contended
    from partita.planning.baselines import baseline_plans
    from partita.planning.context import planning_context
    from partita.planning.driver import best_plan
    from partita.planning.manual import manual_plan
    from partita.planning.simulate import simulate

    torch.set_num_threads(1)  # the profile must see what one rank with one thread sees
    ex = build_example(name, global_batch)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    cluster = partita.Cluster.local(num_devices=2, cache_dir=cache_dir, num_threads=1)

    def context(num_stages):
        options = partita.PlanOptions(
            num_stages=num_stages, uniform_replicas=True, costs="measured", cache_dir=cache_dir
        )
        return planning_context(
            graph,
            ex.args,
            ex.kwargs,
            cluster=cluster,
            global_batch_size=global_batch,
            loss_fn=ex.loss_fn,
            target=ex.target,
            options=options,
        )

    started = time.perf_counter()
    ctx = context(None)
    free = best_plan(ctx)
    plans = {"partita": free}
    pipelined, pctx = free, ctx
    if free.num_rank_groups == 1:
        pctx = context(2)
        pipelined = best_plan(pctx)
        plans["partita pp=2"] = pipelined
    for method, p in baseline_plans(pctx, pipelined).items():
        plans[method] = p
    planning_s = time.perf_counter() - started
    # The unsplit step as the solo profile predicts it (one process: no contention between ranks).
    whole = manual_plan(
        graph,
        [0, graph.num_nodes],
        schedule="gpipe",
        num_rank_groups=1,
        num_microbatches=1,
        global_batch_size=global_batch,
    )
    solo = dataclasses.replace(cluster, compute_slowdown=1.0)
    unsplit_pred = simulate(whole, lambda b: contended(ctx.costs_at(b), 1.0), solo).step_s
    out = {
        "name": name,
        "num_parameters": graph.num_parameters,
        "num_nodes": graph.num_nodes,
        "planning_s": planning_s,
        "plans": {},
        "unsplit_predicted_s": unsplit_pred,
        "compute_slowdown": cluster.compute_slowdown,
    }
    for label, p in plans.items():
        if p is None:
            out["plans"][label] = None
            continue
        path = work / f"{name}.{label.replace(' ', '_').replace('=', '')}.json"
        p.save(str(path))
        out["plans"][label] = {
            "path": str(path),
            "predicted_s": p.predicted_step_s,
            "config": config_text(p),
            "boundaries": list(p.boundaries),
            "split": split_text(graph, p),
        }
    return out


def split_text(graph, p) -> str:
    """Stage sizes as shares of the model's parameters (first-use) per rank group."""
    if p.num_stages == 1:
        return "-"
    return " / ".join(f"{s.start}-{s.stop}" for s in p.stages)


# ----------------------------------------------------------------------------- ranks


def machine_busy_s() -> float:
    """CPU seconds all processes of this machine have run (user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6] + fields[7]) / os.sysconf("SC_CLK_TCK")


def worker(out_dir: Path) -> None:
    import torch.distributed as dist

    import partita

    torch.set_num_threads(1)
    params = torch.load(out_dir / "params.pt", weights_only=False)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    gb = params["global_batch"]
    ex = build_example(params["model"], gb)
    graph = partita.capture(ex.model, ex.args, ex.kwargs, loss_fn=ex.loss_fn, target=ex.target)
    unsplit = copy.deepcopy(ex.model) if rank == 0 else None
    unsplit_opt = torch.optim.AdamW(unsplit.parameters(), lr=LR) if rank == 0 else None
    trainers = {}
    for label, path in params["plans"].items():
        plan = partita.Plan.load(path, graph=graph)
        trainers[label] = partita.Trainer(
            ex.model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR)
        )
    labels = list(trainers) + ["unsplit 1t", "unsplit 2t"]
    batches = [ex.make_batch(gb, s) for s in range(3)]
    times: dict[str, list] = {label: [] for label in labels}
    losses: dict[str, list] = {label: [] for label in labels}
    cpu_s: dict[str, list] = {label: [] for label in labels}  # this process's CPU seconds per step
    busy_s: dict[str, list] = {label: [] for label in labels}  # the whole machine's (rank 0 only)
    wall_s: dict[str, list] = {label: [] for label in labels}  # the window of cpu_s and busy_s
    idle_cpu: list[float] = []  # rank 1's CPU seconds per unsplit step (should be ~0)
    threads_seen: dict[str, int] = {}
    foreign_s: dict[str, list] = {label: [] for label in labels}  # other jobs' share of the machine per step
    quiet_count, r = 0, 0
    while True:
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            batch = batches[r % len(batches)]
            dist.barrier()
            cpu, busy, wall = time.process_time(), machine_busy_s(), time.perf_counter()
            if label in trainers:
                start = time.perf_counter()
                loss = trainers[label].step(*step_kwargs(ex, batch)[0], **step_kwargs(ex, batch)[1])
                elapsed = time.perf_counter() - start
                ex.model.zero_grad(set_to_none=True)
            elif rank == 0:
                threads = 1 if label.endswith("1t") else 2
                torch.set_num_threads(threads)
                threads_seen[label] = torch.get_num_threads()
                start = time.perf_counter()
                value = loss_of(ex, unsplit, batch)
                value.backward()
                unsplit_opt.step()
                elapsed = time.perf_counter() - start
                unsplit_opt.zero_grad(set_to_none=True)
                loss = float(value.detach())
                torch.set_num_threads(1)
            else:
                dist.barrier()  # waits here while rank 0 runs the unsplit step
                idle_cpu.append(time.process_time() - cpu)
                elapsed, loss = float("nan"), float("nan")
            cpu, busy, wall = time.process_time() - cpu, machine_busy_s() - busy, time.perf_counter() - wall
            if label not in trainers and rank == 0:
                dist.barrier()
            both = torch.tensor([cpu], dtype=torch.float64)
            dist.all_reduce(both)
            foreign = max(0.0, busy - float(both)) / (2 * wall)
            if r >= params["warmup"]:
                times[label].append(elapsed)
                losses[label].append(loss)
                cpu_s[label].append(cpu)
                busy_s[label].append(busy)
                wall_s[label].append(wall)
                foreign_s[label].append(foreign)
        print(
            f"round {r}: "
            + ", ".join(f"{k} {times[k][-1]:.3f}" for k in labels if times[k])
            + " | others' share "
            + ", ".join(f"{foreign_s[k][-1]:.2f}" for k in labels if foreign_s[k]),
            flush=True,
        )
        r += 1
        timed = r - params["warmup"]
        if timed > 0 and rank == 0:
            quiet_count += all(foreign_s[k][-1] < QUIET for k in labels)
        decision = torch.tensor([quiet_count], dtype=torch.int64)
        dist.broadcast(decision, 0)
        quiet_count = int(decision)
        if timed >= params["rounds"] and (quiet_count >= params["quiet_rounds"] or timed >= params["max_rounds"]):
            break
    torch.save(
        {
            "times": times,
            "losses": losses,
            "idle_cpu": idle_cpu,
            "threads": threads_seen,
            "cpu": cpu_s,
            "busy": busy_s,
            "wall": wall_s,
            "foreign": foreign_s,
        },
        out_dir / f"result{rank}.pt",
    )
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- parent


def measure_model(info: dict, args, work: Path) -> dict:
    plans = {label: p["path"] for label, p in info["plans"].items() if p is not None}
    out_dir = work / f"run-{info['name']}"
    load_before = os.getloadavg()[0]
    results = run_ranks(
        Path(__file__),
        2,
        out_dir,
        timeout_s=args.timeout,
        model=info["name"],
        plans=plans,
        global_batch=args.global_batch,
        warmup=args.warmup,
        rounds=args.rounds,
        quiet_rounds=args.quiet_rounds,
        max_rounds=args.max_rounds,
    )
    r0, r1 = results
    times = {}
    for label, t0 in r0["times"].items():
        t1 = r1["times"][label]
        # A distributed step ends with an all-reduce, so both ranks end together; take the later.
        times[label] = [max(a, b) if b == b else a for a, b in zip(t0, t1)]
    # Other jobs' share of the machine during each step: machine-wide CPU time less both ranks' own.
    foreign = r0["foreign"]
    return {
        "times": times,
        "losses": r0["losses"],
        "idle_cpu": r1["idle_cpu"],
        "threads": r0["threads"],
        "load": (load_before, os.getloadavg()[0]),
        "foreign": foreign,
    }


def quiet_rounds(measured: dict) -> list[bool]:
    foreign = measured["foreign"]
    n = len(next(iter(foreign.values())))
    return [all(foreign[label][i] < QUIET for label in foreign) for i in range(n)]


def headline_rows(info: dict, measured: dict, global_batch: int) -> list[dict]:
    """Medians over the quiet rounds when there are at least 3, else over all rounds."""
    mask = measured["quiet"]
    return summarize(info, measured, global_batch, mask) if sum(mask) >= 3 else measured["rows_all"]


def summarize(info: dict, measured: dict, global_batch: int, mask: list[bool] | None = None) -> list[dict]:
    times = measured["times"]
    if mask is not None:
        times = {label: [t for t, keep in zip(ts, mask) if keep] for label, ts in times.items()}
    ref = "partita"
    pipelined_ref = "partita pp=2" if "partita pp=2" in times else "partita"
    one = statistics.median(times["unsplit 1t"])
    rows = []
    for label, ts in times.items():
        med = statistics.median(ts)
        plan = info["plans"].get(label)
        pred = plan["predicted_s"] if plan else (info["unsplit_predicted_s"] if label == "unsplit 1t" else None)
        ratio = statistics.median(a / b for a, b in zip(ts, times[ref]))  # > 1: slower than partita
        ratio_pp = statistics.median(a / b for a, b in zip(ts, times[pipelined_ref]))
        ranks = 2 if plan else 1
        rows.append(
            dict(
                label=label,
                config=plan["config"]
                if plan
                else ("1 process, 1 thread" if label.endswith("1t") else "1 process, 2 threads"),
                split=plan["split"] if plan else "-",
                median_s=med,
                min_s=min(ts),
                max_s=max(ts),
                samples_s=global_batch / med,
                slowdown=ratio,
                slowdown_pp=ratio_pp,
                efficiency=one / (2 * med) if plan else (one / (2 * med) if label.endswith("2t") else None),
                ranks=ranks,
                predicted_s=pred,
                error=(pred - med) / med if pred else None,
            )
        )
    return rows


def slowdowns(infos: dict) -> str:
    """The contention factor(s) the plans were made with (one cached measurement for all models)."""
    found = sorted({round(i["compute_slowdown"], 3) for i in infos.values() if i and "compute_slowdown" in i})
    return ", ".join(f"{x:.3f}" for x in found) or "not recorded"


def write_markdown(
    path: Path, all_rows: dict, infos: dict, measured: dict, args, started: float | None, header: str
) -> None:
    commands = []
    for m in sorted(measured.values(), key=lambda m: m["meta"]["date"]):
        line = f"`{m['meta']['command']}` ({m['meta']['date']})"
        if line not in commands:
            commands.append(line)
    lines = [
        "# End-to-end throughput: partita's plan vs the baselines' splits vs no split",
        "",
        "- command(s): "
        + "; then ".join(commands)
        + (
            " (models with fewer than 3 quiet rounds in the first run measured again with `--reuse`)"
            if len(commands) > 1
            else ""
        ),
        f"- report written {now_utc()} by `{command_line()}`",
        f"- machine: {header}",
        f"- setup: 2 ranks x 1 thread, gloo on loopback, separate processes (torchrun-style); global batch "
        f"{args.global_batch}; AdamW; fp32. Every configuration of a model runs in the same two processes, "
        f"interleaved step by step (order rotated every round); {args.warmup} warm-up rounds dropped, then at "
        f"least {args.rounds} timed rounds, going on (up to {args.max_rounds}) until {args.quiet_rounds} were quiet: "
        f"other jobs used < {QUIET:.0%} of the machine during every step of the round (machine-wide busy time "
        f"from /proc/stat less both ranks' own CPU time). Medians over the quiet rounds when there are >= 3, "
        f"else over all rounds. `vs partita`: median of within-round ratios step / partita's "
        f"step (> 1: slower than partita). `vs pp=2`: the same against partita pinned to 2 pipeline rank "
        f"groups. Efficiency: unsplit-1-thread step / (2 x step). Predicted: the plan's simulated step from "
        f"the solo 1-thread profile slowed by the measured contention between 2 ranks (`Cluster.local`'s "
        f"`compute_slowdown`: {slowdowns(infos)}); the unsplit 1-thread step from the solo profile; "
        "error = (predicted - measured) / measured.",
        "- plans: `partita.plan(..., cluster=Cluster.local(num_devices=2), options=PlanOptions(costs='measured'))`; "
        "baselines: "
        "`planning.baselines.baseline_plans(ctx, pipelined plan)`: the baseline's split under the pipelined plan's "
        "configuration (recomputation only where a stage would not fit).",
        "- config legend: `GxR` = G pipeline rank groups x R data-parallel replicas (`1x2` is plain data "
        "parallelism), `v` stages per rank group, `m` micro-batches of `mb` samples per replica, `rc` recomputed stages.",
        f"- wall time: {'-' if started is None else format((time.perf_counter() - started) / 60, '.1f')} min for the "
        f"last command (profiles cached in `{args.cache_dir}`; cold planning of all five models: ~5 min).",
        "",
    ]
    # Summary table.
    lines += [
        "## Summary",
        "",
        "Samples/s (medians). Baselines: step time relative to partita's split under the same (pipelined) "
        "configuration, > 1 = slower. Efficiency: unsplit-1-thread step / (2 x step).",
        "",
        "| model | params | partita's plan | partita | partita pp=2 | uniform | parameters | equal_flops "
        "| unsplit 1 thread | unsplit 2 threads | efficiency partita / pp=2 | predicted vs measured partita / pp=2 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, rows in all_rows.items():
        by = {r["label"]: r for r in rows}
        p = by["partita"]
        pp = by.get("partita pp=2", p)

        def rel(method):
            return f"{by[method]['slowdown_pp']:.2f}x" if method in by else "n/a"  # noqa: B023 - called in this iteration

        lines.append(
            f"| {name} | {infos[name]['num_parameters'] / 1e6:.1f} M | {p['config']} | {p['samples_s']:.1f} | "
            f"{pp['samples_s']:.1f} | {rel('uniform')} | {rel('parameters')} | {rel('equal_flops')} | "
            f"{by['unsplit 1t']['samples_s']:.1f} | {by['unsplit 2t']['samples_s']:.1f} | "
            f"{p['efficiency']:.2f} / {pp['efficiency']:.2f} | {p['error'] * 100:+.0f}% / {pp['error'] * 100:+.0f}% |"
        )
    lines.append("")
    lines += findings(all_rows)
    for name, rows in all_rows.items():
        info = infos[name]
        m = measured[name]
        lines += [f"<!-- threads seen by the unsplit runs: {m['threads']} -->"]
        idle = statistics.median(m["idle_cpu"]) if m["idle_cpu"] else float("nan")
        mask = m["quiet"]
        used = (
            f"the {sum(mask)} quiet rounds of {len(mask)}"
            if sum(mask) >= 3
            else f"all {len(mask)} rounds (only {sum(mask)} quiet: numbers include other jobs' load)"
        )
        others = statistics.median(x for ts in m["foreign"].values() for x in ts)
        all_med = {r["label"]: r["median_s"] for r in m["rows_all"]}
        lines += [
            f"## {name}",
            "",
            f"Medians over {used}; other jobs' median share of the machine during a step: "
            f"{others * 100:.0f}%. Measured by `{m['meta']['command']}` ({m['meta']['date']}).",
            "",
            f"{info['num_parameters']:,} parameters, {info['num_nodes']} graph nodes; planning "
            f"{info['planning_s']:.1f} s; rank 1's CPU time while waiting during an unsplit step: "
            f"median {idle * 1e3:.0f} ms; 1-min load average before / after: {m['load'][0]:.1f} / "
            f"{m['load'][1]:.1f}.",
            "",
            "| configuration | plan | stages (node ranges) | step median (min-max) s | samples/s | vs partita "
            "| vs pp=2 | efficiency | predicted s | error | all rounds: median s |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            eff = f"{r['efficiency']:.2f}" if r["efficiency"] is not None else "-"
            pred = f"{r['predicted_s']:.3f}" if r["predicted_s"] else "-"
            err = f"{r['error'] * 100:+.0f}%" if r["error"] is not None else "-"
            lines.append(
                f"| {r['label']} | {r['config']} | {r['split']} | {r['median_s']:.3f} ({r['min_s']:.3f}-"
                f"{r['max_s']:.3f}) | {r['samples_s']:.1f} | {r['slowdown']:.2f}x | {r['slowdown_pp']:.2f}x "
                f"| {eff} | {pred} | {err} | {all_med[r['label']]:.3f} |"
            )
        for label, p in info["plans"].items():
            if p is None:
                lines.append(f"| {label} | does not fit / cannot split | | | | | | | | | |")
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def findings(all_rows: dict) -> list[str]:
    """Bullet points with the numbers of this run (computed, so that a re-run rewrites them)."""

    def by(name):
        return {r["label"]: r for r in all_rows[name]}

    out = ["## Findings (computed from the tables below)", ""]
    dp = [n for n in all_rows if by(n)["partita"]["config"].startswith("1x")]
    if dp:
        out.append(
            f"- partita chose plain data parallelism (`1x2`) for {len(dp)} of {len(all_rows)} models "
            f"({', '.join(dp)}). Its step vs the best pipelined plan (`partita pp=2`): "
            + ", ".join(f"{n} {by(n)['partita']['slowdown_pp']:.2f}x" for n in dp if "partita pp=2" in by(n))
            + " (< 1: data parallelism was faster)."
        )
    for method in ("uniform", "parameters", "equal_flops"):
        vals = {n: by(n)[method]["slowdown_pp"] for n in all_rows if method in by(n)}
        if vals:
            out.append(
                f"- `{method}` split under partita's pipelined configuration: step "
                f"{min(vals.values()):.2f}x-{max(vals.values()):.2f}x partita's split ("
                + ", ".join(f"{n} {v:.2f}x" for n, v in vals.items())
                + ")."
            )
    best2 = {n: min(r["median_s"] for r in all_rows[n] if not r["label"].startswith("unsplit")) for n in all_rows}
    two = {n: by(n)["unsplit 2t"]["median_s"] for n in all_rows}
    out.append(
        "- One process with 2 threads vs the fastest 2-rank configuration: "
        + ", ".join(
            f"{n} {best2[n] / two[n]:.2f}x faster" if best2[n] > two[n] else f"{n} {two[n] / best2[n]:.2f}x slower"
            for n in all_rows
        )
        + ". 2 threads run "
        + ", ".join(f"{by(n)['unsplit 1t']['median_s'] / two[n]:.2f}x" for n in all_rows)
        + " one thread."
    )
    errs = [
        (n, r["label"], r["error"])
        for n in all_rows
        for r in all_rows[n]
        if r["error"] is not None and not r["label"].startswith("unsplit")
    ]
    solo = [(n, by(n)["unsplit 1t"]["error"]) for n in all_rows]
    within = sum(abs(e) <= 0.25 for _, _, e in errs)
    out.append(
        f"- Predicted vs measured step: the solo 1-thread profile predicts the unsplit 1-thread step within "
        f"{max(abs(e) for _, e in solo) * 100:.0f}% ("
        + ", ".join(f"{e * 100:+.0f}%" for _, e in solo)
        + "); the 2-rank steps are under-predicted by "
        f"{-max(e for _, _, e in errs) * 100:.0f}% to {-min(e for _, _, e in errs) * 100:.0f}% "
        f"({within} of {len(errs)} within the 25% target)."
    )
    out += [
        "",
        "Notes:",
        "- Why data parallelism wins on this machine: each rank computes half the batch with the whole model, "
        "and the only communication is one gradient all-reduce (gloo between 2 processes, as `Cluster.local` "
        "measures it: send/recv at 2.4-3 GB/s, a 2-rank all-reduce at 0.4-0.55 of that; GPT-2 small's "
        "35 MB of gradients took 45-51 ms with the flattening copy, bench/results/probes.md), while a 2-stage "
        "pipeline has a bubble and sends activations every micro-batch. The pipelined configurations only "
        "show how good each split is.",
        "- Contention: `Cluster.local` measures how much slower a rank computes while the other computes too "
        "(a kernel mix in 2 processes at once vs 1, the least disturbed of 3 rounds) and the planner applies "
        "it to every compute time; on this machine with no other jobs it measured ~1.01.",
        "- What the predictions miss (bench/results/probes.md, a hand-written data-parallel loop on the same 2 "
        "ranks, GPT-2 small): its step took 0.73-0.78 s and partita's trainer 0.77-0.78 s, so the trainer "
        "adds at most ~5% and the rest of the gap is the cost model's (the loop's forward + backward alone took "
        "0.62-0.63 s, its all-reduce 45-51 ms). A fixed cost per stage call is not modelled either: a "
        "pipelined split with a one-node stage (the CNN's, 9-10) pays it for nothing, which is why partita's "
        "pinned 2-stage CNN split measured 6% slower than uniform and equal FLOPs although it "
        "was predicted 2% faster. partita's own CNN plan (data parallel) is 13% faster than all of them.",
        "- One process with 2 threads is the fastest way to train these models on 2 cores (no duplicated "
        "weights, no communication); partita does not consider intra-op threads as an alternative to ranks.",
        "- Quiet rounds matter: when another job holds a core, 2 ranks x 1 thread run at about the speed of one "
        "thread, and 2 OpenMP threads in one process become 3-6x SLOWER than one thread (threads wait for a "
        "descheduled peer). Rounds with other jobs running are left out of the medians (the `all rounds` column "
        "keeps them), and a model with fewer than 3 quiet rounds is measured again.",
        "",
    ]
    return out


def plot(path: Path, all_rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(all_rows)
    labels = ["partita", "partita pp=2", "uniform", "parameters", "equal_flops", "unsplit 1t", "unsplit 2t"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        xs, ys = [], []
        for j, name in enumerate(names):
            by = {r["label"]: r for r in all_rows[name]}
            if label in by:
                xs.append(j + (i - len(labels) / 2 + 0.5) * width)
                ys.append(by[label]["samples_s"])
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("samples / s (median)")
    ax.set_title("Training throughput, 2 CPU cores: 2 ranks x 1 thread, or one process")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds at least")
    parser.add_argument(
        "--quiet-rounds", type=int, default=5, help="go on (up to --max-rounds) until this many rounds were quiet"
    )
    parser.add_argument("--max-rounds", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--cache-dir", default=".partita-cache")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/partita-e2e-throughput"))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/e2e_throughput.md")
    parser.add_argument("--plot", type=Path, default=REPO / "bench/results/e2e_throughput.png")
    parser.add_argument(
        "--reuse",
        type=Path,
        help="raw.json of an earlier run: its models with >= 3 quiet "
        "rounds are taken from it instead of measured again",
    )
    parser.add_argument("--report-only", type=Path, help="rewrite the report from a raw.json, measure nothing")
    parser.add_argument("--plan-only", action="store_true", help="plan (and fill the cost cache), do not train")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if args.report_only:
        raw = json.loads(args.report_only.read_text())
        rows = {name: headline_rows(raw["infos"][name], m, args.global_batch) for name, m in raw["measured"].items()}
        write_markdown(args.out, rows, raw["infos"], raw["measured"], args, None, raw["machine"])
        if args.plot:
            plot(args.plot, rows)
        return
    started = time.perf_counter()
    header = machine_line()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    infos, measured, all_rows = {}, {}, {}
    previous = json.loads(args.reuse.read_text()) if args.reuse else {"infos": {}, "measured": {}}
    reused = [
        name
        for name in args.models.split(",")
        if name in previous["measured"] and sum(previous["measured"][name]["quiet"]) >= 3
    ]
    for name in args.models.split(","):
        if name in reused:
            infos[name] = previous["infos"][name]
            continue
        t = time.perf_counter()
        infos[name] = plan_model(name, args.global_batch, args.cache_dir, args.work_dir)
        print(
            f"{name}: planned in {time.perf_counter() - t:.0f} s: "
            + json.dumps(
                {
                    k: v and (v["config"], v["split"], round(v["predicted_s"], 3))
                    for k, v in infos[name]["plans"].items()
                }
            ),
            flush=True,
        )
    if args.plan_only:
        return
    meta = {"date": now_utc(), "command": command_line()}

    def record():
        raw = json.dumps({"machine": header, "infos": infos, "measured": measured}, default=str)
        (args.work_dir / "raw.json").write_text(raw)
        args.out.with_suffix(".raw.json").write_text(raw)  # beside the report: --report-only rebuilds it
        write_markdown(args.out, all_rows, infos, measured, args, started, header)

    def measure(name):
        m = measure_model(infos[name], args, args.work_dir)
        m["quiet"] = quiet_rounds(m)
        m["rows_all"] = summarize(infos[name], m, args.global_batch)
        m["meta"] = {**meta, "attempt": attempt}
        return m

    # Models with fewer than 3 quiet rounds are measured once more at the end; the run with more
    # quiet rounds is kept.
    for attempt in (1, 2):
        for name in infos:
            if name in reused:
                if attempt == 1:
                    measured[name] = previous["measured"][name]
                    all_rows[name] = headline_rows(infos[name], measured[name], args.global_batch)
                    record()
                continue
            if attempt == 2 and sum(measured[name]["quiet"]) >= 3:
                continue
            t = time.perf_counter()
            m = measure(name)
            if attempt == 1 or sum(m["quiet"]) > sum(measured[name]["quiet"]):
                measured[name] = m
            all_rows[name] = headline_rows(infos[name], measured[name], args.global_batch)
            print(f"{name}: measured in {time.perf_counter() - t:.0f} s, {sum(m['quiet'])} quiet rounds", flush=True)
            for r in all_rows[name]:
                print(
                    f"  {r['label']:14s} {r['median_s']:.3f} s  {r['samples_s']:.1f}/s  x{r['slowdown']:.2f} "
                    f"x{r['slowdown_pp']:.2f} pred {r['predicted_s']}",
                    flush=True,
                )
            record()
    if args.plot:
        plot(args.plot, all_rows)


if __name__ == "__main__":
    main()
