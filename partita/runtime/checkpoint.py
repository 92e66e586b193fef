"""Checkpoints keyed by the model's own names, so that any plan (or the plain model) can read them.

Written with torch.distributed.checkpoint (DCP): every rank saves what its stages hold, under
names that do not depend on the plan, and DCP keeps one copy of anything several ranks hold
(replicas, tied parameters). Loading asks for the names this rank's stages need under the
plan it runs now, whatever plan wrote the checkpoint.

Keys (flat; ``<name>`` is a canonical parameter or buffer name, e.g. ``transformer.wte.weight``):

    model.<name>               parameters and persistent buffers
    optim.state.<name>.<key>   optimizer state per parameter (``exp_avg``, ``step``, ``momentum_buffer``)
    optim.param_groups         hyper-parameters of each parameter group (lr, betas, ...), no params
    trainer.num_steps          optimizer steps taken (int64)
    trainer.lr_scheduler       the LR scheduler's state_dict (absent without a scheduler)
    trainer.meta               partita and torch versions, the graph fingerprint, the plan (as JSON data)
    extra                      the caller's own small state (``extra_state``: e.g. where the training
                               loop stands in its data), the same on every rank; absent if none given
    rng.cpu.<rank>             RNG states of each rank (``rng.cuda.<rank>`` on GPUs); a rank that the
                               writing run did not have takes rank 0's

A checkpoint loads only into the model it was written for: its ``model.`` entries must be the
model's parameters and persistent buffers, name for name (a non-persistent buffer, which seeds hold,
is the model's own too), whatever plan wrote or reads it. Otherwise loading raises InputError
naming the names on each side, before any tensor is read, on every rank alike (each compares the
whole model's names with the checkpoint's metadata, and the ranks agree on the shape check), so
that no rank loads while another raises.

Tensor-parallel parts are saved whole (gathered over their group) and each rank keeps its own
part when loading, so the keys and shapes never depend on the degree.

A checkpoint is written to ``<dir>.partial`` and renamed to ``<dir>`` only when every rank has
finished: an interrupted write never looks complete. A complete checkpoint is a directory
holding DCP's metadata file (``checkpoint_dir.is_complete``); loading anything else raises InputError.

Before the rename, rank 0 writes a manifest of every file's size and sha256 (each rank hashes the
files it wrote). Loading first checks the files against it (each rank a share of them) and
raises InputError naming a damaged file, before any tensor is read; ``latest_intact_checkpoint``
picks the latest checkpoint that passes, warning about each damaged one it skips. Checkpoints
without a manifest (earlier partita) load with a warning that they cannot be verified.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from partita import __version__
from partita.capturing import canonical_names
from partita.errors import InputError
from partita.runtime.checkpoint_dir import (
    METADATA_FILE,
    PARTIAL_SUFFIX,
    complete_checkpoints,
    damage,
    file_digest,
    is_complete,
    manifest_files,
    warn_unverified,
    write_manifest,
)
from partita.runtime.gradient_sync import local_tensor
from partita.runtime.materialize import single_process
from partita.runtime.stage_set import StageSet, state_names
from partita.runtime.tensor_parallel import gather_full, local_part
from partita.types import Plan
from partita.types.plan_file import plan_to_dict

__all__ = ["Checkpointer", "StepCount", "latest_intact_checkpoint", "load_into_model"]


@dataclass
class StepCount:
    """Optimizer steps a trainer has taken (skipped ones included) and skipped: what a checkpoint
    restores besides tensors."""

    num_steps: int = 0
    num_skipped_steps: int = 0


class Checkpointer:
    """Saves and restores a trainer's state -- the model's tensors this rank holds (``StageSet``),
    the optimizer, the LR scheduler, the step count and the RNG -- under plan-independent keys
    (see the module docstring). It talks to the trainer only through what it was given here.

    ``job_plan`` is the plan of the whole job (recorded in ``trainer.meta``), not this rank's
    tensor-parallel part of it.
    """

    def __init__(
        self,
        stages: StageSet,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any,
        count: StepCount,
        *,
        job_plan: Plan,
        graph_fingerprint: str,
    ):
        self.stages, self.optimizer, self.lr_scheduler, self.count = stages, optimizer, lr_scheduler, count
        self.job_plan, self.graph_fingerprint = job_plan, graph_fingerprint

    def save(self, path: str | os.PathLike, *, extra_state: dict | None = None) -> None:
        """Write the state to ``path``, and ``extra_state`` (a small picklable dict, the same on every
        rank) when given. Collective: call on every rank with the same path (a filesystem all ranks
        share)."""
        path = os.fspath(path)
        partial = path + PARTIAL_SUFFIX
        rank = dist.get_rank()
        if rank == 0 and os.path.exists(partial):
            shutil.rmtree(partial)  # left by an interrupted write
        dist.barrier()
        state = self._state_to_save()
        if extra_state is not None:
            state["extra"] = dict(extra_state)
        dcp.save(
            state,
            storage_writer=FileSystemWriter(partial),
            planner=DefaultSavePlanner(flatten_state_dict=False, dedup_save_to_lowest_rank=True),
        )
        dist.barrier()  # every rank's files are complete
        own = _own_file_digests(partial, rank)  # each rank hashes what it wrote
        gathered: list | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(own, gathered, dst=0)
        if rank == 0:
            write_manifest(partial, {name: d for part in gathered for name, d in part.items()})  # the last file
            old = path + ".old"
            if os.path.exists(path):
                os.replace(path, old)
            os.replace(partial, path)
            shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def load(self, path: str | os.PathLike, *, verify: bool = True) -> dict:
        """Load a checkpoint written under any plan (model, optimizer, scheduler, step count, RNG) and
        return its ``extra_state`` ({} when it has none). Collective: call on every rank. With
        ``verify`` the files are first checked against the checkpoint's manifest (InputError naming a
        damaged one); pass False for a checkpoint that ``latest_intact_checkpoint`` has just
        verified. InputError, before anything is read and on every rank, when the checkpoint was
        written for another model: other parameter or buffer names (naming them), or a parameter's
        shape differs from the checkpoint's (another model under the same names)."""
        if verify:
            _require_intact(os.fspath(path), _collective_damage(os.fspath(path)))
        stored = _stored_keys(path)
        _require_same_names(stored, self.stages.model, path)  # the whole model's: the same answer on every rank
        device = self.stages.topology.device
        state: dict[str, Any] = {f"model.{name}": t.detach() for name, t in self.stages.model_tensors().items()}
        names = self._optimizer_names()
        for name in names:
            prefix = f"optim.state.{name}."
            for key, meta in stored.items():
                if key.startswith(prefix):
                    state[key] = (
                        None
                        if isinstance(meta, BytesStorageMetadata)
                        else torch.empty(meta.size, dtype=meta.properties.dtype, device=device)
                    )
        rng_keys = _rng_keys(self.stages.topology.rank, device, stored)
        for key in rng_keys.values():
            state[key] = torch.empty(stored[key].size, dtype=torch.uint8)
        state["trainer.num_steps"] = torch.zeros((), dtype=torch.int64)
        state["optim.param_groups"] = None
        if self.lr_scheduler is not None:
            state["trainer.lr_scheduler"] = None
        _require(stored, state, path)
        _agreed(lambda: _require_shapes(stored, state, path))  # this rank's tensors: raise on every rank
        if "extra" in stored:
            state["extra"] = None
        with _readable(path):
            dcp.load(state, storage_reader=FileSystemReader(os.fspath(path)), planner=_load_planner())
        _keep_local_parts(self.stages, state)
        _load_optimizer(self.optimizer, self.stages.params, names, state)
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["trainer.lr_scheduler"])
        self.count.num_steps = int(state["trainer.num_steps"])
        torch.set_rng_state(state[rng_keys["cpu"]])
        if "cuda" in rng_keys:
            torch.cuda.set_rng_state(state[rng_keys["cuda"]], device)
        return dict(state.get("extra") or {})

    def _state_to_save(self) -> dict[str, Any]:
        """The flat state dict this rank writes (see the module docstring for the keys)."""
        stages = self.stages
        state: dict[str, Any] = {f"model.{name}": t.detach() for name, t in stages.model_tensors().items()}
        optimizer_state = self.optimizer.state_dict()
        tp = stages.tensor_parallel
        shards = tp.shards() if tp is not None else {}
        for index, name in enumerate(self._optimizer_names()):
            for key, value in optimizer_state["state"].get(index, {}).items():
                if isinstance(value, torch.Tensor) and name in shards and value.dim() > 0:
                    value = gather_full(value, shards[name], tp)  # whole, as the model's tensors are
                state[f"optim.state.{name}.{key}"] = value.detach() if isinstance(value, torch.Tensor) else value
        state["optim.param_groups"] = [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer_state["param_groups"]
        ]
        state["trainer.num_steps"] = torch.tensor(self.count.num_steps, dtype=torch.int64)
        if self.lr_scheduler is not None:
            state["trainer.lr_scheduler"] = self.lr_scheduler.state_dict()
        state["trainer.meta"] = {
            "partita_version": __version__,
            "torch_version": torch.__version__,
            "graph_fingerprint": self.graph_fingerprint,
            "plan": plan_to_dict(self.job_plan),
        }
        rank, device = stages.topology.rank, stages.topology.device
        state[f"rng.cpu.{rank}"] = torch.get_rng_state()
        if device.type == "cuda":
            state[f"rng.cuda.{rank}"] = torch.cuda.get_rng_state(device)
        return state

    def _optimizer_names(self) -> list[str]:
        """Canonical names of the optimizer's parameters, in its state_dict's index order."""
        name_of = {id(p): name for name, p in self.stages.params.items()}
        names = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in name_of:
                    raise InputError(
                        "the optimizer holds a parameter that is not one of the trainer's stages': build it "
                        "from the parameters the trainer passes to the optimizer factory"
                    )
                names.append(name_of[id(p)])
        return names


