"""Where a profiled training step's GPU time went: its kernels by kind, and the time the device sat idle.

    python scripts/gpu/step_breakdown.py TRACE.json[.gz]

TRACE is the Chrome trace Megatron's own profiler writes (``--profile --use-pytorch-profiler
--profile-step-start N --profile-step-end N+1 --tensorboard-dir DIR`` among a config's ``megatron_args``:
``DIR/../torch_profile/rank-<r>.json.gz``). On one H200 a training micro-batch took about 20% more than
its layers' own work (benchmarks/results/train-peaks_h200_20261127_d44f729.md); this says whether that
time is kernels (which kind) or the device waiting for the host. Kernels are sorted into kinds by name;
"idle" is the time inside the profiled span on no stream. The last line:

    span_ms=<s> busy_ms=<b> idle_ms=<i> gemm_ms=<g> attention_ms=<a> communication_ms=<c> copy_ms=<m> other_ms=<o>
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

# The first kind whose words a kernel's name holds (lower case) is its kind.
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("fmha", "flash", "attention", "cudnn")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
)
_DEVICE_EVENTS = {"kernel": None, "gpu_memcpy": "copy", "gpu_memset": "copy"}


def kind_of(category: str, name: str) -> str:
    fixed = _DEVICE_EVENTS[category]
    if fixed is not None:
        return fixed
    lowered = name.lower()
    return next((kind for kind, words in KINDS if any(word in lowered for word in words)), "other")


def breakdown(trace: dict) -> tuple[dict[str, float], list[tuple[str, str, float, int]]]:
    """(milliseconds by kind, with the span, busy and idle time; ``(kind, name, milliseconds, calls)`` of
    each kernel name, by total time). Times in a Chrome trace are microseconds."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in _DEVICE_EVENTS]
    if not events:
        raise ValueError("the trace holds no GPU kernels: profile a CUDA run (--use-pytorch-profiler)")
    totals: dict[str, float] = defaultdict(float)
    by_name: dict[tuple[str, str], list] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in events:
        start, duration, kind = float(e["ts"]), float(e["dur"]), kind_of(e["cat"], e["name"])
        totals[kind] += duration
        by_name[kind, e["name"]][0] += duration
        by_name[kind, e["name"]][1] += 1
        intervals.append((start, start + duration))
    intervals.sort()
    busy, covered_to = 0.0, intervals[0][0]
    for start, end in intervals:  # the union of the intervals: overlapping streams count once
        if end > covered_to:
            busy += end - max(start, covered_to)
            covered_to = end
    span = covered_to - intervals[0][0]
    figures = {"span": span, "busy": busy, "idle": span - busy}
    figures.update({kind: totals.get(kind, 0.0) for kind in ("gemm", "attention", "communication", "copy", "other")})
    names = sorted(((kind, name, t / 1e3, n) for (kind, name), (t, n) in by_name.items()), key=lambda row: -row[2])
    return {key: value / 1e3 for key, value in figures.items()}, names


def _read(path: Path) -> dict:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=15, help="kernels listed by total time")
    args = parser.parse_args(argv)
    try:
        figures, names = breakdown(_read(args.trace))
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"{args.trace}: {e}")
    for kind, name, ms, calls in names[: args.top]:
        print(f"{ms:>10.2f} ms {calls:>6}x  {kind:<13} {name[:100]}")
    print(" ".join(f"{key}_ms={value:.2f}" for key, value in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
