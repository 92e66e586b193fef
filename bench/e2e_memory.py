"""Training under a per-rank memory budget: which plans fit, predicted vs measured, and how large a model
each method can train.

Every rank gets a budget (``--budget-mib``, default 512 MiB; ``Cluster.local(num_devices=N,
memory_bytes=budget)``, of which the planner fills 60%: ``LOCAL_RESERVED_MEMORY_FRACTION``). The
models are GPT-2s of hidden size ``--hidden`` (512, 8 heads), vocabulary 8192, 128 tokens, global batch 16, AdamW, with a growing number
of layers (``gpt2-L{layers}-H{hidden}``). Planning uses analytic costs on the ``meta`` device (memory
predictions come from shapes; analytic and measured cost tables give the same bytes), as one plans a
model that does not fit this machine.

(A) Which plans fit. For the largest model partita fits on 2 ranks, the predicted peak per rank of
    partita's plan, of each baseline's split under partita's configuration (recomputing a stage only
    where it would not fit otherwise; shown even when it still does not fit), of plain data
    parallelism and of the unsplit model in one process (plain PyTorch: forward and backward of the
    whole batch, no micro-batching, no recomputation) -- against the MEASURED peak per rank while
    training 2 steps after 1 warm-up step.
(B) The largest model each method fits under the budget with 1, 2 and 4 ranks, by the planner's
    prediction (ladder of layer counts, each method stops at its first failure): partita
    (``partita.plan``), each baseline's split under ITS best configuration (every pp x dp, schedule,
    micro-batch count and recompute mode the search knows), data parallelism (``num_stages=1``), and
    the unsplit model in one process. The largest size of partita and of the best baseline is then
    trained for 2 steps and its peaks measured.

Measuring a rank's peak (FACTS.md): ``malloc_trim(0)``, ``5`` into ``/proc/self/clear_refs`` (VmHWM :=
current RSS), train, read ``VmHWM``. "Measured" is VmHWM minus the rank's RSS before the model was built
(interpreter, torch, transformers, gloo: reported as ``base``), so it holds the rank's parameters,
gradients, optimizer state, activations, transient buffers and the allocator's slack, as the prediction
does, plus the captured graph's bookkeeping. The ranks build the model on ``meta`` and take their
stages' weights from a seed checkpoint the parent writes (``Trainer(init_from=...)``), so no rank ever
allocates the whole model; the set-up peak (model build, capture, Trainer, first step) is reported too.

Usage: python bench/e2e_memory.py [--budget-mib 512] [--hidden 512] [--ranks 2,4] [--no-verify]
                                  [--out bench/results/e2e_memory.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from _e2e_common import (  # noqa: E402
    MIB,
    REPO,
    InUseSampler,
    build_example,
    command_line,
    config_text,
    gpt2_params,
    loss_of,
    machine_line,
    malloc_in_use,
    memory_status,
    now_utc,
    reset_peak,
    run_ranks,
    step_kwargs,
)

from partita.cost.local_machine import LOCAL_RESERVED_MEMORY_FRACTION  # noqa: E402

LADDER = [1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32, 40, 48, 56, 64]
BASELINE_METHODS = ("uniform", "parameters", "equal_flops")
PARTITA_NO_ZBV = "partita, GPipe/1F1B only"
REPLICATE_ONLY = "partita, no sharding"  # every stage's replicas hold whole copies (issue 13's "without sharding")
FSDP_DP = "FSDP data parallel"  # num_stages=1, every device a fully sharded replica (what most users run)
METHODS = ["partita", REPLICATE_ONLY, PARTITA_NO_ZBV, "data parallel", FSDP_DP, *BASELINE_METHODS]
LR = 1e-4


# ----------------------------------------------------------------------------- planning (parent)


def model_name(layers: int, hidden: int) -> str:
    return f"gpt2-L{layers}-H{hidden}"


class Sized:
    """One ladder model on meta: its graph and a planning context per rank count."""

    def __init__(self, layers: int, args):
        import partita

        self.layers, self.args = layers, args
        self.name = model_name(layers, args.hidden)
        ex = build_example(self.name, args.global_batch, device="meta")
        self.graph = partita.capture(ex.model, ex.args, ex.kwargs)
        self.num_parameters = self.graph.num_parameters
        self._ctx = {}

    def ctx(self, ranks: int, **pins):
        import partita
        from partita.planning.context import planning_context

        key = (ranks, tuple(sorted(pins.items())))
        if key not in self._ctx:
            cluster = partita.Cluster.local(
                num_devices=ranks, memory_bytes=self.args.budget_mib * MIB, cache_dir=self.args.cache_dir, num_threads=1
            )
            options = partita.PlanOptions(uniform_replicas=True, costs="analytic", **pins)
            self._ctx[key] = planning_context(
                self.graph, cluster=cluster, global_batch_size=self.args.global_batch, options=options
            )
        return self._ctx[key]

    def usable(self, ranks: int = 1) -> int:
        return self.ctx(ranks).options.memory_limit_bytes

    # -- methods: each returns a Plan (fits), or None (does not fit)

    def partita(self, ranks: int):
        from partita.planning.driver import best_plan

        return best_plan(self.ctx(ranks))

    def data_parallel(self, ranks: int):
        from partita.planning.driver import best_plan

        return best_plan(self.ctx(ranks, num_stages=1, replicas=ranks))

    def replicate_only(self, ranks: int):
        """partita with every stage replicated (no sharding: the plans before sharding existed)."""
        from partita.planning.driver import best_plan

        return best_plan(self.ctx(ranks, sharding="replicate"))

    def fsdp_data_parallel(self, ranks: int):
        """Plain data parallelism with every parameter, gradient and optimizer state fully sharded."""
        from partita.planning.driver import best_plan

        return best_plan(self.ctx(ranks, num_stages=1, replicas=ranks, sharding="full_shard"))

    def partita_no_zbv(self, ranks: int):
        """partita restricted to the GPipe and 1F1B schedules (no ZBV, no interleaving)."""
        from partita.planning.driver import best_plan

        return best_plan(self.ctx(ranks, schedules=("gpipe", "1f1b")))

    def baseline_own(self, ranks: int, method: str):
        """The baseline's split under its own best config (None: none fits or none can be made)."""
        from plan_quality import own_best

        best = own_best(self.ctx(ranks), method)
        return None if best == "n/a" else best

    def unsplit_bytes(self) -> int:
        """Plain PyTorch in one process: the whole model, the whole batch at once, no recomputation."""
        from partita.cost.memory import device_memory
        from partita.types import OptimizerKind

        ctx = self.ctx(1)
        costs = ctx.costs_at(self.args.global_batch)
        return device_memory(
            costs, [(0, self.graph.num_nodes)], in_flight=1, optimizer=OptimizerKind.ADAM, num_microbatches=1
        ).total_bytes


