"""Attention kernels that record how they were called."""

from __future__ import annotations

from megatron_paradyse.attention import kernels


class DenseLayoutRecorder(kernels.MathKernel):
    """The ``math`` kernel, recording whether each call's q, k, v are dense ``[b, s, n, d]``."""

    def __init__(self):
        self.dense = []

    def forward(self, q, k, v, causal, scale):
        self.dense.append(tuple(t.transpose(1, 2).is_contiguous() for t in (q, k, v)))
        return super().forward(q, k, v, causal, scale)
