"""What one rank computes and sends for one sublayer under one strategy: the time model's atoms.

Every strategy's terms live in one function here, written from its code in ``strategies/``, as
formulas in the micro-batch's padded length ``s``, local tokens ``t = s/p``, batch ``b``, hidden ``h``,
heads ``nq`` and key/value groups ``ng`` of head dim ``hn``, MLP width ``f`` (``g = 2`` gated) and the
element size ``e`` (:class:`~megatron_paradyse.cost.allocations.Dims`). Nothing here is measured:
:mod:`cost.analytic` turns the terms into seconds with a calibrated profile. What the strategies keep
in memory is :mod:`cost.allocations`' concern.

- :class:`Gemm` ``(m, n, k)``: ``y[m, n] = x[m, k] @ w[n, k]^T``; ``2mnk`` FLOPs forward, ``4mnk``
  backward (dgrad + wgrad). ``recompute_gemms`` run again, forward only, inside the backward.
- :class:`AttentionCall`: one kernel call on a dense (query block, key block); ``pairs`` visible
  query-key pairs per head (``sq*sk`` full, ``sq(sq+1)/2`` causal); ``4*pairs*hn`` FLOPs per head
  forward, ``10*pairs*hn`` backward (flash recomputes the scores).
- :class:`Collective`: a collective (``all_gather``: output bytes; ``reduce_scatter``: input bytes;
  ``all_to_all``: bytes each rank sends and receives; ``broadcast``/``reduce``: the message) or one
  ring hop (``send_recv``: bytes sent to the next rank while receiving as many). ``fwd_comm`` and
  ``bwd_comm`` are waited for where they are issued; ``*_streamed`` run asynchronously while the
  same pass computes (``lean``'s weight shards, issued one step ahead). Weight gradients summed over
  ranks travel in the accumulation dtype (fp32 for half precision).
- :class:`RingStage`: ``p`` steps of kernel calls, each overlapped with the next block's hop.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

from megatron_paradyse.core.layout import Segment, SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.allocations import (
    RANK_DEPENDENT,
    Dims,
    LayerMemory,
    layer_memory,
    ring_steps,
    sublayer_memory,
    tiled_mlp_memory,
)
from megatron_paradyse.strategies import gathers_mlp_weight_ahead

__all__ = [
    "AttentionCall",
    "COLLECTIVE_KINDS",
    "Collective",
    "CollectiveKind",
    "Dims",
    "Gemm",
    "LayerMemory",
    "LayerTerms",
    "RANK_DEPENDENT",
    "RingStage",
    "SublayerTerms",
    "attention_calls",
    "layer_terms",
    "sublayer_terms",
    "supported_options",
]

_MEMO_SIZE = 1024
"""Kernel-call lists memoised by their segments: ranks and ring steps repeat a few blocks."""

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
    """``len(steps)`` ring steps; step ``i`` runs its kernel calls while the hop of ``hop`` is in flight
    (none after the last forward step; backward also passes the gradient accumulator, ``bwd_hop``)."""

    steps: tuple[tuple[AttentionCall, ...], ...]
    hop: Collective
    bwd_hop: Collective

    @property
    def fwd_hops(self) -> int:
        return len(self.steps) - 1


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

    def syncs(self, *, backward: bool) -> int:
        """Collectives and ring hops of the forward or the backward: where the ranks wait for each other."""
        comms = len(self.bwd_comm) + len(self.bwd_streamed) if backward else len(self.fwd_comm) + len(self.fwd_streamed)
        return comms + sum(ring.fwd_hops + (len(ring.steps) if backward else 0) for ring in self.rings)


def attention_calls(layout: SequenceLayout, b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """Kernel calls of full-sequence attention on ``heads`` heads (tp_sp, ulysses): one per document;
    one causal document and its padding: one over the whole sequence, one over the padding."""
    if tail := layout.causal_tail_padding:
        s = layout.padded_len
        return (AttentionCall(b, heads, s, s, hn, True), AttentionCall(b, heads, tail, tail, hn, True))
    return _segment_calls(layout.full_segments(), b, heads, hn)


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _segment_calls(segments: tuple[Segment, ...], b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """One kernel call per visible segment; memoised: ring steps of every rank repeat a few blocks."""
    return tuple(
        AttentionCall(b, heads, seg.q_end - seg.q_start, seg.k_end - seg.k_start, hn, seg.causal) for seg in segments
    )


def _ring_stage(layout: SequenceLayout, rank: int, d: Dims, heads: int, kv_heads: int) -> RingStage:
    """Ring attention on ``heads`` query heads: step ``i`` attends the K/V block (``kv_heads`` heads) of
    ``rank - i``; the block hops forward, its gradient accumulator (accumulation dtype) backward."""
    kv_block = 2 * d.t * d.b * kv_heads * d.hn
    steps = tuple(_segment_calls(step, d.b, heads, d.hn) for step in ring_steps(layout, rank))
    return RingStage(steps, Collective("send_recv", kv_block * d.e), Collective("send_recv", kv_block * d.acc))


def _mlp_weight_gathered_ahead(d: Dims) -> tuple[Collective, ...]:
    """The MLP's fc1 weight, where the layer gathers it during the attention (:attr:`Dims.mlp_weight_ahead`):
    streamed beside the attention's forward, where the attention's terms count it."""
    return (Collective("all_gather", d.f1 * d.h * d.e),) if d.mlp_weight_ahead else ()


def _gathered(w: int, d: Dims) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """``zero3_linear`` of a weight of ``w`` bytes: (forward, backward) collectives. The weight is
    gathered for the forward and again for the backward, whose gradient is reduce-scattered in the
    accumulation dtype. The backward's two stream beside its GEMMs: the gather beside the weight
    gradient's, the reduce-scatter beside the input gradient's."""
    gather = Collective("all_gather", w)
    return (gather,), (gather, Collective("reduce_scatter", w // d.e * d.acc))


# -- attention ------------------------------------------------------------------------------------
def _qk_norm_bytes(d: Dims) -> float:
    """What the q/k norms (``shape.qk_norm``) read and write in a forward: each strategy normalises
    ``s (nq + ng) hn / p`` elements of q and k on a rank, whichever way it splits them."""
    return 2 * d.s * d.b * (d.nq + d.ng) * d.hn // d.p * d.e if d.shape.qk_norm else 0.0


def _tp_sp_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    x_full, core = s * b * d.h * e, s * b * d.nq // p * d.hn * e
    return SublayerTerms(
        gemms=(Gemm(s * b, d.qkv // p, d.h), Gemm(s * b, d.h, d.a // p)),
        attention=attention_calls(layout, b, d.nq // p, d.hn),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        # Megatron's column-parallel linear gathers its input again for the weight gradient (issued beside
        # the input gradient's GEMM, its reduce-scatter beside the weight gradient's: counted as waited)
        bwd_comm=(
            Collective("all_gather", x_full),
            Collective("reduce_scatter", x_full),
            Collective("all_gather", x_full),
        ),
        elementwise_bytes=2 * (s * b * d.qkv // p * e) * (2 if layout.causal else 1) + 4 * core + _qk_norm_bytes(d),
    )


def _ulysses_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The output projection's weight (and the MLP's first, where the layer gathers it ahead) gathered
    while the attention core runs (``Zero3Gathers``), the QKV projection's while the core's backward
    runs: those gathers stream beside their pass, as the projections' backward collectives do; the
    all-to-alls and the QKV projection's forward gather are waited for."""
    t, b, e = d.t, d.b, d.e
    qkv_local, core_local = t * b * d.qkv * e, t * b * d.a * e  # = [s, b, qkv/p], [s, b, a/p] on the other side
    qkv_fwd, qkv_bwd = _gathered(d.qkv * d.h * e, d)
    proj_fwd, proj_bwd = _gathered(d.h * d.a * e, d)
    a2a_qkv, a2a_core = Collective("all_to_all", qkv_local), Collective("all_to_all", core_local)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        attention=attention_calls(layout, b, d.nq // d.p, d.hn),
        fwd_comm=(*qkv_fwd, a2a_qkv, a2a_core),
        fwd_streamed=(*proj_fwd, *_mlp_weight_gathered_ahead(d)),
        bwd_comm=(a2a_core, a2a_qkv),
        bwd_streamed=(*proj_bwd, *qkv_bwd),
        elementwise_bytes=4 * qkv_local * (2 if layout.causal else 1) + 6 * core_local + _qk_norm_bytes(d),
    )


