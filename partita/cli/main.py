"""The `partita` command line: parse arguments, call the library, print. No logic of its own."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import warnings
from collections.abc import Sequence

from partita.cli.devices import check_groups_flags, default_nodes, groups_cluster
from partita.cli.parser import DEFAULT_TRAIN_GLOBAL_BATCH, build_parser, joined_negative_numbers, parse_bytes
from partita.errors import PartitaError
from partita.planning.options import CostSource, PlanOptions
from partita.types import Schedule
from partita.types.cluster import Cluster


def _load(args: argparse.Namespace):
    from partita.cli.model_spec import load_model

    return load_model(
        args.model,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        device=args.model_device,
        seed=getattr(args, "seed", 0),
    )


def _capture(example):
    from partita.capturing import capture

    return capture(example.model, example.args, example.kwargs, loss_fn=example.loss_fn, target=example.target)


def _inspect(args: argparse.Namespace) -> int:
    from partita.report.inspect import inspect_dict, inspect_text

    example = _load(args)
    graph = _capture(example)
    if args.json:
        print(json.dumps(inspect_dict(graph, depth=args.depth, top=args.top), indent=2))
    else:
        print(inspect_text(graph, name=example.name, depth=args.depth, top=args.top))
    if args.costs:
        from partita.report.inspect import costs_text

        print()
        print(costs_text(graph, _inspect_costs(graph, example, args.device), depth=args.depth))
    return 0


def _inspect_costs(graph, example, device):
    """Analytic costs for a catalog device or a meta model; measured costs otherwise."""
    on_meta = any(p.device.type == "meta" for p in example.model.parameters())
    if device is not None or on_meta:
        from partita.cost.analytic import analytic_costs

        return analytic_costs(graph, device or "h100", graph.batch_size)
    from partita.cost.profiler import profile

    _check_example_values(graph, example)
    return profile(graph, (example.args, example.kwargs, example.target), microbatch_size=graph.batch_size)


def _plan_options(args: argparse.Namespace) -> PlanOptions:
    """The PlanOptions that the `plan` and `train` commands' flags pin (the only place they are read;
    both commands declare them once, partita.cli.parser._add_planner_flags)."""
    return PlanOptions(
        schedules=tuple(Schedule) if args.schedule is None else args.schedule,
        num_stages=args.num_stages,
        replicas=args.replicas,
        num_microbatches=args.microbatches,
        recompute=args.recompute,
        uniform_replicas=True if args.uniform_replicas else None,
        optimizer=args.optimizer,  # train: a torch optimizer's name, which OptimizerKind.parse reads too
        precision=args.precision,
        sharding=args.sharding,
        tensor_parallel=args.tensor_parallel,
        sequence_parallel={"yes": True, "no": False}.get(args.sequence_parallel),
        compile=args.compile,
        costs=CostSource.AUTO if args.costs is None else args.costs,
        cache_dir=args.cache_dir,
    )


def _cluster(args: argparse.Namespace, *, num_devices: int, device_type: str = "cpu", num_nodes: int = 1):
    """``num_devices`` CPU ranks on ``num_nodes`` machines like this one (measured here), or catalog devices."""
    from partita.cli.multinode import local_nodes_cluster

    if device_type == "cpu":
        return local_nodes_cluster(num_devices, num_nodes=num_nodes, memory_bytes=args.memory, cache_dir=args.cache_dir)
    return _catalog_cluster(args, num_devices=num_devices, device_type=device_type, num_nodes=num_nodes)


def _catalog_cluster(args: argparse.Namespace, *, num_devices: int, device_type: str, num_nodes: int) -> Cluster:
    """``num_devices`` catalog devices in ``num_nodes`` nodes: a catalog type's cluster, and the shape
    of this machine's (measured, ``_cluster``) that the pins are checked against before a capture."""
    return Cluster(
        device=device_type,
        num_devices=num_devices,
        devices_per_node=max(1, num_devices // num_nodes),
        memory_bytes=args.memory,
    )


def _plan(args: argparse.Namespace) -> int:
    from partita.planning.api import plan_with_baselines
    from partita.planning.context import check_options
    from partita.report.plan import plan_text

    nodes = args.nodes
    if isinstance(args.devices, tuple):  # device groups: a mixed cluster (partita/cli/devices.py)
        check_groups_flags(args)
    else:
        if nodes is None:  # one node here; catalog devices fill nodes of 8, as device groups do
            nodes = 1 if args.device_type == "cpu" else default_nodes(args.devices, args.device_type)
        _check_nodes(nodes, args.devices, args.device_type)
    _check_batch_flags(args)
    options = _plan_options(args)  # checked against the cluster's shape before the capture (seconds to minutes)
    if isinstance(args.devices, tuple):
        cluster = groups_cluster(args.devices, parse_bytes)
    else:
        cluster = _catalog_cluster(args, num_devices=args.devices, device_type=args.device_type, num_nodes=nodes)
    check_options(options, cluster, args.global_batch)
    example = _load(args)
    graph = _capture(example)
    _check_example_values(graph, example)
    if args.device_type == "cpu" and not isinstance(args.devices, tuple):  # this machine's CPU ranks: measured
        cluster = _cluster(args, num_devices=args.devices, num_nodes=nodes)
    result = plan_with_baselines(
        graph,
        example.args,
        example.kwargs,
        cluster=cluster,
        global_batch_size=args.global_batch,
        loss_fn=example.loss_fn,
        target=example.target,
        options=options,
    )
    best = result.plan
    print(plan_text(best, baselines=result.baselines, baseline_reasons=result.baseline_reasons))
    if (args.png or args.trace) and result.mixed is not None:  # a mixed cluster: each rank at its type's speed
        simulated = result.mixed.simulate(best)
        if simulated is None:
            print("no figure or trace: the plan splits matmuls, which the mixed-cluster simulator does not time")
            args.png = args.trace = None
    elif args.png or args.trace:
        from partita.planning.simulate import simulate

        simulated = simulate(best, result.context.costs_at, cluster)
    if args.png:
        from partita.report.plots import plan_figure

        plan_figure(best, simulated, _with_parent(args.png), baselines=result.baselines)
        print(f"figure written to {args.png}")
    if args.trace:
        from partita.report.trace import write_chrome_trace

        write_chrome_trace(_with_parent(args.trace), simulated, best)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.out:
        best.save(_with_parent(args.out))
        print(f"plan written to {args.out}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from partita.cli.model_spec import is_factory_spec
    from partita.cli.multinode import Nodes, launch_nodes
    from partita.cli.train_loop import TrainConfig, check_train_config
    from partita.errors import InputError
    from partita.runtime.launch import launch_local, under_torchrun
    from partita.runtime.materialize import on_meta, save_seed

    config = TrainConfig(
        steps=args.steps,
        lr=args.lr,
        optimizer=args.optimizer,
        max_grad_norm=args.max_grad_norm or None,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        seed=args.seed,
        on_nonfinite=args.on_nonfinite,
        init_from=args.init_from,
        trace_dir=args.trace,
        accumulate=args.accumulate,
        lr_schedule=args.lr_schedule,
        warmup_steps=args.warmup_steps,
        min_lr=args.min_lr,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        log_dir=args.log_dir,
    )
    check_train_config(config)
    if args.init_from is not None and is_factory_spec(args.model):
        raise InputError(
            "--init-from works with zoo models, which can be built on meta; a factory "
            f"({args.model}) builds its own weights: drop --init-from"
        )
    if args.init_from is not None and args.eval_every:
        raise InputError(
            f"--eval-every {args.eval_every} with --init-from: the processes would build the model on meta, and "
            "evaluating captures it again in eval mode, which needs its weights: drop --init-from (each process "
            "then builds the whole model), or --eval-every"
        )
    _check_train_flags(args)
    nodes = Nodes.from_args(args)
    if under_torchrun():
        return _train_rank(args, config)  # a restarted rank may find every step done: it stops quietly
    _check_before_launch(args)
    if nodes.num_nodes > 1:
        plan_nproc = functools.partial(
            _processes_for_plan_file,
            args.plan,
            args.nproc,
            args.global_batch,
            args.accumulate,
            num_nodes=nodes.num_nodes,
        )
        launch_nodes(args, nodes, plan_nproc)
        return 0
    argv = list(args.argv)
    if args.plan:
        plan_path = args.plan
        nproc = _processes_for_plan_file(args.plan, args.nproc, args.global_batch, args.accumulate)
    else:
        plan_path, example, nproc = _plan_for_training(args)
        seeded = not (is_factory_spec(args.model) or on_meta(example.model) or args.eval_every)
        if args.init_from is None and seeded:
            # The processes build the model on meta and read their stages' weights from this seed:
            # none of them needs memory for the whole model. (Not with --eval-every: evaluating
            # captures the model once more, in eval mode, which takes a model with weights.)
            argv += ["--init-from", plan_path + ".seed"]
            save_seed(example.model, plan_path + ".seed")
    launch_local([*argv, "--plan", plan_path], nproc=nproc, max_restarts=args.max_restarts)
    return 0


def _check_train_flags(args: argparse.Namespace) -> None:
    """What `partita train` can tell is wrong before it plans or starts a process: InputError naming
    the flag, the value and the fix (otherwise these fail late, some after the whole run)."""
    from partita.errors import InputError
    from partita.runtime.checkpoint_dir import check_writable

    if args.max_restarts < 0:
        raise InputError(f"--max-restarts must be >= 0 (restarts after a failure), got {args.max_restarts}")
    if args.nproc is not None and args.nproc < 1:
        raise InputError(f"--nproc must be >= 1, got {args.nproc}")
    if args.global_batch is not None and args.global_batch < 1:
        raise InputError(f"--global-batch must be >= 1, got {args.global_batch}")
    if not args.plan:
        _check_accumulation(args)
    if args.checkpoint_dir:
        check_writable(args.checkpoint_dir, "--checkpoint-dir")
    if args.losses_out:
        check_writable(os.path.dirname(os.path.abspath(args.losses_out)), "the folder of --losses-out")
    if args.log_dir:
        check_writable(args.log_dir, "--log-dir")


def _check_accumulation(args: argparse.Namespace) -> None:
    """--accumulate K divides --global-batch, and the samples of one pipeline round (global / K)
    split into the pinned --microbatches and --replicas."""
    from partita.errors import InputError
    from partita.planning.context import check_batch_divisible

    if args.accumulate == 1:
        _check_batch_flags(args)
        return
    global_batch = _train_global_batch(args)
    if global_batch % args.accumulate:
        lower = global_batch // args.accumulate * args.accumulate
        nearest = " or ".join(str(b) for b in (lower, lower + args.accumulate) if b > 0)
        raise InputError(
            f"--accumulate {args.accumulate} does not divide --global-batch {global_batch}: each of the "
            f"{args.accumulate} pipeline rounds of a step takes the same number of samples; use --global-batch "
            f"{nearest}, or an --accumulate that divides {global_batch}"
        )
    check_batch_divisible(
        global_batch // args.accumulate,
        args.microbatches,
        args.replicas,
        names=(
            f"the samples per round (--global-batch / --accumulate {args.accumulate})",
            "--microbatches",
            "--replicas",
        ),
    )


def _train_global_batch(args: argparse.Namespace) -> int:
    """Samples per optimizer step (K pipeline rounds with --accumulate K)."""
    return DEFAULT_TRAIN_GLOBAL_BATCH if args.global_batch is None else args.global_batch


def _check_batch_flags(args: argparse.Namespace) -> None:
    """--global-batch against the pinned --microbatches and --replicas (divisibility), before planning."""
    from partita.planning.context import check_batch_divisible

    global_batch = DEFAULT_TRAIN_GLOBAL_BATCH if args.global_batch is None else args.global_batch
    if global_batch >= 1:
        check_batch_divisible(
            global_batch, args.microbatches, args.replicas, names=("--global-batch", "--microbatches", "--replicas")
        )


def _check_nodes(nodes: int, devices: int, device_type: str) -> None:
    from partita.errors import InputError

    if nodes < 1:
        raise InputError(f"--nodes must be >= 1, got {nodes}")
    if device_type == "cpu" and nodes != 1:
        raise InputError(
            f"--nodes {nodes} with --device-type cpu: cpu plans are for this machine, one node; "
            "drop --nodes, or plan for a catalog device (--device-type h100) on several nodes"
        )
    if devices >= 1 and devices % nodes:
        lower = devices // nodes * nodes
        nearest = " or ".join(str(d) for d in (lower, lower + nodes) if d > 0)
        raise InputError(
            f"--nodes {nodes} does not divide --devices {devices}: every node holds the same number of "
            f"devices; use --devices {nearest}, or another --nodes"
        )


def _check_plan_global_batch(path: str, plan, global_batch: int | None, accumulate: int = 1) -> None:
    from partita.errors import InputError

    if global_batch is not None and global_batch != plan.global_batch_size * accumulate:
        rounds = f" x --accumulate {accumulate} = {plan.global_batch_size * accumulate}" if accumulate > 1 else ""
        raise InputError(
            f"--global-batch {global_batch} differs from the global batch {plan.global_batch_size}{rounds} of "
            f"the plan {path}: drop --global-batch to train with the plan's, or re-plan for {global_batch} "
            "(without --plan)"
        )


def _check_before_launch(args: argparse.Namespace) -> None:
    """The launcher's own checks: --resume that would train nothing, without --plan the planner flags
    against the cluster, and with --plan the planning flags, the planner flags against the plan and a
    factory's data (InputError before any process)."""
    import partita
    from partita.cli.plan_flags import check_planning_only_flags
    from partita.cli.train_loop import check_resume_steps
    from partita.planning.context import check_options

    if args.resume and args.checkpoint_dir:
        check_resume_steps(args.checkpoint_dir, args.steps)
    if not args.plan:  # the pins against the job's shape (--nproc per node), before the model is captured
        nproc = 2 if args.nproc is None else args.nproc
        shape = _catalog_cluster(args, num_devices=nproc * args.nnodes, device_type="cpu", num_nodes=args.nnodes)
        check_options(_plan_options(args), shape, _train_global_batch(args) // args.accumulate)
    if args.plan:
        check_planning_only_flags(args)
        plan = partita.Plan.load(args.plan)
        _check_flags_against_plan(args, plan)
        _check_data_for_plan(args, plan)


def _check_flags_against_plan(args: argparse.Namespace, plan) -> None:
    """The planner's flags given with --plan must agree with the plan (partita.cli.plan_flags)."""
    from partita.cli.plan_flags import check_plan_flags

    check_plan_flags(args, plan, args.plan, memory_bytes=args.memory)


def _check_data_for_plan(args: argparse.Namespace, plan) -> None:
    """With --plan the launcher plans nothing, but a factory's data is still checked before any
    process starts (its first batches, as planning checks them): the model is loaded and captured here."""
    from partita.cli.model_spec import is_factory_spec
    from partita.training.data_source import check_first_batch, check_held_out

    if not is_factory_spec(args.model):
        return  # zoo models' batches are made to fit
    example = _load(args)
    if args.eval_every:
        check_held_out(example)
    if getattr(example, "data", None) is None and getattr(example, "eval_data", None) is None:
        return
    graph = _capture(example)
    step_samples = plan.global_batch_size * args.accumulate
    check_first_batch(example, graph, batch_size=step_samples, held_out=bool(args.eval_every))


def _check_example_values(graph, example) -> None:
    """The example's own inputs against the graph's embeddings and loss (before planning profiles them)."""
    from partita.runtime.batch_values import check_batch_values
    from partita.runtime.stages import flatten_inputs

    flat = flatten_inputs(graph, example.args, example.kwargs, example.target if graph.has_loss_fn else None)
    check_batch_values(graph, flat, f"the example inputs of {example.name}")


def _processes_for_plan_file(
    path: str, nproc: int | None, global_batch: int | None = None, accumulate: int = 1, *, num_nodes: int = 1
) -> int:
    """The plan's devices per node: one process per device. InputError when --nproc says otherwise,
    the devices do not split over the nodes, or --global-batch differs from the plan's (x --accumulate)."""
    import partita
    from partita.errors import InputError

    plan = partita.Plan.load(path)
    _check_plan_global_batch(path, plan, global_batch, accumulate)
    needed, per_node = plan.num_devices, plan.num_devices // num_nodes
    if needed % num_nodes:
        raise InputError(
            f"{path} is a plan for {needed} devices, which do not split evenly over --nnodes {num_nodes}: "
            f"every node starts the same number of processes; use an --nnodes that divides {needed}, or re-plan"
        )
    if nproc is not None and nproc != per_node:
        node = f" x --nnodes {num_nodes}" if num_nodes > 1 else ""
        raise InputError(
            f"{path} is a plan for {needed} devices, but --nproc is {nproc}{node}: drop --nproc (one process "
            f"per device of the plan) or re-plan for {nproc}{node} processes (without --plan)"
        )
    if num_nodes > 1 and plan.cluster.devices_per_node != per_node:
        print(
            f"note: {path} was planned for nodes of {plan.cluster.devices_per_node} devices, this job has "
            f"{num_nodes} nodes of {per_node}: its predicted times assume the plan's nodes"
        )
    return per_node


def _plan_for_training(args: argparse.Namespace):
    """Plan on this machine's CPU for ``--nproc`` processes, print it, and write it to a file.
    Returns the file's path, the example the plan was made for and the number of processes to
    start: the plan's devices, which can be fewer than ``--nproc`` (no faster plan used them all)."""
    import tempfile

    example = _load(args)
    graph = _capture(example)
    nproc = 2 if args.nproc is None else args.nproc
    plan = _plan_now(args, example, graph, lambda: _cluster(args, num_devices=nproc))
    path = _with_parent(args.plan_out) or os.path.join(tempfile.mkdtemp(prefix="partita-"), "plan.json")
    plan.save(path)
    rounds = f", {args.accumulate} rounds per optimizer step" if args.accumulate > 1 else ""
    print(f"plan for {nproc} processes ({plan.cost_source} costs{rounds}), written to {path}:")
    print(plan.summary())
    if plan.num_devices < nproc:
        print(f"starting {plan.num_devices} processes, one per device of the plan")
    return path, example, plan.num_devices


def _plan_now(args: argparse.Namespace, example, graph, make_cluster, *, check_data: bool = True):
    """Check the example's data (``_check_job_data``, unless the caller did), then plan one pipeline
    round (--global-batch / --accumulate samples) for ``make_cluster()`` (made after the checks:
    measuring this machine takes a while)."""
    import partita

    if check_data:
        _check_job_data(args, example, graph)
    return partita.plan(
        graph,
        example.args,
        example.kwargs,
        loss_fn=example.loss_fn,
        target=example.target,
        cluster=make_cluster(),
        global_batch_size=_train_global_batch(args) // args.accumulate,
        options=_plan_options(args),
    )


def _check_job_data(args: argparse.Namespace, example, graph) -> None:
    """The example's values and the factory's data sources (their first batches), before planning.
    Reading a source advances its state (a DataLoader draws from its generator for every new
    iterator), so in a job's processes every rank runs this, and then all read the same batches."""
    from partita.training.data_source import check_first_batch, check_held_out

    _check_example_values(graph, example)
    if args.eval_every:
        check_held_out(example)
    check_first_batch(example, graph, batch_size=_train_global_batch(args), held_out=bool(args.eval_every))


def _train_rank(args: argparse.Namespace, config) -> int:
    """One process of the job: the same model, plan and batches as every other rank."""
    import torch.distributed as dist

    import partita
    from partita.cli.train_loop import timing_rows, train, write_losses
    from partita.report.format import fmt_seconds, table

    if config.init_from is not None:
        from partita.cli.model_spec import load_model
        from partita.runtime.materialize import meta_copies

        # The model on meta (no weights), its batches real; capture from meta copies of them.
        example = load_model(
            args.model,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            device="meta",
            seed=args.seed,
            data_device="cpu",
        )
        graph = _capture(
            dataclasses.replace(
                example,
                args=meta_copies(example.args),
                kwargs=meta_copies(example.kwargs),
                target=meta_copies(example.target),
            )
        )
    else:
        example = _load(args)
        graph = _capture(example)
    if args.plan:
        plan = partita.Plan.load(args.plan, graph=graph)
        _check_plan_global_batch(args.plan, plan, args.global_batch, args.accumulate)
        _check_flags_against_plan(args, plan)
    else:  # a multi-node job (or torchrun run by hand): rank 0 plans for the ranks started
        from partita.cli.multinode import job_plan

        _check_job_data(args, example, graph)  # on every rank: see there
        plan = job_plan(
            args,
            graph,
            lambda num_devices, num_nodes: _plan_now(
                args,
                example,
                graph,
                lambda: _cluster(args, num_devices=num_devices, num_nodes=num_nodes),
                check_data=False,
            ),
        )
    summary = train(example, plan, graph, config)
    if dist.get_rank() == 0:
        if summary.resumed_from is not None:
            print(f"resumed from step {summary.resumed_from}")
        if summary.losses:
            print(
                f"loss: {summary.losses[0]:.4f} (step {config.steps - len(summary.losses) + 1}) -> "
                f"{summary.losses[-1]:.4f} (step {config.steps})"
            )
        if summary.skipped_steps:
            print(f"skipped updates (non-finite loss or gradient) at steps {summary.skipped_steps}")
        if summary.eval_losses:
            ends = dict([summary.eval_losses[0], summary.eval_losses[-1]])  # step -> loss, once if one
            print("eval loss: " + " -> ".join(f"{loss:.4f} (step {step})" for step, loss in ends.items()))
        if summary.losses:  # none when a restart found every step done
            print(
                table(
                    ["", "predicted", "measured"],
                    [(name, fmt_seconds(p), fmt_seconds(m)) for name, p, m in timing_rows(plan, summary)],
                )
            )
        if args.losses_out:
            write_losses(args.losses_out, summary)
    dist.destroy_process_group()
    return 0


def _with_parent(path: str | None) -> str | None:
    """``path``, with its folder made when missing (the user named the path)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    # torch's own pytree code trips its LeafSpec deprecation in every process; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)
    argv = joined_negative_numbers(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    args.argv = argv
    try:
        return {"inspect": _inspect, "plan": _plan, "train": _train}[args.command](args)
    except PartitaError as e:
        print(f"partita {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
