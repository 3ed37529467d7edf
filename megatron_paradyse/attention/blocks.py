"""Attention over the visible segments of a (query block, key block) pair.

A block pair is described by the :class:`~megatron_paradyse.core.layout.Segment` list the layout gives it
(causal diagonals, fully visible rectangles, documents of a packed sequence); every segment is one
kernel call. Two uses:

- :func:`segment_attention`: a whole sequence against itself (``tp_sp``, ``ulysses``). Its segments
  are one per document (padding is a document of its own), so every query row is in exactly one
  segment: results are written in place, in the inputs' dtype, and the gradients likewise. A kernel
  with a variable-length call takes all documents in that one call instead; one causal document and
  its padding run as one call over the whole sequence, the padding's rows redone apart.
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

from megatron_paradyse.attention.kept import kept_core
from megatron_paradyse.attention.kernels import AttentionKernel, VarlenAttentionKernel, accumulation_dtype
from megatron_paradyse.core.layout import Segment

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


def _tokens_first(t: Tensor) -> Tensor:
    """``[b, n, s, d] -> [b*s, n, d]``: samples back to back, as a variable-length call takes them (a
    view for one sample of a sequence-major tensor, a copy otherwise)."""
    b, n, s, d = t.shape
    return t.transpose(1, 2).reshape(b * s, n, d)


def _heads_first(t: Tensor, b: int) -> Tensor:
    """The inverse of :func:`_tokens_first` (a view)."""
    return t.unflatten(0, (b, -1)).transpose(1, 2)


def batch_cu_seqlens(cu_seqlens: Tensor, b: int) -> Tensor:
    """The document bounds ``[docs+1]`` of one sample of ``s = cu_seqlens[-1]`` tokens, for ``b`` samples
    back to back (``[b*docs+1]``), on ``cu_seqlens``'s device: no host data, so no host synchronisation."""
    if b == 1:
        return cu_seqlens
    s = cu_seqlens[-1:]
    return torch.cat([*(cu_seqlens[:-1] + s * i for i in range(b)), s * b])


def _attend_segments(ctx, q, k, v, segments, scale, kernel, cu_seqlens, tail) -> tuple[Tensor, Tensor]:
    """:class:`_SegmentAttention`'s output and log-sum-exp, by the calls ``ctx.whole`` and ``ctx.varlen`` say."""
    causal = segments[0].causal
    if ctx.whole:
        out, lse = kernel.forward(q, k, v, causal, scale)
        if tail:  # the padding's rows saw the document: redone over the padding alone
            pad = slice(q.shape[2] - tail, None)
            part_out, part_lse = kernel.forward(q[:, :, pad], k[:, :, pad], v[:, :, pad], True, scale)
            out[:, :, pad] = part_out
            lse[:, :, pad] = part_lse
            del part_out, part_lse
        return out, lse
    if ctx.varlen:
        out, lse = kernel.forward_varlen(
            *map(_tokens_first, (q, k, v)), batch_cu_seqlens(cu_seqlens, q.shape[0]), ctx.max_len, causal, scale
        )
        return _heads_first(out, q.shape[0]), lse
    out = torch.zeros_like(q)
    lse = q.new_full(q.shape[:-1], float("-inf"), dtype=accumulation_dtype(q.dtype))
    for seg in segments:
        rows, cols = slice(seg.q_start, seg.q_end), slice(seg.k_start, seg.k_end)
        part_out, part_lse = kernel.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], seg.causal, scale)
        out[:, :, rows] = part_out
        lse[:, :, rows] = part_lse
        del part_out, part_lse  # freed before the next call allocates its own
    return out, lse


class _SegmentAttention(torch.autograd.Function):
    """Attention of a sequence against itself, with the kernel's own backward (no ``[s, s]`` tensor is
    kept). One call over the whole block where one segment covers it, or where the segments are one
    causal document and its padding (``tail``: the padding's rows then redone over the padding alone);
    else one variable-length call over every document where the kernel has one and the bounds are
    given; else one call per document. Documents share no query and no key, so each call's results are
    written into their rows, in the inputs' dtype: nothing to merge."""

    @staticmethod
    def forward(ctx, q, k, v, segments, scale, kernel, cu_seqlens, tail):
        ctx.whole = tail > 0 or _one_call(segments, q.shape[2], k.shape[2])
        ctx.varlen = not ctx.whole and cu_seqlens is not None and kernel.varlen(q)
        ctx.max_len = max(seg.q_end - seg.q_start for seg in segments)
        out, lse = kept_core(lambda: _attend_segments(ctx, q, k, v, segments, scale, kernel, cu_seqlens, tail))
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.segments, ctx.scale, ctx.kernel, ctx.tail = segments, scale, kernel, tail
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        segments, scale, kernel, tail = ctx.segments, ctx.scale, ctx.kernel, ctx.tail
        if ctx.whole:
            whole_lse = lse
            if tail:  # the padding's rows take no part in the whole call: weights exp(s - inf) = 0
                whole_lse = lse.clone()
                whole_lse[:, :, q.shape[2] - tail :] = float("inf")
            dq, dk, dv = kernel.backward(dout, q, k, v, out, whole_lse, segments[0].causal, scale)
            del whole_lse
            if tail:  # the padding's own share, where the whole call left zeros
                accumulate_block_grads(dout, q, k, v, out, lse, segments[-1:], scale, kernel, (dq, dk, dv))
        elif ctx.varlen:
            b = q.shape[0]
            grads = kernel.backward_varlen(
                *map(_tokens_first, (dout, q, k, v, out)),
                lse,
                batch_cu_seqlens(cu_seqlens, b),
                ctx.max_len,
                segments[0].causal,
                scale,
            )
            dq, dk, dv = (_heads_first(g, b) for g in grads)
        else:
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            accumulate_block_grads(dout, q, k, v, out, lse, segments, scale, kernel, (dq, dk, dv))
        return dq, dk, dv, None, None, None, None, None


def _check_tail(segments: Sequence[Segment], s: int, tail: int) -> None:
    """``tail`` padding rows must be the last of two causal segments that tile the sequence."""
    expected = (Segment(0, s - tail, 0, s - tail, True), Segment(s - tail, s, s - tail, s, True))
    if tuple(segments) != expected:
        raise ValueError(
            f"tail={tail} padding rows need one causal document then its padding, {expected}; got {tuple(segments)}"
        )


def segment_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    segments: Sequence[Segment],
    scale: float,
    kernel: AttentionKernel | VarlenAttentionKernel,
    cu_seqlens: Tensor | None = None,
    tail: int = 0,
) -> Tensor:
    """Differentiable ``[b, nq, s, d]`` attention of a whole sequence over its visible ``segments``
    (each query row in exactly one: :meth:`SequenceLayout.full_segments`). ``cu_seqlens``: the same
    segments' bounds ``[0, end_1, ..., s]`` as int32 on the inputs' device
    (:attr:`LayoutIndices.cu_seqlens`), for kernels with a variable-length call. ``tail``: the layout's
    :attr:`~SequenceLayout.causal_tail_padding`; a padded document then runs as one dense call (on a
    Hopper GPU cuDNN's, where a variable-length call would be FlashAttention-2's, 1.8x slower)."""
    if tail:
        _check_tail(segments, q.shape[2], tail)
    return _SegmentAttention.apply(q, k, v, tuple(segments), scale, kernel, cu_seqlens, tail)
