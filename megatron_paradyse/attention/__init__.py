"""Attention kernels (with log-sum-exp) and exact block-wise attention over layout segments."""

from megatron_paradyse.attention.blocks import (
    merge_partial,
    segment_attention,
    segments_backward,
    segments_forward,
)
from megatron_paradyse.attention.kernels import AttentionKernel, accumulation_dtype, get_kernel, kernel_names

__all__ = [
    "AttentionKernel",
    "accumulation_dtype",
    "get_kernel",
    "kernel_names",
    "merge_partial",
    "segment_attention",
    "segments_backward",
    "segments_forward",
]