def load_into_model(model: nn.Module, path: str | os.PathLike) -> None:
    """Load the parameters and persistent buffers of a checkpoint into a plain (unsplit) model,
    in place, in this process alone (no process group needed). The files are first checked against
    the checkpoint's manifest (InputError naming a damaged one); InputError too when the checkpoint
    was written for another model (other names, or other shapes), before anything is read."""
    _require_intact(os.fspath(path), _local_damage(os.fspath(path)))
    stored = _stored_keys(path)
    _require_same_names(stored, model, path)
    names = canonical_names(model)
    state = {f"model.{names[id(t)]}": t.detach() for t in model.state_dict(keep_vars=True).values()}
    _require(stored, state, path)
    _require_shapes(stored, state, path)
    with single_process(), _readable(path):
        dcp.load(state, storage_reader=FileSystemReader(os.fspath(path)), planner=_load_planner(), no_dist=True)


def latest_intact_checkpoint(directory: str) -> str | None:
    """The latest complete checkpoint in ``directory`` whose files match its manifest, or None.
    Collective: every rank gets the same answer (rank 0 lists the directory; each rank checks a
    share of each candidate's files). Rank 0 warns about every damaged checkpoint it skips."""
    rank = dist.get_rank()
    candidates = [complete_checkpoints(directory) if rank == 0 else None]
    dist.broadcast_object_list(candidates, src=0)
    for path in candidates[0]:
        problem = _collective_damage(path)
        if problem is None:
            if rank == 0:
                warn_unverified(path)
            return path
        if rank == 0:
            warnings.warn(f"checkpoint {path!r} is damaged ({problem}): skipped, an earlier one is used", stacklevel=2)
    return None


