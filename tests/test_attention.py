"""Attention kernels and block-wise attention over layout segments, against dense references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_paradyse.attention import (
    accumulate_block,
    accumulate_block_grads,
    get_kernel,
    merge_into,
    segment_attention,
)
from megatron_paradyse.layout import Segment, SequenceLayout

CPU = torch.device("cpu")


def _qkv(b=2, nq=4, nkv=2, sq=12, sk=12, d=8, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, nq, sq, d, generator=gen, dtype=dtype),
        torch.randn(b, nkv, sk, d, generator=gen, dtype=dtype),
        torch.randn(b, nkv, sk, d, generator=gen, dtype=dtype),
    )


def _dense(q, k, v, mask, scale):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@pytest.mark.parametrize("kernel_name", ["torch", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_matches_sdpa_forward_and_backward_with_gqa(kernel_name, causal):
    kernel = get_kernel(kernel_name, CPU, torch.float64)
    q, k, v = _qkv()
    scale = 0.3
    out, lse = kernel.forward(q, k, v, causal, scale)
    mask = torch.ones(12, 12, dtype=torch.bool).tril() if causal else None
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _dense(qr, kr, vr, mask, scale)
    dout = torch.randn_like(ref)
    ref.backward(dout)
    torch.testing.assert_close(out, ref.detach())
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal, scale)
    torch.testing.assert_close(dq, qr.grad)
    torch.testing.assert_close(dk, kr.grad)
    torch.testing.assert_close(dv, vr.grad)


def test_segments_over_packed_documents_match_a_dense_mask():
    layout = SequenceLayout.build((3, 6, 2), 2, causal=True)  # 11 tokens + 1 padding
    s = layout.padded_len
    doc = torch.cat([torch.full((e - b,), i) for i, (b, e) in enumerate(layout.doc_bounds)])
    mask = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    q, k, v = _qkv(sq=s, sk=s)
    kernel = get_kernel("torch", CPU, torch.float64)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = segment_attention(qs, ks, vs, layout.full_segments(), 0.5, kernel)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _dense(qr, kr, vr, mask, 0.5)
    dout = torch.randn_like(ref)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(out, ref)
    for mine, theirs in ((qs, qr), (ks, kr), (vs, vr)):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_block_gradients_with_the_merged_lse_sum_to_the_full_gradient():
    """The ring-attention identity: split the keys in blocks, merge forward by LSE, and each block's
    backward with the *merged* out/lse gives exactly its share of the gradient."""
    kernel = get_kernel("math", CPU, torch.float64)
    q, k, v = _qkv(sq=6, sk=10)
    out_a, lse_a = kernel.forward(q, k[:, :, :4], v[:, :, :4], False, 1.0)
    out_b, lse_b = kernel.forward(q, k[:, :, 4:], v[:, :, 4:], False, 1.0)
    out, lse = torch.zeros_like(out_a), torch.full_like(lse_a, float("-inf"))
    merge_into(out, lse, out_a, lse_a)
    merge_into(out, lse, out_b, lse_b)
    full_out, full_lse = kernel.forward(q, k, v, False, 1.0)
    torch.testing.assert_close(out, full_out)
    torch.testing.assert_close(lse, full_lse)
    dout = torch.randn_like(out)
    ga = kernel.backward(dout, q, k[:, :, :4], v[:, :, :4], out, lse, False, 1.0)
    gb = kernel.backward(dout, q, k[:, :, 4:], v[:, :, 4:], out, lse, False, 1.0)
    full = kernel.backward(dout, q, k, v, full_out, full_lse, False, 1.0)
    torch.testing.assert_close(ga[0] + gb[0], full[0])
    torch.testing.assert_close(torch.cat([ga[1], gb[1]], 2), full[1])
    torch.testing.assert_close(torch.cat([ga[2], gb[2]], 2), full[2])


def test_merge_is_stable_for_huge_logits_and_ignores_empty_rows():
    out = torch.zeros(1, 1, 3, 2)
    lse = torch.full((1, 1, 3), float("-inf"))
    part = torch.ones(1, 1, 3, 2)
    part_lse = torch.tensor([[[1000.0, float("-inf"), 2000.0]]])  # exp(1000) overflows fp32
    merge_into(out, lse, part, part_lse)
    merge_into(out, lse, (3 * part).bfloat16(), part_lse)  # a half-precision part merges into fp32
    assert torch.isfinite(out).all()
    # Equal weights; the empty row stays zero. fp32 holds lse=1000.69 to ~6e-5, hence the tolerance.
    torch.testing.assert_close(out[0, 0, :, 0], torch.tensor([2.0, 0.0, 2.0]), rtol=1e-4, atol=0)
    torch.testing.assert_close(lse[0, 0, 0], torch.tensor(1000.6931471805599))
    assert lse[0, 0, 1] == float("-inf")


def test_rows_no_segment_covers_get_zero_output_and_minus_infinite_lse():
    q, k, v = _qkv(sq=4, sk=4)
    kernel = get_kernel("math", CPU, torch.float64)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    accumulate_block(q, k, v, [Segment(0, 2, 0, 4, False)], 1.0, kernel, out, lse)
    assert (out[:, :, 2:] == 0).all() and (lse[:, :, 2:] == float("-inf")).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[:, :, :2]).all()
    grads = tuple(torch.zeros_like(t) for t in (q, k, v))
    accumulate_block_grads(torch.ones_like(q), q, k, v, out, lse, [], 1.0, kernel, grads)
    assert all((g == 0).all() for g in grads)


def test_ring_blocks_accumulate_half_precision_parts_in_fp32():
    """Blocks of bf16 attention merged into fp32 accumulators equal the fp32 attention of the whole
    key range up to bf16 rounding of the inputs, not of every partial sum."""
    q, k, v = (t.bfloat16() for t in _qkv(sq=8, sk=12, dtype=torch.float32))
    kernel = get_kernel("math", CPU, torch.bfloat16)
    out = torch.zeros(q.shape, dtype=torch.float32)
    lse = torch.full(q.shape[:-1], float("-inf"))
    for cols in ((0, 5), (5, 9), (9, 12)):
        accumulate_block(q, k, v, [Segment(0, 8, cols[0], cols[1], False)], 0.3, kernel, out, lse)
    ref, ref_lse = get_kernel("math", CPU, torch.float64).forward(q.double(), k.double(), v.double(), False, 0.3)
    torch.testing.assert_close(out, ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-3, atol=1e-3)


def test_get_kernel_rejects_unknown_names_and_wrong_devices():
    with pytest.raises(ValueError, match=r"unknown attention kernel 'flash'; known: flash_attn, math, torch, auto"):
        get_kernel("flash", CPU, torch.float32)
    with pytest.raises(ValueError, match=r"the 'flash_attn' kernel needs CUDA \(got cpu\)"):
        get_kernel("flash_attn", CPU, torch.bfloat16)
    assert get_kernel("auto", CPU, torch.float32).name == "torch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_kernel_matches_math_on_gpu(causal):
    cuda = torch.device("cuda")
    q, k, v = (t.to(cuda, torch.bfloat16) for t in _qkv(sq=64, sk=64, d=64))
    flash, math = get_kernel("flash_attn", cuda, torch.bfloat16), get_kernel("math", cuda, torch.bfloat16)
    out_f, lse_f = flash.forward(q, k, v, causal, 0.125)
    out_m, lse_m = math.forward(q, k, v, causal, 0.125)
    torch.testing.assert_close(out_f, out_m, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_f, lse_m, atol=2e-2, rtol=2e-2)
    dout = torch.randn_like(out_f)
    for g_f, g_m in zip(
        flash.backward(dout, q, k, v, out_f, lse_f, causal, 0.125),
        math.backward(dout, q, k, v, out_m, lse_m, causal, 0.125),
    ):
        torch.testing.assert_close(g_f, g_m, atol=5e-2, rtol=5e-2)
