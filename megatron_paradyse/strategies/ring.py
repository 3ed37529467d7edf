"""``ring``: context-parallel ring attention with ZeRO-3 weights.

Each rank projects its own ``s/p`` tokens to Q, K, V for *all* heads with the all-gathered QKV
weight, then passes its K/V block around the ring: at hop ``t`` it holds the block of rank
``r - t`` and attends to the parts the layout marks visible. In zigzag order (causal) every hop costs
every rank the same: the block from an earlier rank is seen by both local chunks' queries against
its first chunk, the block from a later rank by the second local chunk against both of its chunks.
Partial results merge by log-sum-exp. The next block is in flight while the current one is computed.

Backward walks the ring again: ``dq`` stays home, each block's ``(dk, dv)`` accumulator travels with
it and, after ``p`` hops, arrives back at its owner complete. The projection's weight is gathered
while the ring runs (and a ``zero3`` MLP's first weight), and in backward the QKV projection's.
Memory: ``O(s/p)`` activations, two K/V blocks and the gathered weights.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.attention import (
    AttentionKernel,
    accumulate_block,
    accumulate_block_grads,
    accumulation_dtype,
)
from megatron_paradyse.attention.kept import kept_core
from megatron_paradyse.core.comm import RingComm, Zero3Gathers, zero3_linear
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.strategies.allocations import (
    MEMO_SIZE,
    Allocations,
    Call,
    SublayerMemory,
    sublayer_memory_of,
)
from megatron_paradyse.strategies.attention_allocations import (
    block_of,
    qk_backward,
    qk_forward,
    ring_backward_memory,
    ring_forward_memory,
)
from megatron_paradyse.strategies.base import AttentionContext, AttentionWeights, Strategy
from megatron_paradyse.strategies.common import add_bias, heads_first, local_positions, split_qkv
from megatron_paradyse.strategies.dims import Dims, ring_hops
from megatron_paradyse.strategies.linear_allocations import (
    add_bias_memory,
    bias_grad,
    gather_ahead,
    gather_mlp_weight_ahead,
    mlp_weight_handed_on,
    zero3_backward,
    zero3_forward,
)
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.terms import (
    Gemm,
    SublayerTerms,
    gathered_weight,
    mlp_weight_gathered_ahead,
    qk_norm_bytes,
    ring_stage,
)

__all__ = ["ring_attention", "ring_attention_backward", "ring_attention_forward"]


def ring_attention_forward(
    q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, group: ProcessGroup, kernel: AttentionKernel, scale: float
) -> tuple[Tensor, Tensor]:
    """``q [b, nq, s/p, d]``, ``k``/``v`` ``[b, nkv, s/p, d]`` (local tokens) -> ``out [b, nq, s/p, d]`` in
    ``q``'s dtype and ``lse [b, nq, s/p]`` in ``accumulation_dtype(q.dtype)``.

    No autograd; every rank of ``group`` must call it together.
    """
    rank, p = group.rank(), group.size()
    comm = RingComm(group) if p > 1 else None
    kv = torch.stack((k, v))  # [2, b, nkv, s/p, d]: one message per hop
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros(q.shape, dtype=acc)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=acc)
    for hop in range(p):
        if hop + 1 < p:
            kv_next = comm.send_recv(kv)
        accumulate_block(q, kv[0], kv[1], layout.ring_segments(rank, (rank - hop) % p), scale, kernel, out, lse)
        if hop + 1 < p:
            comm.wait()
            kv = kv_next
    return out.to(q.dtype), lse


def ring_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    layout: SequenceLayout,
    group: ProcessGroup,
    kernel: AttentionKernel,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` of the local blocks, given the forward's ``out`` and ``lse``. No autograd.

    ``dq`` and each block's travelling ``(dk, dv)`` accumulator are summed in the accumulation dtype:
    no half-precision sums across hops or ranks."""
    rank, p = group.rank(), group.size()
    kv_comm = RingComm(group) if p > 1 else None
    dkv_comm = RingComm(group) if p > 1 else None
    kv = torch.stack((k, v))
    acc = accumulation_dtype(q.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    dkv_in = None
    for hop in range(p):
        src = (rank - hop) % p
        if hop + 1 < p:
            kv_next = kv_comm.send_recv(kv)
        dkv = torch.zeros_like(kv, dtype=acc)  # this hop's gradient of src's block
        segments = layout.ring_segments(rank, src)
        accumulate_block_grads(dout, q, kv[0], kv[1], out, lse, segments, scale, kernel, (dq, dkv[0], dkv[1]))
        if dkv_in is not None:
            dkv_comm.wait()
            dkv += dkv_in  # what the ranks before us added to src's block
        if p == 1:
            dkv_in = dkv
            break
        # Pass src's accumulator on; receive the one of the block we hold next.
        dkv_in = dkv_comm.send_recv(dkv)
        if hop + 1 < p:
            kv_comm.wait()
            kv = kv_next
    if p > 1:
        dkv_comm.wait()  # after p hops our own block's accumulator is back, complete
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Autograd wrapper of :func:`ring_attention_forward` / :func:`ring_attention_backward`."""

    @staticmethod
    def forward(ctx, q, k, v, layout: SequenceLayout, group: ProcessGroup, kernel: AttentionKernel, scale: float):
        out, lse = kept_core(lambda: ring_attention_forward(q, k, v, layout, group, kernel, scale))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.group, ctx.kernel, ctx.scale = layout, group, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = ring_attention_backward(dout, *ctx.saved_tensors, ctx.layout, ctx.group, ctx.kernel, ctx.scale)
        return *grads, None, None, None, None


def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: SequenceLayout, group: ProcessGroup, kernel: AttentionKernel, scale: float
) -> Tensor:
    """Exact attention of the local queries over the whole sequence's keys, block by block around the ring."""
    return _RingAttention.apply(q, k, v, layout, group, kernel, scale)


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    group, shards, layout = ctx.group, ctx.weights_over, ctx.layout
    s_local, b, _ = x_local.shape
    gathers = Zero3Gathers([(w.qkv, 0), (w.proj, 1)], shards, chained=False)
    qkv = zero3_linear(x_local, w.qkv, w.qkv_bias, shards, dim=0, gathers=gathers, index=0)
    q, k, v = split_qkv(qkv, ctx.shape)  # all heads, local tokens
    if ctx.qk_transform is not None:
        q, k = ctx.qk_transform(q, k, local_positions(ctx, q.device))
    gathers.start(1)  # the projection's weight travels while the ring computes
    ctx.start_mlp_gather()  # and the MLP's first weight (where the layer gathers it ahead)
    out = ring_attention(heads_first(q), heads_first(k), heads_first(v), layout, group, ctx.kernel, ctx.softmax_scale)
    gathers.start_when_gradient_reaches(out, 0)  # backward: the QKV weight travels while the ring runs
    core = out.permute(2, 0, 1, 3).reshape(s_local, b, -1)  # [s/p, b, np*hn]
    return add_bias(zero3_linear(core, w.proj, None, shards, dim=1, gathers=gathers, index=1), w.proj_bias)


# -- what it costs: time terms (priced by cost.analytic) and memory (composed by cost.layer_memory) --
def attention_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The output projection's weight (and the MLP's first, where the layer gathers it ahead) gathered
    while the ring runs, the QKV projection's while the ring's backward runs: streamed beside their
    pass, as the projections' backward collectives are."""
    t, b, e, p = d.t, d.b, d.e, d.p
    qkv_fwd, qkv_bwd = gathered_weight(d.qkv * d.h * e, d)
    proj_fwd, proj_bwd = gathered_weight(d.h * d.a * e, d)
    ring = ring_stage(layout, rank, d, d.nq, d.ng)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.qkv, d.h), Gemm(t * b, d.h, d.a)),
        rings=(ring,),
        fwd_comm=qkv_fwd,
        fwd_streamed=(*proj_fwd, *mlp_weight_gathered_ahead(d)),
        bwd_streamed=(*proj_bwd, *qkv_bwd),
        # per hop: the block's partial output and lse merged into the running ones
        elementwise_bytes=p * 8 * t * b * d.a * d.acc + 4 * t * b * d.a * e + 2 * ring.send.nbytes + qk_norm_bytes(d),
    )


