"""Megatron indexed datasets (``.bin``/``.idx``): checked reading and atomic writing of documents.

Files are read and written by megatron-core's own ``IndexedDataset`` and ``IndexedDatasetBuilder``,
so they move freely between this package, ``tools/preprocess_data.py`` and ``GPTDataset``. Before
megatron-core opens a pair, :func:`validate` checks it and names what is wrong (a truncated file, a
``.bin`` from another dataset, a bad header), where megatron-core would fail with a bare assert, a
short ``numpy`` buffer or silently wrong tokens.

The ``.idx`` layout (megatron-core 0.19): magic ``b"MMIDIDX\\x00\\x00"``, ``<Q`` version 1, ``<B``
dtype code, ``<Q`` sequence count ``S``, ``<Q`` document-index count ``D``, ``int32[S]`` sequence
lengths, ``int64[S]`` byte pointers into the ``.bin``, ``int64[D]`` document indices (document ``i``
is sequences ``[D_i, D_{i+1})``), then ``int8[S]`` modes for multimodal datasets only.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from megatron_paradyse.mcore.indexed import DType, IndexedDataset, IndexedDatasetBuilder

__all__ = ["DocumentDataset", "IndexInfo", "missing_files", "validate", "write_documents"]

_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document-index count
# megatron-core's DType codes (indexed_dataset.DType), kept here so validation needs no import.
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


@dataclasses.dataclass(frozen=True)
class IndexInfo:
    """What :func:`validate` learnt from a consistent ``.idx``/``.bin`` pair."""

    dtype: np.dtype
    num_sequences: int
    num_documents: int
    num_tokens: int


def _paths(path_prefix: str | os.PathLike) -> tuple[Path, Path]:
    prefix = os.fspath(path_prefix)
    return Path(prefix + ".idx"), Path(prefix + ".bin")


def missing_files(path_prefix: str | os.PathLike) -> str | None:
    """What is missing of the dataset ``{prefix}.bin``/``{prefix}.idx``, said for a reader (a typo in the
    path is the commonest data mistake), or None when both files are there."""
    prefix = os.fspath(path_prefix)
    missing = [str(p) for p in reversed(_paths(prefix)) if not p.is_file()]
    if len(missing) == 2:
        return (
            f"no dataset at {prefix}: neither {missing[0]} nor {missing[1]} exists (a dataset is named by the path "
            f"of its .bin and .idx files without the suffix)"
        )
    if missing:
        return f"the dataset {prefix} is incomplete: {missing[0]} does not exist"
    return None


def validate(path_prefix: str | os.PathLike) -> IndexInfo:
    """Check that ``{prefix}.idx`` and ``{prefix}.bin`` form one consistent, complete dataset."""
    idx_path, bin_path = _paths(path_prefix)
    missing = missing_files(path_prefix)
    if missing:
        raise FileNotFoundError(missing)
    idx_size, bin_size = idx_path.stat().st_size, bin_path.stat().st_size
    if idx_size < _HEADER.size:
        raise ValueError(f"{idx_path} is truncated: {idx_size} bytes, shorter than the {_HEADER.size}-byte header")
    with open(idx_path, "rb") as f:
        magic, version, code, num_seq, num_doc_idx = _HEADER.unpack(f.read(_HEADER.size))
    if magic != _MAGIC:
        raise ValueError(f"{idx_path} is not a Megatron indexed-dataset index: starts with {magic!r}, not {_MAGIC!r}")
    if version != 1:
        raise ValueError(f"{idx_path} has index version {version}; megatron-core reads version 1 only")
    if code not in _DTYPES:
        raise ValueError(f"{idx_path} has dtype code {code}; valid codes are {sorted(_DTYPES)} (megatron DType)")
    dtype = np.dtype(_DTYPES[code])
    if num_doc_idx < 1:
        raise ValueError(f"{idx_path} has no document indices; even an empty dataset has one (0)")

    expected = _HEADER.size + num_seq * (4 + 8) + num_doc_idx * 8
    if idx_size != expected:
        extra = idx_size - expected
        hint = (
            " (the extra int8 per sequence are multimodal sequence modes, which this package does not read)"
            if extra == num_seq > 0
            else " (truncated)"
            if extra < 0
            else ""
        )
        raise ValueError(
            f"{idx_path} has {idx_size} bytes, but its header ({num_seq} sequences, {num_doc_idx} document "
            f"indices) needs exactly {expected}{hint}"
        )

    index = np.memmap(idx_path, mode="r", offset=_HEADER.size)
    lengths = np.frombuffer(index, dtype=np.int32, count=num_seq)
    pointers = np.frombuffer(index, dtype=np.int64, count=num_seq, offset=4 * num_seq)
    doc_idx = np.frombuffer(index, dtype=np.int64, count=num_doc_idx, offset=12 * num_seq)
    if num_seq and lengths.min() < 0:
        bad = int(np.argmin(lengths))
        raise ValueError(f"{idx_path}: sequence {bad} has negative length {lengths[bad]}; the index is corrupt")
    starts = np.zeros(num_seq + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    wrong = np.flatnonzero(pointers != starts[:-1] * dtype.itemsize)
    if len(wrong):
        j = int(wrong[0])
        raise ValueError(
            f"{idx_path}: sequence {j} points to byte {pointers[j]} of the .bin, but the sequences before it "
            f"end at byte {starts[j] * dtype.itemsize}; the index is corrupt or was not written by "
            f"IndexedDatasetBuilder"
        )
    if doc_idx[0] != 0 or doc_idx[-1] != num_seq or np.any(np.diff(doc_idx) < 0):
        raise ValueError(
            f"{idx_path}: document indices must rise from 0 to the sequence count {num_seq}, got "
            f"{doc_idx[:3].tolist()}...{doc_idx[-3:].tolist()} ({num_doc_idx} entries)"
        )
    num_tokens = int(starts[-1])
    if bin_size != num_tokens * dtype.itemsize:
        what = "truncated" if bin_size < num_tokens * dtype.itemsize else "longer than its index"
        raise ValueError(
            f"{bin_path} does not match {idx_path.name}: the index describes {num_tokens} {dtype.name} tokens "
            f"({num_tokens * dtype.itemsize} bytes), the .bin has {bin_size} bytes ({what}; are the two files "
            f"from the same dataset?)"
        )
    return IndexInfo(dtype, num_seq, num_doc_idx - 1, num_tokens)


class DocumentDataset:
    """The documents of a validated indexed dataset, read through megatron-core's ``IndexedDataset``.

    A document is the concatenation of its sequences (one sequence per document unless the data was
    prepared with sentence splitting). ``dataset[i]`` is document ``i`` as a ``numpy`` array in the
    file's dtype; :meth:`read` returns a token range of it.
    """

    def __init__(self, path_prefix: str | os.PathLike) -> None:
        self.path_prefix = os.fspath(path_prefix)
        self.info = validate(self.path_prefix)
        if not self.info.num_tokens:  # megatron-core cannot map an empty .bin
            raise ValueError(
                f"the dataset {self.path_prefix} has no tokens ({self.info.num_documents} documents, every one "
                f"empty): prepare it again from texts that are not empty, or name another dataset"
            )
        self._megatron = IndexedDataset(self.path_prefix, mmap=True)
        doc_idx = self._megatron.document_indices
        seq_starts = np.zeros(self.info.num_sequences + 1, dtype=np.int64)
        np.cumsum(self._megatron.sequence_lengths, out=seq_starts[1:])
        self._first_sequence = doc_idx[:-1]
        doc_starts = seq_starts[doc_idx]
        self.lengths = np.diff(doc_starts)
        """Tokens per document, ``int64 [num_documents]``."""

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, doc: int) -> np.ndarray:
        self._check_doc(doc)
        return self.read(doc, 0, int(self.lengths[doc]))

    def check_token_ids(self, vocab_size: int, *, chunk_tokens: int = 1 << 26) -> None:
        """Raise ``ValueError`` naming the first document with a token id outside ``[0, vocab_size)``.

        An id past the vocabulary trains on nothing at TP > 1 (each embedding shard masks the ids it
        does not hold), and stops a TP=1 run with an index error at whatever step reads it. Reads the
        whole ``.bin`` once, ``chunk_tokens`` at a time; nothing to read when the file's dtype cannot
        hold an id outside the vocabulary.
        """
        dtype = self.info.dtype
        if np.iinfo(dtype).min >= 0 and np.iinfo(dtype).max < vocab_size:
            return
        tokens = np.memmap(self.path_prefix + ".bin", dtype=dtype, mode="r")
        for start in range(0, len(tokens), chunk_tokens):
            chunk = tokens[start : start + chunk_tokens]
            outside = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
            if len(outside):
                token = start + int(outside[0])
                doc_starts = np.concatenate([[0], np.cumsum(self.lengths)])
                doc = int(np.searchsorted(doc_starts, token, side="right")) - 1
                raise ValueError(
                    f"dataset {self.path_prefix}: document {doc} has token id {tokens[token]} (at its token "
                    f"{token - doc_starts[doc]}), outside the tokenizer's vocabulary [0, {vocab_size}); prepare the "
                    f"dataset with the tokenizer the run uses (--tokenizer-type, --vocab-size, or the dataset's "
                    f"manifest)"
                )

    def _check_doc(self, doc: int) -> None:
        if not 0 <= doc < len(self):
            raise IndexError(f"document {doc} out of range for {len(self)} documents")

    def read(self, doc: int, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of document ``doc``."""
        self._check_doc(doc)
        if offset < 0 or length < 0 or offset + length > self.lengths[doc]:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for document {doc} of length {self.lengths[doc]}"
            )
        if length == 0:
            return np.zeros(0, dtype=self.info.dtype)
        # validate() proved the sequences of a document lie back to back in the .bin, so one read from
        # the document's first sequence covers all of them.
        return self._megatron.get(int(self._first_sequence[doc]), offset=offset, length=length)


