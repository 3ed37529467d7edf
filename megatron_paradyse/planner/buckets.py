"""Length buckets of the plan cache: every padded length maps to the upper edge of its bucket."""

from __future__ import annotations

import bisect
import math
from typing import Literal

__all__ = ["LengthBuckets"]


class LengthBuckets:
    """Bucket edges: multiples of ``tokens`` (linear), or ``e_0 = tokens``, ``e_{k+1} = ceil(e_k * ratio)``
    (geometric). Edges are integers computed with one correctly rounded multiply each, so every rank
    (every IEEE machine) gets the same ones.
    """

    def __init__(self, kind: Literal["linear", "geometric"], tokens: int, ratio: float) -> None:
        self.kind, self.tokens, self.ratio = kind, tokens, ratio
        self._edges = [tokens]

    def edge(self, length: int, multiple: int = 1) -> int:
        """Upper edge of ``length``'s bucket, rounded up to a multiple of ``multiple`` (``2p``)."""
        return _round_up(self._edge(length), multiple)

    def edge_at(self, index: int, multiple: int = 1) -> int:
        """The ``index``-th edge (0-based), rounded up to a multiple of ``multiple``."""
        if self.kind == "linear":
            return _round_up((index + 1) * self.tokens, multiple)
        while len(self._edges) <= index:
            self._grow()
        return _round_up(self._edges[index], multiple)

    def _edge(self, length: int) -> int:
        if self.kind == "linear":
            return _round_up(length, self.tokens)
        while self._edges[-1] < length:
            self._grow()
        return self._edges[bisect.bisect_left(self._edges, length)]

    def _grow(self) -> None:
        last = self._edges[-1]
        self._edges.append(max(last + 1, math.ceil(last * self.ratio)))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
