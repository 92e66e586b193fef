"""The model as this rank holds it under a plan: every stage's module, the ones this rank runs, how
they are sharded (FSDP2) and split (tensor parallelism), who holds each parameter, and the
tensors they hold.

``place_stages`` builds it (the Trainer's "stages" set-up step); checkpoints
(``checkpoint.Checkpointer``) and ``state_dict.gather_state_dict`` read the model's state through
its methods (``held_state``, ``model_tensors``, ``owner``), never through the Trainer.

Glossary
--------
all stages   the plan's every stage, split from the graph on every rank (cheap: FX graphs reading
             the model's own tensors), so that each rank knows what the others hold.
this rank's  the stages of this rank's rank group (``StagePlan.rank_group``).
holders      of a parameter or buffer: the sorted ranks whose stages read it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from partita.capturing import canonical_names
from partita.runtime.gradient_sync import unique_parameters
from partita.runtime.layout import replica_microbatch_samples
from partita.runtime.materialize import materialize, on_meta, retarget_device
from partita.runtime.pipeline import StageMetadata, stage_metadata
from partita.runtime.precision import Compute
from partita.runtime.process_groups import Topology
from partita.runtime.same_weights import agree_on_weights
from partita.runtime.sharding import check_sharding, sharded_runners
from partita.runtime.stages import StageModule, meta_microbatch, split_graph
from partita.runtime.tensor_parallel import TensorParallel, start_tensor_parallel, whole_tensors
from partita.runtime.uneven import check_uneven_boundaries
from partita.types import OpGraph, Plan

__all__ = ["StageSet", "place_stages"]


@dataclass(eq=False)
class StageSet:
    """What ``place_stages`` built for this rank (see the module docstring).

    ``plan`` is the plan this rank runs (its tensor-parallel index's ``local_plan``), ``job_plan``
    the job's (every rank's, each stage at its own degree); ``runners``: stage index -> the FSDP2 module that runs a sharded stage; ``params``: this
    rank's trainable parameters by canonical name, each once; ``metadata``: the pipeline's static
    shapes, found on meta when the model was built there (None: found at the first step).
    """

    model: nn.Module
    plan: Plan
    job_plan: Plan
    topology: Topology
    all_stages: list[StageModule]
    stages: list[StageModule]
    runners: dict[int, nn.Module]
    tensor_parallel: TensorParallel | None
    holders: dict[str, tuple[int, ...]]
    params: dict[str, nn.Parameter]
    metadata: list[StageMetadata] | None

    def held_state(self) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters and persistent buffers, by canonical name: the tensors
        training updates (on GPUs, ``.to()`` gave the stages their own buffer objects); whole
        tensors where tensor parallelism splits them."""
        names = state_names(self.model)
        held: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
                if name in names:  # leaves out export's lifted constants, non-persistent buffers
                    held.setdefault(name, t)
        return whole_tensors(held, self.tensor_parallel)

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """Canonical name -> tensor this rank saves and loads: what its stages hold (parameters and
        persistent buffers), and on every rank what no stage holds (it stays as the model has it)."""
        names = canonical_names(self.model)
        read_anywhere = self.read_anywhere()
        unheld = {
            names[id(t)]: t for t in self.model.state_dict(keep_vars=True).values() if names[id(t)] not in read_anywhere
        }
        return {**self.held_state(), **unheld}

    def owner(self, name: str) -> int:
        """The rank that speaks for a held tensor (the first of its holders)."""
        return min(self.holders[name])

    def read_anywhere(self) -> set[str]:
        """Canonical names some stage of the plan reads."""
        return {name for s in self.all_stages for name in s.spec.param_names}

    def trainable_names(self) -> set[str]:
        return {name for s in self.all_stages for name, p in s.named_parameters() if p.requires_grad}

    def stages_of(self) -> dict[str, tuple[int, ...]]:
        """This rank's trainable parameter -> the indices of its stages that read it."""
        return {name: tuple(s.spec.index for s in self.stages if name in s.spec.param_names) for name in self.params}

    def describe(self) -> str:
        """ "stage 2" or "stages 0, 3": what this rank runs, for messages."""
        indices = [s.spec.index for s in self.stages]
        return f"stage{'s' if len(indices) != 1 else ''} {', '.join(map(str, indices))}"


