"""``lean``: METP-style memory-first attention and MLP that never materialise a full weight.

Attention. Head group ``j`` is the set of heads of Megatron TP shard ``j``. For ``j = 0..p-1``, in the
same order on every rank, shard ``j`` (its ``linear_qkv`` rows and bias, its ``linear_proj`` columns)
is broadcast from its owner, the next one in flight while this one is used (two resident; see
:func:`~megatron_paradyse.strategies.streaming.broadcast_shards`). Each rank projects its own
``s/p`` tokens to group ``j``'s q/k/v, applies ``qk_transform`` at their global positions, runs
ring attention for that group only and accumulates ``y_local += core_j proj_j^T``; the replicated
projection bias is added once. Kept for backward: the input, and per group its attention output and
log-sum-exp. Backward streams the shards again, recomputes group ``j``'s q/k/v, runs the ring
backward for that group, and reduces the shard's gradient to its owner.

MLP. Token-local, so the shards simply circulate: at hop ``t`` rank ``r`` holds shard
``(r - t) mod p`` and computes ``y += act(x fc1_j^T + b1_j) fc2_j^T`` (gated: Megatron's
``[gate_j | up_j]`` shard layout); at most ``[s/p, b, ffn/p]`` of intermediate exists at a time.
Kept for backward: the input only. Backward streams again, recomputes the intermediate, and each
shard's gradient accumulator travels with it back to its owner.

Communication is ``p`` broadcasts (attention) or ``p - 1`` hops (MLP) of one shard, plus ``p``
K/V rings of ``1/p`` of the heads: more, smaller messages than any other strategy.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.attention.kept import kept_core
from megatron_paradyse.core.comm import linear_over_rows
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.strategies.allocations import (
    MEMO_SIZE,
    Allocations,
    Call,
    Iteration,
    Loop,
    State,
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
from megatron_paradyse.strategies.base import AttentionContext, AttentionWeights, MLPContext, MLPWeights, Strategy
from megatron_paradyse.strategies.common import activate, add_bias, heads_first, local_positions, split_qkv
from megatron_paradyse.strategies.dims import Dims, ring_hops
from megatron_paradyse.strategies.linear_allocations import (
    add_bias_memory,
    bias_grad,
)
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.ring import ring_attention_backward, ring_attention_forward
from megatron_paradyse.strategies.streaming import broadcast_shards, ring_shards
from megatron_paradyse.strategies.terms import (
    Collective,
    Gemm,
    SublayerTerms,
    qk_norm_bytes,
    ring_stage,
)

__all__ = ["attention", "mlp"]


def _group_heads(qkv: Tensor, ctx: AttentionContext, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One head group's ``[s/p, b, ng/p*(np/ng + 2)*hn]`` projection -> q, k, v ``[b, n, s/p, hn]``."""
    q, k, v = split_qkv(qkv, ctx.shape)
    if ctx.qk_transform is not None:
        q, k = ctx.qk_transform(q, k, positions)
    return heads_first(q), heads_first(k), heads_first(v)


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b``, where the gradient accumulator ``acc`` may be of higher precision than ``a``,
    ``b`` (the CPU has no mixed-precision ``addmm``: the product is then made first)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _tokens_first(out: Tensor) -> Tensor:
    """``[b, n, s/p, hn] -> [s/p * b, n * hn]``: attention output as rows of the projection's input."""
    b, n, s_local, hn = out.shape
    return out.permute(2, 0, 1, 3).reshape(s_local * b, n * hn)


