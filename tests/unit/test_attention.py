"""Attention kernels and block-wise attention over layout segments, against dense references."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_paradyse.attention import (
    accumulate_block,
    accumulate_block_grads,
    get_kernel,
    kernels,
    merge_into,
    segment_attention,
)
from megatron_paradyse.attention.blocks import batch_cu_seqlens
from megatron_paradyse.core.layout import Segment, SequenceLayout
from megatron_paradyse.cost.layer_memory import sublayer_memory
from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.base import AttentionContext
from megatron_paradyse.strategies.common import attend_full_sequence
from megatron_paradyse.strategies.dims import Dims

from helpers.recording_kernels import DenseLayoutRecorder

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


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
    with pytest.raises(ValueError, match=r"the 'flash_attn' kernel needs cuda \(got cpu\)"):
        get_kernel("flash_attn", CPU, torch.bfloat16)
    with pytest.raises(ValueError, match=r"the 'torch' kernel on CUDA takes fp16, bf16 or fp32 \(got torch.float64\)"):
        get_kernel("torch", CUDA, torch.float64)


@pytest.fixture
def fresh_kernels():
    """``get_kernel`` memoises what is installed: forget it around a test that pretends otherwise."""
    get_kernel.cache_clear()
    yield
    get_kernel.cache_clear()


@pytest.mark.parametrize("flash_attn_installed", [False, True])
@pytest.mark.parametrize("capability", [(8, 0), (9, 0)], ids=["ampere", "hopper"])
def test_auto_picks_flash_attn_then_torch_then_math(fresh_kernels, monkeypatch, flash_attn_installed, capability):
    """CUDA choices are checked on a machine without a GPU (its compute capability pretended). From
    Hopper on, ``auto`` takes the torch kernel (cuDNN's attention, 1.8x faster than FlashAttention-2 on
    an H200) even where flash-attn is installed."""
    monkeypatch.setattr(kernels, "_capability", lambda device: capability)
    flash = kernels._KERNELS["flash_attn"]["cuda"]
    takes = (torch.float16, torch.bfloat16) if flash_attn_installed else ()
    monkeypatch.setattr(flash, "unsupported", lambda device, dtype: None if dtype in takes else "not here")
    assert get_kernel("auto", CPU, torch.float32).name == "torch"
    half = get_kernel("auto", CUDA, torch.bfloat16)
    assert half is (flash if flash_attn_installed and capability < (9, 0) else kernels._KERNELS["torch"]["cuda"])
    assert isinstance(get_kernel("auto", CUDA, torch.float32), kernels.TorchCudaKernel)
    assert get_kernel("auto", CUDA, torch.float64).name == "math"


def test_flash_attn_is_absent_here_and_auto_uses_torch_on_cuda(fresh_kernels):
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    assert isinstance(get_kernel("auto", CUDA, torch.float16), kernels.TorchCudaKernel)


def test_layout_bounds_and_their_repetition_for_several_samples():
    layout = SequenceLayout.build((3, 6, 2), 2, causal=True)  # 11 tokens + 1 padding
    cu = layout.indices(CPU).cu_seqlens
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 9, 11, 12]
    assert [(seg.q_start, seg.q_end) for seg in layout.full_segments()] == list(zip(cu.tolist(), cu.tolist()[1:]))
    assert batch_cu_seqlens(cu, 1) is cu
    assert batch_cu_seqlens(cu, 3).tolist() == [0, 3, 9, 11, 12, 15, 21, 23, 24, 27, 33, 35, 36]


class _VarlenMath(kernels.MathKernel):
    """The ``math`` kernel with a variable-length call (one dense call per document, bounds read on the
    host) and FlashAttention's ``[n, total]`` log-sum-exp: the oracle for the packing around the call."""

    def varlen(self, q):
        return True

    def _documents(self, cu_seqlens):
        bounds = cu_seqlens.tolist()
        return [slice(a, b) for a, b in zip(bounds, bounds[1:])]

    def forward_varlen(self, q, k, v, cu_seqlens, max_len, causal, scale):
        assert max_len == max(b.stop - b.start for b in self._documents(cu_seqlens))
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float64)
        for doc in self._documents(cu_seqlens):
            doc_out, doc_lse = self.forward(*(t[doc].transpose(0, 1)[None] for t in (q, k, v)), causal, scale)
            out[doc], lse[:, doc] = doc_out[0].transpose(0, 1), doc_lse[0]
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, cu_seqlens, max_len, causal, scale):
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        for doc in self._documents(cu_seqlens):
            tensors = (t[doc].transpose(0, 1)[None] for t in (dout, q, k, v, out))
            for g, part in zip(grads, self.backward(*tensors, lse[None, :, doc], causal, scale)):
                g[doc] = part[0].transpose(0, 1)
        return grads


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b", [1, 2])
def test_one_variable_length_call_over_packed_documents_matches_a_dense_mask(causal, b):
    """Samples laid out sequence-major as the strategies give them (``[s, b, n, d]`` permuted), so the
    token-major packing is a view for one sample and a copy for two."""
    layout = SequenceLayout.build((3, 6, 2), 2, causal=causal)
    s = layout.padded_len
    doc = torch.cat([torch.full((e - a,), i) for i, (a, e) in enumerate(layout.doc_bounds)])
    mask = doc[:, None] == doc[None, :]
    if causal:
        mask &= torch.ones(s, s, dtype=torch.bool).tril()
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(s, b, n, 8, generator=gen, dtype=torch.float64).permute(1, 2, 0, 3) for n in (4, 2, 2))
    kernel = _VarlenMath()
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = segment_attention(qs, ks, vs, layout.full_segments(), 0.5, kernel, layout.indices(CPU).cu_seqlens)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = _dense(qr, kr, vr, mask, 0.5)
    dout = torch.randn_like(ref)
    out.backward(dout)
    ref.backward(dout)
    torch.testing.assert_close(out, ref)
    for mine, theirs in ((qs, qr), (ks, kr), (vs, vr)):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_only_a_causal_document_with_padding_after_it_has_causal_tail_padding():
    assert SequenceLayout.build(9, 2, causal=True).causal_tail_padding == 3
    assert SequenceLayout.build(8, 2, causal=True).causal_tail_padding == 0  # no padding
    assert SequenceLayout.build(9, 2, causal=False).causal_tail_padding == 0  # the padding would be seen
    assert SequenceLayout.build((5, 4), 2, causal=True).causal_tail_padding == 0  # the second would see the first