def same_config_unchecked(ctx, like, method: str):
    """``method``'s split under ``like``'s configuration, recomputing the stages over the limit, WITHOUT the
    fit check (so that a split that does not fit still shows its predicted peak)."""
    import partita
    from partita.planning.baselines import baseline_boundaries
    from partita.planning.build import build_plan
    from partita.planning.chain import legal_cuts
    from partita.planning.configs import Config

    config = Config(
        replicas=like.stages[0].num_replicas,
        num_rank_groups=like.num_rank_groups,
        schedule=like.schedule,
        virtual_stages=like.num_stages // like.num_rank_groups,
        num_microbatches=like.num_microbatches,
        microbatch_size=like.microbatch_size,
        recompute_mode=None,
    )
    boundaries = baseline_boundaries(method, ctx.graph, legal_cuts(ctx.graph), config.num_stages)
    if boundaries is None:
        return None
    costs = ctx.costs_at(config.microbatch_size)

    def build(recompute):
        return build_plan(
            ctx.graph,
            costs,
            config,
            boundaries,
            recompute,
            ctx.options,
            cluster=ctx.cluster,
            method=method,
            resolved_options=ctx.resolved,
            versions=(partita.__version__, torch.__version__),
        )

    draft = build([False] * config.num_stages)
    limit = ctx.options.memory_limit_bytes
    return build([s.memory_bytes > limit for s in draft.stages])


def per_rank_predicted(plan) -> list[int]:
    ranks = sorted({r for s in plan.stages for r in s.ranks})
    return [max(s.memory_bytes for s in plan.stages if r in s.ranks) for r in ranks]