class _LeanAttention(torch.autograd.Function):
    """``x_local [s/p, b, h]`` and this rank's shards -> ``y_local [s/p, b, h]`` without the proj bias.

    Per head group ``j`` (``T = s/p * b`` local token rows, ``core_j [T, np/p*hn]``):
        forward:  y = sum_j core_j proj_j^T,  core_j = ring_attention(q_j, k_j, v_j)
        backward: dproj_j = dy^T core_j,  dcore_j = dy proj_j,  (dq_j, dk_j, dv_j) = ring backward,
                  dqkv_j = d(split + qk_transform)^T, dqkv_w_j = dqkv_j^T x,  dx = sum_j dqkv_j qkv_w_j
    ``dqkv_w_j``/``dproj_j`` are summed over ranks onto shard ``j``'s owner.
    """

    @staticmethod
    def forward(ctx, x_local: Tensor, qkv_w: Tensor, proj_w: Tensor, qkv_b: Tensor | None, actx: AttentionContext):
        group, layout = actx.group, actx.layout
        s_local, b, h = x_local.shape
        positions = local_positions(actx, x_local.device)
        y = x_local.new_zeros(s_local * b, h)
        outs, lses = [], []

        def core(w_qkv: Tensor, b_qkv: Tensor | None) -> tuple[Tensor, Tensor]:
            q, k, v = _group_heads(linear_over_rows(x_local, w_qkv, b_qkv), actx, positions)
            return ring_attention_forward(q, k, v, layout, group, actx.kernel, actx.softmax_scale)

        def hop(j: int, shard, _grad) -> None:
            w_qkv, w_proj, b_qkv = shard
            out, lse = kept_core(lambda: core(w_qkv, b_qkv))  # a kept core's rerun needs no q, k, v
            outs.append(out)
            lses.append(lse)
            y.addmm_(_tokens_first(out), w_proj.t())

        broadcast_shards((qkv_w, proj_w, qkv_b), group, hop)
        ctx.save_for_backward(x_local, qkv_w, proj_w, qkv_b, *outs, *lses)
        ctx.actx = actx
        return y.view(s_local, b, h)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_local, qkv_w, proj_w, qkv_b, *kept = ctx.saved_tensors
        actx = ctx.actx
        group, layout = actx.group, actx.layout
        p = group.size()
        outs, lses = kept[:p], kept[p:]
        s_local, b, h = x_local.shape
        x2, dy2 = x_local.reshape(-1, h), dy.reshape(-1, h)
        dx2 = torch.zeros_like(x2)
        positions = local_positions(actx, x_local.device)

        def hop(j: int, shard, grad) -> None:
            w_qkv, w_proj, b_qkv = shard
            g_qkv, g_proj, g_bias = grad
            out = outs[j]
            _add_matmul(g_proj, dy2.t(), _tokens_first(out))
            dout = (dy2 @ w_proj).view(s_local, b, out.shape[1], -1)  # [s/p, b, np/p, hn]
            # Recompute this group's q/k/v; autograd differentiates split + qk_transform (whose own
            # parameters, e.g. q/k norm weights, get their gradient accumulated directly).
            qkv = linear_over_rows(x_local, w_qkv, b_qkv).requires_grad_()
            with torch.enable_grad():
                q, k, v = _group_heads(qkv, actx, positions)
            dq, dk, dv = ring_attention_backward(
                heads_first(dout), q, k, v, out, lses[j], layout, group, actx.kernel, actx.softmax_scale
            )
            torch.autograd.backward((q, k, v), (dq, dk, dv))
            dqkv2 = qkv.grad.reshape(s_local * b, -1)
            _add_matmul(g_qkv, dqkv2.t(), x2)
            if g_bias is not None:
                g_bias.add_(dqkv2.sum(0, dtype=g_bias.dtype))
            dx2.addmm_(dqkv2, w_qkv)

        dqkv_w, dproj_w, dqkv_b = broadcast_shards((qkv_w, proj_w, qkv_b), group, hop, grads=True)
        return dx2.view_as(x_local), dqkv_w, dproj_w, dqkv_b, None


