"""Plan <-> JSON. Plans are data: versioned, readable, never pickled, validated field by field.

``load_plan`` rejects anything that is not a valid plan with a PlanFileError that names the
field, the value and the cause; with ``graph`` / ``cluster`` it also rejects a plan made for
another model or cluster. Files of every version in ``READABLE_SCHEMA_VERSIONS`` load (schema 1's
``"recompute": true / false`` as the levels full / none); a loaded plan is of the current schema.

Executed fields and records. The runtime runs what these fields say, and nothing else:

- ``stages[k]``: ``start``, ``stop`` (the nodes of the stage), ``ranks``, ``rank_group``,
  ``recompute``, ``sharding``, ``tensor_parallel``, ``sequence_parallel``, ``replica_samples``
  (written only when the replicas take unequal shares of each micro-batch: stages over several
  device groups), ``accumulation`` (written only for a sharded stage that reduce-scatters its
  gradients every micro-batch; absent: ``whole``) and ``recompute_blocks`` (written only for a stage
  that recomputes some of its blocks alone);
- ``schedule``, ``global_batch_size``, ``num_microbatches``, ``microbatch_size``, ``precision`` and
  ``compile`` (written only when true: every block runs through torch.compile);
- ``cluster``: its device count and ``devices_per_node`` (where tensor-parallel groups may lie); of a
  mixed cluster (several device groups), each group's count and ``devices_per_node``.

Records say how the plan was made and what it predicts; the runtime never reads them to decide
anything: ``options`` (what was pinned and what the search was allowed), ``method``,
``cost_source``, ``predicted_step_s``, ``predicted_bubble_fraction``, ``total_compute_s``,
``partita_version``, ``torch_version``, and per stage ``forward_s``, ``backward_s``,
``memory_bytes``, ``param_bytes``, ``cut_bytes``, ``blocks``, ``memory_breakdown`` and ``memory_bytes_by_group``
(written only for mixed clusters). Checked against the
model on load: ``graph_fingerprint`` and each stage's ``first_node``, ``last_node`` (and
``module_range``, a record). Editing a record changes nothing that runs, so the choices that
``options`` records must agree with the executed fields (``plan_checks.check_options_agree``: e.g.
``options.tensor_parallel`` 4 with stages of ``tensor_parallel`` 2 is refused, naming both; so is a
stage of a degree above 1 whose ``sequence_parallel`` differs from ``options.sequence_parallel``):
to change a plan, edit the executed fields, or re-plan.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from partita.errors import PlanFileError
from partita.types.choices import Accumulation, Precision, Recompute, Schedule, Sharding
from partita.types.cluster import Cluster
from partita.types.graph import OpGraph
from partita.types.plan import READABLE_SCHEMA_VERSIONS, MemoryBreakdown, Plan, StagePlan
from partita.types.plan_checks import check_plan_consistency, check_plan_matches_cluster, check_plan_matches_graph

_STAGE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "index": int,
    "start": int,
    "stop": int,
    "first_node": str,
    "last_node": str,
    "module_range": str,
    "ranks": list,
    "rank_group": int,
    "recompute": (str, bool),  # a Recompute level; true / false (schema 1): full / none
    "forward_s": (int, float),
    "backward_s": (int, float),
    "memory_bytes": int,
    "param_bytes": int,
    "cut_bytes": int,
}
# Absent in files of earlier versions: they load as replicate, without a breakdown, without
# tensor or sequence parallelism. The last two are written only where they hold something (plans for
# mixed clusters), so that other plan files read as before.
_OPTIONAL_STAGE_FIELDS = (
    "sharding",
    "memory_breakdown",
    "tensor_parallel",
    "sequence_parallel",
    "replica_samples",
    "memory_bytes_by_group",
    "accumulation",
    "blocks",
    "recompute_blocks",
)
_BREAKDOWN_FIELDS: dict[str, type] = {f.name: int for f in dataclasses.fields(MemoryBreakdown)}
_PLAN_FIELDS: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "partita_version": str,
    "torch_version": str,
    "graph_fingerprint": str,
    "cluster": dict,
    "stages": list,
    "schedule": str,
    "global_batch_size": int,
    "num_microbatches": int,
    "microbatch_size": int,
    "options": dict,
    "method": str,
    "predicted_step_s": (int, float),
    "predicted_bubble_fraction": (int, float),
    "cost_source": str,
}
# absent in files of earlier versions (fp32); "compile" is written only when true
_OPTIONAL_PLAN_FIELDS = ("total_compute_s", "precision", "compile")


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """JSON-safe dict with a stable key order."""
    return {
        "schema_version": plan.schema_version,
        "partita_version": plan.partita_version,
        "torch_version": plan.torch_version,
        "method": plan.method,
        "graph_fingerprint": plan.graph_fingerprint,
        "cost_source": plan.cost_source,
        "schedule": plan.schedule.value,
        "global_batch_size": plan.global_batch_size,
        "num_microbatches": plan.num_microbatches,
        "microbatch_size": plan.microbatch_size,
        "predicted_step_s": plan.predicted_step_s,
        "predicted_bubble_fraction": plan.predicted_bubble_fraction,
        "total_compute_s": plan.total_compute_s,
        "precision": plan.precision.value,
        **({"compile": True} if plan.compile else {}),
        "options": dict(plan.options),
        "cluster": plan.cluster.to_dict(),
        "stages": [_stage_to_dict(s) for s in plan.stages],
    }


def _stage_to_dict(stage: StagePlan) -> dict[str, Any]:
    breakdown = stage.memory_breakdown
    data = {
        **{k: getattr(stage, k) for k in _STAGE_FIELDS if k != "ranks"},
        "ranks": list(stage.ranks),
        "recompute": stage.recompute.value,
        "sharding": stage.sharding.value,
        "tensor_parallel": stage.tensor_parallel,
        "sequence_parallel": stage.sequence_parallel,
        "memory_breakdown": None if breakdown is None else {k: getattr(breakdown, k) for k in _BREAKDOWN_FIELDS},
    }
    if stage.replica_samples is not None:
        data["replica_samples"] = list(stage.replica_samples)
    if stage.memory_bytes_by_group is not None:
        data["memory_bytes_by_group"] = list(stage.memory_bytes_by_group)
    if stage.blocks is not None:
        data["blocks"] = stage.blocks
    if stage.recompute_blocks is not None:
        data["recompute_blocks"] = stage.recompute_blocks
    if stage.accumulation is not Accumulation.WHOLE:
        data["accumulation"] = stage.accumulation.value
    return data


# The executed fields (see the module docstring); every other field is a record.
_EXECUTED_PLAN_FIELDS = ("graph_fingerprint", "schedule", "global_batch_size", "num_microbatches", "microbatch_size")
_EXECUTED_STAGE_FIELDS = ("index", "start", "stop", "first_node", "last_node", "ranks", "rank_group", "recompute")


def executed_part(plan: Plan) -> dict[str, Any]:
    """The fields of ``plan`` that the runtime executes (the module docstring lists them), JSON-safe,
    in a stable order: ranks whose plans differ only in records run the same job."""
    whole = plan_to_dict(plan)
    stages = [
        {
            **{k: stage[k] for k in _EXECUTED_STAGE_FIELDS},
            "sharding": stage["sharding"],
            "tensor_parallel": stage["tensor_parallel"],
            "sequence_parallel": stage["sequence_parallel"],
            **({"replica_samples": stage["replica_samples"]} if "replica_samples" in stage else {}),
            **({"accumulation": stage["accumulation"]} if "accumulation" in stage else {}),
            **({"recompute_blocks": stage["recompute_blocks"]} if "recompute_blocks" in stage else {}),
        }
        for stage in whole["stages"]
    ]
    if plan.cluster.is_mixed:
        cluster = {
            "groups": [{k: g[k] for k in ("num_devices", "devices_per_node")} for g in whole["cluster"]["groups"]]
        }
    else:
        cluster = {k: whole["cluster"][k] for k in ("num_devices", "devices_per_node")}
    return {
        **{k: whole[k] for k in _EXECUTED_PLAN_FIELDS},
        "precision": whole["precision"],
        **({"compile": True} if plan.compile else {}),
        "cluster": cluster,
        "stages": stages,
    }


def plan_to_json(plan: Plan) -> str:
    """Deterministic text: the same plan gives the same bytes."""
    return json.dumps(plan_to_dict(plan), indent=2, sort_keys=False, allow_nan=False) + "\n"


def save_plan(plan: Plan, path: str | os.PathLike) -> None:
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(plan_to_json(plan))
    os.replace(tmp, path)


def load_plan(path: str | os.PathLike, *, graph: OpGraph | None = None, cluster: Any = None) -> Plan:
    """Read and validate a plan file; check it against ``graph`` and ``cluster`` when given."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {os.fspath(path)!r}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise PlanFileError(
            f"{os.fspath(path)!r} is not a plan file: byte {e.start} is not UTF-8 text (a binary "
            "file?); give the JSON file that `partita plan --out` writes"
        ) from e
    return plan_from_json(text, graph=graph, cluster=cluster, source=os.fspath(path))


