"""Attention cores kept through a layer's recompute (``+rc+keepcore``).

A recomputed layer runs its forward twice: once in the forward pass, keeping only its input, and again
in the backward, to rebuild what its backward reads. At long lengths the attention kernel is most of
that rerun, and its results are small: the output (as large as q) and a log-sum-exp row per head. A
layer that keeps its core runs its function under :meth:`KeptCores.run`: the first run keeps the
results of every attention core it calls (:func:`kept_core`), in call order; the rerun takes them back
in the same order instead of running the kernels (and, for the ring, its hops) again. The core's
backward then reads the rebuilt q, k, v with the kept output and log-sum-exp: the same tensors as
without recompute, so the gradients are those of a layer that is not recomputed.

The kept results are held here, not by autograd, from the forward to the rerun (the recompute's
hooks see only the layer's input); the rerun hands them to the core's autograd node, which frees them
with its backward.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable

from torch import Tensor

__all__ = ["KeptCores", "kept_core"]

_ACTIVE: contextvars.ContextVar[KeptCores | None] = contextvars.ContextVar("kept_cores", default=None)


class KeptCores:
    """The results of the attention cores of one layer's run, kept for its rerun."""

    def __init__(self) -> None:
        self._kept: list[tuple[Tensor, ...]] = []
        self._rerun = False

    def run(self, fn: Callable[..., Tensor], *args) -> Tensor:
        """``fn(*args)`` with its attention cores kept (the first call) or taken back (the next)."""
        token = _ACTIVE.set(self)
        try:
            out = fn(*args)
        finally:
            _ACTIVE.reset(token)
        if self._rerun and self._kept:
            raise RuntimeError(
                f"a layer's rerun called {len(self._kept)} attention core(s) fewer than its forward: "
                f"its recompute must run the same strategies"
            )
        self._rerun = True
        return out

    def core(self, compute: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
        if not self._rerun:
            results = compute()
            self._kept.append(tuple(t.detach() for t in results))
            return results
        if not self._kept:
            raise RuntimeError("a layer's rerun called more attention cores than its forward")
        return self._kept.pop(0)


def kept_core(compute: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """``compute()``: an attention core's results (no autograd inside). In a layer run that keeps its
    cores (:meth:`KeptCores.run`), the rerun gets the forward's results back without computing them."""
    kept = _ACTIVE.get()
    return compute() if kept is None else kept.core(compute)