class _CountedCalls:
    """A kernel whose dense and variable-length calls are recorded as (method, query rows)."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getattr__(self, name):
        method = getattr(self.kernel, name)
        if name not in ("forward", "backward", "forward_varlen", "backward_varlen"):
            return method

        def counted(*args):
            rows = args[1 if name.startswith("backward") else 0].shape[2 if name in ("forward", "backward") else 0]
            self.calls.append((name, rows))
            return method(*args)

        return counted


# Relative error (norm) allowed against the fp64 reference on the same rounded inputs: fp64 to its round-off; the
# half-precision kernels accumulate in fp32 and round their results (measured: under 0.5% at unit
# logits). Large logits, which fp64 runs at, would amplify half precision's rounding in the gradients
# (8% in bf16, per-document calls alike).
_RELATIVE = {torch.float64: 1e-10, torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.mark.parametrize(
    ("kernel_name", "dtype"),
    [
        *((name, torch.float64) for name in ("torch", "math", "varlen")),
        ("torch", torch.bfloat16),
        ("torch", torch.float16),
    ],
)
@pytest.mark.parametrize("b", [1, 2])
def test_a_causal_document_and_its_padding_run_as_one_call_with_the_paddings_rows_redone(kernel_name, dtype, b):
    """No real query comes after a padding key, so the whole padded sequence is one causal call (on a
    Hopper GPU cuDNN's, where the variable-length call is FlashAttention-2's); the padding attends to
    itself alone, as a document of its own: its rows are redone forward, and left out of the whole
    call's backward. Large logits: a padding row's weights over the document would overflow if they
    took part (fp64)."""
    layout = SequenceLayout.build(9, 2, causal=True)  # 9 tokens, 3 of padding
    s, tail = layout.padded_len, layout.causal_tail_padding
    logits = 10 if dtype == torch.float64 else 1
    q, k, v = (logits * t.to(dtype) for t in _qkv(b=b, sq=s, sk=s))
    inner = _VarlenMath() if kernel_name == "varlen" else get_kernel(kernel_name, CPU, dtype)
    kernel = _CountedCalls(inner)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    out = segment_attention(qs, ks, vs, layout.full_segments(), 0.5, kernel, layout.indices(CPU).cu_seqlens, tail)
    doc = torch.cat([torch.full((e - a,), i) for i, (a, e) in enumerate(layout.doc_bounds)])
    mask = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = _dense(qr, kr, vr, mask, 0.5)
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(dtype)
    out.backward(dout)
    ref.backward(dout.double())
    assert kernel.calls == [("forward", s), ("forward", tail), ("backward", s), ("backward", tail)]
    for mine, theirs in ((out, ref), *((t.grad, r.grad) for t, r in ((qs, qr), (ks, kr), (vs, vr)))):
        assert mine.dtype == dtype
        assert ((mine.double() - theirs).norm() / theirs.norm()).item() < _RELATIVE[dtype]


def test_tail_padding_needs_one_causal_document_then_its_padding():
    layout = SequenceLayout.build((5, 4), 2, causal=True)  # two documents, 3 of padding
    q, k, v = _qkv(b=1, sq=12, sk=12)
    kernel = get_kernel("math", CPU, torch.float64)
    expected = (Segment(0, 9, 0, 9, True), Segment(9, 12, 9, 12, True))
    message = f"tail=3 padding rows need one causal document then its padding, {expected}; got {layout.full_segments()}"
    with pytest.raises(ValueError, match=re.escape(message)):
        segment_attention(q, k, v, layout.full_segments(), 0.5, kernel, None, 3)


@pytest.mark.parametrize(("p", "causal"), [(1, True), (2, True), (2, False)], ids=["p1", "zigzag", "contiguous"])
@pytest.mark.parametrize("rotary", [False, True])
def test_full_sequence_attention_hands_the_kernel_dense_sequence_major_q_k_v(p, causal, rotary):
    """Views of the fused projection (v always; q, k where no transform made them anew) are copied dense:
    only so does cuDNN key its graphs by length bucket (``CUDNN_LENGTH_BUCKETS``)."""
    shape = ModelShape(hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=64)
    layout = SequenceLayout.build(16, p, causal=causal)
    recorder = DenseLayoutRecorder()
    transform = (lambda q, k, positions: (q * 2, k * 2)) if rotary else None  # new tensors, as RoPE's
    ctx = AttentionContext(
        group=None, layout=layout, shape=shape, kernel=recorder, softmax_scale=0.5, qk_transform=transform
    )
    qkv = torch.randn(16, 1, 2 * (2 + 2) * 8, dtype=torch.float64)
    attend_full_sequence(qkv, ctx)
    assert recorder.dense == [(True, True, True)]


@pytest.mark.parametrize(
    ("dtype", "d", "capability", "dense_op"),
    [
        (torch.bfloat16, 64, (8, 0), "_flash_attention_forward"),
        (torch.bfloat16, 64, (9, 0), "_scaled_dot_product_cudnn_attention"),
        (torch.float16, 128, (9, 0), "_scaled_dot_product_cudnn_attention"),
        (torch.float16, 60, (8, 0), "_flash_attention_forward"),
        (torch.bfloat16, 60, (9, 0), "_flash_attention_forward"),  # cuDNN takes multiples of 8; padded
        (torch.float32, 64, (9, 0), "_scaled_dot_product_efficient_attention"),
    ],
)
def test_torch_cuda_kernel_calls_match_the_ops_schemas_and_shapes(monkeypatch, dtype, d, capability, dense_op):
    """The CUDA kernel's op calls on meta tensors (torch's shape functions, no device): arguments
    against each op's schema, and the shapes it hands back: cuDNN (bf16 on Hopper, queries and keys
    equally many, more than one), FlashAttention (bf16: rectangles, head sizes padded to a multiple of 8, Ampere),
    memory-efficient attention (fp32, whose log-sum-exp rows come padded to a multiple of 32), GQA,
    dense and variable-length. The numbers are checked on a GPU (tests/gpu/test_attention_gpu.py)."""
    monkeypatch.setattr(kernels, "_capability", lambda device: capability)
    called = []
    for name in (
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_scaled_dot_product_efficient_attention",
    ):
        op = getattr(torch.ops.aten, name)
        monkeypatch.setattr(
            torch.ops.aten, name, lambda *a, _op=op, _name=name, **k: called.append(_name) or _op(*a, **k)
        )
    kernel = kernels.TorchCudaKernel()
    b = 2
    meta = dict(device="meta", dtype=dtype)
    for sq, sk in ((40, 40), (40, 24), (1, 1)):  # (1, 1): a padding of one token, which cuDNN is not given
        called.clear()
        q = torch.empty(sq, b, 4, d, **meta).permute(1, 2, 0, 3)
        k, v = (torch.empty(sk, b, 2, d, **meta).permute(1, 2, 0, 3) for _ in range(2))
        out, lse = kernel.forward(q, k, v, False, 0.1)
        square_op = dense_op if sq == sk > 1 or dense_op != "_scaled_dot_product_cudnn_attention" else None
        assert called == [square_op or "_flash_attention_forward"]
        assert out.shape == q.shape and lse.shape == (b, 4, sq) and lse.dtype == torch.float32
        dq, dk, dv = kernel.backward(torch.empty_like(out), q, k, v, out, lse, False, 0.1)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    assert kernel.varlen(q) == (dtype != torch.float32)
    if kernel.varlen(q):
        cu = torch.tensor([0, 10, 40, 50, 80], dtype=torch.int32, device="meta")
        qt, kt, vt = (torch.empty(b * sq, n, d, **meta) for n in (4, 2, 2))
        out, lse = kernel.forward_varlen(qt, kt, vt, cu, 30, True, 0.1)
        assert out.shape == qt.shape and lse.shape == (4, b * sq)
        grads = kernel.backward_varlen(torch.empty_like(out), qt, kt, vt, out, lse, cu, 30, True, 0.1)
        assert [g.shape for g in grads] == [qt.shape, kt.shape, vt.shape]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", [2, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_memory_scripts_of_full_and_ring_attention_hold_on_both_devices(device, dtype, batch):
    """Every attention script runs through (each tensor allocated once, freed once, the backward
    leaving only the input's gradient) for packed documents; on CUDA in half precision the packed
    attention is one variable-length call and saves what the per-document calls save."""
    shape = ModelShape(hidden_size=48, num_attention_heads=8, num_query_groups=4, kv_channels=8, ffn_hidden_size=96)
    layout = SequenceLayout.build((41, 34, 6), 2, causal=True)
    memories = {}
    for where in ("cpu", device):
        d = Dims(shape=shape, p=2, s=layout.padded_len, b=batch, e=dtype, device=where)
        for name in ("tp_sp", "ulysses", "ring", "lean"):
            memories[where, name] = sublayer_memory("attention", name, d, layout, rank=1)
    for name in ("tp_sp", "ulysses"):
        assert memories[device, name].saved_bytes == memories["cpu", name].saved_bytes
