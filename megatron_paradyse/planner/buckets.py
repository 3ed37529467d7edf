"""Length buckets of the plan cache: every padded length maps to the upper edge of its bucket."""

from __future__ import annotations

import bisect
import math
from typing import Literal

__all__ = ["LengthBuckets"]


class LengthBuckets:
    """Bucket edges: multiples of ``tokens`` (linear), or ``e_0 = tokens``, ``e_{k+1} = ceil(e_k * ratio)``
    (geometric), none past ``cap``: the longest micro-batch the run plans (None: no bound). The bucket that
    holds ``cap`` ends there, so nothing the run plans is priced past it, whatever the ratio; past it, each
    length is a bucket of its own (none should come, and the longest-fitting search walks them one by one).
    Edges are integers computed with one correctly rounded multiply each, so every rank (every IEEE
    machine) gets the same ones.
    """

    def __init__(self, kind: Literal["linear", "geometric"], tokens: int, ratio: float, cap: int | None = None) -> None:
        if cap is not None and not (isinstance(cap, int) and cap > 0):
            raise ValueError(f"the buckets' cap must be a positive number of tokens (or None), got {cap!r}")
        self.kind, self.tokens, self.ratio, self.cap = kind, tokens, ratio, cap
        self._edges = [tokens if cap is None else min(tokens, cap)]

    def edge(self, length: int, multiple: int = 1) -> int:
        """Upper edge of ``length``'s bucket, rounded up to a multiple of ``multiple`` (``2p``)."""
        if self.cap is not None and length > self.cap:
            return _round_up(length, multiple)
        return _round_up(self._edge(length), multiple)

    def edge_at(self, index: int, multiple: int = 1) -> int:
        """The ``index``-th edge (0-based), rounded up to a multiple of ``multiple``."""
        if self.kind == "linear":
            last = math.inf if self.cap is None else -(-self.cap // self.tokens) - 1  # the cap's index
            if index <= last:
                return _round_up(self._edge((index + 1) * self.tokens), multiple)
        else:
            while len(self._edges) <= index and self._edges[-1] != self.cap:
                self._grow()
            last = len(self._edges) - 1
            if index <= last:
                return _round_up(self._edges[index], multiple)
        return _round_up(self.cap, multiple) + (index - last) * multiple

    def _edge(self, length: int) -> int:
        """Of ``length`` at most the cap: its bucket's edge."""
        if self.kind == "linear":
            edge = _round_up(length, self.tokens)
            return edge if self.cap is None else min(edge, self.cap)
        while self._edges[-1] < length:
            self._grow()
        return self._edges[bisect.bisect_left(self._edges, length)]

    def _grow(self) -> None:
        last = self._edges[-1]
        grown = last * self.ratio
        if self.cap is not None and grown >= self.cap:  # inf included: an edge past the cap is never computed
            self._edges.append(self.cap)
        else:
            self._edges.append(max(last + 1, math.ceil(grown)))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
