"""Pieces shared by several strategies: the QKV split, full-sequence attention, the MLP activation."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.attention import segment_attention
from megatron_paradyse.strategies.base import AttentionContext, ModelShape

__all__ = [
    "activate",
    "add_bias",
    "attend_full_sequence",
    "gated_activation_problem",
    "heads_first",
    "local_positions",
    "split_qkv",
]


def split_qkv(mixed: Tensor, shape: ModelShape) -> tuple[Tensor, Tensor, Tensor]:
    """``[s, b, g*(np/ng + 2)*hn]`` (Megatron's per-group interleave, any number of groups ``g``) ->
    ``q [s, b, g*np/ng, hn]``, ``k``/``v`` ``[s, b, g, hn]``."""
    hn, per_group = shape.kv_channels, shape.heads_per_group
    s, b, width = mixed.shape
    groups = width // ((per_group + 2) * hn)
    mixed = mixed.view(s, b, groups, (per_group + 2) * hn)
    q, k, v = torch.split(mixed, [per_group * hn, hn, hn], dim=3)
    return q.reshape(s, b, groups * per_group, hn), k, v


def heads_first(t: Tensor) -> Tensor:
    """``[s, b, n, d] -> [b, n, s, d]`` (a view)."""
    return t.permute(1, 2, 0, 3)


def attend_full_sequence(qkv_full: Tensor, ctx: AttentionContext) -> Tensor:
    """Attention of whole sequences on this rank's heads.

    ``qkv_full`` is ``[s, b, g*(np/ng + 2)*hn]`` in canonical order; the result is ``[s, b, nq*hn]`` in
    canonical order. Tokens are put in natural order first so each document is one dense block.
    """
    layout = ctx.layout
    indices = layout.indices(qkv_full.device)
    q, k, v = split_qkv(qkv_full, ctx.shape)
    if ctx.qk_transform is not None:
        q, k = ctx.qk_transform(q, k, indices.position_ids)
    # Natural order, and q, k, v dense [s, b, n, d] (views of the projection copied): only so can cuDNN's
    # attention build one graph for all lengths up to a power of two (attention.kernels.CUDNN_LENGTH_BUCKETS),
    # and a copied v lets the projection's output die where q and k are made anew.
    if layout.is_identity:
        q, k, v = (t.contiguous() for t in (q, k, v))
    else:
        q, k, v = (t.index_select(0, indices.canonical_index) for t in (q, k, v))
    out = segment_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        layout.full_segments(),
        ctx.softmax_scale,
        ctx.kernel,
        indices.cu_seqlens,
        layout.causal_tail_padding,
    )
    out = out.permute(2, 0, 1, 3)  # [s, b, nq, hn], natural order
    if not layout.is_identity:
        out = out.index_select(0, indices.natural_positions)
    return out.reshape(out.shape[0], out.shape[1], -1)


def local_positions(ctx: AttentionContext, device: torch.device) -> Tensor:
    """Rotary positions of this rank's tokens ``[s/p]`` (a view of the layout's device copy)."""
    layout = ctx.layout
    return layout.indices(device).position_ids[layout.local_slice(ctx.group.rank())]


def activate(h: Tensor, shape: ModelShape, activation, blocks: int) -> Tensor:
    """Apply the MLP activation to ``linear_fc1`` output made of ``blocks`` TP shards.

    Megatron's gated shard is ``[gate | up]`` per rank, so a gathered ``fc1`` output is
    ``[gate_0 | up_0 | gate_1 | up_1 | ...]``; the result is ``[..., blocks * ffn/p]`` in rank order.
    """
    if not shape.gated_mlp:
        return activation(h)
    if (problem := gated_activation_problem(activation)) is not None:
        raise ValueError(problem)
    return _GatedActivation.apply(h, activation, blocks)


def gated_activation_problem(activation) -> str | None:
    """Why ``activation`` cannot gate an MLP here (None: it can)."""
    if _activation_operators(activation) is not None:
        return None
    return (
        f"a gated MLP with activation {getattr(activation, '__name__', activation)!r}: the gated MLPs run torch's "
        f"silu (SwiGLU) or gelu, exact or tanh (GEGLU), whose gradient they compute in place"
    )


def _activation_operators(activation) -> tuple[Callable, Callable] | None:
    """``activation``'s operators that write into a given tensor, ``(forward(x, out), backward(grad, x))``
    (the backward in place of ``grad``), for torch's silu and gelu; None for another."""
    aten = torch.ops.aten
    if activation is F.silu:
        return (
            lambda x, out: aten.silu.out(x, out=out),
            lambda grad, x: aten.silu_backward.grad_input(grad, x, grad_input=grad),
        )
    gelu = activation is F.gelu or (
        isinstance(activation, functools.partial)
        and activation.func is F.gelu
        and not activation.args
        and set(activation.keywords) <= {"approximate"}
    )
    if not gelu:
        return None
    approximate = getattr(activation, "keywords", {}).get("approximate", "none")
    return (
        lambda x, out: aten.gelu.out(x, approximate=approximate, out=out),
        lambda grad, x: aten.gelu_backward.grad_input(grad, x, approximate=approximate, grad_input=grad),
    )


def _gate_and_up(h: Tensor, blocks: int) -> tuple[Tensor, Tensor]:
    """The gate and up halves of every shard of ``h``, as views ``[..., blocks, ffn/p]``."""
    gate, up = h.unflatten(-1, (blocks, 2, -1)).unbind(-2)
    return gate, up


class _GatedActivation(torch.autograd.Function):
    """``activation(gate) * up``, keeping only its input for backward and computing ``activation(gate)``
    again there, as Megatron's fused SwiGLU does: autograd would keep ``activation(gate)`` too, one more
    ``[..., ffn]`` a layer from forward to backward. The backward writes both halves' gradients straight
    into the input's gradient, which is all it allocates. The gradients are autograd's, to the bit (the
    same operators on the same values)."""

    @staticmethod
    def forward(ctx, h: Tensor, activation, blocks: int) -> Tensor:
        gate, up = _gate_and_up(h, blocks)
        ctx.save_for_backward(h)
        ctx.activation, ctx.blocks = activation, blocks
        return (activation(gate) * up).flatten(-2)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (h,) = ctx.saved_tensors
        forward_into, backward_in_place = _activation_operators(ctx.activation)
        gate, up = _gate_and_up(h, ctx.blocks)
        dy = dy.unflatten(-1, (ctx.blocks, -1))
        dh = torch.empty_like(h)
        d_gate, d_up = _gate_and_up(dh, ctx.blocks)
        forward_into(gate, d_up)
        d_up.mul_(dy)
        torch.mul(dy, up, out=d_gate)  # the activation's output gradient, then its input's in its place
        backward_in_place(d_gate, gate)
        return dh, None, None


def add_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    return y if bias is None else y + bias
