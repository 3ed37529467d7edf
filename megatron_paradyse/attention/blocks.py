"""Attention over the visible segments of a (query block, key block) pair, merged exactly.

A block pair is described by the :class:`~megatron_paradyse.layout.Segment` list the layout gives it
(causal diagonals, fully visible rectangles, documents of a packed sequence). Partial results are
merged by their log-sum-exp with a max shift, so no exponent overflows (the ``exp(lse)`` sum of the
reference implementation overflows fp32 once lse > 88). Rows no segment covers keep ``lse = -inf``
and a zero output, which later merges ignore.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_paradyse.attention.kernels import AttentionKernel, accumulation_dtype
from megatron_paradyse.layout import Segment

__all__ = ["merge_partial", "segment_attention", "segments_backward", "segments_forward"]


def merge_partial(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two softmax-normalised partial results over disjoint key sets (in ``out``'s dtype)."""
    new_lse = torch.logaddexp(lse, part_lse)
    shift = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    w_old = torch.exp(lse - shift).unsqueeze(-1)
    w_new = torch.exp(part_lse - shift).unsqueeze(-1)
    return out * w_old + part_out.to(out.dtype) * w_new, new_lse


def _covers_all(segments: Sequence[Segment], sq: int, sk: int) -> bool:
    return len(segments) == 1 and segments[0] == Segment(0, sq, 0, sk, segments[0].causal)


def segments_forward(
    q: Tensor, k: Tensor, v: Tensor, segments: Sequence[Segment], scale: float, kernel: AttentionKernel
) -> tuple[Tensor, Tensor]:
    """``(out [b, nq, sq, d], lse [b, nq, sq])`` of queries ``q`` over keys ``k``/``v``, in the
    accumulation dtype (no grad)."""
    b, nq, sq, d = q.shape
    acc = accumulation_dtype(q.dtype)
    if _covers_all(segments, sq, k.shape[2]):
        out, lse = kernel.forward(q, k, v, segments[0].causal, scale)
        return out.to(acc), lse.to(acc)
    out = q.new_zeros((b, nq, sq, d), dtype=acc)
    lse = q.new_full((b, nq, sq), float("-inf"), dtype=acc)
    for seg in segments:
        rows = slice(seg.q_start, seg.q_end)
        cols = slice(seg.k_start, seg.k_end)
        part_out, part_lse = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], seg.causal, scale)
        out[:, :, rows], lse[:, :, rows] = merge_partial(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
    return out, lse


def segments_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segments: Sequence[Segment],
    scale: float,
    kernel: AttentionKernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one key block, given the *final* ``out``/``lse`` of the queries (accumulation dtype)."""
    acc = accumulation_dtype(q.dtype)
    if _covers_all(segments, q.shape[2], k.shape[2]):
        grads = kernel.backward(dout, q, k, v, out, lse, segments[0].causal, scale)
        return tuple(g.to(acc) for g in grads)
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    for seg in segments:
        rows = slice(seg.q_start, seg.q_end)
        cols = slice(seg.k_start, seg.k_end)
        dq_s, dk_s, dv_s = kernel.backward(
            dout[:, :, rows],
            q[:, :, rows],
            k[:, :, cols],
            v[:, :, cols],
            out[:, :, rows],
            lse[:, :, rows].contiguous(),
            seg.causal,
            scale,
        )
        dq[:, :, rows] += dq_s
        dk[:, :, cols] += dk_s
        dv[:, :, cols] += dv_s
    return dq, dk, dv


class _SegmentAttention(torch.autograd.Function):
    """Attention of one block pair with the kernel's own backward (no ``[s, s]`` tensor is saved)."""

    @staticmethod
    def forward(ctx, q, k, v, segments, scale, kernel):
        out, lse = segments_forward(q, k, v, segments, scale, kernel)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale, ctx.kernel = segments, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = segments_backward(dout, q, k, v, out, lse, ctx.segments, ctx.scale, ctx.kernel)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def segment_attention(
    q: Tensor, k: Tensor, v: Tensor, segments: Sequence[Segment], scale: float, kernel: AttentionKernel
) -> Tensor:
    """Differentiable ``[b, nq, sq, d]`` attention output over the visible ``segments``."""
    return _SegmentAttention.apply(q, k, v, tuple(segments), scale, kernel)
