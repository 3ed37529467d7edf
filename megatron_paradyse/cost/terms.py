"""What one rank computes, sends and keeps for one sublayer under one strategy: the cost models' atoms.

Every strategy's terms live in one function here, written from its code in ``strategies/``, as
formulas in the micro-batch's padded length ``s``, local tokens ``t = s/p``, batch ``b``, hidden ``h``,
heads ``nq`` and key/value groups ``ng`` of head dim ``hn``, MLP width ``f`` (``g = 2`` gated) and the
element size ``e``. Nothing here is measured: :mod:`cost.analytic` turns the terms into seconds with a
calibrated profile, and the unit tests check them against hand counts.

- :class:`Gemm` ``(m, n, k)``: ``y[m, n] = x[m, k] @ w[n, k]^T``; ``2mnk`` FLOPs forward, ``4mnk``
  backward (dgrad + wgrad).
- :class:`AttentionCall`: one kernel call on a dense (query block, key block); ``pairs`` visible
  query-key pairs per head (``sq*sk`` full, ``sq(sq+1)/2`` causal); ``4*pairs*hn`` FLOPs per head
  forward, ``10*pairs*hn`` backward (flash recomputes the scores).
- :class:`Collective`: a synchronous collective (``all_gather``: output bytes; ``reduce_scatter``:
  input bytes; ``all_to_all``: bytes each rank sends and receives) or one ring hop (``send_recv``:
  bytes sent to the next rank while receiving as many).
- :class:`RingStage`: ``p`` steps of kernel calls, each overlapped with the next block's hop.
- Memory: ``saved`` (named tensors kept from forward to backward) and two peaks above them, the
  forward's and the backward's, as the code allocates them (see :func:`layer_terms`).

``lean`` (issue 4) is written from its description, not its code: check it when it lands.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

from megatron_paradyse.layout import SequenceLayout
from megatron_paradyse.plan import LayerOption
from megatron_paradyse.strategies import ModelShape

__all__ = [
    "AttentionCall",
    "CollectiveKind",
    "Collective",
    "Dims",
    "Gemm",
    "LayerTerms",
    "RANK_DEPENDENT",
    "RingStage",
    "SublayerTerms",
    "attention_calls",
    "layer_terms",
    "sublayer_terms",
    "supported_options",
]

CollectiveKind = Literal["all_gather", "reduce_scatter", "all_to_all", "send_recv"]
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = ("all_gather", "reduce_scatter", "all_to_all", "send_recv")
LSE_BYTES = 4  # log-sum-exp and ring accumulators are fp32 whatever the activations' dtype


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
    attention: tuple[AttentionCall, ...] = ()
    """Kernel calls run back to back (not overlapped with communication)."""
    ring: RingStage | None = None
    fwd_comm: tuple[Collective, ...] = ()
    bwd_comm: tuple[Collective, ...] = ()
    elementwise_bytes: float = 0.0
    """Bytes read + written by memory-bound ops (norms, copies, merges, activations), forward;
    backward counts twice as many."""
    saved: dict[str, float]
    """Bytes kept from forward to backward, by tensor."""
    fwd_peak: float
    """Bytes above the sublayer's input at its forward's high-water mark (its saved bytes included)."""
    bwd_peak: float
    """Bytes above everything saved up to here, the incoming gradient included, at its backward's
    high-water mark."""

    @property
    def saved_bytes(self) -> float:
        return float(sum(self.saved.values()))

    def syncs(self, *, backward: bool) -> int:
        """Collectives and ring hops of the forward or the backward: where the ranks wait for each other."""
        comms = len(self.bwd_comm if backward else self.fwd_comm)
        if self.ring is None:
            return comms
        return comms + self.ring.fwd_hops + (len(self.ring.steps) if backward else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class Dims:
    """The sizes a strategy's terms are written in, for one micro-batch on one rank."""

    shape: ModelShape
    p: int
    s: int
    """Padded sequence length (a multiple of 2p)."""
    b: int
    e: int
    """Bytes per activation/weight element."""

    @property
    def t(self) -> int:
        return self.s // self.p

    @property
    def h(self) -> int:
        return self.shape.hidden_size

    @property
    def hn(self) -> int:
        return self.shape.kv_channels

    @property
    def nq(self) -> int:
        return self.shape.num_attention_heads

    @property
    def ng(self) -> int:
        return self.shape.num_query_groups

    @property
    def qkv(self) -> int:
        """Columns of the full QKV projection: ``(nq + 2 ng) hn``."""
        return (self.nq + 2 * self.ng) * self.hn

    @property
    def a(self) -> int:
        """Columns of the full attention output: ``nq hn``."""
        return self.nq * self.hn

    @property
    def f(self) -> int:
        return self.shape.ffn_hidden_size

    @property
    def f1(self) -> int:
        """Rows of the full ``linear_fc1``: ``g f``."""
        return (2 if self.shape.gated_mlp else 1) * self.f

    @property
    def x(self) -> int:
        """Bytes of one ``[t, b, h]`` activation."""
        return self.t * self.b * self.h * self.e

    def q_copied(self, groups: int) -> bool:
        """Whether ``split_qkv`` copies q out of a QKV tensor holding ``groups`` key/value groups: the
        query heads of a group are contiguous, so q is a view with one query head per group (MHA) or
        a single group, a copy otherwise."""
        return groups > 1 and self.shape.heads_per_group > 1


