"""What one rank computes and sends for one sublayer under one strategy: the time model's atoms.

Every strategy's ``terms`` (its record in the library) are written from its code, as formulas in the
micro-batch's padded length ``s``, local tokens ``t = s/p``, batch ``b``, hidden ``h``, heads ``nq`` and
key/value groups ``ng`` of head dim ``hn``, MLP width ``f`` (``g = 2`` gated) and the element size ``e``
(:class:`~megatron_paradyse.strategies.dims.Dims`). Nothing here is measured:
:mod:`megatron_paradyse.cost.analytic` turns the terms into seconds with a calibrated profile.

- :class:`Gemm` ``(m, n, k)``: ``y[m, n] = x[m, k] @ w[n, k]^T``; ``2mnk`` FLOPs forward, ``4mnk``
  backward (dgrad + wgrad). ``recompute_gemms`` run again, forward only, inside the backward.
- :class:`AttentionCall`: one kernel call on a dense (query block, key block); ``pairs`` visible
  query-key pairs per head (``sq*sk`` full, ``sq(sq+1)/2`` causal); ``4*pairs*hn`` FLOPs per head
  forward, ``10*pairs*hn`` backward (flash recomputes the scores).
- :class:`Collective`: a collective (``all_gather``: output bytes; ``reduce_scatter``: input bytes;
  ``all_to_all``: bytes each rank sends and receives; ``broadcast``/``reduce``: the message) or one
  ring hop (``send_recv``: bytes sent to the next rank while receiving as many). ``fwd_comm`` and
  ``bwd_comm`` are waited for where they are issued; ``*_streamed`` run asynchronously while the
  same pass computes (``lean``'s weight shards, issued one hop ahead). Weight gradients summed over
  ranks travel in the accumulation dtype (fp32 for half precision).
- :class:`RingStage`: ``p`` hops of kernel calls, each overlapped with sending the block on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

from megatron_paradyse.core.layout import Segment, SequenceLayout
from megatron_paradyse.strategies.dims import Dims, ring_hops

__all__ = [
    "AttentionCall",
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveKind",
    "Gemm",
    "MEMO_SIZE",
    "RingStage",
    "SublayerTerms",
    "attention_calls",
    "gathered_weight",
    "mlp_weight_gathered_ahead",
    "qk_norm_bytes",
    "ring_stage",
]

MEMO_SIZE = 1024
"""Kernel-call lists memoised by their segments: ranks and ring hops repeat a few blocks."""

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast", "reduce"]

COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = (
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
    "broadcast",
    "reduce",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Gemm:
    m: int
    n: int
    k: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionCall:
    b: int
    heads: int
    sq: int
    sk: int
    hn: int
    causal: bool

    @property
    def pairs(self) -> int:
        """Visible (query, key) pairs of one head."""
        return self.sq * (self.sq + 1) // 2 if self.causal else self.sq * self.sk

    @property
    def flops(self) -> int:
        """Forward FLOPs: ``QK^T`` and ``PV`` over the visible pairs."""
        return 4 * self.b * self.heads * self.pairs * self.hn

    @property
    def length(self) -> float:
        """The block's length for rate look-ups: ``sq`` of a causal square, ``sqrt(sq sk)`` otherwise."""
        return float(self.sq) if self.causal else math.sqrt(self.sq * self.sk)


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    kind: CollectiveKind
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class RingStage:
    """``len(hops)`` ring hops; hop ``i`` runs its kernel calls while ``send`` (the K/V block) is in
    flight (none after the last forward hop; backward also passes the gradient accumulator,
    ``bwd_send``)."""

    hops: tuple[tuple[AttentionCall, ...], ...]
    send: Collective
    bwd_send: Collective

    @property
    def fwd_sends(self) -> int:
        return len(self.hops) - 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SublayerTerms:
    """One sublayer (attention or MLP) under one strategy, on one rank, for one micro-batch."""

    gemms: tuple[Gemm, ...]
    recompute_gemms: tuple[Gemm, ...] = ()
    """GEMMs the backward runs again, forward only (``lean`` recomputes its projections)."""
    attention: tuple[AttentionCall, ...] = ()
    """Kernel calls run back to back (not overlapped with communication)."""
    rings: tuple[RingStage, ...] = ()
    fwd_comm: tuple[Collective, ...] = ()
    bwd_comm: tuple[Collective, ...] = ()
    fwd_streamed: tuple[Collective, ...] = ()
    """Asynchronous collectives in flight while the forward computes."""
    bwd_streamed: tuple[Collective, ...] = ()
    elementwise_bytes: float = 0.0
    """Bytes read + written by memory-bound ops (norms, copies, merges, activations), forward;
    backward counts twice as many."""
    core_gemms: tuple[Gemm, ...] = ()
    """Of ``gemms``, those whose output only the attention core reads (``lean``'s per-group q/k/v
    projections): a rerun that keeps the core's results (``+rc+keepcore``) skips them."""

    def without_core(self) -> SublayerTerms:
        """The forward that a recompute keeping the attention core's results reruns: no kernel call,
        no ring (nor its sends), no GEMM only the core reads (its memory-bound work is still counted)."""
        gemms = list(self.gemms)
        for gemm in self.core_gemms:
            gemms.remove(gemm)
        return dataclasses.replace(self, gemms=tuple(gemms), core_gemms=(), attention=(), rings=())

    def syncs(self, *, backward: bool) -> int:
        """Collectives and ring hops of the forward or the backward: where the ranks wait for each other."""
        comms = len(self.bwd_comm) + len(self.bwd_streamed) if backward else len(self.fwd_comm) + len(self.fwd_streamed)
        return comms + sum(ring.fwd_sends + (len(ring.hops) if backward else 0) for ring in self.rings)