def ladder(args, log) -> dict:
    """Largest fitting layer count per (method, ranks), by prediction. A coarse pass over LADDER (each
    method stops at its first failure), then every layer count between a method's largest fit and its
    first failure."""
    keys = [("unsplit", 1), ("partita", 1)] + [(m, n) for n in args.ranks for m in METHODS]
    largest: dict = {}
    failed: dict = {}  # (method, ranks) -> smallest layer count found not to fit
    rows: dict = {}

    def evaluate(layers: int, todo: list) -> None:
        t = time.perf_counter()
        sized = Sized(layers, args)
        row = rows.setdefault(layers, {"layers": layers, "params": sized.num_parameters})
        for m, n in todo:
            if m == "unsplit":
                need = sized.unsplit_bytes()
                row[(m, n)] = need
                fits, plan = need <= sized.usable(1), None
            else:
                plan = (
                    sized.partita(n)
                    if m == "partita"
                    else sized.replicate_only(n)
                    if m == REPLICATE_ONLY
                    else sized.fsdp_data_parallel(n)
                    if m == FSDP_DP
                    else sized.data_parallel(n)
                    if m == "data parallel"
                    else sized.partita_no_zbv(n)
                    if m == PARTITA_NO_ZBV
                    else sized.baseline_own(n, m)
                )
                need = plan and max(per_rank_predicted(plan))
                row[(m, n)] = need
                fits = plan is not None
            if fits:
                if (m, n) not in largest or largest[(m, n)][0] < layers:
                    largest[(m, n)] = (layers, plan, need)
            else:
                failed[(m, n)] = min(layers, failed.get((m, n), layers))
        log(
            f"L={layers} ({sized.num_parameters / 1e6:.1f} M) in {time.perf_counter() - t:.0f} s: "
            + ", ".join(
                f"{m}@{n} {'fits' if (m, n) in largest and largest[(m, n)][0] == layers else 'no'}" for m, n in todo
            )
        )

    for layers in LADDER:
        todo = [k for k in keys if k not in failed]
        if not todo:
            break
        evaluate(layers, todo)
    while True:  # refine: the next layer count above each method's largest fit, below its first failure
        todo = {}
        for k in keys:
            nxt = largest[k][0] + 1 if k in largest else 1
            if nxt < failed.get(k, nxt):
                todo.setdefault(nxt, []).append(k)
        if not todo:
            break
        for layers, ks in sorted(todo.items()):
            evaluate(layers, ks)
    return {"rows": [rows[k] for k in sorted(rows)], "largest": largest}


# ----------------------------------------------------------------------------- ranks