def attention_calls(layout: SequenceLayout, b: int, heads: int, hn: int) -> tuple[AttentionCall, ...]:
    """Kernel calls of full-sequence attention on ``heads`` heads (tp_sp, ulysses: one per document)."""
    return tuple(
        AttentionCall(b, heads, seg.q_end - seg.q_start, seg.k_end - seg.k_start, hn, seg.causal)
        for seg in layout.full_segments()
    )


def _ring_steps(
    layout: SequenceLayout, rank: int, b: int, heads: int, hn: int
) -> tuple[tuple[AttentionCall, ...], ...]:
    """Kernel calls of each ring step of ``rank``: its queries against the K/V block of ``rank - step``."""
    p = layout.p
    return tuple(
        tuple(
            AttentionCall(b, heads, seg.q_end - seg.q_start, seg.k_end - seg.k_start, hn, seg.causal)
            for seg in layout.ring_segments(rank, (rank - step) % p)
        )
        for step in range(p)
    )


# -- attention ------------------------------------------------------------------------------------
def _core_attention(d: Dims, layout: SequenceLayout, heads: int, kv_heads: int) -> dict[str, float]:
    """What full-sequence attention (``attend_full_sequence``) on ``heads`` heads keeps: q/k/v (views
    of the QKV tensor, or natural-order copies when causal), a copied q, the output and its
    log-sum-exp."""
    s, b, e = d.s, d.b, d.e
    saved = {"qkv": s * b * (heads + 2 * kv_heads) * d.hn * e}
    if d.q_copied(kv_heads) and layout.is_identity:
        saved["q_copy"] = s * b * heads * d.hn * e
    saved["attn_out"] = s * b * heads * d.hn * e
    saved["lse"] = s * b * heads * LSE_BYTES
    return saved


