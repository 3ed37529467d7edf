"""Length histograms in the bins of the paper's Table 3 (lengths in tokens, K = 1024)."""

from __future__ import annotations

import numpy as np

__all__ = ["BIN_EDGES", "BIN_LABELS", "format_histogram", "length_histogram"]

K = 1024
BIN_EDGES = (0, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K, 128 * K)
"""Lower edges; the last bin is open: ``[0,4K) [4K,8K) ... [64K,128K) [128K,+inf)``."""
BIN_LABELS = ("0-4K", "4K-8K", "8K-16K", "16K-32K", "32K-64K", "64K-128K", "128K+")


def length_histogram(lengths: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """Count of ``lengths`` per bin, the bin edges multiplied by ``scale`` (for scaled-down corpora)."""
    edges = np.array(BIN_EDGES, dtype=np.float64) * scale
    return np.bincount(np.searchsorted(edges, np.asarray(lengths), side="right") - 1, minlength=len(edges))


def format_histogram(lengths: np.ndarray, scale: float = 1.0) -> str:
    """A table of counts and shares per bin, then the number, total, min, median and max of ``lengths``."""
    lengths = np.asarray(lengths)
    counts = length_histogram(lengths, scale)
    header = "bin" if scale == 1.0 else f"bin (x{scale:.4g})"
    lines = [f"{header:>14} {'count':>9} {'share':>7}"]
    for label, count in zip(BIN_LABELS, counts):
        lines.append(f"{label:>14} {count:>9d} {100 * count / max(len(lengths), 1):>6.1f}%")
    if len(lengths):
        lines.append(
            f"documents={len(lengths)} tokens={int(lengths.sum())} min={int(lengths.min())} "
            f"median={float(np.median(lengths)):g} max={int(lengths.max())}"
        )
    else:
        lines.append("documents=0")
    return "\n".join(lines)
