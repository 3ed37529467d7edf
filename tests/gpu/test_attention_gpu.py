"""CUDA attention kernels against the ``math`` kernel: ``pytest -m gpu`` on a machine with a GPU.

Every fused kernel installed here (``torch`` always, ``flash_attn`` where flash-attn is installed) in
every dtype it takes, causal and not, GQA, with sequence lengths that are not multiples of the
kernels' blocks: output, log-sum-exp and the three gradients of the explicit backward, the ring
identity (block backwards given the merged output and log-sum-exp), and packed documents through
one variable-length call, one sample and two. ``math`` runs in fp64 on the same inputs: the
reference is exact, the tolerances are the kernel dtype's round-off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from megatron_paradyse.attention import get_kernel, merge_into, segment_attention
from megatron_paradyse.attention.kernels import CUDNN_LENGTH_BUCKETS, TorchCudaKernel
from megatron_paradyse.core.layout import SequenceLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
# Inputs of unit scale: bf16 keeps 8 bits of mantissa, fp16 11, and the kernels accumulate in fp32;
# the gradients' sums over 77-300 keys round a few ulps more.
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2, torch.float32: 1e-3}
CASES = [(name, dtype) for name in ("torch", "flash_attn") for dtype in TOLERANCE]


def _kernel(name, dtype):
    try:
        return get_kernel(name, CUDA, dtype)
    except ValueError as e:  # flash-attn not installed, or fp32 for flash-attn
        pytest.skip(str(e))


def _qkv(b, nq, nkv, sq, sk, d, dtype, seed=0):
    """Sequence-major ``[s, b, n, d]`` storage seen as ``[b, n, s, d]``, as the strategies hand it over."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return tuple(
        torch.randn(s, b, n, d, generator=gen, device=CUDA).to(dtype).permute(1, 2, 0, 3)
        for n, s in ((nq, sq), (nkv, sk), (nkv, sk))
    )


def _close(mine, ref, dtype):
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(mine.double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("name", "dtype"), CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("d", [64, 128, 60], ids=["d64", "d128", "d60"])
def test_kernel_forward_and_backward_match_math(name, dtype, causal, heads, d):
    """d=60 is no multiple of 8: in fp16/bf16 the torch kernel pads it to 64 for FlashAttention."""
    kernel, math = _kernel(name, dtype), get_kernel("math", CUDA, torch.float64)
    if name == "flash_attn" and d % 8:
        pytest.skip("flash-attn's block API takes head sizes that are multiples of 8")
    q, k, v = _qkv(2, *heads, 77, 77, d, dtype)
    out, lse = kernel.forward(q, k, v, causal, d**-0.5)
    ref, ref_lse = math.forward(q.double(), k.double(), v.double(), causal, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32
    _close(out, ref, dtype)
    _close(lse, ref_lse, torch.float32)
    dout = torch.randn_like(out)
    grads = kernel.backward(dout, q, k, v, out, lse.contiguous(), causal, d**-0.5)
    ref_grads = math.backward(dout.double(), q.double(), k.double(), v.double(), ref, ref_lse, causal, d**-0.5)
    for g, r, t in zip(grads, ref_grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == dtype
        _close(g, r, dtype)


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_block_backwards_with_the_merged_lse_sum_to_the_full_gradient(name, dtype):
    """Ring attention's identity on the kernel: keys in two blocks (a causal diagonal and a visible
    rectangle), merged by log-sum-exp, each block's backward given the merged out/lse."""
    kernel = _kernel(name, dtype)
    q, k, v = _qkv(1, 8, 2, 70, 130, 64, dtype)
    scale = 0.125
    out = torch.zeros(q.shape, dtype=torch.float32, device=CUDA)
    lse = torch.full(q.shape[:-1], float("-inf"), device=CUDA)
    blocks = ((slice(0, 60), False), (slice(60, 130), True))
    for cols, causal in blocks:
        merge_into(out, lse, *kernel.forward(q, k[:, :, cols], v[:, :, cols], causal, scale))
    out = out.to(dtype)
    dout = torch.randn_like(q)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=CUDA) for t in (q, k, v)]
    for cols, causal in blocks:
        dq, dk, dv = kernel.backward(dout, q, k[:, :, cols], v[:, :, cols], out, lse, causal, scale)
        grads[0] += dq
        grads[1][:, :, cols] += dk
        grads[2][:, :, cols] += dv
    # the dense reference: the rectangle visible, the diagonal block causal
    mask = torch.ones(70, 130, dtype=torch.bool, device=CUDA)
    mask[:, 60:] = torch.ones(70, 70, dtype=torch.bool, device=CUDA).tril()
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    rep = 8 // 2
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr, kr.repeat_interleave(rep, 1), vr.repeat_interleave(rep, 1), attn_mask=mask, scale=scale
    )
    ref.backward(dout.double())
    _close(out, ref, dtype)
    for g, r in zip(grads, (qr.grad, kr.grad, vr.grad)):
        _close(g, r, dtype)


def _matches_a_dense_mask(layout, inputs, leaves, out, dtype):
    """``out`` (from ``leaves``, copies of ``inputs`` needing gradients; 8 query heads, 2 key heads,
    scale 0.125) and the leaves' gradients against fp64 SDPA under the layout's document mask."""
    s = layout.padded_len
    doc = torch.cat([torch.full((e - a,), i, device=CUDA) for i, (a, e) in enumerate(layout.doc_bounds)])
    mask = doc[:, None] == doc[None, :]
    if layout.causal:
        mask &= torch.ones(s, s, dtype=torch.bool, device=CUDA).tril()
    qr, kr, vr = (t.double().requires_grad_() for t in inputs)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qr, kr.repeat_interleave(4, 1), vr.repeat_interleave(4, 1), attn_mask=mask, scale=0.125
    )
    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.double())
    _close(out, ref, dtype)
    for mine, theirs in zip(leaves, (qr, kr, vr)):
        _close(mine.grad, theirs.grad, dtype)