# ----------------------------------------------------------------------------- saving


def _keep_local_parts(stages: StageSet, state: dict[str, Any]) -> None:
    """With tensor parallelism: copy this rank's part of each whole tensor loaded into its own
    (``held_state`` gave whole copies to load into), and cut the optimizer state likewise."""
    tp = stages.tensor_parallel
    if tp is None:
        return
    shards = tp.shards()
    for stage in stages.stages:
        for name, t in stage.state_tensors().items():
            if name in shards and f"model.{name}" in state:
                part = local_part(state[f"model.{name}"], shards[name], tp.index, tp.degree)
                if isinstance(t, DTensor):  # a sharded stage's: this replica's shard of the part
                    part = distribute_tensor(part, t.device_mesh, t.placements, src_data_rank=None)
                with torch.no_grad():
                    local_tensor(t).copy_(local_tensor(part))
    for key, value in list(state.items()):
        if not key.startswith("optim.state.") or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        name = next((n for n in shards if key.startswith(f"optim.state.{n}.")), None)
        if name is not None and key[len(f"optim.state.{name}.") :].count(".") == 0:
            state[key] = local_part(value, shards[name], tp.index, tp.degree)


def _own_file_digests(partial: str, rank: int) -> dict[str, dict]:
    """Size and sha256 of the data files this rank wrote (DCP names them ``__<rank>_<k>.distcp``)."""
    own = re.compile(rf"^__{rank}_\d+\.distcp$")
    return {name: file_digest(os.path.join(partial, name)) for name in sorted(os.listdir(partial)) if own.match(name)}