def attention_memory(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    blocks = tuple(map(block_of, ring_hops(layout, rank)))
    plain = dataclasses.replace(d, core_kept=False) if d.core_kept else d  # the ring's own: the same
    return _memory_around_ring(
        d, ring_forward_memory(plain, blocks, d.nq, d.ng), ring_backward_memory(plain, blocks, d.nq, d.ng)
    )


@functools.lru_cache(maxsize=MEMO_SIZE)
def _memory_around_ring(d: Dims, ring_forward: Call, ring_backward: Call) -> SublayerMemory:
    """``ring`` attention's memory around the rank's ring forward and backward (which ranks often
    share: memoised): the projections' ZeRO-3 gathers (the output projection's while the ring runs, in
    backward the QKV projection's), q's copy, RoPE on the local tokens, the output permuted."""
    e = d.e
    w_qkv, w_proj, qkv_bias = d.qkv * d.h * e, d.h * d.a * e, d.qkv * e if d.bias else 0.0
    qkv_local, core_local = d.t * d.b * d.qkv * e, d.t * d.b * d.a * e

    fwd = Allocations(x_local=d.x)
    zero3_forward(fwd, d, "qkv", "qkv_local", qkv_local, w_qkv, bias=qkv_bias)
    qk = qk_forward(fwd, d, d.t, d.nq, d.ng, "qkv_local")
    gather_ahead(fwd, d, "proj", w_proj)  # while the ring runs
    gather_mlp_weight_ahead(fwd, d)
    if d.core_kept:  # the ring's output and log-sum-exp, taken back: no hop runs
        fwd.kept(**dict(ring_forward.leaves))
    else:
        fwd.call(ring_forward)
    fwd.alloc(core=core_local)  # [s/p, b, nq hn]: the output permuted
    zero3_forward(fwd, d, "proj", "proj_out", d.x, w_proj, row=True, gathered=True)
    add_bias_memory(fwd, d, "proj_out")
    handed_on = mlp_weight_handed_on(fwd, d)
    # v (and q, k untransformed) are views of the projection
    saved = fwd.returns("y_local", "x_local", "qkv_local", *qk.transformed, *qk.kept, "out", "lse", "core")

    bwd = Allocations(dy_local=0.0, **saved)
    bias_grad(bwd, d, d.bias)
    zero3_backward(bwd, d, "proj", "d_core", core_local, w_proj, row=True, release=("core",), uses_output_gradient=True)
    gather_ahead(bwd, d, "qkv", w_qkv)  # once the ring output's gradient (a view of d_core) is there
    bwd.call(ring_backward)
    bwd.free("d_core", *(() if qk.norms_keep_qkv else ("qkv_local",)), *qk.transformed, "out", "lse")
    grads = [name for name, _ in ring_backward.leaves]
    # for full precision dk is a view of the arrived accumulator
    dq, dk = qk_backward(bwd, d, d.t, d.nq, d.ng, qk, "dq", "dk" if d.half else None)
    if d.qk_transformed:  # the ring's dq (and a half-precision dk) died in the transform's backward
        grads = [name for name in grads if name not in ("dq", "dk")] + [dq, dk]
    bwd.alloc(d_qkv_local=qkv_local)  # split's backward: one tensor
    bwd.free(*grads)
    release = ("d_qkv_local", "x_local")
    zero3_backward(bwd, d, "qkv", "dx_local", d.x, w_qkv, bias=qkv_bias, release=release, gathered=True)
    return sublayer_memory_of(fwd.peak, bwd, saved, handed_on=handed_on, kept_core=fwd.kept_bytes)


register(
    Strategy(
        name="ring",
        sublayer="attention",
        forward=attention,
        depends_on_rank=True,
        terms=attention_terms,
        memory=attention_memory,
        starts_mlp_gather=True,
        runs_on_subgroup=True,
        summary="ring CP + ZeRO-3: p-1 K/V hops overlapped with compute; all heads on s/p tokens; weights gathered",
    )
)
