"""Make each slice's loss a part of the full-batch loss: rewrite the stages, feed global values.

A step computes the loss once per *slice* -- one micro-batch of one replica of the last stage,
``S = num_microbatches x replicas(last stage) x accumulation_steps`` slices in all. Unsplit training computes it once
over the global batch. Two ways to make the two agree (``partita.capturing.normalizer`` tells
which one a loss needs):

- **averaging** (the loss is a mean over equally many elements in every slice, or S = 1): the
  stages run the loss as captured, each parameter's gradient is summed over the slices and
  scaled by ``1 / S`` (``grad_scale``), the reported loss is the mean of the slices' losses;
- **global normalisation** (the loss divides by a count that depends on the data: cross-entropy
  with ``ignore_index``, a masked mean, or it is a plain sum): the stage that computes each part
  of the loss is rewritten so that the slices' losses SUM to the full-batch loss, gradients are
  summed unscaled (``grad_scale = 1``) and the reported loss is the sum. Per term:

  * ``cross_entropy`` / ``nll_loss`` with ``reduction="mean"`` becomes ``reduction="sum"``
    divided by the *global count*: the number of targets that are not ``ignore_index`` in the
    whole global batch (with class weights, the sum of their weights), as torch divides by;
  * a data-only factor of the loss (``mask.sum()`` in ``(x * mask).sum() / mask.sum()``, a
    token count, a size) is replaced by its value on the global batch;
  * a mean over a fixed number of elements, or a constant (a weight penalty), is scaled by ``1/S``
    (by ``w/S`` with unequal shares, below).

**Unequal sample shares** (``StagePlan.replica_samples``: replicas of unequal speed on a mixed
cluster): replica ``j`` of a stage with ``r`` replicas runs ``n_j`` of every micro-batch's ``b``
samples. A mean over its slice then stands for ``n_j`` samples, not ``b / r``: the full-batch mean
is ``sum_{i,j} n_j L_ij / (m b)``, so each slice's value is weighted by ``w_j = n_j r / b`` (1 for
an even split), and the scale ``1/S`` above applies on top. Averaging: the last stage's loss is
multiplied by ``w_j`` in its graph, so its backward and the reported loss carry it. Global
normalisation: a MEAN or CONSTANT term is scaled by ``w_j / S`` (a constant, the same in every
slice, keeps its value: ``sum_j w_j = r``); COUNT_MEAN terms and global factors need nothing, they
already divide by counts over the whole batch. The gradient sync then sums over replicas and
scales by ``1/S`` or 1 as before, and FSDP2 reduce-scatters sums (``sharding.py``): the gradient
is the unsplit model's on the whole batch whatever the shares.

The global values are computed once per step, before any forward, by every rank that runs a
rewritten stage, from the global batch it is given (every rank is given the whole global batch,
so the count needs no collective). They live in non-persistent 0-dim buffers of the stage's
GraphModule (``_partita_global_<k>``), filled in place: recomputation and every micro-batch of
the step read the same value.

Where the loss's structure is not recognised (``LossStructure.unknown``), the stages run the
loss as captured (averaging) and ``warning`` says which node and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from partita.capturing.normalizer import (
    REDUCTION_SUM,
    LossStructure,
    TermKind,
    Unrecognised,
    analyse_loss,
    global_values_module,
    schema_arguments,
)
from partita.runtime.layout import stage_shares
from partita.runtime.materialize import retarget_device
from partita.runtime.stages import StageModule
from partita.types import OpGraph, Plan

__all__ = ["LossScaling"]

aten = torch.ops.aten
_BUFFER_PREFIX = "_partita_global_"
_TENSOR_OVERLOAD = {aten.mul.Scalar: aten.mul.Tensor, aten.div.Scalar: aten.div.Tensor}


@dataclass(frozen=True)
class _Site:
    """One rewrite: ``node`` (FX name) in stage ``stage``; ``kind`` a TermKind or "factor"."""

    stage: int
    node: str
    kind: str
    term_index: int  # index into structure.terms, or into structure.factors for "factor"


@dataclass
class _Fed:
    """A buffer filled every step from the global batch."""

    buffer: torch.Tensor
    kind: str  # "count" or "factor"
    values: tuple[int, ...]  # positions in the global-values module's outputs: (target[, weight]) or (factor,)
    ignore_index: int | None = None


class LossScaling:
    """The loss normalisation of one trainer: decides averaging vs global normalisation, rewrites
    this rank's stages for the latter, and fills their global values each step (``update``).

    Attributes: ``structure`` (the analysis), ``num_slices`` (S), ``normalised`` (global
    normalisation in use: the same decision on every rank), ``grad_scale``, ``warning`` (a message
    for the user when the loss is not recognised, else None).
    """

    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        stages: Sequence[StageModule],
        local: Sequence[StageModule],
        device: torch.device,
        *,
        accumulation_steps: int = 1,
        replica: int = 0,
    ):
        self.graph, self.device = graph, device
        self.num_slices = plan.num_microbatches * plan.stages[-1].num_replicas * accumulation_steps
        # this rank's slice weight w_j in each of its stages (module docstring; ``replica``: its index there)
        self._weights = {k: _share_weight(plan, k, replica) for k in {s.spec.index for s in local}}
        try:
            self.structure: LossStructure = analyse_loss(graph)
        except Exception as e:  # noqa: BLE001 - an analysis failure must not stop training: fall back, say so
            loss = graph.nodes[graph.loss_node]
            self.structure = LossStructure(
                loss=loss.name,
                unknown=Unrecognised(
                    loss.name, loss.target, loss.source, f"the analysis of the loss failed ({type(e).__name__}: {e})"
                ),
            )
        self.normalised = False
        self.warning: str | None = None
        self._fed: list[_Fed] = []
        self._values: torch.fx.GraphModule | None = None
        self._value_inputs: tuple[int, ...] = ()
        if self.num_slices == 1:
            return  # the last stage sees the whole global batch at once: exact as captured
        if not self.structure.recognised:
            self.warning = _unrecognised_message(self.structure, self.num_slices)
            self._weigh_averaged_loss(local)
            return
        if self.structure.averages_equal_counts:
            self._weigh_averaged_loss(local)
            return
        targets = {n.name: n.target for n in graph.graph_module.graph.nodes}
        sites, problem = _locate(self.structure, stages, plan, targets)
        if problem is not None:
            self.warning = _unplaceable_message(problem, self.num_slices)
            self._weigh_averaged_loss(local)
            return
        self.normalised = True
        local_indices = {s.spec.index for s in local}
        by_index = {s.spec.index: s for s in stages}
        wanted: list[str] = []
        for site in sites:
            if site.stage in local_indices:
                self._rewrite(by_index[site.stage], site, wanted, targets[site.node])
        for stage in local:
            stage.graph_module.recompile()
        if wanted:
            self._values = global_values_module(graph, wanted)
            retarget_device(self._values, device)
            read = {j for j, n in enumerate(n for n in self._values.graph.nodes if n.op == "placeholder") if n.users}
            self._value_inputs = tuple(sorted(read))

    @property
    def grad_scale(self) -> float:
        """What each parameter's gradient, summed over slices and holders, is multiplied by."""
        return 1.0 if self.normalised else 1.0 / self.num_slices

    def reported_loss(self, losses: Sequence[torch.Tensor]) -> torch.Tensor:
        """This last-stage rank's part of the full-batch loss (the parts of all last-stage ranks sum to it)."""
        stacked = torch.stack([loss.detach().float() for loss in losses])
        return stacked.sum() if self.normalised else stacked.sum() / self.num_slices

    def update(self, flat: Sequence[Any]) -> None:
        """Fill this rank's global values from the global batch ``flat`` (flat graph inputs)."""
        if self._values is None:
            return
        inputs = list(flat)
        for j in self._value_inputs:
            if isinstance(inputs[j], torch.Tensor):
                inputs[j] = inputs[j].to(self.device)
        with torch.no_grad():
            values = self._values(*inputs)
            for fed in self._fed:
                if fed.kind == "count":
                    target = values[fed.values[0]]
                    weight = values[fed.values[1]] if len(fed.values) > 1 else None
                    fed.buffer.copy_(_count(target, weight, fed.ignore_index))
                else:
                    value = values[fed.values[0]]
                    if isinstance(value, torch.Tensor):
                        fed.buffer.copy_(value.reshape(()))
                    else:
                        fed.buffer.fill_(value)

    # ------------------------------------------------------------------ rewriting

    def _weigh_averaged_loss(self, local: Sequence[StageModule]) -> None:
        """Averaging with unequal shares: multiply this replica's loss by its slice weight in the
        last stage's graph (module docstring), so that the slices' weighted mean is the full-batch
        mean. Nothing to do with an even split (weight 1)."""
        for stage in local:
            weight = self._weights[stage.spec.index]
            if not stage.spec.is_last or weight == 1.0:
                continue
            g = stage.graph_module.graph
            output = next(n for n in g.nodes if n.op == "output")
            loss = output.args[0]  # the last stage returns the 0-dim loss itself
            with g.inserting_before(output):
                weighted = g.call_function(aten.mul.Tensor, (loss, weight))
            weighted.meta = dict(loss.meta)
            output.replace_input_with(loss, weighted)
            stage.graph_module.recompile()

    def _rewrite(self, stage: StageModule, site: _Site, wanted: list[str], target: Any) -> None:
        gm = stage.graph_module
        g = gm.graph
        node = _find(stage, site.node, target)
        if site.kind == "factor":
            factor = self.structure.factors[site.term_index]
            name, buffer = _buffer(gm, _dtype_of(node), self.device)
            self._fed.append(_Fed(buffer, "factor", (_want(wanted, factor.node),)))
            with g.inserting_before(node):
                value = g.get_attr(name)
            node.update_arg(factor.position, value)
            node.target = _TENSOR_OVERLOAD.get(node.target, node.target)
            return
        term = self.structure.terms[site.term_index]
        if term.kind is TermKind.COUNT_MEAN:
            name, buffer = _buffer(gm, _dtype_of(node), self.device)
            outputs = (_want(wanted, term.target),) + ((_want(wanted, term.weight),) if term.weight else ())
            self._fed.append(_Fed(buffer, "count", outputs, term.ignore_index))
            bound = schema_arguments(node)
            bound["reduction"] = REDUCTION_SUM
            args = tuple(bound[a.name] for a in node.target._schema.arguments)
            with g.inserting_after(node):
                summed = g.call_function(node.target, args)
            with g.inserting_after(summed):
                count = g.get_attr(name)
            with g.inserting_after(count):
                scaled = g.call_function(aten.div.Tensor, (summed, count))
            scaled.meta = dict(node.meta)
            node.replace_all_uses_with(scaled)
            g.erase_node(node)
        elif term.kind in (TermKind.MEAN, TermKind.CONSTANT):
            with g.inserting_after(node):
                scaled = g.call_function(aten.mul.Tensor, (node, self._weights[site.stage] / self.num_slices))
            scaled.meta = dict(node.meta)
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        # TermKind.SUM: additive over slices as it is