def attention_calls(layout: SequenceLayout, b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """Kernel calls of full-sequence attention on ``heads`` heads (tp_sp, ulysses): one per document;
    one causal document and its padding: one over the whole sequence, one over the padding."""
    if tail := layout.causal_tail_padding:
        s = layout.padded_len
        return (AttentionCall(b, heads, s, s, hn, True), AttentionCall(b, heads, tail, tail, hn, True))
    return _segment_calls(layout.full_segments(), b, heads, hn)


@functools.lru_cache(maxsize=MEMO_SIZE)
def _segment_calls(segments: tuple[Segment, ...], b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """One kernel call per visible segment; memoised: ring hops of every rank repeat a few blocks."""
    return tuple(
        AttentionCall(b, heads, seg.q_end - seg.q_start, seg.k_end - seg.k_start, hn, seg.causal) for seg in segments
    )


def ring_stage(layout: SequenceLayout, rank: int, d: Dims, heads: int, kv_heads: int) -> RingStage:
    """Ring attention on ``heads`` query heads: hop ``i`` attends the K/V block (``kv_heads`` heads) of
    ``rank - i``; the block hops forward, its gradient accumulator (accumulation dtype) backward."""
    kv_block = 2 * d.t * d.b * kv_heads * d.hn
    hops = tuple(_segment_calls(hop, d.b, heads, d.hn) for hop in ring_hops(layout, rank))
    return RingStage(hops, Collective("send_recv", kv_block * d.e), Collective("send_recv", kv_block * d.acc))


def mlp_weight_gathered_ahead(d: Dims) -> tuple[Collective, ...]:
    """The MLP's fc1 weight, where the layer gathers it during the attention (:attr:`Dims.mlp_weight_ahead`):
    streamed beside the attention's forward, where the attention's terms count it."""
    return (Collective("all_gather", d.f1 * d.h * d.e),) if d.mlp_weight_ahead else ()


def gathered_weight(w: int, d: Dims) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``zero3_linear`` of a weight of ``w`` bytes: (forward, backward) collectives. The weight is
    gathered for the forward and again for the backward, whose gradient is reduce-scattered in the
    accumulation dtype. The backward's two stream beside its GEMMs: the gather beside the weight
    gradient's, the reduce-scatter beside the input gradient's."""
    gather = Collective("all_gather", w)
    return (gather,), (gather, Collective("reduce_scatter", w // d.e * d.acc))


def qk_norm_bytes(d: Dims) -> float:
    """What the q/k norms (``shape.qk_norm``) read and write in a forward: each strategy normalises
    ``s (nq + ng) hn / p`` elements of q and k on a rank, whichever way it splits them."""
    return 2 * d.s * d.b * (d.nq + d.ng) * d.hn // d.p * d.e if d.shape.qk_norm else 0.0
