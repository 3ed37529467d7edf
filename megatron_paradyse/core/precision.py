"""Which dtype sums are kept in.

Half-precision activations and weights are multiplied in their own dtype, but whatever is *summed*
over blocks, ranks or hops (attention's softmax statistics and ring accumulators, weight gradients
reduced over a group or carried around a ring) is kept in fp32, as Megatron keeps its main gradients:
a bf16 sum over p contributions loses about log2(p) bits of an 8-bit mantissa.
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half precision, the dtype itself otherwise (fp32, fp64)."""
    return torch.promote_types(dtype, torch.float32)
