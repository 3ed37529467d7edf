"""Tokenizers that need no download: byte-level text and DNABERT-style DNA k-mers.

Both map text to a 1-D ``numpy`` array of token ids (``uint16``: both vocabularies are tiny) and
declare two special ids: ``eod_id`` (end of document, appended by ``prepare --append-eod``) and
``pad_id`` (what pads a micro-batch; it never reaches the loss).
"""

from __future__ import annotations

import itertools
from typing import Protocol

import numpy as np

__all__ = ["ByteTokenizer", "KmerTokenizer", "Tokenizer", "get_tokenizer"]


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int
    pad_id: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte: ids 0..255 are the byte values, 256 is EOD, 257 is padding.

    Text read with ``errors="surrogateescape"`` round-trips exactly, so files that are not valid
    UTF-8 keep their bytes.
    """

    name = "byte"
    eod_id = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="surrogateescape"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: np.ndarray) -> str:
        ids = np.asarray(ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="surrogateescape")


class KmerTokenizer:
    """Overlapping k-mers of a DNA sequence (DNABERT, Ji et al. 2021): ``L`` bases give ``L-k+1`` tokens.

    Ids ``0 .. 4^k-1`` are the k-mers over ``ACGT`` in lexicographic order (``AAA`` = 0, ``AAC`` = 1,
    ...); ``4^k`` is a k-mer with any other letter (``N`` and the like, case-insensitive), then EOD and
    padding. Decoding rebuilds the bases from the first letter of every k-mer plus the last k-mer.
    """

    _ALPHABET = "ACGT"

    def __init__(self, k: int = 3) -> None:
        if not 1 <= k <= 7:
            raise ValueError(f"k must be in [1, 7] (vocabulary 4^k + 3 must fit uint16), got {k}")
        self.k = k
        self.name = f"dna{k}"
        self.unk_id = 4**k
        self.eod_id = self.unk_id + 1
        self.pad_id = self.unk_id + 2
        self.vocab_size = self.unk_id + 3
        # ASCII code -> base index (0..3), 4 for anything that is not a base.
        self._base = np.full(256, 4, dtype=np.int64)
        for i, letter in enumerate(self._ALPHABET):
            self._base[ord(letter)] = self._base[ord(letter.lower())] = i
        self._kmers = ["".join(t) for t in itertools.product(self._ALPHABET, repeat=k)]

    def encode(self, text: str) -> np.ndarray:
        bases = self._base[np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)]
        n = len(bases) - self.k + 1
        if n < 1:
            return np.zeros(0, dtype=np.uint16)
        ids = np.zeros(n, dtype=np.int64)
        unknown = np.zeros(n, dtype=bool)
        for j in range(self.k):  # base-4 digits, most significant first
            window = bases[j : j + n]
            ids = ids * 4 + np.minimum(window, 3)
            unknown |= window == 4
        ids[unknown] = self.unk_id
        return ids.astype(np.uint16)

    def decode(self, ids: np.ndarray) -> str:
        kmers = [self._kmers[i] if i < self.unk_id else "N" * self.k for i in np.asarray(ids) if i < self.eod_id]
        if not kmers:
            return ""
        return "".join(kmer[0] for kmer in kmers) + kmers[-1][1:]


def get_tokenizer(name: str) -> Tokenizer:
    """``"byte"`` or ``"dnaK"`` (overlapping K-mers, e.g. ``"dna3"``)."""
    if name == "byte":
        return ByteTokenizer()
    if name.startswith("dna") and name[3:].isdigit():
        return KmerTokenizer(int(name[3:]))
    raise ValueError(f"unknown tokenizer {name!r}; known: byte, dnaK for k-mers of DNA (e.g. dna3)")
