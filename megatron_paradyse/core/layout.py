"""The canonical token layout of one micro-batch over a group of ``p`` ranks.

Every strategy reads and writes activations as ``[s/p, b, h]``: Megatron's sequence-parallel split of
the sequence *in canonical order*. The padded sequence is cut into ``2p`` equal chunks. In the
``zigzag`` order (the default for causal attention) rank ``r`` holds chunks ``r`` and ``2p-1-r``, so
every rank does the same amount of causal attention work; in the ``contiguous`` order (the default for
bidirectional attention, and the order stock Megatron feeds a model in) rank ``r`` holds chunks ``2r``
and ``2r+1``: canonical order is natural order. The data pipeline applies the permutation once to ids,
labels, loss mask and positions; Megatron's contiguous split then hands each rank its canonical shard.

Sequences are padded to a multiple of ``2p``. Padding is a document of its own: it never attends to,
or is attended by, a real token, and the loss mask removes it.

Attention strategies ask the layout which (query, key) token blocks may see each other
(:class:`Segment`), so causal masking, key padding and packed documents are one mechanism.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch

__all__ = ["LayoutIndices", "Segment", "SequenceLayout", "padded_length", "zigzag_permutation"]

_ORDERS = ("zigzag", "contiguous")


def padded_length(seq_len: int, p: int) -> int:
    """Smallest multiple of ``2p`` that holds ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_len}")
    if p < 1:
        raise ValueError(f"group size p must be >= 1, got {p}")
    quantum = 2 * p
    return -(-seq_len // quantum) * quantum


def zigzag_permutation(padded_len: int, p: int) -> torch.Tensor:
    """Canonical index -> natural position for the zigzag order (rank r: chunks r and 2p-1-r)."""
    _check_padded(padded_len, p)
    chunk = padded_len // (2 * p)
    order = [c for r in range(p) for c in (r, 2 * p - 1 - r)]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in order])


def _check_padded(padded_len: int, p: int) -> None:
    if padded_len % (2 * p):
        raise ValueError(
            f"sequence length {padded_len} is not a multiple of 2p={2 * p}; "
            f"pad it to padded_length(s, p)={padded_length(max(padded_len, 1), p)}"
        )