def write_documents(path_prefix: str | os.PathLike, documents: Iterable[np.ndarray], *, vocab_size: int) -> IndexInfo:
    """Write ``documents`` (1-D integer arrays, one sequence each) as ``{prefix}.bin``/``{prefix}.idx``.

    The token dtype is megatron-core's choice for ``vocab_size`` (``uint16`` below 65500, else
    ``int32``). Both files appear only when complete: they are written under a temporary name and
    renamed, so a reader never sees a half-written pair.
    """
    dtype = np.dtype(DType.optimal_dtype(vocab_size))
    idx_path, bin_path = _paths(path_prefix)
    idx_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_idx, tmp_bin = _paths(f"{os.fspath(path_prefix)}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype.type)
    try:
        for i, doc in enumerate(documents):
            doc = np.asarray(doc)
            if doc.ndim != 1 or not np.issubdtype(doc.dtype, np.integer):
                raise ValueError(f"document {i} must be a 1-D integer array, got {doc.dtype} of shape {doc.shape}")
            if len(doc) and (doc.min() < 0 or doc.max() >= vocab_size):
                raise ValueError(
                    f"document {i} has token ids in [{doc.min()}, {doc.max()}], outside the vocabulary "
                    f"[0, {vocab_size})"
                )
            builder.add_item(torch.from_numpy(doc.astype(dtype, copy=False)))
            builder.end_document()
        builder.finalize(str(tmp_idx))
        os.replace(tmp_bin, bin_path)
        os.replace(tmp_idx, idx_path)
    finally:
        builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
    return validate(path_prefix)
