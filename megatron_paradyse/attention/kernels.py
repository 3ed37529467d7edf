"""Dense attention kernels that return the log-sum-exp, with an explicit backward.

A kernel computes softmax attention of one dense block, square-causal or fully visible:

    forward(q, k, v, causal, scale)                -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)

``q`` is ``[b, nq, sq, d]``, ``k``/``v`` are ``[b, nkv, sk, d]`` with ``nq % nkv == 0`` (GQA: query head
``i`` uses key head ``i // (nq/nkv)``, Megatron's grouping); ``lse`` is ``[b, nq, sq]`` in fp32 (fp64
for fp64 inputs). The backward takes ``out`` and ``lse`` as arguments so a caller that splits the keys
into blocks can pass the *merged* output and log-sum-exp and get each block's exact gradient (ring
attention). A kernel that cannot return the log-sum-exp is not a kernel here.

Kernels with a variable-length call (``varlen(q)`` true) also take documents packed back to back in one
call, token-major: ``q [total, nq, d]``, ``k``/``v`` ``[total, nkv, d]``, document ``i`` at rows
``[cu_seqlens[i], cu_seqlens[i+1])``; their ``lse`` is in the kernel's own layout, only handed back to
its ``backward_varlen``.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.core.precision import accumulation_dtype

__all__ = [
    "CUDNN_LENGTH_BUCKETS",
    "EFFICIENT_LSE_ROWS",
    "AttentionKernel",
    "TorchCudaKernel",
    "VarlenAttentionKernel",
    "accumulation_dtype",
    "get_kernel",
    "kernel_names",
]

logger = logging.getLogger(__name__)

CUDNN_LENGTH_BUCKETS = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"
"""PyTorch's switch for cuDNN's attention, opt-in (``export TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` before
the job; PyTorch reads it once, at the first cuDNN attention call). Without it a graph is built for
every new sequence length (70 to 220 ms each on an H100, and a training run meets a new length with
most micro-batches); with it, where q, k, v and the output are dense ``[b, s, n, d]`` (as
``strategies.common.attend_full_sequence`` hands them over), the graphs are keyed by lengths rounded up
to a power of two and the true lengths passed at run time: on an H100 no build at a new length, the
same output, steady attention 3% to 7% slower in one run each (two runs without it differed by up to
8%; benchmarks/results/cudnn-recompile_h100_20261128_b90c39f.md). Not on by default: PyTorch calls it
experimental, its ragged backward's gradients have not been checked here on a GPU yet
(``tests/gpu/test_attention_gpu.py`` does), and a ragged cuDNN backward has returned zero gradients without
an error in some cuDNN releases (cudnn-frontend pull request 462)."""


class AttentionKernel(Protocol):
    name: str

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this kernel cannot run on ``device``/``dtype``, or None."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]: ...

    def varlen(self, q: Tensor) -> bool:
        """Whether packed documents of queries like ``q`` go to one variable-length call."""


class VarlenAttentionKernel(AttentionKernel, Protocol):
    """A kernel whose ``varlen`` can be true: the variable-length calls over packed documents."""

    def forward_varlen(
        self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor]: ...

    def backward_varlen(
        self,
        dout: Tensor,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        cu_seqlens: Tensor,
        max_len: int,
        causal: bool,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


def _expand_kv(t: Tensor, groups: int) -> Tensor:
    """``[b, nkv, s, d] -> [b, nkv*groups, s, d]``, each key head repeated for its query heads."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_kv(grad: Tensor, groups: int) -> Tensor:
    """Sum the gradients of repeated key heads back: the adjoint of :func:`_expand_kv`."""
    if groups == 1:
        return grad
    b, n, s, d = grad.shape
    return grad.view(b, n // groups, groups, s, d).sum(dim=2)


class TorchCpuKernel:
    """PyTorch's blocked (flash) CPU attention: O(s) memory, returns the log-sum-exp."""

    name = "torch"

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def varlen(self, q: Tensor) -> bool:
        # The CPU op has no variable-length form, and one masked call would build an [s, s] mask and
        # compute every cross-document block: one call per document costs sum(d_i^2), not s^2, in work
        # and O(s) in memory, and a CPU call costs no launch.
        return False

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, causal, scale=scale
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(),
            q,
            _expand_kv(k, groups),
            _expand_kv(v, groups),
            out,
            lse,
            0.0,
            causal,
            scale=scale,
        )
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)


class MathKernel:
    """Explicit softmax attention on any device and dtype: the numerical oracle, O(s^2) memory."""

    name = "math"

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        return None

    def varlen(self, q: Tensor) -> bool:
        return False  # the oracle stays the plain definition: one dense call per document

    def _probs(self, q, k, lse, causal, scale) -> Tensor:
        acc = accumulation_dtype(q.dtype)
        scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # [b, nq, sq, sk]
        if causal:
            sq, sk = scores.shape[-2:]
            scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        if lse is None:
            lse = torch.logsumexp(scores, dim=-1)
        return torch.exp(scores - lse.unsqueeze(-1)), lse

    def forward(self, q, k, v, causal, scale):
        groups = q.shape[1] // k.shape[1]
        k, v = _expand_kv(k, groups), _expand_kv(v, groups)
        probs, lse = self._probs(q, k, None, causal, scale)
        return torch.matmul(probs, v.to(probs.dtype)).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        groups = q.shape[1] // k.shape[1]
        k_full, v_full = _expand_kv(k, groups), _expand_kv(v, groups)
        probs, _ = self._probs(q, k_full, lse, causal, scale)
        acc = probs.dtype
        dout_acc = dout.to(acc)
        dv = torch.matmul(probs.transpose(-1, -2), dout_acc)
        dprobs = torch.matmul(dout_acc, v_full.to(acc).transpose(-1, -2))
        delta = (dout_acc * out.to(acc)).sum(dim=-1, keepdim=True)
        dscores = probs * (dprobs - delta) * scale
        dq = torch.matmul(dscores, k_full.to(acc))
        dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
        return dq.to(q.dtype), _reduce_kv(dk, groups).to(k.dtype), _reduce_kv(dv, groups).to(v.dtype)


def _bsnd(t: Tensor) -> Tensor:
    """``[b, n, s, d] <-> [b, s, n, d]`` (a view): the FlashAttention kernels' layout."""
    return t.transpose(1, 2)


def _no_rng(q: Tensor) -> Tensor:
    """The random state a backward without dropout is handed and never reads (empty)."""
    return q.new_empty(0, dtype=torch.int64)


EFFICIENT_LSE_ROWS = 32
"""Memory-efficient attention pads its log-sum-exp rows to a multiple of this (and reads them so)."""


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _pad_head(t: Tensor, d: int) -> Tensor:
    """``t`` with its head dimension zero-padded to ``d`` (``t`` itself where it has ``d``): padded
    query and key columns add nothing to a score, padded value columns give output columns of zeros."""
    return t if t.shape[-1] == d else F.pad(t, (0, d - t.shape[-1]))


class TorchCudaKernel:
    """PyTorch's own CUDA attention: no package beyond torch. CI has no GPU: ``pytest -m gpu`` runs it
    (docs/gpu.md).

    fp16/bf16 on Hopper or newer, a block whose queries and keys are equally many (more than one), head
    sizes up to 128 and a multiple of 8: cuDNN's fused attention (``aten._scaled_dot_product_cudnn_attention`` and
    its backward), GQA natively; on an H200 it ran a causal 8B layer's attention core (32 query heads,
    8 key heads, d=128) forward and backward in 211 ms at 64K tokens against 374 ms for FlashAttention-2.
    Its causal mask aligns the block's top-left corners, so rectangles (ring blocks of unequal length)
    go to FlashAttention-2, which aligns bottom-right as every kernel here does.
    Otherwise fp16/bf16 on Ampere or newer with head sizes up to 256: torch's copy of FlashAttention-2
    (``aten._flash_attention_forward``/``_backward``), GQA natively, packed documents in one
    variable-length call, head sizes that are not a multiple of 8 zero-padded to one. Otherwise (fp32,
    older GPUs): memory-efficient attention (``aten._scaled_dot_product_efficient_attention`` and its
    backward), key heads repeated for GQA. Every backward takes ``out`` and ``lse`` as given.
    """

    name = "torch"

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the '{self.name}' kernel on CUDA takes fp16, bf16 or fp32 (got {dtype}); use 'math'"
        return None

    def varlen(self, q: Tensor) -> bool:
        return self._flash(q)

    @staticmethod
    def _flash(q: Tensor) -> bool:
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and _capability(q.device) >= (8, 0)

    @staticmethod
    def _cudnn(q: Tensor, k: Tensor) -> bool:
        d = q.shape[-1]
        return (
            q.dtype in (torch.float16, torch.bfloat16)
            and d % 8 == 0
            and d <= 128
            and q.shape[2] == k.shape[2] > 1  # PyTorch's own dispatch gives cuDNN no key length 1
            and _capability(q.device) >= (9, 0)
        )

    def forward(self, q, k, v, causal, scale):
        sq, sk = q.shape[2], k.shape[2]
        if self._cudnn(q, k):
            out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )
            return out, lse.squeeze(-1)  # cuDNN's statistics are [b, nq, sq, 1]
        if self._flash(q):
            out, lse = _flash_forward(*map(_bsnd, (q, k, v)), None, sq, sk, causal, scale)
            return _bsnd(out), lse
        groups = q.shape[1] // k.shape[1]
        out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, _expand_kv(k, groups), _expand_kv(v, groups), None, True, 0.0, causal, scale=scale
        )
        return out, lse[:, :, :sq]

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        sq, sk = q.shape[2], k.shape[2]
        if self._cudnn(q, k):
            unused = q.new_empty((), dtype=torch.int64)  # the dropout's random state: no dropout
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout,
                q,
                k,
                v,
                out,
                lse.unsqueeze(-1),
                unused,
                unused,
                None,
                None,
                None,
                sq,
                sk,
                0.0,
                causal,
                scale=scale,
            )
        if self._flash(q):
            grads = _flash_backward(*map(_bsnd, (dout, q, k, v, out)), lse, None, sq, sk, causal, scale)
            return tuple(map(_bsnd, grads))
        groups = q.shape[1] // k.shape[1]
        lse_rows = F.pad(lse, (0, -sq % EFFICIENT_LSE_ROWS))
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout,
            q,
            _expand_kv(k, groups),
            _expand_kv(v, groups),
            None,
            out,
            lse_rows,
            _no_rng(q),
            _no_rng(q),
            0.0,
            [True, True, True, False],
            causal,
            scale=scale,
        )
        return dq, _reduce_kv(dk, groups), _reduce_kv(dv, groups)

    def forward_varlen(self, q, k, v, cu_seqlens, max_len, causal, scale):
        return _flash_forward(q, k, v, cu_seqlens, max_len, max_len, causal, scale)

    def backward_varlen(self, dout, q, k, v, out, lse, cu_seqlens, max_len, causal, scale):
        return _flash_backward(dout, q, k, v, out, lse, cu_seqlens, max_len, max_len, causal, scale)


def _flash_forward(q, k, v, cu_seqlens, max_q, max_k, causal, scale) -> tuple[Tensor, Tensor]:
    """torch's FlashAttention-2 on ``[b, s, n, d]`` tensors (``cu_seqlens`` None) or packed ``[total, n,
    d]`` ones, the head dimension zero-padded to a multiple of 8 for the call."""
    d = q.shape[-1]
    inputs = (_pad_head(t, _flash_head(d)) for t in (q, k, v))
    lengths = (cu_seqlens, cu_seqlens, max_q, max_k)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(*inputs, *lengths, 0.0, causal, False, scale=scale)
    return out[..., :d], lse


def _flash_backward(dout, q, k, v, out, lse, cu_seqlens, max_q, max_k, causal, scale) -> tuple[Tensor, ...]:
    """The backward of :func:`_flash_forward`, given ``out`` and ``lse``."""
    d = q.shape[-1]
    inputs = (_pad_head(t, _flash_head(d)) for t in (dout, q, k, v, out))
    lengths = (cu_seqlens, cu_seqlens, max_q, max_k)
    no_rng = _no_rng(q)  # the dropout's random state, never read without dropout
    grads = torch.ops.aten._flash_attention_backward(*inputs, lse, *lengths, 0.0, causal, no_rng, no_rng, scale=scale)
    return tuple(g[..., :d] for g in grads)


def _flash_head(d: int) -> int:
    """The head size FlashAttention-2 runs ``d`` at: the next multiple of 8."""
    return -(-d // 8) * 8


class FlashAttnKernel:
    """flash-attn 2.x on CUDA (fp16/bf16). Not exercised by CI: CI machines have no GPU.

    flash-attn's public functions return the log-sum-exp but offer no backward that takes an external
    one, which ring attention needs; like ring-flash-attention, this calls the block-level
    ``_flash_attn_forward``/``_flash_attn_backward`` (and their ``_varlen_`` forms) of the 2.6+ API,
    checked at first use. GQA natively; inputs go as views (flash-attn copies only rows that are not
    contiguous in the head dimension), so its tensors are those of :class:`TorchCudaKernel`'s flash path.
    """

    name = "flash_attn"

    @functools.cached_property
    def _api(self):
        from flash_attn import flash_attn_interface as api  # CUDA-only import

        return api

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if dtype not in (torch.float16, torch.bfloat16):
            return f"the '{self.name}' kernel needs fp16 or bf16 (got {dtype}); use 'torch' or 'math' for fp32"
        try:
            _ = self._api
        except ImportError as e:
            return f"flash-attn is not installed ({e}); pip install 'megatron-paradyse[gpu]'"
        return None

    def varlen(self, q: Tensor) -> bool:
        return True

    def forward(self, q, k, v, causal, scale):
        out, lse, *_ = self._api._flash_attn_forward(
            _bsnd(q), _bsnd(k), _bsnd(v), 0.0, scale, causal, -1, -1, 0.0, None, False
        )
        return _bsnd(out), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        grads = tuple(torch.empty_like(_bsnd(t)) for t in (q, k, v))
        self._api._flash_attn_backward(
            *map(_bsnd, (dout, q, k, v, out)), lse, *grads, 0.0, scale, causal, -1, -1, 0.0, None, False, None
        )
        return tuple(map(_bsnd, grads))

    def forward_varlen(self, q, k, v, cu_seqlens, max_len, causal, scale):
        out, lse, *_ = self._api._flash_attn_varlen_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, scale, causal
        )
        return out, lse

    def backward_varlen(self, dout, q, k, v, out, lse, cu_seqlens, max_len, causal, scale):
        grads = tuple(torch.empty_like(t) for t in (q, k, v))
        self._api._flash_attn_varlen_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            *grads,
            cu_seqlens,
            cu_seqlens,
            max_len,
            max_len,
            0.0,
            scale,
            causal,
            -1,
            -1,
            0.0,
            None,
            False,
        )
        return grads


_KERNELS: dict[str, dict[str | None, AttentionKernel]] = {
    "torch": {"cpu": TorchCpuKernel(), "cuda": TorchCudaKernel()},
    "flash_attn": {"cuda": FlashAttnKernel()},
    "math": {None: MathKernel()},
}
"""Each kernel by name and by the device type it runs on (None: any)."""


def kernel_names() -> list[str]:
    return sorted(_KERNELS)


def _auto(device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: on CUDA, flash-attn where it can run and the GPU is older than Hopper (on Hopper
    PyTorch's own kernel runs cuDNN's attention, faster than FlashAttention-2), else PyTorch's own
    kernels; ``math`` where neither takes the dtype (fp64)."""
    if (
        device.type == "cuda"
        and not _KERNELS["flash_attn"]["cuda"].unsupported(device, dtype)
        and _capability(device) < (9, 0)
    ):
        return "flash_attn"
    by_device = _KERNELS["torch"]
    if device.type in by_device and not by_device[device.type].unsupported(device, dtype):
        return "torch"
    logger.warning(
        "attention kernel 'auto': no fused kernel takes %s on %s; using 'math' (O(s^2) memory)", dtype, device
    )
    return "math"


@functools.cache
def get_kernel(name: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel ``name`` (or ``"auto"``, see :func:`_auto`), checked for device and dtype."""
    device = torch.device(device)
    if name == "auto":
        name = _auto(device, dtype)
        logger.info("attention kernel 'auto' on %s, %s: %s", device, dtype, name)
    if name not in _KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; known: {', '.join(kernel_names())}, auto")
    by_device = _KERNELS[name]
    kernel = by_device.get(device.type, by_device.get(None))
    if kernel is None:
        raise ValueError(f"the '{name}' kernel needs {' or '.join(sorted(by_device))} (got {device.type})")
    reason = kernel.unsupported(device, dtype)
    if reason:
        raise ValueError(reason)
    return kernel
