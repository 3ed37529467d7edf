"""LayerNorm / RMSNorm for Megatron layer specs that also works under sequence parallelism.

Megatron's torch fallback norm (``WrappedTorchNorm``) refuses ``sequence_parallel=True``; apex and
TransformerEngine norms accept it but are GPU-only. Under sequence parallelism a norm sees only its
rank's tokens (the q/k norms: only some heads or tokens), so its gradient is partial and Megatron
all-reduces it over the tensor-parallel group, for every parameter marked ``sequence_parallel``.
This norm marks its parameters that way. Its state-dict keys (``weight``, ``bias``) are those of
Megatron's other norms.

Both norms keep the same tensors on every device, their input and per-token statistics, which is what
the memory model counts: LayerNorm is ``torch.nn.LayerNorm``'s fused kernel; RMSNorm runs torch's
fused kernel (``aten._fused_rms_norm``: what ``F.rms_norm`` runs on CUDA) forward on every device,
where ``F.rms_norm`` on the CPU would keep fp32 copies of its input and output (four bf16
activations' worth per norm), and torch's fused backward where there is one (CUDA).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.core.precision import accumulation_dtype

from megatron.core.transformer import TransformerConfig

__all__ = ["RMSNorm", "fused_input_norm", "sequence_parallel_norm"]


class _RMSNorm(torch.autograd.Function):
    """``y = x rstd w`` over the last dimension, ``rstd = 1 / sqrt(mean(x^2) + eps)`` per token in fp32;
    keeps ``x``, ``w`` and ``rstd``.

        backward: x_hat = x rstd;  g = dy w;  dw = sum_tokens dy x_hat;
                  dx = rstd (g - x_hat mean_h(g x_hat))
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, rstd = ctx.saved_tensors
        if dy.is_cuda:
            mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1]]
            dx, dweight = torch.ops.aten._fused_rms_norm_backward(dy, x, [x.shape[-1]], rstd, weight, mask)
            return dx, dweight, None
        # No fused CPU backward: the same sums, in fp32 for half precision.
        acc = accumulation_dtype(x.dtype)
        x_hat = x * rstd  # [..., h] (acc: rstd is fp32)
        g = dy.to(acc) * weight  # [..., h]
        dweight = (dy * x_hat).sum(dim=tuple(range(dy.dim() - 1))).to(weight.dtype)  # [h]
        mean = (g * x_hat).mean(dim=-1, keepdim=True)  # [..., 1]
        dx = g.sub_(x_hat.mul_(mean)).mul_(rstd).to(x.dtype)
        return dx, dweight, None


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (its parameters and state dict) computed as :class:`_RMSNorm`."""

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return _RMSNorm.apply(x, self.weight, eps)


def sequence_parallel_norm(config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> torch.nn.Module:
    """``config.normalization`` (LayerNorm or RMSNorm) over the last ``hidden_size`` features.

    A Megatron ``LayerNormBuilder``: usable for ``input_layernorm``, ``pre_mlp_layernorm``,
    ``q_layernorm``/``k_layernorm`` and a block's final ``layer_norm``.
    """
    if config.layernorm_zero_centered_gamma:
        raise ValueError(
            "layernorm_zero_centered_gamma=True is not supported by megatron_paradyse's norm; "
            "set it to False (the weights then hold gamma itself)"
        )
    if config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    elif config.normalization == "RMSNorm":
        norm = RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    else:
        raise ValueError(f"config.normalization must be 'LayerNorm' or 'RMSNorm', got {config.normalization!r}")
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm


def fused_input_norm(linear: torch.nn.Module) -> Callable[[Tensor], Tensor] | None:
    """The norm fused into ``linear``, as a function of the module's input; None when there is none.

    Transformer Engine's layers fuse the input norm into ``linear_qkv`` and ``linear_fc1`` (TE's
    ``LayerNormLinear``, Megatron's ``TELayerNormColumnParallelLinear``; the layer's ``input_layernorm``
    and ``pre_mlp_layernorm`` are then identities). Strategies that read the weights rather than call the
    module need that norm first: it is computed here from the module's ``layer_norm_weight`` (and
    ``layer_norm_bias``) with its ``normalization``, ``eps`` and ``zero_centered_gamma``, as TE computes it.
    TE marks those parameters ``sequence_parallel``, so Megatron sums their gradients over the group.
    Unverified: written from TE's documented attributes; Transformer Engine does not run on the CPU
    machine the tests run on.
    """
    weight = getattr(linear, "layer_norm_weight", None)
    if weight is None:
        return None
    bias, eps, normalization = getattr(linear, "layer_norm_bias", None), linear.eps, linear.normalization
    zero_centered = linear.zero_centered_gamma

    def norm(x: Tensor) -> Tensor:
        gamma = weight + 1 if zero_centered else weight
        if normalization == "LayerNorm":
            return F.layer_norm(x, (x.shape[-1],), gamma, bias, eps)
        return _RMSNorm.apply(x, gamma, eps)

    return norm
