"""Two corpora built on any machine, with no download, shaped like the paper's datasets.

``code``: every ``.py`` file of the running interpreter's standard library (``site-packages``
excluded), in sorted path order, one document per file, byte-level tokens. Its lengths are long-tailed
like the paper's GitHubCode (Python files, GPT-2 tokens); bytes are ~3-4x more tokens than GPT-2 BPE,
so its tail is heavier.

``dna``: **synthetic** DNA, not GRCh38. Sequence lengths, in overlapping 3-mer tokens (DNABERT, as
in the paper), follow the GRCh38 row of the paper's Table 3: the share of sequences in each bin is the
paper's (normalised: the printed row sums to 99.1%), with one sequence of exactly the maximum. The
paper's maximum, 624K tokens, is read as 624 x 1024 = 638,976; ``max_len`` scales every bin edge by
``max_len / 638976`` so a CPU run can stay small. Inside a bin, lengths are log-uniform; the open
first bin ``(0, 4K)`` is drawn from ``[512, 4K)``. Bases are drawn i.i.d. from a seeded generator with
the human genome's 41% GC content; nothing else about them is genomic.

Each builder writes ``{out_dir}/{name}.bin/.idx/.json`` and returns the prefix; a dataset already
there, built with the same parameters, is reused.
"""

from __future__ import annotations

import logging
import os
import platform
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from megatron_paradyse.data.indexed import validate
from megatron_paradyse.data.prepare import folder_texts, read_manifest, write_dataset
from megatron_paradyse.data.stats import BIN_EDGES
from megatron_paradyse.data.tokenizers import ByteTokenizer, KmerTokenizer

__all__ = [
    "GITHUBCODE_MAX_LEN",
    "GITHUBCODE_SHARES",
    "GRCH38_MAX_LEN",
    "GRCH38_SHARES",
    "NotBuilt",
    "binned_lengths",
    "build_code_corpus",
    "build_dna_corpus",
    "dna_lengths",
]

logger = logging.getLogger(__name__)

GRCH38_SHARES = (3.5, 26.4, 28.7, 21.2, 11.9, 5.5, 1.9)
"""Percent of GRCh38 sequences per bin of :data:`~megatron_paradyse.data.stats.BIN_EDGES` (paper, Table 3)."""
GRCH38_MAX_LEN = 624 * 1024
GITHUBCODE_SHARES = (65.7, 14.5, 9.8, 5.1, 2.7, 1.1, 1.1)
"""Percent of GitHubCode sequences (GPT-2 tokens) per bin of :data:`~megatron_paradyse.data.stats.BIN_EDGES`
(paper, Table 3)."""
GITHUBCODE_MAX_LEN = 309 * 1024
_FIRST_BIN_LOW = 512
_BASE_PROBS = (0.295, 0.205, 0.205, 0.295)  # A, C, G, T: 41% GC


class NotBuilt(LookupError):
    """A corpus asked for without building it (``build=False``) is not in its folder yet."""


def _cached(prefix: Path, params: dict) -> bool:
    """True when ``prefix`` holds a complete dataset whose manifest records ``params``."""
    try:
        manifest = read_manifest(prefix)
        if manifest is None or any(manifest.get(k) != v for k, v in params.items()):
            return False
        validate(prefix)
    except (OSError, ValueError):  # missing, half-written or stale: build again
        return False
    return True