# ----------------------------------------------------------------------------- integrity


def _collective_damage(path: str) -> str | None:
    """``checkpoint_dir.damage`` of checkpoint ``path``, each rank hashing a share of its files; the
    same answer on every rank (one all_gather_object, whatever any rank found)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        files = manifest_files(path)
    except InputError as e:
        local = str(e)
    else:
        local = None if files is None else damage(path, sorted(files)[rank::world])
        if files is None and rank == 0 and is_complete(path):
            warn_unverified(path)
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, local)
    return next((p for p in problems if p), None)


def _local_damage(path: str) -> str | None:
    """``checkpoint_dir.damage`` in this process alone, warning when there is no manifest."""
    problem = damage(path)
    if problem is None and is_complete(path):
        warn_unverified(path)
    return problem


def _require_intact(path: str, problem: str | None) -> None:
    if problem is not None:
        raise InputError(
            f"checkpoint {path!r} is damaged ({problem}): load an earlier one; "
            "partita.runtime.checkpoint_dir.latest_checkpoint(directory) skips damaged checkpoints"
        )


@contextlib.contextmanager
def _readable(path: str | os.PathLike) -> Iterator[None]:
    """DCP's read failures (a file cut short or altered in a checkpoint without a manifest) as an
    InputError that names the checkpoint, the cause and what to do."""
    try:
        yield
    except CheckpointException as error:
        failures = list(getattr(error, "failures", {}).values())
        inner = getattr(failures[0], "exc", None) if failures else None
        cause = f"{type(inner).__name__}: {inner}" if inner is not None else str(error).splitlines()[0]
        raise InputError(
            f"checkpoint {os.fspath(path)!r} could not be read ({cause.strip()}): a file is cut short "
            "or damaged; load an earlier checkpoint"
        ) from error


# ----------------------------------------------------------------------------- loading


def _load_planner() -> DefaultLoadPlanner:
    """Reads into the caller's dict itself: objects (not only tensors) come back in place."""
    return DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _stored_keys(path: str | os.PathLike) -> dict[str, Any]:
    """Key -> storage metadata of a checkpoint directory; InputError if it is not a complete one."""
    path = os.fspath(path)
    if path.rstrip(os.sep).endswith(PARTIAL_SUFFIX):
        raise InputError(
            f"{path!r} is an unfinished checkpoint write (the job stopped before every rank had "
            f"written it): load a complete checkpoint instead, e.g. the one "
            f"partita.runtime.checkpoint_dir.latest_checkpoint(directory) finds"
        )
    try:
        return dict(FileSystemReader(path).read_metadata().state_dict_metadata)
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        if os.path.exists(path + PARTIAL_SUFFIX):
            cause = "an interrupted write left only a .partial directory"
        elif os.path.isdir(path) and not os.path.exists(os.path.join(path, METADATA_FILE)):
            cause = f"it lacks DCP's {METADATA_FILE} file, which is written last: the write was interrupted or the copy is partial"
        else:
            cause = str(e)
        raise InputError(
            f"{path!r} is not a complete partita checkpoint ({cause}): load an earlier complete one; "
            "partita.runtime.checkpoint_dir.latest_checkpoint(directory) skips incomplete ones"
        ) from e