class _LeanMLP(torch.autograd.Function):
    """``x_local [s/p, b, h]`` and this rank's shards -> ``y_local [s/p, b, h]`` without the fc2 bias.

    Per shard ``j`` (``a_j = x fc1_j^T + b1_j``, ``m_j = act(a_j)`` ``[T, ffn/p]``):
        forward:  y = sum_j m_j fc2_j^T
        backward: dfc2_j = dy^T m_j,  da_j = act'(a_j) * (dy fc2_j),  dfc1_j = da_j^T x,
                  db1_j = sum_T da_j,  dx = sum_j da_j fc1_j
    ``a_j``/``m_j`` are recomputed; the shard gradients are summed over ranks as they travel home.
    """

    @staticmethod
    def forward(ctx, x_local: Tensor, fc1_w: Tensor, fc2_w: Tensor, fc1_b: Tensor | None, mctx: MLPContext):
        s_local, b, h = x_local.shape
        x2 = x_local.reshape(-1, h)
        y = x2.new_zeros(s_local * b, h)

        def hop(j: int, shard, _grad) -> None:
            w1, w2, b1 = shard
            y.addmm_(activate(F.linear(x2, w1, b1), mctx.shape, mctx.activation, blocks=1), w2.t())

        ring_shards((fc1_w, fc2_w, fc1_b), mctx.group, hop)
        ctx.save_for_backward(x_local, fc1_w, fc2_w, fc1_b)
        ctx.mctx = mctx
        return y.view(s_local, b, h)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x_local, fc1_w, fc2_w, fc1_b = ctx.saved_tensors
        mctx = ctx.mctx
        h = x_local.shape[-1]
        x2, dy2 = x_local.reshape(-1, h), dy.reshape(-1, h)
        dx2 = torch.zeros_like(x2)

        def hop(j: int, shard, grad) -> None:
            w1, w2, b1 = shard
            g1, g2, g_b1 = grad
            pre = F.linear(x2, w1, b1).requires_grad_()  # [T, ffn/p] (gated: [T, 2*ffn/p])
            with torch.enable_grad():
                act = activate(pre, mctx.shape, mctx.activation, blocks=1)  # [T, ffn/p]
            _add_matmul(g2, dy2.t(), act.detach())
            (dpre,) = torch.autograd.grad(act, pre, dy2 @ w2)
            del act
            _add_matmul(g1, dpre.t(), x2)
            if g_b1 is not None:
                g_b1.add_(dpre.sum(0, dtype=g_b1.dtype))
            dx2.addmm_(dpre, w1)

        dfc1_w, dfc2_w, dfc1_b = ring_shards((fc1_w, fc2_w, fc1_b), mctx.group, hop, grads=True)
        return dx2.view_as(x_local), dfc1_w, dfc2_w, dfc1_b, None


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    return add_bias(_LeanAttention.apply(x_local, w.qkv, w.proj, w.qkv_bias, ctx), w.proj_bias)


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    return add_bias(_LeanMLP.apply(x_local, w.fc1, w.fc2, w.fc1_bias, ctx), w.fc2_bias)


