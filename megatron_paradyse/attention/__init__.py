"""Attention kernels (with log-sum-exp) and exact block-wise attention over layout segments."""

from megatron_paradyse.attention.blocks import (
    accumulate_block,
    accumulate_block_grads,
    merge_into,
    segment_attention,
)
from megatron_paradyse.attention.kernels import AttentionKernel, accumulation_dtype, get_kernel, kernel_names

__all__ = [
    "AttentionKernel",
    "accumulate_block",
    "accumulate_block_grads",
    "accumulation_dtype",
    "get_kernel",
    "kernel_names",
    "merge_into",
    "segment_attention",
]