# ----------------------------------------------------------------------------- placing the rewrites


def _locate(
    structure: LossStructure, stages: Sequence[StageModule], plan: Plan, targets: dict[str, Any]
) -> tuple[list[_Site], str | None]:
    """The stage of every rewrite, or a reason why one cannot be placed."""
    sites = []
    wanted = [(k, t.node, t.kind.value) for k, t in enumerate(structure.terms) if t.kind is not TermKind.SUM]
    wanted += [(k, f.consumer, "factor") for k, f in enumerate(structure.factors)]
    last = len(stages) - 1
    for k, name, kind in wanted:
        found = [s.spec.index for s in stages if _find(s, name, targets[name]) is not None]
        if len(found) != 1:
            return [], f"node {name} of the loss runs in {len(found)} stages"
        b = plan.global_batch_size // plan.num_microbatches
        if found[0] != last and stage_shares(plan.stages[found[0]], b) != stage_shares(plan.stages[-1], b):
            # its per-slice value crosses to the last stage without batch dim, from one replica to the
            # replicas whose first sample it holds (partita.runtime.uneven): only alike slices match
            return [], (
                f"node {name} of the loss runs on stage {found[0]}, whose replicas hold other samples than the "
                "last stage's (another replica count or other shares)"
            )
        sites.append(_Site(found[0], name, kind, k))
    return sites, None