def _tp_sp_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    x_full = s * b * d.h * e
    core = s * b * heads * d.hn * e  # the output in canonical order, kept by linear_proj
    saved = {"x_full": x_full, **_core_attention(d, layout, heads, kv_heads), "core": core}
    w_proj = d.h * heads * d.hn * e
    return SublayerTerms(
        gemms=(Gemm(s * b, d.qkv // p, d.h), Gemm(s * b, d.h, d.a // p)),
        attention=attention_calls(layout, b, heads, d.hn),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        bwd_comm=(Collective("reduce_scatter", x_full), Collective("all_gather", x_full)),
        elementwise_bytes=2 * (s * b * d.qkv // p * e) * (2 if layout.causal else 1) + 4 * core,
        saved=saved,
        # the row-parallel output [s, b, h] and its reduce-scattered shard, on top of everything kept
        fwd_peak=sum(saved.values()) + x_full + 2 * d.x,
        # linear_proj backward (the all-gathered gradient, dgrad, wgrad), or the kernel's backward
        # (dq, dk, dv beside a contiguous copy of the output gradient)
        bwd_peak=max(x_full + core + w_proj, saved["qkv"] + core),
    )


def _ulysses_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, t, b, e, p = d.s, d.t, d.b, d.e, d.p
    heads, kv_heads = d.nq // p, d.ng // p
    w_qkv, w_proj = d.qkv * d.h * e, d.h * d.a * e
    qkv_local = t * b * d.qkv * e
    core_local = t * b * d.a * e
    saved = {"x_local": d.x, "w_qkv": w_qkv, **_core_attention(d, layout, heads, kv_heads)}
    saved.update(core_local=core_local, w_proj=w_proj)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        attention=attention_calls(layout, b, heads, d.hn),
        fwd_comm=(
            Collective("all_gather", w_qkv),
            Collective("all_to_all", qkv_local),
            Collective("all_to_all", core_local),
            Collective("all_gather", w_proj),
        ),
        bwd_comm=(
            Collective("reduce_scatter", w_proj),
            Collective("all_to_all", core_local),
            Collective("all_to_all", qkv_local),
            Collective("reduce_scatter", w_qkv),
        ),
        elementwise_bytes=4 * qkv_local * (2 if layout.causal else 1) + 6 * core_local,
        saved=saved,
        # the QKV projection and the all-to-all's send and receive buffers
        fwd_peak=sum(saved.values()) + 3 * qkv_local,
        # linear_proj backward (dgrad, wgrad), or the kernel's backward (dq, dk, dv beside a contiguous
        # copy of the output gradient)
        bwd_peak=max(core_local + w_proj, saved["qkv"] + s * b * heads * d.hn * e),
    )


def _ring_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    t, b, e, p = d.t, d.b, d.e, d.p
    w_qkv, w_proj = d.qkv * d.h * e, d.h * d.a * e
    qkv_local = t * b * d.qkv * e
    core_local = t * b * d.a * e
    kv_block = 2 * t * b * d.ng * d.hn * e
    out32 = t * b * d.a * LSE_BYTES
    kv32 = kv_block // e * LSE_BYTES
    saved = {"x_local": d.x, "w_qkv": w_qkv, "qkv": qkv_local}
    if d.q_copied(d.ng):
        saved["q_copy"] = core_local
    saved.update(attn_out=out32, lse=t * b * d.nq * LSE_BYTES, core=core_local, w_proj=w_proj)
    ring = RingStage(
        steps=_ring_steps(layout, rank, b, d.nq, d.hn),
        hop=Collective("send_recv", kv_block),
        bwd_hop=Collective("send_recv", kv32),
    )
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        ring=ring,
        fwd_comm=(Collective("all_gather", w_qkv), Collective("all_gather", w_proj)),
        bwd_comm=(Collective("reduce_scatter", w_proj), Collective("reduce_scatter", w_qkv)),
        # per step: the block's partial output and lse merged into the running ones (fp32)
        elementwise_bytes=p * 8 * out32 + 4 * core_local + 2 * kv_block,
        saved=saved,
        # two K/V blocks (current and in flight) and a partial result beside the running one
        fwd_peak=sum(saved.values()) + 2 * kv_block + 2 * out32,
        # At a step with several segments: K/V held, in flight (not on the last step, so not for p=2)
        # and stacked, the step's and the travelling dk/dv accumulators (fp32) both ways, dq (fp32),
        # the kernel's block gradients, and with GQA the kernel's K/V heads expanded to the queries'.
        bwd_peak=max(
            3 * core_local + w_proj,
            (4 if p > 2 else 3) * kv_block
            + 4 * kv32
            + 2 * out32
            + 2 * core_local
            + 2 * (d.shape.heads_per_group - 1) * kv_block,
        ),
    )


def _lean_attention(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """METP-style (issue 4, from its description): the QKV/proj shards stream round the ring one group
    at a time, each head group's K/V blocks circulate for ring attention, only the input and the
    per-group attention outputs are kept, the rest is recomputed in backward."""
    t, b, e, p = d.t, d.b, d.e, d.p
    w_qkv_shard, w_proj_shard = d.qkv // p * d.h * e, d.h * d.a // p * e
    kv_block = 2 * t * b * d.ng // p * d.hn * e
    core_local = t * b * d.a * e
    saved = {"x_local": d.x, "core": core_local, "lse": t * b * d.nq * LSE_BYTES}
    steps = _ring_steps(layout, rank, b, d.nq // p, d.hn)
    return SublayerTerms(
        # the projections run group by group: the same FLOPs as one GEMM; recompute adds the QKV again
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        ring=RingStage(
            steps=steps * p,
            hop=Collective("send_recv", kv_block + w_qkv_shard // p),
            bwd_hop=Collective("send_recv", kv_block // e * LSE_BYTES + w_qkv_shard // p),
        ),
        fwd_comm=(Collective("send_recv", w_proj_shard),) * (p - 1),
        bwd_comm=(Collective("send_recv", w_proj_shard),) * (2 * (p - 1)),
        elementwise_bytes=p * 8 * t * b * d.a // p * LSE_BYTES + 4 * core_local,
        saved=saved,
        fwd_peak=sum(saved.values()) + 2 * (w_qkv_shard + kv_block) + t * b * d.qkv // p * e,
        bwd_peak=2 * (w_qkv_shard + kv_block) + 2 * t * b * d.qkv // p * e + core_local,
    )


# -- MLP ------------------------------------------------------------------------------------------
def _activation_saved(tokens: int, d: Dims, units: int) -> dict[str, float]:
    """fc1 output (kept by the activation) and the activation's output (kept by fc2); gated: the
    gate's activation and the product as well."""
    g = 2 if d.shape.gated_mlp else 1
    saved = {"fc1_out": tokens * d.b * g * units * d.e, "act_out": tokens * d.b * units * d.e}
    if d.shape.gated_mlp:
        saved["gated_out"] = tokens * d.b * units * d.e
    return saved


def _tp_sp_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    s, b, e, p = d.s, d.b, d.e, d.p
    x_full = s * b * d.h * e
    units = d.f // p
    saved = {"x_full": x_full, **_activation_saved(s, d, units)}
    return SublayerTerms(
        gemms=(Gemm(s * b, d.f1 // p, d.h), Gemm(s * b, d.h, units)),
        fwd_comm=(Collective("all_gather", x_full), Collective("reduce_scatter", x_full)),
        bwd_comm=(Collective("reduce_scatter", x_full), Collective("all_gather", x_full)),
        elementwise_bytes=3 * s * b * d.f1 // p * e,
        saved=saved,
        fwd_peak=sum(saved.values()) + x_full + 2 * d.x,
        # linear_fc2 backward: the all-gathered gradient, dgrad and wgrad
        bwd_peak=x_full + s * b * units * e + d.h * units * e,
    )


def _zero3_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    t, b, e = d.t, d.b, d.e
    w1, w2 = d.f1 * d.h * e, d.h * d.f * e
    saved = {"x_local": d.x, "w_fc1": w1, **_activation_saved(t, d, d.f), "w_fc2": w2}
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1, d.h), Gemm(t * b, d.h, d.f)),
        fwd_comm=(Collective("all_gather", w1), Collective("all_gather", w2)),
        bwd_comm=(Collective("reduce_scatter", w2), Collective("reduce_scatter", w1)),
        elementwise_bytes=3 * t * b * d.f1 * e,
        saved=saved,
        fwd_peak=sum(saved.values()) + d.x,
        # linear_fc2 backward: dgrad and the full weight's gradient; then (fc2's saved input and weight
        # released) that gradient's reduce-scatter copy and shard
        bwd_peak=max(t * b * d.f * e + w2, w2 + w2 // d.p),
    )


def _lean_mlp(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """METP-style (issue 4, from its description): fc1/fc2 shards stream round the ring, partial
    outputs accumulate; only the input is kept, the rest is recomputed in backward."""
    t, b, e, p = d.t, d.b, d.e, d.p
    w1_shard, w2_shard = d.f1 // p * d.h * e, d.h * d.f // p * e
    units = d.f // p
    saved = {"x_local": d.x}
    hidden = sum(_activation_saved(t, d, units).values())
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1, d.h), Gemm(t * b, d.h, d.f), Gemm(t * b, d.f1, d.h)),  # fc1 again in backward
        fwd_comm=(Collective("send_recv", w1_shard + w2_shard),) * (p - 1),
        bwd_comm=(Collective("send_recv", 2 * (w1_shard + w2_shard)),) * (p - 1),
        elementwise_bytes=3 * t * b * d.f1 * e,
        saved=saved,
        fwd_peak=d.x + 2 * (w1_shard + w2_shard) + hidden + d.x,
        bwd_peak=2 * (w1_shard + w2_shard) + 2 * hidden + 2 * d.x,
    )


_ATTENTION: dict[str, Callable[[Dims, SequenceLayout, int], SublayerTerms]] = {
    "tp_sp": _tp_sp_attention,
    "ulysses": _ulysses_attention,
    "ring": _ring_attention,
    "lean": _lean_attention,
}
RANK_DEPENDENT = frozenset({"ring", "lean"})
"""Attention strategies whose per-rank work depends on the rank (which ring blocks it sees)."""
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
    """A whole layer (``x + attn(LN1(x))``, ``+ mlp(LN2(.))``) under one option."""

    attention: SublayerTerms
    mlp: SublayerTerms
    recompute: bool
    norm_saved: dict[str, float]
    """LayerNorm statistics, the residual sum (LN2's input) and the layer output."""
    saved_bytes: float
    peak_bytes: float
    """High-water mark over forward (+ recompute) and backward, above the layer's input."""

    @property
    def transient_bytes(self) -> float:
        return self.peak_bytes - self.saved_bytes


def layer_terms(option: LayerOption, d: Dims, layout: SequenceLayout, rank: int = 0) -> LayerTerms:
    """Terms of one layer, and its memory composed from its sublayers'.

    Forward: LN1's output, the attention sublayer, the residual ``x1``, LN2's output, the MLP, the
    output. Backward runs the MLP first with everything saved alive, then the attention with the MLP's
    part released. Recompute keeps only the output (the next layer's input) and rebuilds the rest when
    the backward reaches the layer, so its peak is the same, its saved bytes one ``[t, b, h]``.
    """
    attn = sublayer_terms("attention", option.attention, d, layout, rank)
    mlp = sublayer_terms("mlp", option.mlp, d, layout, rank)
    ln_stats = 2 * d.t * d.b * LSE_BYTES  # mean and rstd, fp32
    norm_saved = {"ln1_stats": ln_stats, "x1": d.x, "ln2_stats": ln_stats, "output": d.x}
    # LN outputs are kept by strategies whose first op saves its input (their terms count them).
    attn_done = ln_stats + attn.saved_bytes + d.x
    saved = attn_done + ln_stats + mlp.saved_bytes + d.x
    fwd_peak = max(ln_stats + d.x + attn.fwd_peak, attn_done + ln_stats + d.x + mlp.fwd_peak)
    bwd_peak = max(saved + mlp.bwd_peak, attn_done + d.x + attn.bwd_peak)
    peak = max(fwd_peak, bwd_peak)
    return LayerTerms(attn, mlp, option.recompute, norm_saved, d.x if option.recompute else saved, peak)