def _require_same_names(stored: dict[str, Any], model: nn.Module, path: str | os.PathLike) -> None:
    """InputError naming the difference when the checkpoint's ``model.`` entries are not ``model``'s
    parameters and persistent buffers (its non-persistent buffers may be there too: seeds hold them).
    The whole model's names, not this rank's stages': every rank reaches the same answer."""
    saved = {key[len("model.") :] for key in stored if key.startswith("model.")}
    extra = sorted(saved - set(canonical_names(model).values()))
    missing = sorted(state_names(model) - saved)
    if not extra and not missing:
        return
    what = "parameters or buffers"
    found = [f"it holds {len(extra)} {what} this model lacks ({_few(extra)})"] if extra else []
    found += [f"it lacks {len(missing)} {what} this model has ({_few(missing)})"] if missing else []
    raise InputError(
        f"checkpoint {os.fspath(path)!r} was written for another model: {', and '.join(found)}. A checkpoint "
        "loads into the model it was written for (the same parameter and buffer names, under any plan): build "
        "that model, or start without the checkpoint; to start from some of its weights, read them with "
        "torch.distributed.checkpoint (keys 'model.<name>') into the model before building the Trainer"
    )


def _few(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``: the first ``shown`` names, then how many others."""
    rest = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {rest} more" if rest > 0 else "")


def _agreed(check: Callable[[], None]) -> None:
    """Run ``check`` (which raises InputError) so that every rank raises or none does: a rank that
    went on into dcp.load alone would wait for the others until the collective timeout. Collective."""
    try:
        check()
    except InputError as e:
        local: str | None = str(e)
        error: InputError | None = e
    else:
        local, error = None, None
    problems: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, local)
    if error is not None:
        raise error
    first = next((p for p in problems if p), None)
    if first is not None:
        raise InputError(f"{first} (found by another rank)")


def _require(stored: dict[str, Any], state: dict[str, Any], path: str | os.PathLike) -> None:
    missing = sorted(k for k in state if k not in stored)
    if missing:
        raise InputError(
            f"checkpoint {os.fspath(path)!r} lacks {len(missing)} entries this model needs, e.g. "
            f"{missing[:4]}: was it written for another model?"
        )


def _require_shapes(stored: dict[str, Any], state: dict[str, Any], path: str | os.PathLike) -> None:
    """InputError when a model tensor's shape differs from the one stored under its name (a model of
    other sizes: DCP would fail reading it, in words that blame the files)."""
    for key, value in state.items():
        meta = stored.get(key)
        if not key.startswith("model.") or not isinstance(value, torch.Tensor) or not hasattr(meta, "size"):
            continue
        whole = tuple(value.shape)  # a sharded stage's DTensor: its global shape
        if tuple(meta.size) != whole:
            raise InputError(
                f"checkpoint {os.fspath(path)!r} holds {key[len('model.') :]} with shape {list(meta.size)}, but this "
                f"model's has shape {list(whole)}: the checkpoint was written for a model of other sizes (a different "
                "config under the same parameter names); build the model it was trained with, or start without it"
            )


def _load_optimizer(
    optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], names: list[str], state: dict[str, Any]
) -> None:
    """Rebuild the optimizer's state_dict from per-name entries and load it."""
    current = optimizer.state_dict()
    per_param: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        prefix = f"optim.state.{name}."
        entries = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
        param = params[name]
        if isinstance(param, DTensor):  # a sharded stage's parameter: its state is sharded alike
            entries = {
                k: distribute_tensor(v, param.device_mesh, param.placements, src_data_rank=None)
                if isinstance(v, torch.Tensor) and v.shape == param.shape
                else v
                for k, v in entries.items()
            }
        if entries:
            per_param[index] = entries
    groups = current["param_groups"]
    saved_groups = state["optim.param_groups"]
    if len(saved_groups) == len(groups):  # same grouping: restore hyper-parameters (the scheduler's lr too)
        groups = [{**saved, "params": group["params"]} for saved, group in zip(saved_groups, groups)]
    optimizer.load_state_dict({"state": per_param, "param_groups": groups})


def _rng_keys(rank: int, device: torch.device, stored: dict[str, Any]) -> dict[str, str]:
    """The RNG entries this rank restores: its own, or rank 0's when the writing run had fewer ranks."""
    keys: dict[str, str] = {}
    kinds = ["cpu", "cuda"] if device.type == "cuda" else ["cpu"]
    for kind in kinds:
        for key in (f"rng.{kind}.{rank}", f"rng.{kind}.0"):
            if key in stored:
                keys[kind] = key
                break
    return keys