def _share_weight(plan: Plan, stage_index: int, replica: int) -> float:
    """``n_j r / b``: how many samples replica ``replica`` of the stage runs of each micro-batch,
    relative to an even split (1.0 for an even split, and for plans whose shares are all equal)."""
    stage = plan.stages[stage_index]
    if stage.even_shares:
        return 1.0
    b = plan.global_batch_size // plan.num_microbatches
    return stage_shares(stage, b)[replica] * stage.num_replicas / b


def _find(stage: StageModule, name: str, target: Any) -> torch.fx.Node | None:
    """The copy of node ``name`` (with ``target``) that ``stage`` computes itself, not one it
    re-makes from an earlier stage's values."""
    if name in stage.spec.recomputed_names:
        return None
    for node in stage.graph_module.graph.nodes:
        if node.op == "call_function" and node.name == name and node.target == target:
            return node
    return None


def _buffer(gm: torch.fx.GraphModule, dtype: torch.dtype, device: torch.device) -> tuple[str, torch.Tensor]:
    """A new non-persistent 0-dim buffer of ``gm`` holding 1 until the first ``update``."""
    k = sum(1 for name, _ in gm.named_buffers() if name.startswith(_BUFFER_PREFIX))
    name = f"{_BUFFER_PREFIX}{k}"
    gm.register_buffer(name, torch.ones((), dtype=dtype, device=device), persistent=False)
    return name, getattr(gm, name)