def build_code_corpus(
    out_dir: str | os.PathLike, *, stdlib: str | os.PathLike | None = None, build: bool = True
) -> str:
    """The standard library's ``.py`` files as byte-level documents; returns the dataset prefix (``build``:
    write it if it is not there, else raise :class:`NotBuilt`)."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    params = {"corpus": "code", "python": platform.python_version(), "stdlib": str(stdlib)}
    prefix = Path(out_dir) / f"code-python{platform.python_version()}-byte"
    if not _cached(prefix, params):
        if not build:
            raise NotBuilt(prefix)
        texts = folder_texts(stdlib, "*.py", exclude=("site-packages", "dist-packages"))
        result = write_dataset(texts, prefix, ByteTokenizer(), source=str(stdlib), extra_manifest=params)
        logger.info("code corpus: %d files, %d tokens -> %s", result.info.num_documents, result.info.num_tokens, prefix)
    return str(prefix)


def dna_lengths(num_sequences: int, max_len: int, seed: int) -> np.ndarray:
    """Sequence lengths in tokens, binned like GRCh38 (scaled to ``max_len``), in a seeded random order."""
    return binned_lengths(GRCH38_SHARES, num_sequences, max_len, seed, reference_max=GRCH38_MAX_LEN)


def binned_lengths(
    shares: Sequence[float], num_sequences: int, max_len: int, seed: int, *, reference_max: int
) -> np.ndarray:
    """``num_sequences`` lengths with ``shares`` percent in the bins of ``BIN_EDGES`` (a dataset whose
    longest sequence is ``reference_max``), every edge scaled by ``max_len / reference_max``; log-uniform
    inside a bin (the open first bin from 512), one sequence of exactly ``max_len``; seeded random order."""
    if num_sequences < len(shares):
        raise ValueError(f"num_sequences must be >= {len(shares)} (one per bin), got {num_sequences}")
    scale = max_len / reference_max
    # Integer lengths n in the scaled bin [lo, hi) are ceil(lo) <= n < ceil(hi).
    low = np.ceil(np.array([_FIRST_BIN_LOW, *BIN_EDGES[1:]]) * scale)
    high = np.ceil(np.array([*BIN_EDGES[1:], reference_max]) * scale)
    if low[0] < 2:
        raise ValueError(f"max_len={max_len} is too small: the first bin would start below 2 tokens")
    # Largest-remainder rounding of the shares; one more sequence, of exactly max_len, joins the last bin.
    want = np.array(shares) / sum(shares) * (num_sequences - 1)
    counts = np.floor(want).astype(np.int64)
    counts[np.argsort(counts - want, kind="stable")[: num_sequences - 1 - counts.sum()]] += 1
    rng = np.random.default_rng(seed)
    lengths = [np.exp(rng.uniform(np.log(lo), np.log(hi), size=n)) for lo, hi, n in zip(low, high, counts)]
    return rng.permutation(np.floor(np.concatenate([*lengths, [max_len]])).astype(np.int64))


def build_dna_corpus(
    out_dir: str | os.PathLike,
    *,
    num_sequences: int = 1000,
    max_len: int = GRCH38_MAX_LEN,
    seed: int = 0,
    build: bool = True,
) -> str:
    """Synthetic DNA with GRCh38's length histogram, 3-mer tokens; returns the dataset prefix (``build``:
    write it if it is not there, else raise :class:`NotBuilt`)."""
    params = {"corpus": "dna-synthetic", "num_sequences": num_sequences, "max_len": max_len, "seed": seed}
    prefix = Path(out_dir) / f"dna3-synthetic-n{num_sequences}-max{max_len}-seed{seed}"
    if _cached(prefix, params):
        return str(prefix)
    if not build:
        raise NotBuilt(prefix)
    tokenizer = KmerTokenizer(3)
    lengths = dna_lengths(num_sequences, max_len, seed)
    rng = np.random.default_rng([seed, 1])
    letters = np.frombuffer(b"ACGT", dtype=np.uint8)

    def texts() -> Iterator[tuple[str, str]]:
        for i, n in enumerate(lengths):
            bases = letters[rng.choice(4, size=int(n) + tokenizer.k - 1, p=_BASE_PROBS)]
            yield f"synthetic-{i}", bases.tobytes().decode("ascii")

    source = f"synthetic DNA, seed {seed}: GRCh38 length bins (paper Table 3) scaled to max {max_len} tokens"
    write_dataset(texts(), prefix, tokenizer, source=source, extra_manifest=params)
    return str(prefix)
