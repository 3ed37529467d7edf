"""Some of a dataset's documents: a few that still cover its range of lengths, or a held-out split.

A run of a few dozen iterations over a whole corpus in curriculum order sees only its shortest
documents; :func:`spread_by_length` picks documents whose lengths climb evenly (in log length) from
short to long instead. :func:`split_documents` divides documents into training, validation and test
by Megatron's ``--split`` shares. :class:`DocumentSubset` lets the loader read just those.
"""

from __future__ import annotations

import re

import numpy as np

from megatron_paradyse.data.indexed import DocumentDataset

__all__ = ["DocumentSubset", "split_documents", "split_fractions", "spread_by_length"]


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


def split_fractions(split: str) -> tuple[float, float, float]:
    """Megatron's ``--split`` (``"98,2,0"``: training, validation, test shares; missing ones are 0) as
    fractions that sum to 1."""
    shares = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not 1 <= len(shares) <= 3 or sum(shares) <= 0:
        raise ValueError(
            f"--split {split!r}: give up to three non-negative shares of training, validation and test with a "
            f"positive sum, e.g. 98,2,0"
        )
    shares += [0.0] * (3 - len(shares))
    return tuple(share / sum(shares) for share in shares)


def split_documents(num_documents: int, fractions: tuple[float, float, float], seed: int) -> list[np.ndarray]:
    """Training, validation and test documents (indices, each in increasing order) of ``num_documents``.

    Megatron cuts its documents into contiguous ranges at the rounded cumulative fractions; here the
    ranges are cut from a permutation seeded by ``seed`` instead, so that each split spans the dataset
    (a corpus in file order, or a subset in length order, would put its last documents in one split).
    A pure function of its arguments: every rank gets the same split.
    """
    order = np.random.default_rng([seed, num_documents]).permutation(num_documents)
    bounds = np.rint(np.cumsum([0.0, *fractions]) * num_documents).astype(int)
    return [np.sort(order[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
