"""Indexed datasets: what is written is read back identically, by us and by megatron-core; a broken
``.idx``/``.bin`` pair gets a clear error; text folders and JSONL files become datasets; tokenizers."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct

import numpy as np
import pytest
import torch

from megatron_paradyse.data.indexed import DocumentDataset, validate, write_documents
from megatron_paradyse.data.prepare import prepare, read_manifest
from megatron_paradyse.data.tokenizers import ByteTokenizer, KmerTokenizer, get_tokenizer
from megatron_paradyse.mcore import indexed as megatron_indexed

LENGTHS = [1, 2, 3, 0, 517, 70_000, 5]


def random_docs(lengths, vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, size=n) for n in lengths]


@pytest.fixture
def small(tmp_path):
    """A written dataset: (prefix, documents)."""
    docs = random_docs(LENGTHS, 258)
    write_documents(tmp_path / "small", docs, vocab_size=258)
    return str(tmp_path / "small"), docs


@pytest.mark.parametrize("vocab_size, dtype", [(258, np.uint16), (100_000, np.int32)])
def test_round_trip_by_us_and_by_megatron(tmp_path, vocab_size, dtype):
    docs = random_docs(LENGTHS, vocab_size)
    info = write_documents(tmp_path / "d", docs, vocab_size=vocab_size)
    assert (info.dtype, info.num_documents, info.num_tokens) == (np.dtype(dtype), len(docs), sum(LENGTHS))
    dataset = DocumentDataset(tmp_path / "d")
    assert dataset.lengths.tolist() == LENGTHS
    for doc, expected in zip(range(len(dataset)), docs):
        np.testing.assert_array_equal(dataset[doc], expected)
        assert dataset[doc].dtype == dtype
    np.testing.assert_array_equal(dataset.read(5, 60_000, 123), docs[5][60_000:60_123])
    megatron = megatron_indexed.IndexedDataset(str(tmp_path / "d"))
    for i, expected in enumerate(docs):
        np.testing.assert_array_equal(megatron[i], expected)


def test_document_of_several_sequences_reads_as_one(tmp_path):
    """Megatron's sentence-split datasets: a document is several sequences back to back."""
    builder = megatron_indexed.IndexedDatasetBuilder(str(tmp_path / "s.bin"), dtype=np.uint16)
    builder.add_document(torch.arange(7), lengths=[3, 4])
    builder.add_document(torch.arange(10, 12), lengths=[2])
    builder.finalize(str(tmp_path / "s.idx"))
    dataset = DocumentDataset(tmp_path / "s")
    assert dataset.lengths.tolist() == [7, 2]
    np.testing.assert_array_equal(dataset[0], np.arange(7))
    np.testing.assert_array_equal(dataset[1], [10, 11])
    np.testing.assert_array_equal(dataset.read(0, 2, 3), [2, 3, 4])  # across the sequence boundary


def test_out_of_range_reads_and_tokens_are_refused(small, tmp_path):
    prefix, docs = small
    dataset = DocumentDataset(prefix)
    with pytest.raises(IndexError, match=r"tokens \[2, 4\) out of range for document 2 of length 3"):
        dataset.read(2, 2, 2)
    with pytest.raises(IndexError, match="document 7 out of range for 7 documents"):
        dataset[7]
    with pytest.raises(ValueError, match=r"document 1 has token ids in \[0, 258\], outside the vocabulary \[0, 258\)"):
        write_documents(tmp_path / "bad", [np.array([1]), np.array([0, 258])], vocab_size=258)
    assert not (tmp_path / "bad.bin").exists() and not (tmp_path / "bad.idx").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "tmp" in p.name) == []


def _header(prefix):
    with open(prefix + ".idx", "rb") as f:
        return bytearray(f.read())


def _rewrite_idx(prefix, data):
    with open(prefix + ".idx", "wb") as f:
        f.write(bytes(data))


def _truncate(path, nbytes):
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - nbytes)