def plan_from_json(text: str, *, graph: OpGraph | None = None, cluster: Any = None, source: str = "plan") -> Plan:
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise PlanFileError(
            f"{source} is not valid JSON ({e}); was it truncated? Re-create it with `partita plan`"
        ) from e
    plan = plan_from_dict(data, source=source)
    if graph is not None:
        check_plan_matches_graph(plan, graph, source=source)
    if cluster is not None:
        check_plan_matches_cluster(plan, cluster, source=source)
    return plan


def plan_from_dict(data: Any, *, source: str = "plan") -> Plan:
    """Validate every field and build the Plan."""
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: a plan file holds a JSON object, found {type(data).__name__}")
    version = data.get("schema_version")
    if type(version) is not int or version not in READABLE_SCHEMA_VERSIONS:
        readable = " or ".join(str(v) for v in READABLE_SCHEMA_VERSIONS)
        raise PlanFileError(
            f"{source}: field 'schema_version' is {version!r}, but this partita reads schema "
            f"{readable}: re-create the plan with this version of partita"
        )
    _check_fields(data, _PLAN_FIELDS, source, "", optional=_OPTIONAL_PLAN_FIELDS)
    stages = tuple(_stage_from_dict(s, k, source) for k, s in enumerate(_nonempty(data["stages"], "stages", source)))
    schedule = _choice(Schedule, data["schedule"], "schedule", source)
    precision = _choice(Precision, data.get("precision", Precision.FP32.value), "precision", source)
    plan = Plan(
        graph_fingerprint=data["graph_fingerprint"],
        cluster=_cluster(data["cluster"], source),
        stages=stages,
        schedule=schedule,
        global_batch_size=data["global_batch_size"],
        num_microbatches=data["num_microbatches"],
        microbatch_size=data["microbatch_size"],
        options=data["options"],
        method=data["method"],
        predicted_step_s=float(data["predicted_step_s"]),
        predicted_bubble_fraction=float(data["predicted_bubble_fraction"]),
        total_compute_s=_optional_seconds(data, "total_compute_s", source),
        cost_source=data["cost_source"],
        precision=precision,
        compile=_optional_bool(data, "compile", source),
        partita_version=data["partita_version"],
        torch_version=data["torch_version"],
    )
    check_plan_consistency(plan, source)
    return plan