def _want(wanted: list[str], name: str) -> int:
    if name not in wanted:
        wanted.append(name)
    return wanted.index(name)


def _dtype_of(node: torch.fx.Node) -> torch.dtype:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) and val.dtype.is_floating_point else torch.float32


def _count(target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """What torch's mean reduction of nll_loss divides by: the targets that are not ignored, or
    the sum of their class weights."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum()
    return (weight[target.masked_fill(~valid, 0)] * valid).sum()


# ----------------------------------------------------------------------------- messages


def _unrecognised_message(structure: LossStructure, num_slices: int) -> str:
    u = structure.unknown
    where = f"node {u.node} ({u.op}{', ' + u.source if u.source else ''})"
    return (
        f"partita cannot tell what the loss is a mean over: at {where}, {u.reason}. Each step computes the loss "
        f"on {num_slices} slices of the batch (micro-batches x replicas) and averages them, which equals the "
        "full-batch loss only if every slice's loss is a mean over equally many elements. To train exactly as on "
        "the full batch, write the loss as a sum over the batch divided by a count of the batch (e.g. "
        "(x * mask).sum() / mask.sum(), or cross_entropy / nll_loss with ignore_index and reduction='mean'), and "
        "keep the rest of it a sum or mean of such terms."
    )


def _unplaceable_message(problem: str, num_slices: int) -> str:
    return (
        f"partita cannot normalise the loss over the global batch: {problem}. The {num_slices} slices' losses "
        "are averaged instead, which equals the full-batch loss only if every slice's loss is a mean over "
        "equally many elements: cut the model before the loss computation so that the last stage computes it."
    )