def test_truncated_idx(small):
    prefix, _ = small
    _truncate(prefix + ".idx", 8)
    # 34-byte header + 7 sequences * 12 bytes + 8 document indices * 8 bytes = 182
    message = (
        f"{prefix}.idx has 174 bytes, but its header (7 sequences, 8 document indices) needs exactly 182 (truncated)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(prefix)
    with pytest.raises(ValueError, match=re.escape(message)):
        DocumentDataset(prefix)
    _truncate(prefix + ".idx", 170)
    with pytest.raises(ValueError, match=re.escape(f"{prefix}.idx is truncated: 4 bytes, shorter than the 34-byte")):
        validate(prefix)


def test_truncated_bin(small):
    prefix, _ = small
    _truncate(prefix + ".bin", 2)
    tokens = sum(LENGTHS)
    message = (
        f"{prefix}.bin does not match small.idx: the index describes {tokens} uint16 tokens ({2 * tokens} bytes), "
        f"the .bin has {2 * tokens - 2} bytes (truncated; are the two files from the same dataset?)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        DocumentDataset(prefix)


def test_mismatched_pair(small, tmp_path):
    """The .bin of another dataset: shorter, then longer than the index says."""
    prefix, _ = small
    for name, lengths, what in (
        ("shorter", [10, 20], "60 bytes (truncated;"),
        ("longer", [70_000, 600], "141200 bytes (longer"),
    ):
        write_documents(tmp_path / name, random_docs(lengths, 258), vocab_size=258)
        shutil.copy(tmp_path / f"{name}.bin", prefix + ".bin")
        with pytest.raises(ValueError, match=re.escape(f"the .bin has {what}")):
            validate(prefix)


@pytest.mark.parametrize(
    "offset, value, message",
    [
        (0, b"XXIDIDX\x00\x00", "is not a Megatron indexed-dataset index: starts with b'XXIDIDX\\x00\\x00'"),
        (9, struct.pack("<Q", 2), "has index version 2; megatron-core reads version 1 only"),
        (17, struct.pack("<B", 9), "has dtype code 9; valid codes are [1, 2, 3, 4, 5, 6, 7, 8] (megatron DType)"),
        # the pointer of sequence 2 (after the 7 int32 lengths and 2 int64 pointers)
        (
            34 + 28 + 16,
            struct.pack("<q", 7),
            "sequence 2 points to byte 7 of the .bin, but the sequences before it end",
        ),
        # the last document index
        (34 + 84 + 56, struct.pack("<q", 6), "document indices must rise from 0 to the sequence count 7"),
    ],
    ids=["magic", "version", "dtype", "pointer", "document-index"],
)
def test_corrupt_index(small, offset, value, message):
    prefix, _ = small
    data = _header(prefix)
    data[offset : offset + len(value)] = value
    _rewrite_idx(prefix, data)
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(prefix)


def test_missing_file(small):
    prefix, _ = small
    os.remove(prefix + ".bin")
    with pytest.raises(
        FileNotFoundError, match=re.escape(f"the dataset {prefix} is incomplete: {prefix}.bin does not")
    ):
        DocumentDataset(prefix)


def test_a_dataset_without_tokens_is_refused_before_megatron_maps_it(tmp_path, recwarn):
    prefix = tmp_path / "empty"
    write_documents(prefix, [np.zeros(0, dtype=np.int64)] * 2, vocab_size=256)
    message = f"the dataset {prefix} has no tokens (2 documents, every one empty): prepare it again from texts"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        DocumentDataset(prefix)
    assert not recwarn.list  # nothing half-made left to warn as it is collected


def test_prepare_folder_keeps_bytes_and_order(tmp_path):
    src = tmp_path / "src"
    (src / "b").mkdir(parents=True)
    files = {"a.txt": b"hello\r\nworld", "b/c.txt": "caf\u00e9 \xff".encode("latin-1"), "z.txt": b"z"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "empty.txt").write_bytes(b"")
    (src / "skip.md").write_bytes(b"not matched")
    result = prepare(src, tmp_path / "out", ByteTokenizer(), append_eod=True)
    assert result.names == ["a.txt", "b/c.txt", "z.txt"] and result.skipped_empty == ["empty.txt"]
    dataset = DocumentDataset(tmp_path / "out")
    for i, data in enumerate(files.values()):
        np.testing.assert_array_equal(dataset[i], [*data, ByteTokenizer.eod_id])
    manifest = read_manifest(tmp_path / "out")
    assert manifest["tokenizer"] == "byte" and manifest["num_documents"] == 3 and manifest["skipped_empty"] == 1


def test_prepare_jsonl(tmp_path):
    lines = [json.dumps({"text": "ACGTAC", "id": 1}), "", json.dumps({"text": "GGGNA"})]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    result = prepare(tmp_path / "in.jsonl", tmp_path / "dna", get_tokenizer("dna3"))
    assert result.names == [f"{tmp_path / 'in.jsonl'}:1", f"{tmp_path / 'in.jsonl'}:3"]
    dataset = DocumentDataset(tmp_path / "dna")
    # ACG=6 CGT=27 GTA=44 TAC=49; GGG=42, then two k-mers holding N
    assert dataset[0].tolist() == [6, 27, 44, 49] and dataset[1].tolist() == [42, 64, 64]

    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(
        ValueError, match=r"bad\.jsonl:2: needs a string field 'text' \(use --json-key\); found \['txt'\]"
    ):
        prepare(tmp_path / "bad.jsonl", tmp_path / "x", ByteTokenizer())
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a JSON object"):
        prepare(tmp_path / "bad.jsonl", tmp_path / "x", ByteTokenizer())


def test_tokenizers_round_trip():
    byte = ByteTokenizer()
    text = "def f(x):\n    return x  # \u00e9\u4e2d"
    assert byte.decode(byte.encode(text)) == text and len(byte.encode(text)) == len(text.encode())
    kmer = KmerTokenizer(3)
    dna = "ACGTTGCAAC" * 5
    ids = kmer.encode(dna)
    assert len(ids) == len(dna) - 2 and ids.max() < 64 and kmer.decode(ids) == dna
    assert kmer.vocab_size == 67 and (kmer.unk_id, kmer.eod_id, kmer.pad_id) == (64, 65, 66)
    assert len(kmer.encode("AC")) == 0
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt2'"):
        get_tokenizer("gpt2")
