"""Tokenize a folder of text files or a JSONL file into a Megatron indexed dataset.

One input text is one document. Beside ``{prefix}.bin``/``{prefix}.idx`` goes ``{prefix}.json``, a
manifest: the tokenizer (name, vocabulary size, EOD and padding ids), the source, and any extra
fields the caller adds (the built-in corpora record what they were built from).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from megatron_paradyse.data.indexed import IndexInfo, write_documents
from megatron_paradyse.data.tokenizers import Tokenizer

__all__ = ["PrepareResult", "folder_texts", "jsonl_texts", "prepare", "read_manifest", "write_dataset"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PrepareResult:
    path_prefix: str
    info: IndexInfo
    names: list[str]
    """The source of every document written, in order (file path, or ``file:line``)."""
    skipped_empty: list[str]
    """Inputs that tokenized to nothing; they are not written."""


def folder_texts(
    root: str | os.PathLike, pattern: str = "*.txt", exclude: Iterable[str] = ()
) -> Iterator[tuple[str, str]]:
    """``(relative path, text)`` of every file under ``root`` matching ``pattern``, in sorted path order.

    Files whose path has a component in ``exclude`` are skipped. Bytes that are not UTF-8 are kept
    (``surrogateescape``), so the byte tokenizer sees every file exactly as stored.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"input folder {root} does not exist or is not a folder")
    exclude = set(exclude)
    paths = sorted(p for p in root.rglob(pattern) if p.is_file() and not exclude & set(p.relative_to(root).parts))
    for path in paths:
        yield str(path.relative_to(root)), path.read_bytes().decode("utf-8", errors="surrogateescape")


def jsonl_texts(path: str | os.PathLike, key: str = "text") -> Iterator[tuple[str, str]]:
    """``("file:line", text)`` of every non-blank line of a JSONL file, the text under ``key``."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON object ({e.msg})") from e
            if not isinstance(record, dict) or not isinstance(record.get(key), str):
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{where}: needs a string field {key!r} (use --json-key); found {keys}")
            yield where, record[key]


def write_dataset(
    texts: Iterable[tuple[str, str]],
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    append_eod: bool = False,
    source: str = "",
    extra_manifest: dict | None = None,
) -> PrepareResult:
    """Tokenize ``(name, text)`` pairs, write the non-empty ones as documents, then the manifest."""
    names: list[str] = []
    skipped: list[str] = []

    def documents() -> Iterator[np.ndarray]:
        for name, text in texts:
            ids = tokenizer.encode(text)
            if not len(ids):
                skipped.append(name)
                continue
            names.append(name)
            yield np.append(ids, tokenizer.eod_id) if append_eod else ids

    info = write_documents(output_prefix, documents(), vocab_size=tokenizer.vocab_size)
    if skipped:
        logger.info("skipped %d empty inputs (first: %s)", len(skipped), skipped[0])
    manifest = {
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eod_id": tokenizer.eod_id,
        "pad_id": tokenizer.pad_id,
        "append_eod": append_eod,
        "source": source,
        "num_documents": info.num_documents,
        "num_tokens": info.num_tokens,
        "skipped_empty": len(skipped),
        **(extra_manifest or {}),
    }
    path = Path(f"{os.fspath(output_prefix)}.json")
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)  # readers see the old manifest or the new one, never half of one
    return PrepareResult(os.fspath(output_prefix), info, names, skipped)


def read_manifest(path_prefix: str | os.PathLike) -> dict | None:
    """The manifest :func:`write_dataset` wrote beside a dataset, or None (datasets from elsewhere)."""
    path = Path(f"{os.fspath(path_prefix)}.json")
    return json.loads(path.read_text()) if path.is_file() else None


def prepare(
    input_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    tokenizer: Tokenizer,
    *,
    json_key: str = "text",
    pattern: str = "*.txt",
    append_eod: bool = False,
) -> PrepareResult:
    """A folder (every file matching ``pattern``) or a ``.jsonl`` file -> ``{output_prefix}.bin/.idx/.json``."""
    input_path = Path(input_path)
    if input_path.is_dir():
        texts = folder_texts(input_path, pattern)
    elif input_path.is_file():
        texts = jsonl_texts(input_path, json_key)
    else:
        raise ValueError(f"input {input_path} is neither a folder of text files nor a JSONL file")
    return write_dataset(texts, output_prefix, tokenizer, append_eod=append_eod, source=str(input_path))
