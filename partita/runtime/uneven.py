"""Uneven plans: stages with different replica counts, run by partita's own pipeline executor.

torch.distributed.pipelining runs one pipeline per column of a pp x dp mesh, where stage ``k``'s
replica ``j`` talks to stage ``k + 1``'s replica ``j`` only. A plan such as "stage 0 on ranks
(0, 1), stage 1 on rank (2,)" has no such columns, nor has one whose replicas take unequal shares
of each micro-batch (replicas of unequal speed on a mixed cluster), nor one whose stages sit off the
mesh's rank order (``Plan.on_mesh``), so this module runs them: GPipe or 1F1B, one stage per rank
group, point-to-point transfers between overlapping replicas. A stage's ranks may lie anywhere
(``partita.runtime.layout``): on a mixed cluster they follow the device groups, so the first stage
may run on the second group's ranks, also when every stage has as many replicas.

Semantics (what every rank computes)
------------------------------------
Every rank is given the whole global batch of ``B`` samples. Micro-batch ``i`` (of ``m``) is the
global samples ``[i*b, (i+1)*b)``, ``b = B / m``. Replica ``j`` of stage ``k`` (of ``r_k``) runs
``n_kj`` of them (``layout.stage_shares``: ``b / r_k``, or the plan's ``replica_samples``): the
contiguous slice that starts after replicas ``0 .. j-1``'s, ``[i*b + sum_{j'<j} n_kj', ...)``. It
reads its root inputs (graph inputs, along their batch dim) for that slice itself.

Boundary tensors (``StageSpec.output_names``; their ``TensorInfo`` in the OpGraph) travel by
their layout:

- sliced: a batch dim whose size is the sample count. Each receiving replica gets, from each
  sending replica, the overlap of their sample intervals (narrowed along the batch dim by the
  sender, concatenated in sample order by the receiver). Gradients travel back the same way.
- whole: no batch dim (Llama's rotary cos/sin). Receiving replica ``j'`` takes the tensor from
  the sending replica that owns ``j'``'s first sample (its *owner*); the gradient goes back to
  the owner, which sums what its receivers send (zero when it serves none) before its backward.
  A batch dim whose size is a multiple of the sample count (merged dims, ``(B*T, H)``) is sent
  whole too when both sides have the same replicas and shares (then the slices coincide); when
  they differ the Trainer refuses the plan (``check_uneven_boundaries``): whether ``B*T`` is
  batch-major is not knowable from shapes. So is a tensor without batch dim computed from the
  samples (``types.graph.reads_samples``: a reduction over the batch, such as an auxiliary loss
  added up across layers): each sending replica holds its own samples' value, and a receiver
  holding other samples would silently get the wrong one.

The loss: replica ``j`` of the last stage computes its slice's loss. When that is a mean over
its samples, the unsplit loss, the mean over ``B`` samples, is ``1/(m * r_last) * sum_{i, j} L_ij``
with equal shares, so every parameter's gradient, summed over micro-batches and holders
(``GradientSync``), is scaled by ``1/(m * r_last)``, and the reported loss is the same mean (the
Trainer all-reduces it). With unequal shares each ``L_ij`` is first weighted by its samples,
``n_j r_last / b`` (``loss_scaling.py`` rewrites the last stage). When the loss divides by a
data-dependent count, each ``L_ij`` is already its slice's part of the full-batch loss: gradients
and losses are summed, unscaled.

Worked example: ``b = 4`` samples per micro-batch, stage 0 on 2 replicas (slices [0, 2) and
[2, 4)), stage 1 on 1 replica ([0, 4)): stage 1 receives samples 0-1 from replica 0 and 2-3
from replica 1 and concatenates them; a tensor without batch dim comes from replica 0 only (the
owner of sample 0), and replica 1 backpropagates a zero gradient for it. With shares (3, 1) on
stage 0 (a fast and a slow device), replica 0 sends samples 0-2 and replica 1 sample 3.

Order and messages
------------------
Each rank runs ``partita.types.schedule_orders.rank_orders`` for its rank group: the action order of
torch's ScheduleGPipe / Schedule1F1B, which the planner's simulator also assumes. An action
first receives what it needs (blocking), computes, then sends asynchronously. As torch's
schedules do, an action's sends are issued together with the next action's receives
(``batch_isend_irecv``), so NCCL never blocks a send behind a receive of the same pair. Between
two ranks, messages go in micro-batch order, the tensors of one message in output order, on
both sides alike (NCCL ignores tags; gloo matches them). Sends are waited one exchange later
(``_SendWindow``), so at most two actions' sent tensors are held for the wire.

Tensor parallelism: every rank of a replica's group runs the stage on its index's view of the
plan (``tensor_parallel.local_plan``) and holds the boundary tensors whole. Where the stages on both
sides have different degrees (a mixed cluster's stages on device types of their own), a sending
rank serves every receiving rank whose index maps to its own (``send_peers``), and likewise for
the gradients going back.

Receive buffers get their shapes from ``stage_metadata`` run on this replica's own slice size
``n_kj`` (the Trainer runs it on the first ``n_kj`` samples, or on meta tensors of that size):
what stage ``k`` receives and sends at ``n_kj`` samples; a piece from or to a peer has the batch
dim cut to the samples the two share. Recomputation is ``StageRunner``'s (non-reentrant
``torch.utils.checkpoint``), as on the uniform path.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.errors import InputError
from partita.runtime.layout import stage_shares
from partita.runtime.pipeline import StageMetadata, StageRunner, backward_switches, root_key
from partita.runtime.precision import FP32, Compute
from partita.runtime.stages import StageModule, narrow_batch
from partita.types import Accumulation, OpGraph, Plan, Sharding, TensorInfo
from partita.types.graph import reads_samples
from partita.types.schedule_orders import BACKWARD, FORWARD, rank_orders

__all__ = [
    "Layout",
    "Transfer",
    "UnevenExecutor",
    "all_shares",
    "boundary_layouts",
    "check_uneven_boundaries",
    "replica_slice",
    "send_peers",
    "transfers",
]


# ----------------------------------------------------------------------------- routing math


def replica_slice(shares: Sequence[int], replica: int) -> tuple[int, int]:
    """``(first sample, number of samples)`` of ``replica``'s slice within one micro-batch, the
    replicas taking ``shares`` samples each in replica order (``layout.stage_shares``)."""
    return sum(shares[:replica]), shares[replica]


@dataclass(frozen=True)
class Transfer:
    """What sending replica ``sender`` gives receiving replica ``receiver`` for each micro-batch:
    the samples both hold, and (``carries_whole``) the tensors without batch dim."""

    sender: int
    receiver: int
    sender_offset: int  # first shared sample, counted from the start of the sender's slice
    receiver_offset: int  # the same sample, counted from the start of the receiver's slice
    num_samples: int
    carries_whole: bool  # the sender owns the receiver's first sample


def transfers(sender_shares: Sequence[int], receiver_shares: Sequence[int]) -> tuple[Transfer, ...]:
    """Every (sender, receiver) pair of replicas whose slices overlap, sorted by (sender, receiver),
    the sending stage's replicas taking ``sender_shares`` samples of each micro-batch and the
    receiving stage's ``receiver_shares`` (both sum to the micro-batch).

    For a fixed receiver the senders come in sample order, so concatenating their pieces gives
    the receiver's slice; for a fixed sender, the receivers likewise tile its slice.
    """
    assert sum(sender_shares) == sum(receiver_shares), (sender_shares, receiver_shares)
    result = []
    for sender in range(len(sender_shares)):
        s_start, s_size = replica_slice(sender_shares, sender)
        for receiver in range(len(receiver_shares)):
            r_start, r_size = replica_slice(receiver_shares, receiver)
            start, stop = max(s_start, r_start), min(s_start + s_size, r_start + r_size)
            if start < stop:
                result.append(
                    Transfer(
                        sender,
                        receiver,
                        start - s_start,
                        start - r_start,
                        stop - start,
                        carries_whole=s_start <= r_start < s_start + s_size,
                    )
                )
    return tuple(result)


class Layout(str, enum.Enum):
    """How a boundary tensor crosses a stage boundary with uneven replicas."""

    SLICED = "sliced"  # batch dim of one entry per sample: narrowed and concatenated
    WHOLE = "whole"  # no batch dim (or both sides hold the same samples): sent whole by the owner


def boundary_layouts(
    graph: OpGraph,
    names: Sequence[str],
    sender_index: int,
    sender_shares: Sequence[int],
    receiver_shares: Sequence[int],
) -> tuple[Layout, ...]:
    """The layout of each boundary tensor ``names`` (stage ``sender_index``'s outputs, its replicas
    holding ``sender_shares`` samples of each micro-batch, the next stage's ``receiver_shares``);
    InputError for a merged batch dim (``(B*T, H)``) crossing between replicas that hold different
    samples, and for a tensor without batch dim computed from the samples (``reads_samples``)
    crossing between replicas that hold different samples, naming the tensor, the boundary and
    the fix."""
    infos = output_infos(graph)
    same_slices = tuple(sender_shares) == tuple(receiver_shares)
    reads = dict(zip((node.name for node in graph.nodes), reads_samples(graph)))
    layouts = []
    for name in names:
        info = infos[name]
        if info.batch_dim is not None and not info.merges_samples(graph.batch_size):
            layouts.append(Layout.SLICED)
        elif same_slices or (info.batch_dim is None and not reads[name]):
            layouts.append(Layout.WHOLE)
        elif info.batch_dim is None:
            raise InputError(
                f"boundary tensor {name!r} {tuple(info.shape)} between stage {sender_index} "
                f"({_replicas(sender_shares)}) and stage {sender_index + 1} ({_replicas(receiver_shares)}) has no "
                "batch dim but is computed from the samples (a reduction over the batch, such as an auxiliary "
                "loss added up across layers): each replica of the sending stage holds its own samples' value, "
                "and a receiving replica holding other samples would get a wrong one. Cut the model where this "
                "value does not cross (before it is computed or after it is used) or give both stages the same "
                "replicas and shares"
            )
        else:
            raise InputError(
                f"boundary tensor {name!r} {tuple(info.shape)} between stage {sender_index} ({_replicas(sender_shares)}) "
                f"and stage {sender_index + 1} ({_replicas(receiver_shares)}) has batch dim {info.batch_dim} "
                f"of size {info.shape[info.batch_dim]} for a batch of {graph.batch_size} (several batch entries "
                "merged, e.g. batch x sequence), which cannot be split by sample: cut the model elsewhere (where "
                "the activation keeps a per-sample batch dim) or give both stages the same replicas and shares"
            )
    return tuple(layouts)


def _replicas(shares: Sequence[int]) -> str:
    """ "2 replicas", or "2 replicas with shares [3, 1]" when they are unequal."""
    words = f"{len(shares)} replica{'s' if len(shares) != 1 else ''}"
    return words if len(set(shares)) <= 1 else f"{words} with shares {list(shares)}"


def all_shares(plan: Plan) -> list[tuple[int, ...]]:
    """Each stage's samples per replica of every micro-batch (``layout.stage_shares``)."""
    b = plan.global_batch_size // plan.num_microbatches
    return [stage_shares(s, b) for s in plan.stages]


def check_uneven_boundaries(graph: OpGraph, plan: Plan, stages: Sequence[StageModule]) -> None:
    """Refuse (InputError) a plan whose boundaries cannot be routed between its replicas' slices."""
    shares = all_shares(plan)
    for k in range(plan.num_stages - 1):
        boundary_layouts(graph, stages[k].spec.output_names, k, shares[k], shares[k + 1])


def output_infos(graph: OpGraph) -> dict[str, TensorInfo]:
    """FX node name -> TensorInfo of its tensor output, for nodes with one (boundary values are)."""
    return {node.name: node.outputs[0] for node in graph.nodes if len(node.outputs) == 1}


@dataclass(frozen=True)
class _Side:
    """One boundary of this replica's stage, seen from this replica."""

    transfers: tuple[Transfer, ...]  # those with this replica, in the peers' sample order
    peers: tuple[int, ...]  # the rank at the other end of each transfer that this rank receives from
    send_peers: tuple[tuple[int, ...], ...]  # per transfer, the ranks this rank sends to (``send_peers``)
    layouts: tuple[Layout, ...]  # per boundary tensor
    dims: tuple[int | None, ...]  # per boundary tensor: its batch dim


def _side(
    graph: OpGraph,
    plan: Plan,
    sender_index: int,
    names: Sequence[str],
    replica: int,
    *,
    receiving: bool,
    job: Plan | None = None,
    tp_index: int = 0,
) -> _Side:
    """The boundary between stages ``sender_index`` and ``sender_index + 1``, for ``replica`` of
    the receiving (``receiving``) or the sending stage. ``plan`` is this rank's view
    (``tensor_parallel.local_plan``) of ``job`` (default: ``plan`` itself), where it has index
    ``tp_index`` in its replica's group."""
    sender, receiver = plan.stages[sender_index], plan.stages[sender_index + 1]
    shares = all_shares(plan)
    sent, received = shares[sender_index], shares[sender_index + 1]
    mine = [t for t in transfers(sent, received) if (t.receiver if receiving else t.sender) == replica]
    peers = [sender.ranks[t.sender] if receiving else receiver.ranks[t.receiver] for t in mine]
    infos = output_infos(graph)
    return _Side(
        tuple(mine),
        tuple(peers),
        send_peers(job or plan, sender_index, mine, tp_index, forward=not receiving),
        boundary_layouts(graph, names, sender_index, sent, received),
        tuple(infos[name].batch_dim for name in names),
    )


def send_peers(
    job: Plan, sender_index: int, mine: Sequence[Transfer], tp_index: int, *, forward: bool
) -> tuple[tuple[int, ...], ...]:
    """Per transfer of ``mine``, the ranks that this rank (index ``tp_index`` in its replica's
    tensor-parallel group) sends to across the boundary after stage ``sender_index``: forward, the
    receiving replica's ranks of the indices ``i`` with ``i mod t_send = tp_index``; backward, the
    sending replica's ranks of the indices ``j`` with ``j mod t_recv = tp_index`` (the receiving
    rank of index ``i`` takes its input from the sender of index ``i mod t_send``, and the sending
    rank of index ``j`` its gradient from the receiver of index ``j mod t_recv``: the boundary
    tensors and their gradients are whole on every rank of a group). One rank each at equal degrees."""
    sender, receiver = job.stages[sender_index], job.stages[sender_index + 1]
    t_send, t_recv = sender.tensor_parallel, receiver.tensor_parallel
    if forward:
        return tuple(
            tuple(r for i, r in enumerate(receiver.replica_ranks(t.receiver)) if i % t_send == tp_index) for t in mine
        )
    return tuple(tuple(r for j, r in enumerate(sender.replica_ranks(t.sender)) if j % t_recv == tp_index) for t in mine)


# ----------------------------------------------------------------------------- executor


@dataclass
class _InFlight:
    """One micro-batch between its forward and its backward."""

    received: tuple[torch.Tensor, ...]  # leaves: their .grad goes back to the senders
    outputs: Any  # the boundary tensors sent on, or the last stage's loss


class UnevenExecutor:
    """Runs this rank's one stage of an uneven plan over the micro-batches of a step.

    ``plan`` is this rank's view (``tensor_parallel.local_plan``) of ``job_plan`` (default: ``plan``),
    where it has index ``tp_index`` in its replica's tensor-parallel group: the view says whom it
    receives from, the job whom it sends to (``send_peers``). ``metadata`` describes the stage at this replica's own slice size ``n_kj`` (``stage_metadata``
    run on ``n_kj`` samples): the shapes of what it receives and sends, batch dims included.
    """

    def __init__(
        self,
        graph: OpGraph,
        plan: Plan,
        stage: StageModule,
        replica: int,
        metadata: StageMetadata,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        compute: Compute = FP32,
        runner: nn.Module | None = None,
        job_plan: Plan | None = None,
        tp_index: int = 0,
    ):
        spec, k = stage.spec, stage.spec.index
        self.graph, self.stage, self.metadata, self.device = graph, stage, metadata, device
        self.group = group  # of all ranks, carrying the collective timeout; None: the default group
        self.microbatch_samples = plan.global_batch_size // plan.num_microbatches
        self.first, self.num_samples = replica_slice(all_shares(plan)[k], replica)
        # the stage's FSDP2 module when it is sharded (sharding.py), else a plain runner
        self.runner = runner or StageRunner.of(stage, plan, compute)
        self.sharded = runner is not None
        self.full_shard = self.sharded and plan.stages[k].sharding is Sharding.FULL_SHARD
        self.sharded_accumulation = self.sharded and plan.stages[k].accumulation is Accumulation.SHARDED
        self.order = rank_orders(plan.schedule, plan.num_microbatches, plan.num_rank_groups, plan.num_stages)[k]
        self.last_backward = next((a for a in reversed(self.order) if a.kind == BACKWARD), None)
        view = dict(job=job_plan, tp_index=tp_index)
        self.inbound = _side(graph, plan, k - 1, spec.input_names, replica, receiving=True, **view) if k > 0 else None
        self.outbound = (
            None if spec.is_last else _side(graph, plan, k, spec.output_names, replica, receiving=False, **view)
        )

    def step(self, flat: Sequence[Any], *, forward_only: bool = False) -> list[torch.Tensor]:
        """Forward and backward of every micro-batch in the schedule's order, ``flat`` being the
        whole global batch (flat graph inputs). Parameter gradients are accumulated, unscaled, in
        ``.grad``. Returns the last stage's micro-batch losses (detached, in micro-batch order),
        ``[]`` on other stages. ``forward_only`` (an evaluation, under no_grad): the forwards alone,
        in the schedule's order, on every rank."""
        in_flight: dict[int, _InFlight] = {}
        losses: dict[int, torch.Tensor] = {}
        pending: list[dist.P2POp] = []  # an action's sends, issued with the next action's receives
        sent = _SendWindow()
        for action in self.order:
            i = action.microbatch
            if forward_only and action.kind != FORWARD:
                continue
            if action.kind == FORWARD:
                buffers = _buffers(self.inbound, self.metadata.input_args, self.device)
                sent.issued(_exchange(pending, _receives(self.inbound, buffers, i, FORWARD, self.group)))
                received = self._assemble_inputs(buffers)
                outputs = self.runner(*received, **self._root_inputs(flat, i))
                if not forward_only:
                    in_flight[i] = _InFlight(received, outputs)
                if self.outbound is None:
                    losses[i] = outputs.detach()
                sent_dtypes = [m.dtype for m in self.metadata.output_args]  # in bf16, also under no_grad
                pending = (
                    _sends(
                        self.outbound, [x.detach().to(d) for x, d in zip(outputs, sent_dtypes)], i, FORWARD, self.group
                    )
                    if self.outbound
                    else []
                )
            else:
                assert action.kind == BACKWARD, f"uneven plans run GPipe or 1F1B, got action {action}"
                grad_like = [x if x.requires_grad else None for x in self.metadata.output_args]
                buffers = _buffers(self.outbound, grad_like, self.device)
                sent.issued(_exchange(pending, _receives(self.outbound, buffers, i, BACKWARD, self.group)))
                state = in_flight.pop(i)
                if self.sharded:  # reduce-scatter the gradients once, after the step's last backward
                    self._sync_gradients(last=action is self.last_backward)
                self._backward(state, buffers)
                pending = (
                    _sends(self.inbound, self._input_grads(state), i, BACKWARD, self.group) if self.inbound else []
                )
        sent.issued(_exchange(pending, []))
        sent.wait_all()
        return [losses[i] for i in sorted(losses)]

    def _root_inputs(self, flat: Sequence[Any], microbatch: int) -> dict[str, Any]:
        """This replica's slice of micro-batch ``microbatch`` of the graph inputs its stage reads."""
        start = microbatch * self.microbatch_samples + self.first
        local = narrow_batch(self.graph, flat, start, self.num_samples)
        return {root_key(j): local[j] for j in self.stage.graph_input_indices}

    def _assemble_inputs(self, buffers: list[list]) -> tuple[torch.Tensor, ...]:
        """Received pieces -> this replica's inputs, as leaves that collect the input gradients."""
        if self.inbound is None:
            return ()
        received = []
        for p, meta in enumerate(self.metadata.input_args):
            value = _join([pieces[p] for pieces in buffers], self.inbound.layouts[p], self.inbound.dims[p])
            received.append(value.requires_grad_(meta.requires_grad))
        return tuple(received)

    def _backward(self, state: _InFlight, buffers: list[list]) -> None:
        """Backpropagate one micro-batch: from its loss, or from the gradients the next stage sent
        (sliced pieces concatenated in sample order, whole tensors summed over the receivers this
        replica owns, zero when it owns none)."""
        if self.outbound is None:
            state.outputs.backward()
            return
        tensors, grads = [], []
        for p, out in enumerate(state.outputs):
            if not self.metadata.output_args[p].requires_grad:
                continue
            pieces = [pieces[p] for pieces in buffers]
            tensors.append(out)
            grads.append(_join(pieces, self.outbound.layouts[p], self.outbound.dims[p], like=out))
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _sync_gradients(self, *, last: bool) -> None:
        """FSDP2's per-backward switches (``backward_switches``): accumulate unreduced until the
        last backward of the step (or in shards), which reduce-scatters unit by unit and finishes the step."""
        backward_switches(
            self.runner,
            last=last,
            full_shard=self.full_shard,
            sharded_accumulation=self.sharded_accumulation,
            is_last=last,
        )

    def _input_grads(self, state: _InFlight) -> list[torch.Tensor | None]:
        """The gradient of each received tensor (zeros if the stage did not use it), None for
        tensors that take no gradient."""
        return [
            None if not x.requires_grad else x.grad if x.grad is not None else torch.zeros_like(x)
            for x in state.received
        ]


# ----------------------------------------------------------------------------- messages


def _buffers(side: _Side | None, like: Sequence[torch.Tensor | None], device: torch.device) -> list[list]:
    """Empty receive buffers: per transfer of ``side``, per boundary tensor, its piece (None when
    the transfer does not carry it: a whole tensor from a non-owner, or a tensor without gradient).
    ``like`` holds this replica's tensors (their shapes at its slice size)."""
    if side is None:
        return []
    result = []
    for t in side.transfers:
        pieces = []
        for x, layout, dim in zip(like, side.layouts, side.dims):
            shape = _piece_shape(x, layout, t, dim)
            pieces.append(None if shape is None else torch.empty(shape, dtype=x.dtype, device=device))
        result.append(pieces)
    return result


def _piece_shape(x: torch.Tensor | None, layout: Layout, t: Transfer, dim: int | None) -> list[int] | None:
    if x is None or (layout is Layout.WHOLE and not t.carries_whole):
        return None
    shape = list(x.shape)
    if layout is Layout.SLICED:
        shape[dim] = t.num_samples
    return shape


def _join(
    pieces: Sequence[torch.Tensor | None], layout: Layout, dim: int | None, like: torch.Tensor | None = None
) -> torch.Tensor:
    """One tensor from the pieces of the transfers: concatenated in sample order (sliced), or the
    sum of the copies received (whole; zeros like ``like`` when none was)."""
    present = [x for x in pieces if x is not None]
    if layout is Layout.SLICED:
        return torch.cat(present, dim=dim) if len(present) > 1 else present[0]
    if not present:
        return torch.zeros_like(like)
    return present[0] if len(present) == 1 else torch.stack(present).sum(0)


def _sends(
    side: _Side,
    tensors: Sequence[torch.Tensor | None],
    microbatch: int,
    kind: str,
    group: dist.ProcessGroup | None = None,
) -> list[dist.P2POp]:
    """isend ops of this replica's ``tensors`` (outputs forward, input gradients backward), cut
    per transfer; None entries (no gradient) are not sent."""
    ops = []
    for t, peers in zip(side.transfers, side.send_peers):
        offset = t.sender_offset if kind == FORWARD else t.receiver_offset
        for p, (x, layout, dim) in enumerate(zip(tensors, side.layouts, side.dims)):
            if x is None or (layout is Layout.WHOLE and not t.carries_whole):
                continue
            piece = (x.narrow(dim, offset, t.num_samples) if layout is Layout.SLICED else x).contiguous()
            tag = _tag(microbatch, p, len(tensors), kind)
            ops.extend(dist.P2POp(dist.isend, piece, peer, group=group, tag=tag) for peer in peers)
    return ops


def _receives(
    side: _Side | None, buffers: list[list], microbatch: int, kind: str, group: dist.ProcessGroup | None = None
) -> list[dist.P2POp]:
    """irecv ops filling ``buffers``, in the order the peers send (transfer, then tensor);
    ``peer`` is a global rank (P2POp maps it into ``group``)."""
    if side is None:
        return []
    return [
        dist.P2POp(dist.irecv, buffer, peer, group=group, tag=_tag(microbatch, p, len(pieces), kind))
        for peer, pieces in zip(side.peers, buffers)
        for p, buffer in enumerate(pieces)
        if buffer is not None
    ]


class _SendWindow:
    """The send works of the latest exchange, waited at the next one.

    A send's tensor (an output, an input gradient, a piece of either) lives until its work is
    waited; waiting only at the end of the step would keep every micro-batch's boundary tensors
    alive, m times what the memory model counts. The exchange of action ``a`` issues the sends of
    action ``a - 1`` with the receives of ``a`` and waits those receives; then the sends issued by
    the exchange before (action ``a - 2``'s) are waited. Their receivers post the matching
    receives on their own, without waiting for anything this rank sends later: every rank runs
    the schedule's order, and torch's Schedule1F1B waits its sends even sooner (with the next
    receives).
    """

    def __init__(self):
        self.previous: list[Any] = []

    def issued(self, works: list[Any]) -> None:
        for work in self.previous:
            work.wait()
        self.previous = works

    def wait_all(self) -> None:
        self.issued([])


def _exchange(sends: list[dist.P2POp], receives: list[dist.P2POp]) -> list[Any]:
    """Issue the previous action's sends and this action's receives together; wait for the
    receives only. Returns the send works (waited at the end of the step)."""
    ops = sends + receives
    if not ops:
        return []
    works = dist.batch_isend_irecv(ops)
    if len(works) != len(ops):  # NCCL coalesced the batch into one work: waiting on it only orders streams
        for work in works:
            work.wait()
        return []
    for work in works[len(sends) :]:
        work.wait()
    return works[: len(sends)]


def _tag(microbatch: int, position: int, num_positions: int, kind: str) -> int:
    """A tag unique per (micro-batch, tensor, direction) between two ranks (gloo matches on it;
    NCCL ignores tags and relies on the order, the same on both sides)."""
    return 2 * (microbatch * num_positions + position) + (kind == BACKWARD)