def place_stages(
    model: nn.Module,
    graph: OpGraph,
    plan: Plan,
    topology: Topology,
    compute: Compute,
    init_from: str | None,
    job_plan: Plan | None = None,
) -> StageSet:
    """Split ``graph`` into ``plan``'s stages (this rank's view of ``job_plan``, by default ``plan``
    itself: ``partita.runtime.tensor_parallel.local_plan``) and make this rank's runnable: rank 0's
    weights where the ranks built others (``agree_on_weights``), weights on its device
    (allocated and loaded from ``init_from`` for a model on meta: only what this rank reads), then
    its part of every weight tensor parallelism splits, then FSDP2 around the sharded stages --
    in that order, since each step replaces parameters the next one wraps."""
    job_plan = plan if job_plan is None else job_plan
    all_stages = split_graph(graph, plan.boundaries)
    if not plan.on_mesh:
        check_uneven_boundaries(graph, plan, all_stages)
    stages = [s for s in all_stages if plan.stages[s.spec.index].rank_group == topology.rank_group]
    built_on_meta = on_meta(model)  # then the weights materialized here are partita's own
    agree_on_weights(model, topology.device, topology.world_group)  # rank 0's where the ranks' differ
    metadata = _put_on_device(model, graph, plan, topology, compute, init_from, all_stages, stages)
    check_sharding(plan, all_stages)
    tensor_parallel = start_tensor_parallel(graph, topology, all_stages, stages, job_plan, release_whole=built_on_meta)
    whole = {name: t for stage in stages for name, t in stage.state_tensors().items()}
    runners = sharded_runners(job_plan, stages, topology, compute, graph)  # FSDP2 makes new (DTensor) parameters
    if built_on_meta:  # the whole weights partita allocated for them: this rank holds its shards alone
        release_replaced(whole, stages)
    return StageSet(
        model=model,
        plan=plan,
        job_plan=job_plan,
        topology=topology,
        all_stages=all_stages,
        stages=stages,
        runners=runners,
        tensor_parallel=tensor_parallel,
        holders=holders(plan, all_stages),
        params=unique_parameters(stages),
        metadata=metadata,
    )


def _put_on_device(
    model: nn.Module,
    graph: OpGraph,
    plan: Plan,
    topology: Topology,
    compute: Compute,
    init_from: str | None,
    all_stages: list[StageModule],
    stages: list[StageModule],
) -> list[StageMetadata] | None:
    """The weights on this rank's device, from ``init_from`` when given; for a model on meta the
    pipeline's static shapes first, while every stage is still on meta (returned; else None)."""
    device = topology.device
    metadata = None
    if on_meta(model):
        samples = replica_microbatch_samples(plan, topology.rank_group, topology.replica)
        metadata = stage_metadata(all_stages, meta_microbatch(graph, samples), torch.device("cpu"), compute)
    elif device.type != "cpu":
        model.to(device)
        for stage in all_stages:
            stage.to(device)
    if init_from is not None:
        local = _local_names(model, all_stages, stages)
        materialize(model, [*all_stages, graph.graph_module], local, device, init_from)
    if metadata is not None:
        for stage in all_stages:  # ops captured on meta create their tensors on meta
            retarget_device(stage.graph_module, device)
    return metadata


def _local_names(model: nn.Module, all_stages: list[StageModule], stages: list[StageModule]) -> set[str]:
    """Canonical names of what this rank must hold: its stages' tensors, and the model's
    parameters and buffers that no stage reads (checkpoints and state dicts include them)."""
    read_anywhere = {name for s in all_stages for name in s.spec.param_names}
    model_names = set(canonical_names(model).values())
    return {name for s in stages for name in s.spec.param_names} | (model_names - read_anywhere)


def holders(plan: Plan, stages: list[StageModule]) -> dict[str, tuple[int, ...]]:
    """Canonical name -> sorted ranks whose stages read it (parameters and buffers)."""
    found: dict[str, set[int]] = {}
    for stage in stages:
        ranks = plan.stages[stage.spec.index].ranks
        for name in stage.spec.param_names:
            found.setdefault(name, set()).update(ranks)
    return {name: tuple(sorted(r)) for name, r in found.items()}


def state_names(model: nn.Module) -> set[str]:
    """Canonical names of what ``model.state_dict()`` holds (parameters, persistent buffers)."""
    canonical = canonical_names(model)
    return {canonical[id(t)] for t in model.state_dict(keep_vars=True).values()}


def release_replaced(whole: dict[str, torch.Tensor], stages: list[StageModule]) -> None:
    """Free the storage of the tensors of ``whole`` (name -> the tensor a stage read before) that the
    stages no longer read (FSDP2 registered its shards in their place), as
    ``partita.runtime.tensor_parallel.shard_parameters`` frees what it splits: the model's modules
    still hold them, and a model built on meta holds weights partita allocated for the stages. Each
    keeps its shape, as a zero-stride view of one element, so that the model can be captured again."""
    now = {name: t for stage in stages for name, t in stage.state_tensors().items()}
    for name, t in whole.items():
        if now.get(name) is not t and t.numel():
            t.data = t.new_zeros(()).expand(t.shape)
