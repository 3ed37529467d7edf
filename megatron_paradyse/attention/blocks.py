"""Attention over the visible segments of a (query block, key block) pair.

A block pair is described by the :class:`~megatron_paradyse.layout.Segment` list the layout gives it
(causal diagonals, fully visible rectangles, documents of a packed sequence); every segment is one
kernel call. Two uses:

- :func:`segment_attention`: a whole sequence against itself (``tp_sp``, ``ulysses``). Its segments
  are one per document (padding is a document of its own), so every query row is in exactly one
  segment: results are written in place, in the inputs' dtype, and the gradients likewise.
- :func:`accumulate_block` / :func:`accumulate_block_grads`: one key block of ring attention. A query
  row may see several segments of a block, and several blocks: partial results are merged into
  running accumulators (fp32 for half precision) by their log-sum-exp with a max shift, in place, so
  no exponent overflows (the ``exp(lse)`` sum of the authors' code overflows fp32 once lse > 88) and
  no temporary larger than a log-sum-exp row is made. Rows no segment covers keep ``lse = -inf``
  and a zero output, which later merges ignore.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from megatron_paradyse.attention.kernels import AttentionKernel, accumulation_dtype
from megatron_paradyse.layout import Segment

__all__ = ["accumulate_block", "accumulate_block_grads", "merge_into", "segment_attention"]


def merge_into(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor) -> None:
    """``(out, lse) <-`` the softmax-normalised combination with ``(part_out, part_lse)``, over disjoint
    key sets, in place (``out``/``lse`` may be views; ``part_out`` may be of lower precision)."""
    new_lse = torch.logaddexp(lse, part_lse)
    # Rows that neither side covers have new_lse = -inf: shift them by a finite number so that both
    # weights are exp(-inf) = 0, not nan.
    shift = new_lse.clamp_min(torch.finfo(new_lse.dtype).min)
    w_old = lse.sub(shift).exp_().unsqueeze(-1)
    w_new = part_lse.sub(shift).exp_().unsqueeze(-1)
    out.mul_(w_old).addcmul_(part_out, w_new)
    lse.copy_(new_lse)


def accumulate_block(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segments: Sequence[Segment],
    scale: float,
    kernel: AttentionKernel,
    out: Tensor,
    lse: Tensor,
) -> None:
    """Merge the attention of ``q [b, nq, sq, d]`` over the visible segments of the key block ``k``/``v``
    ``[b, nkv, sk, d]`` into the running ``out [b, nq, sq, d]`` and ``lse [b, nq, sq]`` (in place)."""
    for seg in segments:
        rows, cols = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
        part_out, part_lse = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], seg.causal, scale)
        merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
        del part_out, part_lse  # freed before the next call allocates its own


def accumulate_block_grads(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    segments: Sequence[Segment],
    scale: float,
    kernel: AttentionKernel,
    grads: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Add the key block's share of the gradients into ``grads = (dq, dk, dv)`` (in place), given the
    queries' *final* ``out`` and ``lse`` (merged over every block: the ring-attention identity)."""
    dq, dk, dv = grads
    for seg in segments:
        rows, cols = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
        dq_seg, dk_seg, dv_seg = kernel.backward(
            dout[:, :, rows],
            q[:, :, rows],
            k[:, :, cols],
            v[:, :, cols],
            out[:, :, rows],
            lse[:, :, rows].contiguous(),
            seg.causal,
            scale,
        )
        dq[:, :, rows] += dq_seg
        dk[:, :, cols] += dk_seg
        dv[:, :, cols] += dv_seg
        del dq_seg, dk_seg, dv_seg  # freed before the next call allocates its own


def _one_call(segments: Sequence[Segment], sq: int, sk: int) -> bool:
    """One segment covers the whole block: the kernel's results are the block's."""
    return len(segments) == 1 and segments[0][:4] == (0, sq, 0, sk)


class _SegmentAttention(torch.autograd.Function):
    """Attention of a sequence against itself, one kernel call per document, with the kernel's own
    backward (no ``[s, s]`` tensor is kept). Documents share no query and no key, so each call's
    results are written into their rows, in the inputs' dtype: nothing to merge."""

    @staticmethod
    def forward(ctx, q, k, v, segments, scale, kernel):
        if _one_call(segments, q.shape[2], k.shape[2]):
            out, lse = kernel.forward(q, k, v, segments[0].causal, scale)
        else:
            out = torch.zeros_like(q)
            lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
            for seg in segments:
                rows, cols = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
                part_out, part_lse = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], seg.causal, scale)
                out[:, :, rows] = part_out
                lse[:, :, rows] = part_lse
                del part_out, part_lse  # freed before the next call allocates its own
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.segments, ctx.scale, ctx.kernel = segments, scale, kernel
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        segments, scale, kernel = ctx.segments, ctx.scale, ctx.kernel
        if _one_call(segments, q.shape[2], k.shape[2]):
            dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, segments[0].causal, scale)
        else:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            accumulate_block_grads(dout, q, k, v, out, lse, segments, scale, kernel, (dq, dk, dv))
        return dq, dk, dv, None, None, None


def segment_attention(
    q: Tensor, k: Tensor, v: Tensor, segments: Sequence[Segment], scale: float, kernel: AttentionKernel
) -> Tensor:
    """Differentiable ``[b, nq, s, d]`` attention of a whole sequence over its visible ``segments``
    (each query row in exactly one: :meth:`SequenceLayout.full_segments`)."""
    return _SegmentAttention.apply(q, k, v, tuple(segments), scale, kernel)
