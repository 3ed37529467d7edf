"""LayerNorm / RMSNorm for Megatron layer specs that also works under sequence parallelism.

Megatron's torch fallback norm (``WrappedTorchNorm``) refuses ``sequence_parallel=True``; apex and
TransformerEngine norms accept it but are GPU-only. Under sequence parallelism a norm sees only its
rank's tokens (the q/k norms: only some heads or tokens), so its gradient is partial and Megatron
all-reduces it over the tensor-parallel group, for every parameter marked ``sequence_parallel``.
This norm marks its parameters that way. Its state-dict keys (``weight``, ``bias``) are those of
Megatron's other norms.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig

__all__ = ["sequence_parallel_norm"]


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
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
    else:
        raise ValueError(f"config.normalization must be 'LayerNorm' or 'RMSNorm', got {config.normalization!r}")
    for param in norm.parameters():
        param.sequence_parallel = config.sequence_parallel
    return norm