@pytest.mark.parametrize(("name", "dtype"), CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b", [1, 2])
def test_packed_documents_in_one_variable_length_call_match_a_dense_mask(name, dtype, causal, b):
    kernel = _kernel(name, dtype)
    layout = SequenceLayout.build((37, 150, 5, 63), 2, causal=causal)  # padding: a document of its own
    s = layout.padded_len
    q, k, v = _qkv(b, 8, 2, s, s, 64, dtype)
    calls = []
    if kernel.varlen(q):  # count the calls: one variable-length call, no per-document ones
        for method in ("forward", "forward_varlen"):
            original = getattr(kernel, method)

            def counted(*args, _original=original, _method=method, **kwargs):
                calls.append(_method)
                return _original(*args, **kwargs)

            setattr(kernel, method, counted)
    try:
        qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
        out = segment_attention(qs, ks, vs, layout.full_segments(), 0.125, kernel, layout.indices(CUDA).cu_seqlens)
    finally:
        for method in ("forward", "forward_varlen"):
            kernel.__dict__.pop(method, None)
    if kernel.varlen(q):
        assert calls == ["forward_varlen"]
    _matches_a_dense_mask(layout, (q, k, v), (qs, ks, vs), out, dtype)


@pytest.mark.parametrize(("name", "dtype"), CASES)
@pytest.mark.parametrize("tail", [1, 3])
def test_a_document_and_its_padding_run_as_one_dense_call_and_match_a_dense_mask(name, dtype, tail):
    """One causal document padded to a multiple of 2p: one dense call over the whole sequence (bf16 on
    Hopper: cuDNN's, not FlashAttention-2's variable-length call), the padding's rows redone over the
    padding alone (``tail`` 1: a key length cuDNN is not given) and left out of the whole call's backward."""
    kernel = _kernel(name, dtype)
    layout = SequenceLayout.build(301, 1 if tail == 1 else 2, causal=True)  # padded to a multiple of 2p
    s = layout.padded_len
    assert layout.causal_tail_padding == tail and s == 301 + tail
    q, k, v = _qkv(1, 8, 2, s, s, 128, dtype)
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    cu_seqlens = layout.indices(CUDA).cu_seqlens
    out = segment_attention(qs, ks, vs, layout.full_segments(), 0.125, kernel, cu_seqlens, tail)
    _matches_a_dense_mask(layout, (q, k, v), (qs, ks, vs), out, dtype)


_LENGTH_BUCKETS_CHILD = """
import sys, torch
from megatron_paradyse.attention import get_kernel, segment_attention
from megatron_paradyse.core.layout import SequenceLayout
cuda = torch.device("cuda")
kernel, math = get_kernel("torch", cuda, torch.bfloat16), get_kernel("math", cuda, torch.float64)
worst = 0.0
for n, p in ((4096, 1), (4095, 1), (3001, 2), (1337, 4)):  # lengths of two power-of-two buckets, padded and not
    layout = SequenceLayout.build(n, p, causal=True)
    s, tail = layout.padded_len, layout.causal_tail_padding
    gen = torch.Generator(device=cuda).manual_seed(n)
    inputs = [torch.randn(s, 1, h, 128, generator=gen, device=cuda).permute(1, 2, 0, 3) for h in (32, 8, 8)]
    dout = torch.randn(s, 1, 32, 128, generator=gen, device=cuda).permute(1, 2, 0, 3)
    results = []
    for k, dtype in ((kernel, torch.bfloat16), (math, torch.float64)):
        leaves = [t.to(dtype).requires_grad_() for t in inputs]
        out = segment_attention(*leaves, layout.full_segments(), 128**-0.5, k, layout.indices(cuda).cu_seqlens, tail)
        out.backward(dout.to(dtype))
        results.append([out.detach(), *(t.grad for t in leaves)])
    for mine, ref in zip(*results):
        worst = max(worst, ((mine.double() - ref).norm() / ref.norm()).item())
print(f"worst={worst:.2e}")
sys.exit(0 if worst < 2e-2 else 1)
"""


def test_cudnn_length_buckets_give_what_the_dense_graphs_give():
    """PyTorch's opt-in ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` (``CUDNN_LENGTH_BUCKETS``; read once per
    process, so a child with it set): cuDNN's ragged path engaged (its warning, and not the one it gives
    when it declines) on sequence-major bf16 q, k, v, output and every gradient against fp64 ``math``,
    for padded and unpadded documents at p = 1, 2, 4 in two power-of-two buckets. A ragged cuDNN backward
    has returned zero gradients without an error in some cuDNN releases."""
    if torch.cuda.get_device_capability(CUDA) < (9, 0):
        pytest.skip("cuDNN's attention runs from Hopper on")
    env = {**os.environ, CUDNN_LENGTH_BUCKETS: "1"}
    done = subprocess.run([sys.executable, "-c", _LENGTH_BUCKETS_CHILD], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "AVOID_RECOMPILE=1 is currently experimental" in done.stderr
    assert "only works with Q, K, V, and output in BSHD" not in done.stderr


def test_auto_on_cuda_is_torch_on_hopper_else_flash_attn_where_installed():
    half = get_kernel("auto", CUDA, torch.bfloat16)
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        installed = False
    else:
        installed = True
    hopper = torch.cuda.get_device_capability(CUDA) >= (9, 0)
    assert half.name == ("flash_attn" if installed and not hopper else "torch")
    assert isinstance(get_kernel("auto", CUDA, torch.float32), TorchCudaKernel)