def worker(out_dir: Path) -> None:
    params = torch.load(out_dir / "params.pt", weights_only=False)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    distributed = params["plan"] is not None
    if distributed:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    import partita

    warm_up(params, distributed)
    reset_peak()
    base = memory_status()["VmRSS"]
    base_in_use = malloc_in_use() or 0
    out = {"base": base}
    if distributed:
        # The model on meta: each rank allocates its stages' weights and reads them from the seed.
        ex = build_example(params["model"], params["global_batch"], device="meta", data_device="cpu")
        batches = [ex.make_batch(params["global_batch"], s) for s in range(3)]
        graph = capture_on_meta(ex)
        plan = partita.Plan.load(params["plan"], graph=graph)
        trainer = partita.Trainer(
            ex.model,
            plan,
            graph=graph,
            init_from=params["seed"],
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, foreach=params.get("foreach")),
        )
        losses = [trainer.step(*step_kwargs(ex, batches[0])[0], **step_kwargs(ex, batches[0])[1])]
        out["setup_peak"] = memory_status()["VmHWM"] - base
        out["released"] = 0
        out["held_param_bytes"] = sum(p.numel() * p.element_size() for p in trainer.params.values())
        out["held_tensor_bytes"] = held_tensor_bytes(trainer.params.values(), trainer.optimizer)
        reset_peak()
        out["resting"] = memory_status()["VmRSS"] - base
        with InUseSampler() as sampler:
            for s in (1, 2):
                a, k = step_kwargs(ex, batches[s])
                losses.append(trainer.step(*a, **k))
        status = memory_status()
        out["in_use_peak"] = sampler.peak - base_in_use
        # No MemTracker here: under it torch's PipelineStage forward fails, and the peer rank then hangs.
        out["tensor_peak"] = None
        dist.barrier()
    else:
        ex = build_example(params["model"], params["global_batch"])
        batches = [ex.make_batch(params["global_batch"], s) for s in range(3)]
        model = ex.model
        opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=params.get("foreach"))
        losses = []
        sampler = InUseSampler()
        for s in range(3):
            if s == 1:
                out["setup_peak"] = memory_status()["VmHWM"] - base
                out["released"] = 0
                out["held_param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
                out["held_tensor_bytes"] = held_tensor_bytes(model.parameters(), opt)
                reset_peak()
                out["resting"] = memory_status()["VmRSS"] - base
                sampler.__enter__()
            loss = loss_of(ex, model, batches[s])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))
        sampler.__exit__(None, None, None)
        status = memory_status()
        out["in_use_peak"] = sampler.peak - base_in_use

        def plain_step():
            loss_of(ex, model, batches[0]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out["tensor_peak"] = tracked_step(plain_step, [model], opt)
    out.update(peak=status["VmHWM"] - base, peak_abs=status["VmHWM"], losses=losses)
    torch.save(out, out_dir / f"result{rank}.pt")
    if distributed:
        dist.destroy_process_group()


def tracked_step(step, modules, optimizer) -> int | None:
    """Peak bytes of live tensors over one step, by torch's MemTracker (parameters, gradients, optimizer
    state, activations, temporaries); None if it fails. Run after the RSS-measured steps: it is slower
    and its bookkeeping would count in RSS."""
    try:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(*modules, optimizer)
        with tracker:
            step()
        return int(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    except Exception as e:  # noqa: BLE001 - a private API: report, do not fail the benchmark
        print(f"MemTracker failed: {e!r}", flush=True)
        return None


def held_tensor_bytes(params, optimizer) -> int:
    """Bytes of the parameters, their .grad and the optimizer's state tensors (alive between steps)."""
    total = 0
    for p in params:
        total += p.numel() * p.element_size()
        if p.grad is not None:
            total += p.grad.numel() * p.grad.element_size()
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total


def warm_up(params: dict, distributed: bool) -> None:
    """Run the same code paths once on a tiny GPT-2 and drop it, so that the base reading already holds
    what importing and first use load for good (transformers' model code, torch.export, the pipelining
    schedules: ~140 MiB of the process, that is no part of any plan's memory)."""
    import gc

    import partita
    from partita.planning.manual import manual_plan

    gb = params["global_batch"]
    tiny = build_example("gpt2-L2-H64", gb)
    if distributed:
        from partita.runtime.materialize import save_seed

        real = partita.Plan.load(params["plan"])
        seed = f"{params['seed']}-warm-up-{os.environ['RANK']}"
        save_seed(tiny.model, seed)
        tiny = build_example("gpt2-L2-H64", gb, device="meta", data_device="cpu")
        graph = capture_on_meta(tiny)
        n, s = graph.num_nodes, real.num_stages
        plan = manual_plan(
            graph,
            [n * k // s for k in range(s + 1)],
            schedule=real.schedule,
            num_rank_groups=real.num_rank_groups,
            replicas=real.stages[0].num_replicas,
            num_microbatches=real.num_microbatches,
            global_batch_size=gb,
            recompute=[st.recompute for st in real.stages],
        )
        trainer = partita.Trainer(
            tiny.model, plan, graph=graph, optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR), init_from=seed
        )
        for step in range(2):
            a, k = step_kwargs(tiny, tiny.make_batch(gb, step))
            trainer.step(*a, **k)
        del trainer, graph, plan
    else:
        opt = torch.optim.AdamW(tiny.model.parameters(), lr=LR)
        for step in range(2):
            loss_of(tiny, tiny.model, tiny.make_batch(gb, step)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del opt
    del tiny
    gc.collect()


def capture_on_meta(ex):
    """The graph of a meta model, captured from meta copies of its (real) example inputs."""
    import partita
    from partita.runtime.materialize import meta_copies

    return partita.capture(
        ex.model, meta_copies(ex.args), meta_copies(ex.kwargs), loss_fn=ex.loss_fn, target=meta_copies(ex.target)
    )


def verify(label: str, name: str, plan, ranks: int, args, log) -> dict:
    """Train 2 steps (after 1) of ``name`` under ``plan`` (None: unsplit, one process); per-rank peaks."""
    work = args.work_dir / f"{label.replace(' ', '_').replace('/', '_').replace(',', '')}-{ranks}ranks"
    work.mkdir(parents=True, exist_ok=True)
    path = seed = None
    if plan is not None:
        from partita.runtime.materialize import save_seed

        path, seed = str(work / "plan.json"), str(work / "seed")
        plan.save(path)
        save_seed(build_example(name, args.global_batch).model, seed)  # here, in the parent: not measured
    t = time.perf_counter()
    results = run_ranks(
        Path(__file__),
        ranks,
        work,
        timeout_s=args.timeout,
        model=name,
        plan=path,
        seed=seed,
        global_batch=args.global_batch,
    )
    log(
        f"verified {label}: {name} on {ranks} rank(s) in {time.perf_counter() - t:.0f} s: peaks "
        + ", ".join(f"{r['peak'] / MIB:.0f}" for r in results)
        + " MiB"
    )
    return {
        "label": label,
        "model": name,
        "ranks": ranks,
        "results": results,
        "config": config_text(plan, always_recompute=True) if plan is not None else "plain, whole batch",
        "predicted": per_rank_predicted(plan) if plan is not None else None,
        "seconds": time.perf_counter() - t,
    }


# ----------------------------------------------------------------------------- report


def mib(x) -> str:
    return "-" if x is None else f"{x / MIB:.0f}"


def per_rank(values) -> str:
    return " / ".join(mib(v) for v in values)


def rss_ratio_range(measured: list) -> str:
    ratios = [x / u for m in measured for x, u in zip(m[3], m[4]) if x and u]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"


def errors(predicted, measured) -> str:
    return ", ".join("-" if m is None else f"{(p - m) / m * 100:+.0f}%" for p, m in zip(predicted, measured))


def write_markdown(path: Path, args, header: str, part_a: dict, lad: dict, checks: list, started: float) -> None:
    budget = args.budget_mib * MIB
    usable = int(budget * (1 - LOCAL_RESERVED_MEMORY_FRACTION))
    lines = [
        "# Training under a memory budget per rank: which plans fit, and the largest model per method",
        "",
        f"- command: `{command_line()}`",
        f"- date: {now_utc()}; {header}",
        f"- budget: {args.budget_mib} MiB per rank (`Cluster.local(num_devices=N, memory_bytes={budget})`; the "
        f"planner fills {usable / MIB:.0f} MiB: `Cluster.local` reserves {LOCAL_RESERVED_MEMORY_FRACTION:.0%} for what glibc "
        f"keeps of freed memory). Models: GPT-2, hidden {args.hidden} "
        f"({args.hidden // 64} heads), vocabulary 8192, 128 tokens, global batch {args.global_batch}, AdamW, "
        "fp32; planned on `meta` with analytic costs.",
        "- measured: VmHWM over 2 training steps (after 1 warm-up step; `malloc_trim(0)` + `clear_refs` 5 "
        "before them) minus the rank's RSS before the model was built (`base`: interpreter, torch, "
        "transformers, gloo). `set-up`: VmHWM over model build (on meta), capture, Trainer (which allocates the "
        "rank's stages and loads them from a seed checkpoint) and the first step, same base.",
        f"- wall time: {(time.perf_counter() - started) / 60:.1f} min.",
        "",
    ]
    # (A)
    if part_a:
        lines += [
            f"## (A) Which plans fit: {part_a['model']} ({part_a['params'] / 1e6:.1f} M parameters) on 2 ranks",
            "",
            f"The largest ladder model partita fits on 2 ranks. Baselines: their split under partita's "
            f"configuration ({part_a['config']}), recomputing only stages over the limit. Peaks per rank, MiB "
            f"(the planner's limit: {usable / MIB:.0f}; the budget, what `RSS fits` checks: {args.budget_mib}). `RSS`: VmHWM over 2 steps less the base RSS; `in use`: "
            "the largest sample (every 0.5 ms) of glibc's bytes in use (`mallinfo2`: live tensors and Python "
            "objects, without the freed memory glibc keeps), less its value at the base reading. Errors: "
            "(predicted - measured) / measured.",
            "",
            "| plan | configuration | predicted fits | predicted | RSS | error | RSS fits | in use | error "
            "| set-up RSS peak | base RSS |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in part_a["rows"]:
            pred = row["predicted"]
            if pred is None:
                lines.append(f"| {row['label']} | {row['config']} | **no** | - | - | - | - | - | - | - | - |")
                continue
            pred_fit = "yes" if max(pred) <= usable else "**no**"
            if row.get("measured") is not None:
                meas, in_use = row["measured"], row["in_use"]
                lines.append(
                    f"| {row['label']} | {row['config']} | {pred_fit} | {per_rank(pred)} | {per_rank(meas)} | "
                    f"{errors(pred, meas)} | {'yes' if max(meas) <= budget else '**no**'} | {per_rank(in_use)} | "
                    f"{errors(pred, in_use)} | {per_rank(row['setup'])} | {per_rank(row['base'])} |"
                )
            else:
                lines.append(
                    f"| {row['label']} | {row['config']} | {pred_fit} | {per_rank(pred)} | - | - | - | - | - | - | - |"
                )
        lines.append("")
    lines += findings(args, part_a, lad, checks, usable, budget)
    # (B)
    lines += [
        "## (B) The largest model each method fits (planner's prediction)",
        "",
        f"Ladder of layer counts {LADDER[0]}..{LADDER[-1]} at hidden {args.hidden}; a method stops at its first "
        "failure. Baselines: their split under their own best configuration. Entry: layers (parameters), "
        "predicted peak per rank in MiB, configuration.",
        "",
        "| method | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in [1, *args.ranks]) + " |",
        "|---|" + "---|" * (1 + len(args.ranks)),
    ]
    largest = lad["largest"]
    for m in [*METHODS, "unsplit"]:
        cells = []
        for n in [1, *args.ranks]:
            if (m, n) not in largest:
                applicable = (m == "unsplit") == (n == 1) or m == "partita"
                cells.append("none fits" if applicable else "")
                continue
            layers, p, need = largest[(m, n)]
            params = gpt2_params(layers, args.hidden)
            cfg = config_text(p, always_recompute=True) if p is not None else "plain, whole batch"
            cells.append(f"**{layers}** ({params / 1e6:.0f} M), {mib(need)}, {cfg}")
        label = {
            "unsplit": "unsplit, 1 process (plain PyTorch)",
            "data parallel": "data parallel (`num_stages=1, replicas=N`)",
            FSDP_DP: "FSDP data parallel (`num_stages=1, replicas=N, sharding=full_shard`)",
            REPLICATE_ONLY: "partita, no sharding (`sharding=replicate`)",
        }.get(m, m)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("")
    # ladder detail
    keys = [("unsplit", 1), ("partita", 1)] + [(m, n) for n in args.ranks for m in METHODS]
    lines += [
        "Predicted peak per rank (MiB) along the ladder; blank: not evaluated after the method's first failure, "
        "OOM: no configuration fits.",
        "",
        "| layers | params | " + " | ".join(f"{m}@{n}" for m, n in keys) + " |",
        "|---:|---:|" + "---:|" * len(keys),
    ]
    for row in lad["rows"]:
        cells = []
        for k in keys:
            if k not in row:
                cells.append("")
            elif row[k] is None or (k == ("unsplit", 1) and row[k] > usable):
                cells.append("OOM" if row[k] is None else f"OOM ({mib(row[k])})")
            else:
                cells.append(mib(row[k]))
        lines.append(f"| {row['layers']} | {row['params'] / 1e6:.1f} M | " + " | ".join(cells) + " |")
    lines.append("")
    # checks
    if checks:
        lines += [
            "## Verification: the largest sizes, trained",
            "",
            "2 training steps after 1 warm-up step, peaks per rank in MiB, measured as in (A); `tensors`: "
            "MemTracker's peak of live tensors over a third step (one process only: under MemTracker torch's "
            "PipelineStage forward fails).",
            "",
            "| method | model | ranks | configuration | predicted | RSS | error | RSS fits | in use | error "
            "| tensors | set-up RSS peak | losses (rank 0) |",
            "|---|---|---:|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in checks:
            meas = [r["peak"] for r in c["results"]]
            in_use = [r.get("in_use_peak") for r in c["results"]]
            pred = c["predicted"] or [c.get("predicted_unsplit")]
            tensors = [r.get("tensor_peak") for r in c["results"]]
            losses = ", ".join(f"{x:.3f}" for x in c["results"][0]["losses"])
            lines.append(
                f"| {c['label']} | {c['model']} | {c['ranks']} | {c.get('config', '')} | {per_rank(pred)} | "
                f"{per_rank(meas)} | {errors(pred, meas)} | {'yes' if max(meas) <= budget else '**no**'} | "
                f"{per_rank(in_use)} | {errors(pred, in_use)} | {per_rank(tensors)} | "
                f"{per_rank([r['setup_peak'] for r in c['results']])} | {losses} |"
            )
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def findings(args, part_a: dict, lad: dict, checks: list, usable: int, budget: int) -> list[str]:
    """Bullet points computed from this run's numbers."""
    out = ["## Findings (computed from the tables)", ""]
    largest = lad["largest"]

    def size(key):
        if key not in largest:
            return "none"
        layers = largest[key][0]
        return f"{layers} layers ({gpt2_params(layers, args.hidden) / 1e6:.0f} M)"

    for n in args.ranks:
        out.append(
            f"- Largest model by prediction on {n} ranks: partita {size(('partita', n))} "
            f"(GPipe/1F1B only: {size((PARTITA_NO_ZBV, n))}); "
            + ", ".join(f"{m} {size((m, n))}" for m in BASELINE_METHODS)
            + f"; data parallelism {size(('data parallel', n))}, FSDP data parallelism {size((FSDP_DP, n))}. "
            f"One process: unsplit plain PyTorch {size(('unsplit', 1))}, partita on 1 rank (micro-batches + "
            f"recomputation) {size(('partita', 1))}."
        )
        if ("partita", n) in largest and (REPLICATE_ONLY, n) in largest:
            with_sharding = gpt2_params(largest[("partita", n)][0], args.hidden)
            without = gpt2_params(largest[(REPLICATE_ONLY, n)][0], args.hidden)
            out.append(
                f"- Sharding on {n} ranks: partita fits {with_sharding / 1e6:.0f} M parameters with sharding "
                f"searched, {without / 1e6:.0f} M without ({with_sharding / without:.2f}x)."
            )
    measured = []  # (label, config, predicted, rss, in_use)
    for row in (part_a or {}).get("rows", []):
        if row.get("measured") is not None:
            measured.append((f"(A) {row['label']}", row["config"], row["predicted"], row["measured"], row["in_use"]))
    for c in checks:
        if c["label"] == "partita" and c["ranks"] == 2 and part_a:
            continue  # the same run as (A) partita
        measured.append(
            (
                f"{c['label']} on {c['ranks']}",
                c.get("config", ""),
                c["predicted"] or [c.get("predicted_unsplit")],
                [r["peak"] for r in c["results"]],
                [r.get("in_use_peak") for r in c["results"]],
            )
        )
    if measured:
        predicted_fit = [m for m in measured if max(m[2]) <= usable]
        rss_fit = [m for m in predicted_fit if max(m[3]) <= budget]
        out.append(
            f"- Of {len(predicted_fit)} trained plans predicted to fit the planner's {usable / MIB:.0f} MiB, "
            f"{len(rss_fit)} stayed under the {budget / MIB:.0f} MiB budget in RSS"
            + (": " + ", ".join(m[0] for m in rss_fit) if rss_fit else "")
            + "."
        )

        def err_range(group, idx):
            errs = [(p - x) / x for m in group for p, x in zip(m[2], m[idx]) if x]
            return f"{min(errs) * 100:+.0f}% to {max(errs) * 100:+.0f}%" if errs else "-"

        zbv_rc = [m for m in measured if "zbv" in m[1] and "rc=0/" not in m[1]]
        rest = [m for m in measured if m not in zbv_rc]
        out.append(
            f"- Predicted vs measured peak per rank, all plans except ZBV with recomputation: RSS "
            f"{err_range(rest, 3)}, bytes in use {err_range(rest, 4)}."
        )
        if zbv_rc:
            out.append(
                f"- ZBV with recomputation ({', '.join(m[0] for m in zbv_rc)}): RSS {err_range(zbv_rc, 3)}, "
                f"bytes in use {err_range(zbv_rc, 4)}."
            )
    for c in checks:
        if c["ranks"] > 1:
            whole = 4 * gpt2_params(int(c["model"].split("-L")[1].split("-")[0]), args.hidden)
            out.append(
                f"- Set-up of {c['label']} on {c['ranks']} ranks ({c['model']}, {mib(whole)} MiB of parameters "
                f"in all): peaks of {per_rank([r['setup_peak'] for r in c['results']])} MiB RSS, against "
                f"{per_rank([r['peak'] for r in c['results']])} MiB in the timed steps."
            )
    out += [
        "",
        "Notes:",
        "- `RSS` is what a memory limit (cgroup, the OOM killer) sees; `in use` is close to what the planner "
        "models (live tensors). The difference is glibc keeping freed memory (RSS/in use per rank, this run: "
        + rss_ratio_range(measured)
        + f"); `Cluster.local` reserves {LOCAL_RESERVED_MEMORY_FRACTION:.0%} of the "
        "budget for it. Making glibc give freed memory back (`MALLOC_TRIM_THRESHOLD_=0`) brought RSS to ~1.2x "
        "the bytes in use but made a GPT-2 step 40-50% slower on this machine (bench/results/probes.md).",
        "- Set-up: the ranks build the model on meta (no weights), take the pipeline's static shapes from the "
        "graph on meta, then allocate and load only their stages' weights (`partita/runtime/materialize.py`).",
        "- ZBV with recomputation is never planned (an earlier run of this benchmark measured such plans 40-60% "
        "above the memory model: torch's ZBV keeps a recomputed stage's activations alive between its input- "
        "and weight-gradient passes).",
        "",
    ]
    return out


def plot(path: Path, args, lad: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = lad["largest"]
    methods = METHODS
    fig, ax = plt.subplots(figsize=(8, 4))
    ns = list(args.ranks)
    width = 0.8 / (len(methods) + 1)
    for i, m in enumerate(methods):
        ys = [gpt2_params(largest[(m, n)][0], args.hidden) / 1e6 if (m, n) in largest else 0 for n in ns]
        ax.bar([j + i * width for j in range(len(ns))], ys, width, label=m)
    if ("unsplit", 1) in largest:
        ax.axhline(
            gpt2_params(largest[("unsplit", 1)][0], args.hidden) / 1e6, color="k", ls="--", label="unsplit, 1 process"
        )
    if ("partita", 1) in largest:
        ax.axhline(
            gpt2_params(largest[("partita", 1)][0], args.hidden) / 1e6, color="grey", ls=":", label="partita, 1 rank"
        )
    ax.set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(ns))], [f"{n} ranks" for n in ns])
    ax.set_ylabel("largest GPT-2 that fits (M parameters)")
    ax.set_title(f"Largest trainable model, {args.budget_mib} MiB per rank (predicted)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--budget-mib", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--cache-dir", default=".partita-cache")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/partita-e2e-memory"))
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/e2e_memory.md")
    parser.add_argument("--plot", type=Path, default=REPO / "bench/results/e2e_memory.png")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    args.ranks = [int(x) for x in args.ranks.split(",")]
    started = time.perf_counter()
    header = machine_line()
    torch.set_num_threads(1)
    args.work_dir.mkdir(parents=True, exist_ok=True)

    def log(msg):
        print(f"[{time.perf_counter() - started:6.0f} s] {msg}", flush=True)

    lad = ladder(args, log)
    largest = lad["largest"]
    part_a, checks = {}, []
    if 2 in args.ranks and ("partita", 2) in largest:
        layers, plan, _ = largest[("partita", 2)]
        sized = Sized(layers, args)
        ctx = sized.ctx(2)
        rows = [{"label": "partita", "plan": plan}]
        simple = sized.partita_no_zbv(2)
        rows.append(
            {"label": PARTITA_NO_ZBV, "plan": simple}
            if simple is not None
            else {"label": PARTITA_NO_ZBV, "plan": None, "predicted": None, "config": "no plan fits"}
        )
        for m in BASELINE_METHODS:
            p = same_config_unchecked(ctx, plan, m)
            if p is not None:
                rows.append({"label": m, "plan": p})
        dp = sized.data_parallel(2)
        rows.append(
            {"label": "data parallel", "plan": dp}
            if dp is not None
            else {
                "label": "data parallel",
                "plan": None,
                "predicted": None,
                "config": "no micro-batch count / recompute mode fits",
            }
        )
        rows.append(
            {
                "label": "unsplit, 1 process",
                "plan": None,
                "predicted": [sized.unsplit_bytes()],
                "config": "plain, whole batch",
            }
        )
        for row in rows:
            if row["plan"] is not None:
                row["predicted"] = per_rank_predicted(row["plan"])
                row["config"] = config_text(row["plan"], always_recompute=True)
        part_a = {
            "model": sized.name,
            "params": sized.num_parameters,
            "config": config_text(plan, always_recompute=True),
            "rows": rows,
        }
        if not args.no_verify:
            for row in rows:
                if row["predicted"] is None:
                    continue
                ranks = 1 if row["plan"] is None else 2
                c = verify(f"A {row['label']}", sized.name, row["plan"], ranks, args, log)
                row["measured"] = [r["peak"] for r in c["results"]]
                row["in_use"] = [r.get("in_use_peak") for r in c["results"]]
                row["setup"] = [r["setup_peak"] for r in c["results"]]
                row["base"] = [r["base"] for r in c["results"]]
                row["losses"] = c["results"][0]["losses"]
                if row["label"] == "partita":
                    c["label"] = "partita"
                    checks.append(c)
                write_markdown(args.out, args, header, part_a, lad, checks, started)
    if not args.no_verify:
        done = {(c["model"], c["ranks"], c["label"]) for c in checks}
        for n in args.ranks:
            todo = [(m, largest.get((m, n))) for m in ("partita", REPLICATE_ONLY, FSDP_DP, PARTITA_NO_ZBV)]
            base = [(m, largest[(m, n)]) for m in BASELINE_METHODS if (m, n) in largest]
            if base:
                todo.append(max(base, key=lambda kv: (kv[1][0], -kv[1][2])))
            for m, entry in todo:
                if entry is None:
                    continue
                layers, plan, _ = entry
                name = model_name(layers, args.hidden)
                if (name, n, m) in done:
                    continue
                checks.append(verify(m, name, plan, n, args, log))
                write_markdown(args.out, args, header, part_a, lad, checks, started)
        if ("unsplit", 1) in largest:
            layers, _, need = largest[("unsplit", 1)]
            c = verify("unsplit, 1 process", model_name(layers, args.hidden), None, 1, args, log)
            c["predicted_unsplit"] = need
            checks.append(c)
    write_markdown(args.out, args, header, part_a, lad, checks, started)
    if args.plot:
        plot(args.plot, args, lad)
    (args.work_dir / "raw.json").write_text(
        json.dumps(
            {
                "ladder": [{str(k): v for k, v in r.items()} for r in lad["rows"]],
                "checks": [{k: v for k, v in c.items() if k != "results"} | {"results": c["results"]} for c in checks],
            },
            default=str,
        )
    )


if __name__ == "__main__":
    main()
