"""RoPE on queries or keys at their tokens' positions, keeping nothing for backward but what the step holds.

Megatron's unfused ``apply_rotary_pos_emb`` leaves autograd holding each tensor's ``cos`` and ``sin`` (in
the activations' dtype) from forward to backward, and Transformer Engine's fused kernel the rows of the
table it was given: per layer about one ``[s/p, b, h]`` activation at Llama's shapes. :func:`rotate`
keeps only references to GPTModel's rotary table and the layout's positions, which the step holds
anyway, and computes ``cos`` and ``sin`` again in backward. Its output and gradients are Megatron's
unfused ones to the bit: the same operators in the same dtypes (``x2 sin`` subtracted where Megatron adds
``(-x2) sin``, which IEEE arithmetic makes the same number); it writes them into the result in place, so
it allocates less on the way too.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["rotate"]


def rotate(t: Tensor, table: Tensor, position_ids: Tensor, mscale: float) -> Tensor:
    """``t [rows, b, heads, hn]`` rotated at ``position_ids [rows]`` by GPTModel's ``table [S, 1, 1, rot]``
    (fp32 angles; the first ``rot`` channels rotate, non-interleaved), as Megatron's unfused
    ``apply_rotary_pos_emb`` with ``mscale``."""
    return _Rotate.apply(t, table, position_ids, mscale)


def _cos_sin(table: Tensor, position_ids: Tensor, mscale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The rows' ``cos`` and ``sin`` in ``dtype``, made as Megatron makes them."""
    freqs = table.index_select(0, position_ids)
    cos = (torch.cos(freqs) * mscale).to(dtype)
    sin = (torch.sin(freqs) * mscale).to(dtype)
    return cos, sin


def _rotate_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, *, inverse: bool) -> None:
    """``out[..., :rot] = x cos + rotate_half(x) sin`` for ``x [..., rot]`` (``inverse``: the transpose,
    ``x cos + rotate_half^T(x sin)``, which takes the output's gradient to the input's): the products
    ``x cos`` into ``out``, then each half's cross term added or subtracted in place."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    y = out[..., : x.shape[-1]]
    torch.mul(x, cos, out=y)
    crossed = torch.empty_like(x)
    if inverse:  # dx1 = g1 cos1 + g2 sin2, dx2 = g2 cos2 - g1 sin1
        torch.mul(x, sin, out=crossed)
        y[..., :half].add_(crossed[..., half:])
        y[..., half:].sub_(crossed[..., :half])
    else:  # y1 = x1 cos1 - x2 sin1, y2 = x2 cos2 + x1 sin2
        torch.mul(x2, sin[..., :half], out=crossed[..., :half])
        torch.mul(x1, sin[..., half:], out=crossed[..., half:])
        y[..., :half].sub_(crossed[..., :half])
        y[..., half:].add_(crossed[..., half:])


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: Tensor, table: Tensor, position_ids: Tensor, mscale: float) -> Tensor:
        ctx.table, ctx.position_ids, ctx.mscale = table, position_ids, mscale  # the step holds them
        return _apply(t, table, position_ids, mscale, inverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _apply(grad, ctx.table, ctx.position_ids, ctx.mscale, inverse=True), None, None, None


def _apply(t: Tensor, table: Tensor, position_ids: Tensor, mscale: float, *, inverse: bool) -> Tensor:
    rot = table.shape[-1]
    cos, sin = _cos_sin(table, position_ids, mscale, t.dtype)
    out = torch.empty_like(t)
    _rotate_into(out, t[..., :rot], cos, sin, inverse=inverse)
    out[..., rot:] = t[..., rot:]
    return out
