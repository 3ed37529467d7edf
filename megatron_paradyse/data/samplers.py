"""The samples of a dataset and the order an epoch visits them.

A sample is a :class:`Spans` entry: a token range of one document, at most ``max_len`` long.
An epoch's order is a pure function of the sample lengths, the seed and the epoch number, so every
rank computes the same order without talking:

- ``random``: a uniform permutation.
- ``bucketed``: samples sorted by length, shuffled inside buckets of ``bucket_size`` neighbours (so
  micro-batches change every epoch yet hold similar lengths); :func:`shuffle_steps` then visits the
  epoch's global batches in random order: similar lengths in every step (little padding, balanced
  data-parallel work), a different order every epoch.
- ``curriculum``: shortest first, non-decreasing length (the paper's order); ties in random order.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

import numpy as np

__all__ = ["Overflow", "SamplerName", "Spans", "epoch_order", "shuffle_steps"]

SamplerName = Literal["random", "bucketed", "curriculum"]
Overflow = Literal["split", "truncate"]


@dataclasses.dataclass(frozen=True, eq=False)
class Spans:
    """Samples as token ranges ``[offset, offset + length)`` of documents ``doc`` (``int64 [n]`` each).

    A document longer than ``max_len`` is split into consecutive pieces of ``max_len`` tokens
    (``overflow="split"``) or cut after its first ``max_len`` tokens (``"truncate"``). Every token
    but the last of a document has a label (the next token); a span whose document goes on after it
    (``continues``) keeps the label of its last token. Spans with no label at all (documents of
    fewer than two tokens, or a one-token last piece) are left out: they hold nothing to learn.
    """

    doc: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    continues: np.ndarray
    """``bool [n]``: the document has a token after the span, the label of the span's last token."""

    @classmethod
    def build(cls, doc_lengths: np.ndarray, max_len: int, overflow: Overflow = "split") -> Spans:
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2 tokens (one token has no label), got {max_len}")
        if overflow not in get_args(Overflow):
            raise ValueError(f"overflow must be one of {get_args(Overflow)}, got {overflow!r}")
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        pieces = -(-doc_lengths // max_len) if overflow == "split" else np.minimum(doc_lengths, 1)
        doc = np.repeat(np.arange(len(doc_lengths)), pieces)
        first = np.repeat(np.cumsum(pieces) - pieces, pieces)
        offset = (np.arange(len(doc)) - first) * max_len
        length = np.minimum(doc_lengths[doc] - offset, max_len)
        continues = offset + length < doc_lengths[doc]
        keep = length - ~continues >= 1  # tokens with a label: the last one has none unless the document goes on
        return cls(doc[keep], offset[keep], length[keep], continues[keep])

    def __len__(self) -> int:
        return len(self.doc)


def epoch_order(
    sampler: SamplerName, lengths: np.ndarray, *, seed: int, epoch: int, bucket_size: int = 256
) -> np.ndarray:
    """The sample indices of epoch ``epoch`` in order (every sample exactly once)."""
    rng = _rng(seed, epoch)
    n = len(lengths)
    if sampler == "random":
        return rng.permutation(n)
    by_length = np.lexsort((rng.permutation(n), lengths))  # length, ties in random order
    if sampler == "curriculum":
        return by_length
    if sampler == "bucketed":
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        return np.concatenate([rng.permutation(by_length[i : i + bucket_size]) for i in range(0, n, bucket_size)])
    raise ValueError(f"unknown sampler {sampler!r}; known: {', '.join(get_args(SamplerName))}")


def shuffle_steps(micro_batches: list, *, step_size: int, head: int, seed: int, epoch: int) -> list:
    """The micro-batches of a bucketed epoch, whole global batches of ``step_size`` in random order.

    The epoch's stream starts ``head`` micro-batches before a step boundary (the step in progress
    when the epoch began takes them), so the groups are: the first ``head``, full steps, then what
    is left; only the full steps move, so every step but the one spanning two epochs holds
    neighbours in length order.
    """
    head = min(head, len(micro_batches))
    full = (len(micro_batches) - head) // step_size
    starts = head + step_size * _rng(seed, epoch, 1).permutation(full)
    middle = [mb for start in starts for mb in micro_batches[start : start + step_size]]
    return micro_batches[:head] + middle + micro_batches[head + full * step_size :]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng(list(key))
