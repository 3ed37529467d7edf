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

MLP. Token-local, so the shards simply circulate: at step ``t`` rank ``r`` holds shard
``(r - t) mod p`` and computes ``y += act(x fc1_j^T + b1_j) fc2_j^T`` (gated: Megatron's
``[gate_j | up_j]`` shard layout); at most ``[s/p, b, ffn/p]`` of intermediate exists at a time.
Kept for backward: the input only. Backward streams again, recomputes the intermediate, and each
shard's gradient accumulator travels with it back to its owner.

Communication is ``p`` broadcasts (attention) or ``p - 1`` hops (MLP) of one shard, plus ``p``
K/V rings of ``1/p`` of the heads: more, smaller messages than any other strategy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.core.comm import linear_over_rows
from megatron_paradyse.strategies.base import AttentionContext, AttentionWeights, MLPContext, MLPWeights, Strategy
from megatron_paradyse.strategies.common import activate, add_bias, heads_first, local_positions, split_qkv
from megatron_paradyse.strategies.registry import register
from megatron_paradyse.strategies.ring import ring_attention_backward, ring_attention_forward
from megatron_paradyse.strategies.streaming import broadcast_shards, ring_shards

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

        def step(j: int, shard, _grad) -> None:
            w_qkv, w_proj, b_qkv = shard
            q, k, v = _group_heads(linear_over_rows(x_local, w_qkv, b_qkv), actx, positions)
            out, lse = ring_attention_forward(q, k, v, layout, group, actx.kernel, actx.softmax_scale)
            outs.append(out)
            lses.append(lse)
            y.addmm_(_tokens_first(out), w_proj.t())

        broadcast_shards((qkv_w, proj_w, qkv_b), group, step)
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

        def step(j: int, shard, grad) -> None:
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

        dqkv_w, dproj_w, dqkv_b = broadcast_shards((qkv_w, proj_w, qkv_b), group, step, grads=True)
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

        def step(j: int, shard, _grad) -> None:
            w1, w2, b1 = shard
            y.addmm_(activate(F.linear(x2, w1, b1), mctx.shape, mctx.activation, blocks=1), w2.t())

        ring_shards((fc1_w, fc2_w, fc1_b), mctx.group, step)
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

        def step(j: int, shard, grad) -> None:
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

        dfc1_w, dfc2_w, dfc1_b = ring_shards((fc1_w, fc2_w, fc1_b), mctx.group, step, grads=True)
        return dx2.view_as(x_local), dfc1_w, dfc2_w, dfc1_b, None


def attention(x_local: Tensor, w: AttentionWeights, ctx: AttentionContext) -> Tensor:
    return add_bias(_LeanAttention.apply(x_local, w.qkv, w.proj, w.qkv_bias, ctx), w.proj_bias)


def mlp(x_local: Tensor, w: MLPWeights, ctx: MLPContext) -> Tensor:
    return add_bias(_LeanMLP.apply(x_local, w.fc1, w.fc2, w.fc1_bias, ctx), w.fc2_bias)


register(
    Strategy(
        name="lean",
        sublayer="attention",
        forward=attention,
        summary="METP: qkv/proj shards broadcast one head group at a time (2 resident), a K/V ring per group; "
        "keeps input + per-group output/LSE",
    )
)
register(
    Strategy(
        name="lean",
        sublayer="mlp",
        forward=mlp,
        summary="METP: fc1/fc2 shards circulate the ring (2 resident), [s/p,b,ffn/p] at a time; keeps only the input",
    )
)