def _ring_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The output projection's weight (and the MLP's first, where the layer gathers it ahead) gathered
    while the ring runs, the QKV projection's while the ring's backward runs: streamed beside their
    pass, as the projections' backward collectives are."""
    t, b, e, p = d.t, d.b, d.e, d.p
    qkv_fwd, qkv_bwd = _gathered(d.qkv * d.h * e, d)
    proj_fwd, proj_bwd = _gathered(d.h * d.a * e, d)
    ring = _ring_stage(layout, rank, d, d.nq, d.ng)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        rings=(ring,),
        fwd_comm=qkv_fwd,
        fwd_streamed=(*proj_fwd, *_mlp_weight_gathered_ahead(d)),
        bwd_streamed=(*proj_bwd, *qkv_bwd),
        # per step: the block's partial output and lse merged into the running ones
        elementwise_bytes=p * 8 * t * b * d.a * d.acc + 4 * t * b * d.a * e + 2 * ring.hop.nbytes + _qk_norm_bytes(d),
    )


def _lean_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """Head group ``j``: its shard broadcast by rank ``j`` (the next one in flight), its q/k/v
    projected, ring attention, ``y += core_j proj_j^T``; backward broadcasts again, recomputes q/k/v,
    runs the ring backward and reduces the shard's gradient (accumulation dtype) to its owner while
    the next group runs."""
    t, b, e, p = d.t, d.b, d.e, d.p
    qkv_rows = d.qkv // p
    shard = (qkv_rows * d.h + d.h * d.a // p + (qkv_rows if d.bias else 0)) * e
    ring = _ring_stage(layout, rank, d, d.nq // p, d.ng // p)
    # the first shard's broadcast (and the last gradient's reduce) are waited for; the others run
    # while a group computes
    broadcast, reduce = Collective("broadcast", shard), Collective("reduce", shard // e * d.acc)
    return SublayerTerms(
        gemms=(Gemm(t * b, qkv_rows, d.h), Gemm(t * b, d.h, d.a // p)) * p,
        recompute_gemms=(Gemm(t * b, qkv_rows, d.h),) * p,
        rings=(ring,) * p,
        fwd_comm=(broadcast,) if p > 1 else (),
        fwd_streamed=(broadcast,) * (p - 1),
        bwd_comm=(broadcast, reduce) if p > 1 else (),
        bwd_streamed=(broadcast, reduce) * (p - 1),
        # per group and step a merge, the output copied to rows, the shard packed
        elementwise_bytes=p * 8 * t * b * d.a * d.acc + 2 * t * b * d.a * e + 2 * shard + _qk_norm_bytes(d),
    )


# -- MLP ------------------------------------------------------------------------------------------
def _tp_sp_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    x_full = s * b * d.h * e
    return SublayerTerms(
        gemms=(Gemm(s * b, d.f1 // p, d.h), Gemm(s * b, d.h, d.f // p)),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        # Megatron's column-parallel linear gathers its input again for the weight gradient (issued beside
        # the input gradient's GEMM, its reduce-scatter beside the weight gradient's: counted as waited)
        bwd_comm=(
            Collective("all_gather", x_full),
            Collective("reduce_scatter", x_full),
            Collective("all_gather", x_full),
        ),
        elementwise_bytes=3 * s * b * d.f1 // p * e,
    )


def _zero3_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """fc2's weight gathered while fc1 computes (``Zero3Gathers``): that gather streams beside the forward
    pass, the backward's gathers and reduce-scatters beside the backward's GEMMs; fc1's forward gather
    is waited for, unless the attention ran it (:attr:`Dims.mlp_weight_ahead`)."""
    t, b, e = d.t, d.b, d.e
    (fc1_gather,), fc1_bwd = _gathered(d.f1 * d.h * e, d)
    (fc2_gather,), fc2_bwd = _gathered(d.h * d.f * e, d)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1, d.h), Gemm(t * b, d.h, d.f)),
        fwd_comm=() if d.mlp_weight_ahead else (fc1_gather,),
        fwd_streamed=(fc2_gather,),
        bwd_streamed=(*fc2_bwd, *fc1_bwd),
        elementwise_bytes=3 * t * b * d.f1 * e,
    )


def _lean_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The fc1/fc2 shards circulate (at step ``i`` rank ``r`` holds shard ``r - i``, the next one
    arriving): ``y += act(x fc1_j^T + b1_j) fc2_j^T``; backward circulates them again, recomputes the
    intermediate, and each shard's gradient accumulator travels with it back to its owner."""
    t, b, e, p = d.t, d.b, d.e, d.p
    shard = (d.f1 // p * d.h + d.h * d.f // p + (d.f1 // p if d.bias else 0)) * e
    hop, grad_hop = Collective("send_recv", shard), Collective("send_recv", shard // e * d.acc)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1 // p, d.h), Gemm(t * b, d.h, d.f // p)) * p,
        recompute_gemms=(Gemm(t * b, d.f1 // p, d.h),) * p,
        fwd_streamed=(hop,) * (p - 1),
        # the shards' hops and the accumulators' but the last, waited for at the end
        bwd_comm=(grad_hop,) if p > 1 else (),
        bwd_streamed=(hop,) * (p - 1) + (grad_hop,) * (p - 1),
        elementwise_bytes=3 * t * b * d.f1 * e + 2 * shard,
    )


_ATTENTION: dict[str, Callable[[Dims, SequenceLayout, int], SublayerTerms]] = {
    "tp_sp": _tp_sp_attention,
    "ulysses": _ulysses_attention,
    "ring": _ring_attention,
    "lean": _lean_attention,
}
_MLP: dict[str, Callable[[Dims, SequenceLayout, int], SublayerTerms]] = {
    "tp_sp": _tp_sp_mlp,
    "zero3": _zero3_mlp,
    "lean": _lean_mlp,
}


def supported_options() -> tuple[list[str], list[str]]:
    """(attention strategies, MLP strategies) that have terms."""
    return list(_ATTENTION), list(_MLP)


def sublayer_terms(
    sublayer: Literal["attention", "mlp"], name: str, d: Dims, layout: SequenceLayout, rank: int = 0
) -> SublayerTerms:
    table = _ATTENTION if sublayer == "attention" else _MLP
    if name not in table:
        raise ValueError(f"no cost terms for {sublayer} strategy {name!r}; known: {', '.join(table)}")
    return table[name](d, layout, rank)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerTerms:
    """A whole layer (``x + attn(LN1(x))``, ``+ mlp(LN2(.))``) under one option, on one rank."""

    attention: SublayerTerms
    mlp: SublayerTerms
    recompute: bool
    activation_bytes: float
    """One ``[t, b, h]`` activation (the layer's input, output, residual)."""
    saved_bytes: float
    """Kept from the layer's forward to its backward (with recompute: its output only; offloaded: none)."""
    peak_bytes: float
    """High-water mark over forward (+ recompute) and backward, above the layer's input."""

    @property
    def transient_bytes(self) -> float:
        return self.peak_bytes - self.saved_bytes


def layer_terms(option: LayerOption, d: Dims, layout: SequenceLayout, rank: int = 0) -> LayerTerms:
    """Terms and memory (:mod:`cost.allocations`) of one layer on ``rank``."""
    d = dataclasses.replace(d, mlp_weight_ahead=gathers_mlp_weight_ahead(option, d.p))
    if option.mlp_tile_tokens:
        mlp = tiled_mlp_memory(option.mlp, d, layout, option.mlp_tile_tokens)
    else:
        mlp = sublayer_memory("mlp", option.mlp, d, layout, rank)
    memory = layer_memory(sublayer_memory("attention", option.attention, d, layout, rank), mlp, d)
    return LayerTerms(
        sublayer_terms("attention", option.attention, d, layout, rank),
        sublayer_terms("mlp", option.mlp, d, layout, rank),
        option.recompute,
        d.x,
        *memory.saved_and_peak(recompute=option.recompute, offload=option.offload),
    )
