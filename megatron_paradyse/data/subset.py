"""A few documents of a dataset that still cover its range of lengths: for quick runs and the demo.

A run of a few dozen iterations over a whole corpus in curriculum order sees only its shortest
documents; :func:`spread_by_length` picks documents whose lengths climb evenly (in log length) from
short to long instead, and :class:`DocumentSubset` lets the loader read just those.
"""

from __future__ import annotations

import numpy as np

from megatron_paradyse.data.indexed import DocumentDataset

__all__ = ["DocumentSubset", "spread_by_length"]


def spread_by_length(lengths: np.ndarray, count: int, low: int, high: int) -> np.ndarray:
    """Indices of ``count`` distinct documents of ``low`` to ``high`` tokens whose lengths are spread
    evenly in log length over that range, in increasing length (ties by index).

    Each of ``count`` targets, evenly spaced in ``log(low) .. log(high)``, takes the first document at
    or above it; where two targets would take the same document the later one takes the next.
    """
    lengths = np.asarray(lengths)
    eligible = np.flatnonzero((lengths >= low) & (lengths <= high))
    if len(eligible) < count:
        raise ValueError(
            f"the dataset has {len(eligible)} documents of {low} to {high} tokens, fewer than the {count} asked "
            f"for; widen the range (data.min_len, data.max_len) or ask for fewer (data.num_documents)"
        )
    by_length = eligible[np.argsort(lengths[eligible], kind="stable")]
    targets = np.exp(np.linspace(np.log(low), np.log(high), count))
    picks = np.searchsorted(lengths[by_length], targets)
    n = len(by_length)
    for i in range(count):  # distinct and increasing, leaving room for the picks still to come
        if i:
            picks[i] = max(picks[i], picks[i - 1] + 1)
        picks[i] = min(picks[i], n - (count - i))
    return by_length[picks]


class DocumentSubset:
    """Documents ``docs`` of ``dataset``, renumbered ``0 .. len(docs) - 1``; reads like the dataset."""

    def __init__(self, dataset: DocumentDataset, docs: np.ndarray) -> None:
        self.dataset = dataset
        self.docs = np.asarray(docs, dtype=np.int64)
        self.lengths = dataset.lengths[self.docs]
        """Tokens per document of the subset."""

    def __len__(self) -> int:
        return len(self.docs)

    def read(self, doc: int, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of the subset's document ``doc``."""
        if not 0 <= doc < len(self):
            raise IndexError(f"document {doc} out of range for a subset of {len(self)} documents")
        return self.dataset.read(int(self.docs[doc]), offset, length)
