"""Collectives as autograd functions over an explicit process group.

Each public function names its layout change and its conjugate: ``forward: AG dim 0, backward: RS
dim 0``. The group is always an argument and is kept on ``ctx``, because pipeline schedules run the
backward of one micro-batch after the forward of the next. A group of one rank is the identity.
Outputs are fresh buffers allocated on the input's device: no collective ever writes into its input
or into a parameter. ``all_gather_single`` and ``reduce_scatter_single`` are torch's single-tensor
collectives under the name this torch release has (every call in the project goes through them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.core.precision import accumulation_dtype

__all__ = [
    "RingComm",
    "StepGroup",
    "Zero3Gathers",
    "all_gather_seq",
    "all_gather_single",
    "all_to_all_heads_to_seq",
    "all_to_all_seq_to_heads",
    "reduce_scatter_seq",
    "reduce_scatter_single",
    "warm_communicators",
    "zero3_linear",
]


# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_dim0(x: Tensor, group: ProcessGroup) -> Tensor:
    out = x.new_empty((group.size() * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(x: Tensor, group: ProcessGroup) -> Tensor:
    if x.shape[0] % group.size():
        raise ValueError(f"dim 0 ({x.shape[0]}) is not divisible by the group size {group.size()}")
    out = x.new_empty((x.shape[0] // group.size(), *x.shape[1:]))
    reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _Conjugate(torch.autograd.Function):
    """``forward(x, group)``; its backward ``adjoint(grad, group)``: a collective and its conjugate."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup, forward, adjoint) -> Tensor:
        ctx.group, ctx.adjoint = group, adjoint
        return forward(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.adjoint(grad, ctx.group), None, None, None


def all_gather_seq(x_local: Tensor, group: ProcessGroup) -> Tensor:
    """``[s/p, ...] -> [s, ...]``. forward: AG dim 0, backward: RS dim 0."""
    if group.size() == 1:
        return x_local
    return _Conjugate.apply(x_local, group, _all_gather_dim0, _reduce_scatter_dim0)


def reduce_scatter_seq(x_full: Tensor, group: ProcessGroup) -> Tensor:
    """``[s, ...]`` partial sums -> ``[s/p, ...]`` reduced. forward: RS dim 0, backward: AG dim 0."""
    if group.size() == 1:
        return x_full
    return _Conjugate.apply(x_full, group, _reduce_scatter_dim0, _all_gather_dim0)


def _seq_to_heads(x: Tensor, group: ProcessGroup) -> Tensor:
    p = group.size()
    s_local, b, width = x.shape
    # [s/p, b, p*w] -> [p, s/p, b, w]: chunk j of the last dim goes to rank j.
    send = x.view(s_local, b, p, width // p).permute(2, 0, 1, 3).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # [p, s/p, b, w]: block j holds rank j's tokens, which come j-th in canonical order.
    return recv.view(p * s_local, b, width // p)


def _heads_to_seq(x: Tensor, group: ProcessGroup) -> Tensor:
    p = group.size()
    s, b, width = x.shape
    # [s, b, w] -> [p, s/p, b, w]: tokens of rank j go to rank j.
    send = x.contiguous().view(p, s // p, b, width)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # [p, s/p, b, w] -> [s/p, b, p*w]: block j holds head chunk j.
    return recv.permute(1, 2, 0, 3).reshape(s // p, b, p * width)


def all_to_all_seq_to_heads(x_local: Tensor, group: ProcessGroup) -> Tensor:
    """``[s/p, b, p*w] -> [s, b, w]``: gather the sequence, keep the j-th chunk of the last dim on rank j.

    forward: A2A seq->heads, backward: A2A heads->seq.
    """
    if x_local.dim() != 3 or x_local.shape[-1] % group.size():
        raise ValueError(f"expected [s/p, b, w] with w divisible by p={group.size()}, got {tuple(x_local.shape)}")
    if group.size() == 1:
        return x_local
    return _Conjugate.apply(x_local, group, _seq_to_heads, _heads_to_seq)


def all_to_all_heads_to_seq(x_full: Tensor, group: ProcessGroup) -> Tensor:
    """``[s, b, w] -> [s/p, b, p*w]``: the inverse of :func:`all_to_all_seq_to_heads`.

    forward: A2A heads->seq, backward: A2A seq->heads.
    """
    if x_full.dim() != 3 or x_full.shape[0] % group.size():
        raise ValueError(f"expected [s, b, w] with s divisible by p={group.size()}, got {tuple(x_full.shape)}")
    if group.size() == 1:
        return x_full
    return _Conjugate.apply(x_full, group, _heads_to_seq, _seq_to_heads)


def _full_weight(gathered: Tensor, shard: Tensor, dim: int) -> Tensor:
    """The full weight from Megatron TP shards split along ``dim`` (0: column-, 1: row-parallel), all-gathered
    along dim 0 as ``gathered``."""
    if dim == 0:
        return gathered
    # Row-parallel shards [out, in/p] concatenate along dim 1: gathered as [p, out, in/p].
    p = gathered.shape[0] // shard.shape[0]
    return gathered.view(p, *shard.shape).permute(1, 0, 2).reshape(shard.shape[0], p * shard.shape[1])


def _start_reduce_scatter_shards(grad_full: Tensor, group: ProcessGroup, dim: int) -> tuple[Tensor, Tensor, dist.Work]:
    """The adjoint of gathering shards (:func:`_full_weight`), started: sum over ranks, each keeps its own
    shard's gradient. Returns (the shard's gradient once waited for, the reduced buffer, which must live
    until then, the work)."""
    if dim == 1:
        p = group.size()
        out_features, in_features = grad_full.shape
        grad_full = grad_full.view(out_features, p, in_features // p).permute(1, 0, 2)
        grad_full = grad_full.reshape(p * out_features, in_features // p)
    out = grad_full.new_empty((grad_full.shape[0] // group.size(), *grad_full.shape[1:]))
    return out, grad_full, reduce_scatter_single(out, grad_full, group=group, async_op=True)


def linear_over_rows(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``x W^T + b`` for ``x [..., in]``: one GEMM over ``x``'s rows, whatever its strides.

    ``torch.matmul`` folds a 3-D input into one GEMM only where its strides allow a view or the weight
    needs a gradient. Megatron's embedding output at ``b = 1`` is ``[s, 1, h]`` transposed from
    ``[1, s, h]``: contiguous to ``is_contiguous``, but with the size-1 dimension's stride ``s * h``.
    Times a weight that needs no gradient (a gathered or received shard) it would run as a GEMM per
    token against the weight broadcast ``s`` times (on the CPU in bf16, a copy of ``[s, h, out]``).
    """
    return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w, b).view(*x.shape[:-1], w.shape[0])


class Zero3Gathers:
    """The ZeRO-3 weights of linears that run one after another, as ``(shard, dim)`` in forward order, and when
    each weight's gather starts. ``chained`` (an MLP's fc1, then fc2): each linear's forward starts
    gathering the next one's weight before its own GEMM. Otherwise the caller starts a gather where it
    has compute to hide it behind (:meth:`start`: attention's projection while the attention core runs,
    and there too the MLP's fc1, the MLP's object handed to the attention; in backward,
    :meth:`start_when_gradient_reaches`: the QKV projection's while the core's backward runs). Either
    way the gather runs behind compute (on CUDA, on NCCL's stream) rather than before its GEMM; in
    backward, a weight not gathered ahead is gathered behind its own weight gradient's GEMM
    (:class:`_Zero3Linear`). A weight gathered ahead exists from its gather's start until its linear's
    GEMM is done. (The MLP does not gather fc1's weight during fc2's backward: fc1's own weight-gradient
    GEMM hides that gather, and started earlier the weight would sit beside fc2's weight gradient at the
    backward's peak.) One object per run of the linears (a recomputed forward makes its own)."""

    def __init__(self, shards: Sequence[tuple[Tensor, int]], group: ProcessGroup, *, chained: bool = True) -> None:
        self.shards = tuple(shards)
        self.group = group
        self.chained = chained
        self._pending: dict[int, tuple[Tensor, dist.Work]] = {}

    def start(self, index: int) -> None:
        """Start gathering linear ``index``'s weight (none past either end, none for a group of one)."""
        if self.group.size() > 1 and 0 <= index < len(self.shards) and index not in self._pending:
            shard, _ = self.shards[index]
            # grad mode off (a caller outside a linear's forward has it on): started with it on, the
            # all-gather of a shard that needs a gradient goes through autograd, and waiting for it
            # fails ("a view was created in no_grad mode ..."; gloo, torch 2.13)
            with torch.no_grad():
                out = shard.new_empty((self.group.size() * shard.shape[0], *shard.shape[1:]))
                self._pending[index] = (out, all_gather_single(out, shard, group=self.group, async_op=True))

    def start_when_gradient_reaches(self, tensor: Tensor, index: int) -> None:
        """In backward: start gathering linear ``index``'s weight once ``tensor``'s gradient is computed,
        so that the gather runs behind what autograd does next (attention's core)."""
        if tensor.requires_grad and self.group.size() > 1:
            tensor.register_hook(lambda grad: self.start(index))

    def take(self, index: int) -> Tensor:
        """Linear ``index``'s full weight: the gather started ahead, waited for, or one now."""
        shard, dim = self.shards[index]
        pending = self._pending.pop(index, None)
        if pending is None:
            return _full_weight(_all_gather_dim0(shard, self.group), shard, dim)
        gathered, work = pending
        work.wait()
        return _full_weight(gathered, shard, dim)


class _Zero3Linear(torch.autograd.Function):
    """``y = x W^T + b`` with ``W`` (and ``b``) all-gathered from TP shards for the GEMM only.

    ZeRO-3: the full weight exists while a GEMM needs it and is gathered again in backward; only ``x``
    and the shards are saved. Every rank multiplies its own tokens by the full weight, so the summed
    (reduce-scattered) gradient is the full-loss gradient of each rank's shard:

        forward:  W = AG(W_shard);  y = x W^T + b
        backward: W = AG(W_shard) behind dW = dy^T x;  dW_shard = RS(dW) behind dx = dy W;  db_shard = RS(sum dy)

    Each backward collective runs behind a GEMM that does not need it (on CUDA, issued in this order on
    the group's one NCCL stream: the gather beside the weight gradient's GEMM, then the reduce-scatter,
    which waits for that GEMM, beside the input gradient's), so the weight and the full weight gradient
    are alive together.

    The weight gradients are summed over ranks in the accumulation dtype (fp32 for half-precision
    weights) and rounded to the shard's dtype once, after the sum.

    With ``input_from = (source, rebuild)``, ``x == rebuild(source)``: ``source`` is saved instead of
    ``x`` and ``x`` rebuilt from it in backward, for the weight gradient's GEMM only.
    """

    @staticmethod
    def forward(
        ctx,
        x: Tensor,
        w_shard: Tensor,
        b_shard: Tensor | None,
        gathers: Zero3Gathers,
        index: int,
        input_from: tuple[Tensor, Callable[[Tensor], Tensor]] | None,
    ) -> Tensor:
        ctx.gathers, ctx.index, ctx.has_bias = gathers, index, b_shard is not None
        ctx.rebuild = None if input_from is None else input_from[1]
        ctx.save_for_backward(x if input_from is None else input_from[0], w_shard)
        b = None if b_shard is None else _all_gather_dim0(b_shard, gathers.group)
        w = gathers.take(index)
        if gathers.chained:
            gathers.start(index + 1)
        return linear_over_rows(x, w, b)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w_shard = ctx.saved_tensors
        if ctx.rebuild is not None:
            x = ctx.rebuild(x)
        gathers, index = ctx.gathers, ctx.index
        group, dim = gathers.group, gathers.shards[index][1]
        dy_2d, x_2d = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        acc = accumulation_dtype(w_shard.dtype)
        gathers.start(index)  # behind the weight gradient's GEMM
        dw_shard, dw_full, reducing = _start_reduce_scatter_shards((dy_2d.t() @ x_2d).to(acc), group, dim)
        w = gathers.take(index)
        dx = (dy_2d @ w).view(x.shape)  # the weight gradient's reduce-scatter runs behind it
        del w
        reducing.wait()
        del dw_full, reducing
        dw_shard = dw_shard.to(w_shard.dtype)
        db_shard = None
        if ctx.has_bias:
            db_shard = _reduce_scatter_dim0(dy_2d.sum(dim=0, dtype=acc), group).to(w_shard.dtype)
        return dx, dw_shard, db_shard, None, None, None


def zero3_linear(
    x: Tensor,
    w_shard: Tensor,
    b_shard: Tensor | None,
    group: ProcessGroup,
    dim: int = 0,
    *,
    gathers: Zero3Gathers | None = None,
    index: int = 0,
    input_from: tuple[Tensor, Callable[[Tensor], Tensor]] | None = None,
) -> Tensor:
    """``x W^T + b`` for Megatron TP shards split along ``dim`` (0: column-, 1: row-parallel; a
    row-parallel bias is replicated, pass it to :func:`~torch.add` instead); with ``gathers``, the
    ``index``-th of its linears (``w_shard`` and ``dim`` as it lists them), its weight gathered ahead.
    ``input_from``: ``(source, rebuild)`` with ``x == rebuild(source)``, where ``source`` is kept for
    backward anyway (an MLP's pre-activation, for the activation's backward): ``x`` is not kept but
    rebuilt there (at ``p = 1``, a plain linear, ``x`` is kept).

    forward: AG weight + GEMM; backward: AG weight + GEMMs, RS weight (and bias) gradient.
    """
    if dim not in (0, 1) or w_shard.dim() != 2:
        raise ValueError(f"zero3_linear takes a 2-D shard split on dim 0 or 1, got {tuple(w_shard.shape)}, dim={dim}")
    if b_shard is not None and dim != 0:
        raise ValueError("zero3_linear: only a column-parallel (dim 0) linear has a sharded bias")
    if gathers is not None and (gathers.shards[index][0] is not w_shard or gathers.shards[index][1] != dim):
        raise ValueError(f"zero3_linear: linear {index} of gathers is not this shard split on dim {dim}")
    if group.size() == 1:
        return torch.nn.functional.linear(x, w_shard, b_shard)
    gathers = gathers if gathers is not None else Zero3Gathers([(w_shard, dim)], group)
    return _Zero3Linear.apply(x, w_shard, b_shard, gathers, index, input_from)


class RingComm:
    """Asynchronous exchange with the ring neighbours of a group: send to next, receive from previous.

    Used inside autograd functions that carry blocks around the ring (ring attention). One transfer
    may be in flight at a time; :meth:`wait` completes it.
    """

    def __init__(self, group: ProcessGroup):
        self.group = group
        self.size = group.size()
        rank = group.rank()
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)
        self._in_flight: tuple | None = None

    def send_recv(self, send: Tensor) -> Tensor:
        """Start sending ``send`` to the next rank; return the buffer the previous rank's block lands in."""
        if self._in_flight is not None:
            raise RuntimeError("RingComm.send_recv called while a transfer is in flight; wait() first")
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group),
            dist.P2POp(dist.irecv, recv, self.prev, self.group),
        ]
        # Keep ``send`` referenced until the transfer completes.
        self._in_flight = (dist.batch_isend_irecv(ops), send)
        return recv

    def wait(self) -> None:
        if self._in_flight is None:
            raise RuntimeError("RingComm.wait called with no transfer in flight")
        for request in self._in_flight[0]:
            request.wait()
        self._in_flight = None


@dataclass(frozen=True)
class StepGroup:
    """A process group a training step communicates on: collectives, and point-to-point transfers to no
    peer, to the group's ``"neighbours"`` (the next and previous rank) or to ``"all"`` its ranks."""

    group: ProcessGroup
    peers: Literal["none", "neighbours", "all"]


# Elements of the warming message: NCCL picks the algorithm by message size (trees and low-latency
# protocols for small ones, rings and NVLink SHARP for large ones), so a small and a large one.
_WARM_ELEMENTS = {"cuda": (1, 4 * 2**20), "cpu": (1, 1024)}


def warm_communicators(groups: Sequence[StepGroup], device: torch.device) -> None:
    """Run each kind of transfer ``groups`` carry once, in order, on every rank of each (every rank calls
    it with its own groups of the same kinds, in the same order). NCCL creates a group's communicator at
    its first collective and connects each algorithm's buffers, and each peer's point-to-point buffers,
    at their first use: device memory outside PyTorch's caching allocator, taken before the memory the
    allocator can hold is measured instead of in the middle of the first step. Groups of one rank are
    skipped; so is a group met twice."""
    seen: set[int] = set()
    for step_group in groups:
        group = step_group.group
        if group is None or id(group) in seen or dist.get_world_size(group) < 2:
            continue
        seen.add(id(group))
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        for elements in _WARM_ELEMENTS[device.type]:
            message = torch.zeros(elements * size, dtype=torch.float32, device=device)
            dist.all_reduce(message, group=group)
            all_gather_single(message, message.chunk(size)[rank].clone(), group=group)
            reduce_scatter_single(message.chunk(size)[rank], message.clone(), group=group)
            if step_group.peers == "all":
                dist.all_to_all_single(message.clone(), message, group=group)
            elif step_group.peers == "neighbours":
                sent = [message.chunk(size)[0].clone() for _ in range(2)]
                received = [torch.empty_like(sent[0]) for _ in range(2)]
                next_rank = dist.get_global_rank(group, (rank + 1) % size)
                prev_rank = dist.get_global_rank(group, (rank - 1) % size)
                ops = [
                    dist.P2POp(dist.isend, sent[0], next_rank, group),
                    dist.P2POp(dist.irecv, received[0], prev_rank, group),
                    dist.P2POp(dist.isend, sent[1], prev_rank, group),
                    dist.P2POp(dist.irecv, received[1], next_rank, group),
                ]
                for request in dist.batch_isend_irecv(ops):
                    request.wait()
