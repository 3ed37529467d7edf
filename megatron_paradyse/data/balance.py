"""Balance the micro-batches of a global batch over data-parallel ranks by predicted work.

Every DP rank runs the same number of micro-batches per step (Megatron's pipeline schedules need
it), so the assignment is a partition of the global batch into ``dp_size`` groups of equal count that
keeps the largest predicted work small. Longest-processing-time first with a count cap: micro-batches
by decreasing work, each to the least-loaded rank with room left (ties to the lower rank and the
earlier micro-batch), so the result is deterministic and needs no communication.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Sequence

import numpy as np

from megatron_paradyse.core.layout import SequenceLayout

__all__ = ["DEFAULT_WORK_MODEL", "WorkFn", "WorkModel", "assign_to_ranks", "imbalance", "rank_loads"]

WorkFn = Callable[[SequenceLayout], float]
"""Predicted work of one micro-batch from its layout (a planner's step-time estimate fits here)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkModel:
    """``work = quadratic * sum_d s_d^2 + linear * s_padded``: attention within each document plus GEMMs.

    :meth:`from_transformer` gives forward FLOPs per layer: the projections and MLP cost
    ``2 * (4h^2 + 2*h*ffn) `` per token (every padded token is computed), attention ``4h`` per
    visible query-key pair, of which a causal document of ``s`` tokens has ``s^2/2``. Only ratios
    matter for balancing.
    """

    quadratic: float
    """Work per (token of a document)^2."""
    linear: float
    """Work per token, padding included."""

    def __post_init__(self) -> None:
        if self.quadratic < 0 or self.linear < 0 or self.quadratic + self.linear == 0:
            raise ValueError(
                f"WorkModel needs non-negative coefficients, not both zero; got quadratic={self.quadratic}, "
                f"linear={self.linear}"
            )

    @classmethod
    def from_transformer(
        cls, hidden_size: int, ffn_hidden_size: int | None = None, *, causal: bool = True
    ) -> WorkModel:
        ffn = 4 * hidden_size if ffn_hidden_size is None else ffn_hidden_size
        pairs = 0.5 if causal else 1.0
        return cls(quadratic=4.0 * hidden_size * pairs, linear=2.0 * (4 * hidden_size**2 + 2 * hidden_size * ffn))

    def __call__(self, layout: SequenceLayout) -> float:
        return self.quadratic * float(sum(n * n for n in layout.doc_lengths)) + self.linear * layout.padded_len


DEFAULT_WORK_MODEL = WorkModel.from_transformer(4096)
"""A causal 4096-wide layer with a 4x MLP: attention overtakes the GEMMs above ~48K tokens per document."""


def assign_to_ranks(works: Sequence[float], dp_size: int) -> list[list[int]]:
    """Indices of ``works`` per DP rank: ``len(works) / dp_size`` each, max total work kept small."""
    n = len(works)
    if dp_size < 1 or n % dp_size:
        raise ValueError(f"{n} micro-batches cannot be split evenly over dp_size={dp_size} ranks")
    per_rank = n // dp_size
    heap = [(0.0, rank) for rank in range(dp_size)]  # (load, rank) of ranks with room left
    assignment: list[list[int]] = [[] for _ in range(dp_size)]
    for i in sorted(range(n), key=lambda i: (-works[i], i)):
        load, rank = heapq.heappop(heap)
        assignment[rank].append(i)
        if len(assignment[rank]) < per_rank:
            heapq.heappush(heap, (load + works[i], rank))
    return [sorted(a) for a in assignment]


def rank_loads(works: Sequence[float], assignment: Sequence[Sequence[int]]) -> np.ndarray:
    """Total work per DP rank."""
    works = np.asarray(works, dtype=np.float64)
    return np.array([works[list(a)].sum() for a in assignment])


def imbalance(loads: np.ndarray) -> float:
    """``max / mean - 1`` of per-rank loads (0 when perfectly balanced): the time a step loses waiting
    for its slowest rank, as a fraction of the balanced step time."""
    loads = np.asarray(loads, dtype=np.float64)
    return float(loads.max() / loads.mean() - 1.0) if loads.mean() > 0 else 0.0
