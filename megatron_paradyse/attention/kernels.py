"""Dense attention kernels that return the log-sum-exp, with an explicit backward.

A kernel computes softmax attention of one dense block, square-causal or fully visible:

    forward(q, k, v, causal, scale)                -> (out, lse)
    backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)

``q`` is ``[b, nq, sq, d]``, ``k``/``v`` are ``[b, nkv, sk, d]`` with ``nq % nkv == 0`` (GQA: query head
``i`` uses key head ``i // (nq/nkv)``, Megatron's grouping); ``lse`` is ``[b, nq, sq]`` in fp32 (fp64
for fp64 inputs). The backward takes ``out`` and ``lse`` as arguments so a caller that splits the keys
into blocks can pass the *merged* output and log-sum-exp and get each block's exact gradient (ring
attention). A kernel that cannot return the log-sum-exp is not a kernel here.
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
from torch import Tensor

from megatron_paradyse.precision import accumulation_dtype

__all__ = ["AttentionKernel", "accumulation_dtype", "get_kernel", "kernel_names"]

logger = logging.getLogger(__name__)


class AttentionKernel(Protocol):
    name: str

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this kernel cannot run on ``device``/``dtype``, or None."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]: ...

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
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
        if device.type != "cpu":
            return f"the '{self.name}' kernel runs on CPU only (got {device.type}); use 'flash_attn' or 'math'"
        return None

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


class FlashAttnKernel:
    """flash-attn 2.x on CUDA (fp16/bf16). Not exercised by CI: CI machines have no GPU.

    flash-attn's public functions return the log-sum-exp but offer no backward that takes an external
    one, which ring attention needs; like ring-flash-attention, this calls the block-level
    ``_flash_attn_forward``/``_flash_attn_backward`` of the 2.6+ API, checked at first use.
    """

    name = "flash_attn"

    @functools.cached_property
    def _api(self):
        from flash_attn import flash_attn_interface as api  # CUDA-only import

        return api

    def unsupported(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if device.type != "cuda":
            return f"the '{self.name}' kernel needs CUDA (got {device.type})"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"the '{self.name}' kernel needs fp16 or bf16 (got {dtype}); use 'math' for fp32"
        try:
            _ = self._api
        except ImportError as e:
            return f"flash-attn is not installed ({e}); pip install 'megatron-paradyse[gpu]'"
        return None

    def forward(self, q, k, v, causal, scale):
        # flash-attn wants [b, s, n, d]; it supports GQA natively.
        out, lse, *_ = self._api._flash_attn_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            0.0,
            scale,
            causal,
            -1,
            -1,
            0.0,
            None,
            False,
        )
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        to_bsnd = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
        q_, k_, v_, out_, dout_ = map(to_bsnd, (q, k, v, out, dout))
        dq, dk, dv = torch.empty_like(q_), torch.empty_like(k_), torch.empty_like(v_)
        self._api._flash_attn_backward(
            dout_, q_, k_, v_, out_, lse, dq, dk, dv, 0.0, scale, causal, -1, -1, 0.0, None, False, None
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (TorchCpuKernel(), MathKernel(), FlashAttnKernel())}


def kernel_names() -> list[str]:
    return sorted(_KERNELS)


@functools.cache
def get_kernel(name: str, device: torch.device, dtype: torch.dtype) -> AttentionKernel:
    """The kernel ``name`` (or ``"auto"``: torch on CPU, flash_attn on CUDA), checked for device and dtype."""
    device = torch.device(device)
    if name == "auto":
        name = "torch" if device.type == "cpu" else "flash_attn"
        if name == "flash_attn" and _KERNELS[name].unsupported(device, dtype):
            logger.warning(
                "attention kernel 'auto': flash_attn cannot run (%s); using 'math' (O(s^2) memory)",
                _KERNELS[name].unsupported(device, dtype),
            )
            name = "math"
    if name not in _KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; known: {', '.join(kernel_names())}, auto")
    kernel = _KERNELS[name]
    reason = kernel.unsupported(device, dtype)
    if reason:
        raise ValueError(reason)
    return kernel