# -- what it costs: time terms (priced by cost.analytic) and memory (composed by cost.layer_memory) --
def attention_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """Head group ``j``: its shard broadcast by rank ``j`` (the next one in flight), its q/k/v
    projected, ring attention, ``y += core_j proj_j^T``; backward broadcasts again, recomputes q/k/v,
    runs the ring backward and reduces the shard's gradient (accumulation dtype) to its owner while
    the next group runs."""
    t, b, e, p = d.t, d.b, d.e, d.p
    qkv_rows = d.qkv // p
    shard = (qkv_rows * d.h + d.h * d.a // p + (qkv_rows if d.bias else 0)) * e
    ring = ring_stage(layout, rank, d, d.nq // p, d.ng // p)
    # the first shard's broadcast (and the last gradient's reduce) are waited for; the others run
    # while a group computes
    broadcast, reduce = Collective("broadcast", shard), Collective("reduce", shard // e * d.acc)
    return SublayerTerms(
        gemms=(Gemm(t * b, qkv_rows, d.h), Gemm(t * b, d.h, d.a // p)) * p,
        recompute_gemms=(Gemm(t * b, qkv_rows, d.h),) * p,
        core_gemms=(Gemm(t * b, qkv_rows, d.h),) * p,
        rings=(ring,) * p,
        fwd_comm=(broadcast,) if p > 1 else (),
        fwd_streamed=(broadcast,) * (p - 1),
        bwd_comm=(broadcast, reduce) if p > 1 else (),
        bwd_streamed=(broadcast, reduce) * (p - 1),
        # per group and hop a merge, the output copied to rows, the shard packed
        elementwise_bytes=p * 8 * t * b * d.a * d.acc + 2 * t * b * d.a * e + 2 * shard + qk_norm_bytes(d),
    )


def mlp_terms(d: Dims, layout: SequenceLayout, rank: int) -> SublayerTerms:
    """The fc1/fc2 shards circulate (at hop ``i`` rank ``r`` holds shard ``r - i``, the next one
    arriving): ``y += act(x fc1_j^T + b1_j) fc2_j^T``; backward circulates them again, recomputes the
    intermediate, and each shard's gradient accumulator travels with it back to its owner."""
    t, b, e, p = d.t, d.b, d.e, d.p
    shard = (d.f1 // p * d.h + d.h * d.f // p + (d.f1 // p if d.bias else 0)) * e
    send, grad_send = Collective("send_recv", shard), Collective("send_recv", shard // e * d.acc)
    return SublayerTerms(
        gemms=(Gemm(t * b, d.f1 // p, d.h), Gemm(t * b, d.h, d.f // p)) * p,
        recompute_gemms=(Gemm(t * b, d.f1 // p, d.h),) * p,
        fwd_streamed=(send,) * (p - 1),
        # the shards' hops and the accumulators' but the last, waited for at the end
        bwd_comm=(grad_send,) if p > 1 else (),
        bwd_streamed=(send,) * (p - 1) + (grad_send,) * (p - 1),
        elementwise_bytes=3 * t * b * d.f1 * e + 2 * shard,
    )


def _add_matmul_memory(m: Allocations, d: Dims, nbytes: float) -> None:
    """``lean``'s ``_add_matmul_memory`` into a gradient accumulator: in place for full precision; for half
    precision the product, of ``nbytes`` in the activations' dtype, is made first."""
    if d.half:
        m.temporary(product=nbytes)


def _attention_sizes(d: Dims) -> tuple[int, int, int]:
    """``lean`` attention's shard message (qkv rows, proj columns, qkv bias), one group's QKV
    projection and core output."""
    heads, qkv_rows = d.nq // d.p, d.qkv // d.p
    shard = (qkv_rows * d.h + d.h * d.a // d.p + (qkv_rows if d.bias else 0)) * d.e
    return shard, d.t * d.b * qkv_rows * d.e, d.t * d.b * heads * d.hn * d.e


def attention_memory(d: Dims, layout: SequenceLayout, rank: int) -> SublayerMemory:
    """Head group ``j`` (``nq/p`` heads, ``ng/p`` groups): its shard broadcast by rank ``j`` (the next
    one in flight), its q/k/v projected, ring attention, ``y += core_j proj_j^T``; backward
    broadcasts again, recomputes q/k/v, runs the ring backward and reduces the shard's gradient (in
    the accumulation dtype) to its owner while the next group runs."""
    heads, kv_heads = d.nq // d.p, d.ng // d.p
    shard = _attention_sizes(d)[0]
    blocks = tuple(map(block_of, ring_hops(layout, rank)))
    plain = dataclasses.replace(d, core_kept=False) if d.core_kept else d  # the rings and backward: the same
    ring_forward = ring_forward_memory(plain, blocks, heads, kv_heads)
    fwd_peak, kept, kept_core = _attention_forward_memory(d, ring_forward)
    saved = dict(kept)
    ring_backward = ring_backward_memory(plain, blocks, heads, kv_heads)
    start = Allocations(dy_local=0.0, saved=sum(saved.values()))
    bias_grad(start, d, d.bias)
    start.alloc(dx_local=d.x, shard=shard)  # dx accumulates group by group
    loop = Loop(start)
    for j in range(d.p):
        loop.add(_attention_backward_group_memory(plain, ring_backward, loop.state, last=j + 1 == d.p, own=j == rank))
    bwd = loop.end()
    bwd.free("shard_prev", *(("reducing",) if "reducing" in bwd.sizes else ()))
    if d.half:  # the complete gradient rounded to the shard's dtype
        bwd.alloc(own_cast=shard)
        bwd.free("own")
        bwd.rename(own_cast="own")
    # the function's backward returns, the one node of its backward; the shard gradient is accumulated
    bwd.output_gradient_used()
    bwd.free("saved", "own")
    return sublayer_memory_of(fwd_peak, bwd, saved, kept_core=kept_core)


@functools.lru_cache(maxsize=MEMO_SIZE)
def _attention_forward_memory(d: Dims, ring_forward: Call) -> tuple[float, State, float]:
    """``lean`` attention's forward: its high-water mark, what it saves (each group's ring output and
    log-sum-exp) and the bytes of those it takes back (:attr:`Dims.core_kept`: no group's q/k/v is
    projected, no ring runs). It depends on the rank only through ``ring_forward`` (the same for
    every group), which ranks often share: memoised."""
    shard, qkv_group, core_group = _attention_sizes(d)
    p = d.p
    fwd = Allocations(x_local=d.x)
    fwd.alloc(y_sum=d.x, shard0=shard)
    for j in range(p):
        if j:
            fwd.free(f"shard{j - 1}")
        if j + 1 < p:
            fwd.alloc(**{f"shard{j + 1}": shard})
        if d.core_kept:
            fwd.kept(**{f"g{j}_{name}": nbytes for name, nbytes in ring_forward.leaves})
        else:
            fwd.alloc(qkv=qkv_group)
            qk = qk_forward(fwd, d, d.t, d.nq // p, d.ng // p, "qkv", grad=False)  # no autograd inside
            fwd.call(ring_forward, prefix=f"g{j}_")
            fwd.free("qkv", *qk.transformed)  # when the group's core returns
        fwd.temporary(core_rows=core_group)  # the output as [t b, heads hn] for y.addmm_
    fwd.free(f"shard{p - 1}")
    add_bias_memory(fwd, d, "y_sum")
    saved = fwd.returns("y_local", "x_local", *(f"g{j}_{name}" for j in range(p) for name, _ in ring_forward.leaves))
    return fwd.peak, tuple(saved.items()), fwd.kept_bytes


@functools.lru_cache(maxsize=MEMO_SIZE)
def _attention_backward_group_memory(d: Dims, ring_backward: Call, state: State, *, last: bool, own: bool) -> Iteration:
    """Head group ``j`` of ``lean`` attention's backward from ``state`` (what the forward saved, as
    one, the input gradient, the previous group's shard ``shard_prev`` and this one's ``shard``, the
    gradient still being reduced and the rank's ``own``): the next shard arrives, the group's
    gradient accumulator is made, the proj gradient added, q/k/v recomputed, the ring backward, the
    qkv gradients added; the previous gradient's reduce completes (not the rank's own, kept until
    the end) and this one's begins. ``own``: the group is the rank's."""
    shard, qkv_group, core_group = _attention_sizes(d)
    p = d.p
    qkv_rows = d.qkv // p
    m = Allocations(**dict(state))
    if "shard_prev" in m.sizes:
        m.free("shard_prev")
    if not last:
        m.alloc(shard_next=shard)
    m.alloc(grad=shard // d.e * d.acc)
    m.alloc(core_rows=core_group)  # for the proj gradient
    _add_matmul_memory(m, d, d.h * d.a // p * d.e)
    m.free("core_rows")
    m.alloc(dout=core_group, qkv=qkv_group)  # dy proj_j, the recomputed projection
    heads, kv_heads = d.nq // p, d.ng // p
    qk = qk_forward(m, d, d.t, heads, kv_heads, "qkv")  # recomputed with autograd
    m.call(ring_backward)
    # autograd.backward through the transform (the ring's gradients stay the group's)
    through = qk_backward(m, d, d.t, heads, kv_heads, qk, None, None, caller_holds_qkv=True)
    m.alloc(d_qkv=qkv_group)  # qkv.grad, through split
    m.free(*(name for name in through if name))
    _add_matmul_memory(m, d, qkv_rows * d.h * d.e)
    if d.bias:
        m.temporary(bias_sum=qkv_rows * d.acc)
    m.free("dout", "qkv", *qk.transformed, *(n for n, _ in ring_backward.leaves), "d_qkv")
    if "reducing" in m.sizes:
        m.free("reducing")  # its reduce is complete
    m.rename(grad="own" if own else "reducing", shard="shard_prev")
    if not last:
        m.rename(shard_next="shard")
    return Iteration(m.peak, m.state())


register(
    Strategy(
        name="lean",
        sublayer="attention",
        forward=attention,
        qk_norm_grads_in_parts="once per head group",
        depends_on_rank=True,
        terms=attention_terms,
        memory=attention_memory,
        summary="METP: qkv/proj shards broadcast one head group at a time (2 resident), a K/V ring per group; "
        "keeps input + per-group output/LSE",
    )
)
register(
    Strategy(
        name="lean",
        sublayer="mlp",
        forward=mlp,
        terms=mlp_terms,
        summary="METP: fc1/fc2 shards circulate the ring (2 resident), [s/p,b,ffn/p] at a time; keeps only the input",
    )
)
