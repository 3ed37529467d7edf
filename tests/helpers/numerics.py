"""How far a result is from its reference."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