def _optional_bool(data: dict, field: str, source: str) -> bool:
    value = data.get(field, False)
    if not isinstance(value, bool):
        raise PlanFileError(f"{source}: field {field!r} is {value!r}, expected true or false")
    return value


def _choice(cls: Any, value: Any, field: str, source: str) -> Any:
    """The member of the string enum ``cls`` a field names; PlanFileError otherwise."""
    if not isinstance(value, str):
        raise PlanFileError(f"{source}: field {field!r} is {value!r}, expected a string")
    try:
        return cls.parse(value)
    except ValueError as e:
        raise PlanFileError(f"{source}: field {field!r}: {e}") from e


def _optional_seconds(data: dict, key: str, source: str) -> float | None:
    """A field that older plan files lack (None there, and when written as null)."""
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise PlanFileError(f"{source}: field {key!r} must be a number of seconds >= 0 or null, got {value!r}")
    return float(value)


def _stage_from_dict(data: Any, k: int, source: str) -> StagePlan:
    where = f"stages[{k}]"
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: {where} must be an object, found {type(data).__name__}")
    _check_fields(data, _STAGE_FIELDS, source, where + ".", optional=_OPTIONAL_STAGE_FIELDS)
    ranks = data["ranks"]
    if not ranks or not all(type(r) is int and r >= 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise PlanFileError(f"{source}: {where}.ranks is {ranks!r}: it must be a non-empty list of distinct ranks >= 0")
    values = {key: data[key] for key in _STAGE_FIELDS}
    values["ranks"] = tuple(ranks)
    values["forward_s"], values["backward_s"] = float(data["forward_s"]), float(data["backward_s"])
    recompute = data["recompute"]
    values["recompute"] = (
        Recompute.parse(recompute)
        if isinstance(recompute, bool)
        else _choice(Recompute, recompute, f"{where}.recompute", source)
    )
    values["sharding"] = _choice(Sharding, data.get("sharding", Sharding.REPLICATE.value), f"{where}.sharding", source)
    blocks = data.get("blocks")
    if blocks is not None and (type(blocks) is not int or blocks < 0):
        raise PlanFileError(f"{source}: {where}.blocks is {blocks!r}, expected an integer >= 0 (or no such field)")
    values["blocks"] = blocks
    partial = data.get("recompute_blocks")
    if partial is not None and (type(partial) is not int or partial < 1):
        raise PlanFileError(
            f"{source}: {where}.recompute_blocks is {partial!r}, expected an integer >= 1 (or no such field: "
            "every segment recomputes)"
        )
    values["recompute_blocks"] = partial
    values["accumulation"] = _choice(
        Accumulation, data.get("accumulation", Accumulation.WHOLE.value), f"{where}.accumulation", source
    )
    values["memory_breakdown"] = _breakdown(data.get("memory_breakdown"), f"{where}.memory_breakdown", source)
    degree = data.get("tensor_parallel", 1)
    if type(degree) is not int or degree < 1:
        raise PlanFileError(f"{source}: {where}.tensor_parallel is {degree!r}, expected an integer >= 1")
    if len(ranks) % degree:
        raise PlanFileError(
            f"{source}: {where} has {len(ranks)} ranks, which do not split into tensor-parallel groups of "
            f"{degree}: a stage holds whole groups (replicas x tensor_parallel ranks)"
        )
    values["tensor_parallel"] = degree
    values["replica_samples"] = _counts(data.get("replica_samples"), f"{where}.replica_samples", source, positive=True)
    values["memory_bytes_by_group"] = _counts(
        data.get("memory_bytes_by_group"), f"{where}.memory_bytes_by_group", source
    )
    if values["replica_samples"] is not None and len(values["replica_samples"]) != len(ranks) // degree:
        raise PlanFileError(
            f"{source}: {where}.replica_samples has {len(values['replica_samples'])} entries for "
            f"{len(ranks) // degree} replicas: one sample count per replica"
        )
    sequence = data.get("sequence_parallel", False)
    if not isinstance(sequence, bool):
        raise PlanFileError(f"{source}: {where}.sequence_parallel is {sequence!r}, expected true or false")
    if sequence and degree == 1:
        raise PlanFileError(
            f"{source}: {where}.sequence_parallel is true, but its tensor_parallel is 1: sequence parallelism splits "
            "the regions a tensor-parallel group leaves whole; set it to false, or re-plan with tensor parallelism"
        )
    values["sequence_parallel"] = sequence
    return StagePlan(**values)


def _counts(value: Any, where: str, source: str, *, positive: bool = False) -> tuple[int, ...] | None:
    """An optional list of whole numbers (>= 1 with ``positive``, else >= 0) as a tuple."""
    if value is None:
        return None
    least = 1 if positive else 0
    if not isinstance(value, list) or not value or not all(type(x) is int and x >= least for x in value):
        raise PlanFileError(
            f"{source}: {where} is {value!r}: it must be a non-empty list of integers >= {least} or null"
        )
    return tuple(value)


def _breakdown(data: Any, where: str, source: str) -> MemoryBreakdown | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: {where} must be an object or null, found {type(data).__name__}")
    _check_fields(data, _BREAKDOWN_FIELDS, source, where + ".")
    return MemoryBreakdown(**data)


def _check_fields(
    data: dict, fields: Mapping[str, Any], source: str, prefix: str, optional: tuple[str, ...] = ()
) -> None:
    for key, kind in fields.items():
        if key not in data:
            raise PlanFileError(f"{source}: field '{prefix}{key}' is missing")
        value = data[key]
        ok = isinstance(value, kind) and not (kind in (int, (int, float)) and isinstance(value, bool))
        if not ok:
            raise PlanFileError(f"{source}: field '{prefix}{key}' is {value!r}, expected {_kind_name(kind)}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if (isinstance(value, float) and not math.isfinite(value)) or value < 0:
                raise PlanFileError(f"{source}: field '{prefix}{key}' is {value!r}, expected a finite number >= 0")
    unknown = sorted(set(data) - set(fields) - set(optional))
    if unknown:
        raise PlanFileError(
            f"{source}: unknown field(s) {', '.join(prefix + u for u in unknown)}: was the file edited by hand?"
        )


def _kind_name(kind: Any) -> str:
    names = {
        int: "an integer",
        str: "a string",
        bool: "true or false",
        list: "a list",
        dict: "an object",
        (str, bool): 'a recomputation level ("none", "selective", "full")',
    }
    return names.get(kind, "a number")


def _nonempty(value: list, field: str, source: str) -> list:
    if not value:
        raise PlanFileError(f"{source}: field '{field}' is empty: a plan has at least one stage")
    return value


def _cluster(data: dict, source: str) -> Cluster:
    try:
        return Cluster.from_dict(data)
    except Exception as e:  # noqa: BLE001 - any invalid cluster becomes a PlanFileError naming it
        raise PlanFileError(f"{source}: field 'cluster' is invalid: {e}") from e