class Segment(NamedTuple):
    """Queries ``[q_start, q_end)`` attend keys ``[k_start, k_end)`` (local indices).

    ``causal`` segments are square and cover the same natural positions on both sides; the others
    are fully visible.
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    causal: bool


class LayoutIndices(NamedTuple):
    """A layout's index tensors on one device (:meth:`SequenceLayout.indices`)."""

    natural_positions: torch.Tensor
    """Canonical index -> natural position, ``[padded_len]`` int64."""
    canonical_index: torch.Tensor
    """Natural position -> canonical index, ``[padded_len]`` int64."""
    position_ids: torch.Tensor
    """Rotary position of every canonical token, ``[padded_len]`` int64."""
    cu_seqlens: torch.Tensor
    """Natural start of every document and the padded end, ``[docs+1]`` int32 (the padding a document
    of its own): the bounds a variable-length attention call takes."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self)


class _Run(NamedTuple):
    """Tokens ``[local, local+length)`` of a tensor hold natural positions ``[natural, natural+length)``."""

    local: int
    natural: int
    length: int


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceLayout:
    """Padding, order and attention visibility of one micro-batch for a group of ``p`` ranks.

    A pure function of the document lengths, ``p`` and the mask type, so every rank builds the same
    layout without talking. All samples of a ``[s, b]`` micro-batch share it; documents of different
    lengths are packed into one sample (``doc_lengths`` has several entries).
    """

    doc_lengths: tuple[int, ...]
    """Real documents, back to back in natural order; one entry for an unpacked sequence."""
    p: int
    """Size of the group that shares the sequence."""
    causal: bool
    """Causal or bidirectional attention."""
    padded_len: int
    """Total tokens after padding: a multiple of 2p."""
    order: str | None = None
    """``zigzag`` or ``contiguous`` (see the module's docstring); None: zigzag for causal attention,
    contiguous for bidirectional. Every order is exact; only the causal work per rank differs."""

    def __post_init__(self) -> None:
        if self.order is None:
            object.__setattr__(self, "order", "zigzag" if self.causal else "contiguous")
        if self.order not in _ORDERS:
            raise ValueError(f"order must be one of {', '.join(_ORDERS)} (or None), got {self.order!r}")
        if not self.doc_lengths or any(int(n) < 1 for n in self.doc_lengths):
            raise ValueError(f"doc_lengths must be positive, got {self.doc_lengths}")
        _check_padded(self.padded_len, self.p)
        if self.padded_len < self.valid_len:
            raise ValueError(f"padded_len={self.padded_len} is shorter than the {self.valid_len} real tokens")

    @classmethod
    def build(
        cls, doc_lengths: int | Sequence[int], p: int, *, causal: bool, order: str | None = None
    ) -> SequenceLayout:
        """Layout of documents packed back to back and padded to a multiple of ``2p``."""
        docs = (int(doc_lengths),) if isinstance(doc_lengths, int) else tuple(map(int, doc_lengths))
        return cls(docs, p, causal, padded_length(sum(docs), p), order)

    @property
    def value(self) -> tuple:
        """What defines the layout, for the keys of caches that outlive one layout object: layouts
        compare by identity (they cache index tensors), and the planner builds a new one per bucket."""
        return (self.doc_lengths, self.p, self.causal, self.padded_len, self.order)

    # -- sizes ------------------------------------------------------------------------------------
    @property
    def valid_len(self) -> int:
        return sum(self.doc_lengths)

    @property
    def local_len(self) -> int:
        """Tokens per rank: ``s/p``."""
        return self.padded_len // self.p

    @functools.cached_property
    def doc_bounds(self) -> tuple[tuple[int, int], ...]:
        """Natural ``[start, end)`` of every document, the padding document last."""
        bounds, start = [], 0
        for n in self.doc_lengths:
            bounds.append((start, start + n))
            start += n
        if start < self.padded_len:
            bounds.append((start, self.padded_len))
        return tuple(bounds)

    # -- permutation ------------------------------------------------------------------------------
    @functools.cached_property
    def natural_positions(self) -> torch.Tensor:
        """Canonical index -> natural position, ``[padded_len]``."""
        if self.order == "zigzag":
            return zigzag_permutation(self.padded_len, self.p)
        return torch.arange(self.padded_len)

    @functools.cached_property
    def canonical_index(self) -> torch.Tensor:
        """Natural position -> canonical index: the inverse of :attr:`natural_positions`."""
        return torch.argsort(self.natural_positions)

    def indices(self, device: torch.device | str) -> LayoutIndices:
        """The index tensors strategies need, on ``device``; copied there once per layout (that is, per
        micro-batch): the entry point asks for them before the model runs, so that no layer copies
        host data (a host synchronisation on a GPU) and every layer shares one copy."""
        device = torch.device(device)
        if device not in self._indices:
            host = (self.natural_positions, self.canonical_index, self.position_ids, self.cu_seqlens)
            if device.type == "cuda":  # from pinned memory, without waiting for the copy
                host = tuple(t.pin_memory() for t in host)
            self._indices[device] = LayoutIndices(*(t.to(device, non_blocking=True) for t in host))
        return self._indices[device]

    @functools.cached_property
    def _indices(self) -> dict[torch.device, LayoutIndices]:
        return {}

    @property
    def is_identity(self) -> bool:
        """True when canonical order is natural order (contiguous, or p=1)."""
        return self.order == "contiguous" or self.p == 1

    @functools.cached_property
    def position_ids(self) -> torch.Tensor:
        """Rotary position of every canonical token (restarting at 0 in each document)."""
        natural = torch.cat([torch.arange(e - s) for s, e in self.doc_bounds])
        return natural[self.natural_positions]

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """Natural start of every document and the padded end, ``[docs+1]`` int32."""
        return torch.tensor([0, *(end for _, end in self.doc_bounds)], dtype=torch.int32)

    @functools.cached_property
    def loss_mask(self) -> torch.Tensor:
        """1.0 for real tokens, 0.0 for padding, in canonical order."""
        return (self.natural_positions < self.valid_len).float()

    def local_slice(self, rank: int) -> slice:
        """The canonical tokens rank ``rank`` holds."""
        if not 0 <= rank < self.p:
            raise ValueError(f"rank must be in [0, {self.p}), got {rank}")
        return slice(rank * self.local_len, (rank + 1) * self.local_len)

    def to_canonical(self, t: torch.Tensor, dim: int = 0, pad_value: float | int = 0) -> torch.Tensor:
        """Natural order with ``valid_len`` (or ``padded_len``) entries on ``dim`` -> canonical order."""
        n = t.shape[dim]
        if n == self.valid_len and n < self.padded_len:
            pad_shape = list(t.shape)
            pad_shape[dim] = self.padded_len - n
            t = torch.cat([t, t.new_full(pad_shape, pad_value)], dim=dim)
        elif n != self.padded_len:
            raise ValueError(
                f"expected {self.valid_len} (unpadded) or {self.padded_len} (padded) entries on dim {dim}, got {n}"
            )
        if self.is_identity:
            return t
        return t.index_select(dim, self.natural_positions.to(t.device))

    def from_canonical(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Canonical order -> natural order, padding dropped."""
        if t.shape[dim] != self.padded_len:
            raise ValueError(f"expected {self.padded_len} entries on dim {dim}, got {t.shape[dim]}")
        if not self.is_identity:
            t = t.index_select(dim, self.canonical_index.to(t.device))
        return t.narrow(dim, 0, self.valid_len)

    def check_local(self, x_local: torch.Tensor, what: str = "x_local") -> None:
        """Raise if ``x_local`` is not this rank's ``[s/p, ...]`` shard of the padded sequence."""
        if x_local.shape[0] != self.local_len:
            raise ValueError(
                f"{what} has {x_local.shape[0]} tokens on dim 0, but the layout puts "
                f"{self.local_len} on each of p={self.p} ranks ({self.valid_len} tokens padded to "
                f"{self.padded_len}, a multiple of 2p); pad and permute the batch with "
                f"SequenceLayout.to_canonical before the model"
            )

    # -- attention visibility ---------------------------------------------------------------------
    @property
    def causal_tail_padding(self) -> int:
        """Padding tokens after the only document of a causal sequence; 0 where there is no padding,
        more than one document, or no causal mask. Attention over the whole sequence then runs as one
        causal call, as if unpadded: no real query comes after a padding key, and the padding's own
        rows are redone over the padding alone (``attention.blocks.segment_attention``)."""
        if not self.causal or len(self.doc_lengths) != 1:
            return 0
        return self.padded_len - self.valid_len

    def full_segments(self) -> tuple[Segment, ...]:
        """Visible blocks of the whole sequence in natural order (query tensor = key tensor)."""
        return self._self_segments((_Run(0, 0, self.padded_len),))

    def ring_segments(self, q_rank: int, k_rank: int) -> tuple[Segment, ...]:
        """Visible blocks between the local tokens of ``q_rank`` (queries) and ``k_rank`` (keys)."""
        key = (q_rank, k_rank)
        if key not in self._ring_cache:
            self._ring_cache[key] = self._compute_ring_segments(q_rank, k_rank)
        return self._ring_cache[key]

    @functools.cached_property
    def _ring_cache(self) -> dict[tuple[int, int], tuple[Segment, ...]]:
        return {}

    def local_runs(self, rank: int) -> tuple[_Run, ...]:
        """Maximal runs of consecutive natural positions among the tokens ``rank`` holds: its two chunks
        (zigzag ``r, 2p-1-r`` or contiguous ``2r, 2r+1``), one run where they are adjacent. Computed from
        the chunk numbers, not from :attr:`natural_positions`: cost models ask for every rank pair of
        sequences of millions of tokens."""
        if not 0 <= rank < self.p:
            raise ValueError(f"rank must be in [0, {self.p}), got {rank}")
        chunk = self.padded_len // (2 * self.p)
        first, second = (rank, 2 * self.p - 1 - rank) if self.order == "zigzag" else (2 * rank, 2 * rank + 1)
        if second == first + 1:
            return (_Run(0, first * chunk, 2 * chunk),)
        return (_Run(0, first * chunk, chunk), _Run(chunk, second * chunk, chunk))

    def _compute_ring_segments(self, q_rank: int, k_rank: int) -> tuple[Segment, ...]:
        if q_rank == k_rank:
            return self._self_segments(self.local_runs(q_rank))
        segments = []
        for q_runs, k_runs in zip(self._runs_by_document[q_rank], self._runs_by_document[k_rank]):
            for q in q_runs:
                for k in k_runs:
                    # Blocks of different ranks never share positions: all before, or all after.
                    if not self.causal or k.natural + k.length <= q.natural:
                        segments.append(Segment(q.local, q.local + q.length, k.local, k.local + k.length, False))
        return _coalesce(segments)

    @functools.cached_property
    def _runs_by_document(self) -> tuple[tuple[list[_Run], ...], ...]:
        """Each rank's :meth:`local_runs` clipped to each document: ring segments pair two ranks' runs
        document by document, for every pair of ranks."""
        return tuple(
            tuple(_clip_runs(self.local_runs(rank), start, end) for start, end in self.doc_bounds)
            for rank in range(self.p)
        )

    def _self_segments(self, runs: tuple[_Run, ...]) -> tuple[Segment, ...]:
        # Local order increases with natural position, so inside one document "key before query"
        # is the same relation locally and globally: one square segment per document.
        assert all(a.natural + a.length <= b.natural for a, b in zip(runs, runs[1:])), runs
        segments = []
        for d_start, d_end in self.doc_bounds:
            clipped = _clip_runs(runs, d_start, d_end)
            if clipped:
                lo, hi = clipped[0].local, clipped[-1].local + clipped[-1].length
                segments.append(Segment(lo, hi, lo, hi, self.causal))
        return tuple(segments)


def _clip_runs(runs: Sequence[_Run], start: int, end: int) -> list[_Run]:
    """The parts of ``runs`` whose natural positions fall in ``[start, end)``."""
    out = []
    for r in runs:
        lo, hi = max(r.natural, start), min(r.natural + r.length, end)
        if lo < hi:
            out.append(_Run(r.local + lo - r.natural, lo, hi - lo))
    return out


def _coalesce(segments: list[Segment]) -> tuple[Segment, ...]:
    """Merge fully visible segments that share one side and are adjacent on the other."""
    if len(segments) < 2:
        return tuple(segments)
    segments = list(segments)
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(segments):
            for j, b in enumerate(segments):
                if i == j or a.causal or b.causal:
                    continue
                if (a.q_start, a.q_end) == (b.q_start, b.q_end) and a.k_end == b.k_start:
                    segments[i] = a._replace(k_end=b.k_end)
                elif (a.k_start, a.k_end) == (b.k_start, b.k_end) and a.q_end == b.q_start:
                    segments[i] = a._replace(q_end=b.q_end)
                else:
                    continue
                del segments[j]
                merged = True
                break
            if merged:
                break
    return tuple(sorted(segments))
