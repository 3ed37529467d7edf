"""Weight shards streamed through a group one at a time, never more than two resident.

The ``lean`` strategies never hold a full weight: every rank visits the group's ``p`` shards in turn,
the next one arriving while the current one is used (double buffering). A shard is a tuple of tensors
(``None`` for an absent bias), sent as one flat message. Two schedules:

- :func:`broadcast_shards`: at hop ``j`` every rank holds shard ``j``, broadcast from its owner.
  Attention needs this: all ranks must run the K/V ring of the *same* head group together. With
  gradients, each hop's shard gradient is reduced to its owner while the next hop runs.
- :func:`ring_shards`: at hop ``t`` rank ``r`` holds shard ``(r - t) mod p``, passed on to the next
  rank while used. Enough for token-local work (the MLP). With gradients, each shard's accumulator
  travels with it and, after ``p`` hops, arrives at its owner complete (ring attention's dK/dV
  pattern).

Gradients are accumulated, reduced and carried in the accumulation dtype (fp32 for half-precision
shards) and rounded to the shard's dtype once, when complete. Communication buffers are always fresh
tensors, never a parameter's storage: a receive into (or a reuse of) a buffer that aliases a live
weight would overwrite it unnoticed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.core.comm import RingComm
from megatron_paradyse.core.precision import accumulation_dtype

__all__ = ["Shard", "ShardHop", "broadcast_shards", "ring_shards"]

Shard = tuple[Tensor | None, ...]
ShardHop = Callable[[int, Shard, Shard | None], None]
"""``hop(j, shard, grad)``: work with shard ``j`` (read only); with gradients, *add* shard ``j``'s
gradient contribution into ``grad`` (zero-initialised, same structure, in the accumulation dtype);
without, ``grad`` is None. The hop must not keep references to ``shard`` or ``grad``: the schedule
frees them."""


class _FlatShard:
    """Packs a shard's tensors into one flat buffer and views them back out."""

    def __init__(self, own: Sequence[Tensor | None]):
        present = [t for t in own if t is not None]
        if not present:
            raise ValueError("a shard needs at least one tensor")
        dtypes = {t.dtype for t in present}
        if len(dtypes) > 1:
            raise ValueError(f"the tensors of one shard must share a dtype, got {sorted(map(str, dtypes))}")
        self.shapes = [None if t is None else t.shape for t in own]
        self.numel = sum(t.numel() for t in present)
        self.dtype, self.device = present[0].dtype, present[0].device

    def pack(self, tensors: Sequence[Tensor | None]) -> Tensor:
        """A fresh flat copy: safe to send, never aliasing the tensors themselves."""
        return torch.cat([t.reshape(-1) for t in tensors if t is not None])

    def empty(self) -> Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def grad_zeros(self) -> Tensor:
        """A zero gradient accumulator (accumulation dtype)."""
        return torch.zeros(self.numel, dtype=accumulation_dtype(self.dtype), device=self.device)

    def unpack_grad(self, flat: Tensor) -> Shard:
        """A complete gradient, rounded to the shard's dtype once, as the shard's tensors."""
        return self.unpack(flat.to(self.dtype))

    def unpack(self, flat: Tensor) -> Shard:
        views, offset = [], 0
        for shape in self.shapes:
            if shape is None:
                views.append(None)
                continue
            n = shape.numel()
            views.append(flat[offset : offset + n].view(shape))
            offset += n
        return tuple(views)


def broadcast_shards(
    own: Sequence[Tensor | None], group: ProcessGroup, hop: ShardHop, *, grads: bool = False
) -> Shard | None:
    """Run ``hop(j, shard_j, grad_j)`` for ``j = 0..p-1`` on every rank; return this rank's shard
    gradient (summed over ranks) when ``grads``.

    Resident at once: the shard in use and the next one in flight (on its owner, a packed copy of
    its own shard, made just in time); with ``grads``, also the gradient being filled and the
    previous one being reduced. One collective per shard per direction, ``p`` of them per call.
    """
    p, rank = group.size(), group.rank()
    flat = _FlatShard(own)

    def start(j: int) -> tuple[Tensor, dist.Work | None]:
        buffer = flat.pack(own) if j == rank else flat.empty()
        if p == 1:
            return buffer, None
        return buffer, dist.broadcast(buffer, src=dist.get_global_rank(group, j), group=group, async_op=True)

    own_grad = None
    reducing: tuple[dist.Work, Tensor] | None = None  # keeps the buffer alive until the reduce is done
    pending = start(0)
    for j in range(p):
        shard, work = pending
        pending = None  # the only reference to a finished shard is ``shard``, rebound next hop
        if work is not None:
            work.wait()
        if j + 1 < p:
            pending = start(j + 1)  # in flight while shard j is used
        grad = flat.grad_zeros() if grads else None
        hop(j, flat.unpack(shard), None if grad is None else flat.unpack(grad))
        if grad is None:
            continue
        if reducing is not None:
            reducing[0].wait()
            reducing = None
        if p > 1:
            reducing = (dist.reduce(grad, dst=dist.get_global_rank(group, j), group=group, async_op=True), grad)
        if j == rank:
            own_grad = grad  # the reduce's destination: complete once it finishes
        del grad
    if reducing is not None:
        reducing[0].wait()
    return None if own_grad is None else flat.unpack_grad(own_grad)


def ring_shards(
    own: Sequence[Tensor | None], group: ProcessGroup, hop: ShardHop, *, grads: bool = False
) -> Shard | None:
    """Run ``hop((r - t) mod p, shard, grad)`` for ``t = 0..p-1`` on rank ``r``; return this rank's
    shard gradient (summed over ranks) when ``grads``.

    Resident at once: the shard in use and the next one arriving; with ``grads``, also the
    accumulator being filled, the one arriving and the one leaving. ``p - 1`` hops of the shard and,
    with ``grads``, ``p`` hops of its accumulator.
    """
    p, rank = group.size(), group.rank()
    flat = _FlatShard(own)
    shard_comm = RingComm(group) if p > 1 else None
    grad_comm = RingComm(group) if grads and p > 1 else None
    shard = flat.pack(own)
    grad_in = None
    for t in range(p):
        if t + 1 < p:
            shard_next = shard_comm.send_recv(shard)
        grad = flat.grad_zeros() if grads else None
        hop((rank - t) % p, flat.unpack(shard), None if grad is None else flat.unpack(grad))
        if grad is not None:
            if grad_in is not None:
                grad_comm.wait()
                grad += grad_in  # what the ranks before us added to this shard's gradient
            # After the last hop the accumulator that arrives is our own shard's, complete.
            grad_in = grad_comm.send_recv(grad) if p > 1 else grad
            del grad
        if t + 1 < p:
            shard_comm.wait()
            shard = shard_next
    if grad_comm is not None:
        grad_comm.wait()
    return None if grad_in is None else flat.unpack_grad(grad_in)
