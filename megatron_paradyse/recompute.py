"""Per-layer activation recompute: keep only a layer's input, run it again in backward.

Orthogonal to the strategy: the rerun goes through the same strategy functions with the same
micro-batch context (captured by the closure), so every rank reruns the same collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.utils.checkpoint
from torch import Tensor

__all__ = ["recompute"]


def recompute(fn: Callable[..., Tensor], *args) -> Tensor:
    """``fn(*args)``, saving only ``args`` for backward and recomputing the rest there."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
