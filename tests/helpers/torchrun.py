"""Multi-rank jobs launched as a user launches them: ``python -m torch.distributed.run --standalone``, one
gloo process per rank on this machine.

Ranks that share one stdout pipe can split each other's lines: a rank's buffered write larger than the
pipe's atomic size (or one flushed in the middle of a line) lets another rank's line start mid-line. A
test that reads a rank's lines passes ``log_dir`` and reads :func:`rank_output`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.paths import ROOT


def torchrun(
    nproc: int, *program: str, timeout: float = 400, log_dir: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node=nproc *program`` from the repository root (``program``: a script and its
    flags, or ``-m module ...``). With ``log_dir``, each rank's stdout and stderr go to their own files there."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if log_dir is not None:
        command += ["--log-dir", str(log_dir), "--redirects", "3"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [*command, *program], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=timeout
    )


def rank_output(log_dir: Path, rank: int, stream: str = "stdout") -> str:
    """What ``rank`` wrote to ``stream`` in a :func:`torchrun` with ``log_dir`` (its first attempt)."""
    (path,) = log_dir.glob(f"*/attempt_0/{rank}/{stream}.log")
    return path.read_text()


def rank_outputs(log_dir: Path) -> str:
    """Every rank's output in a :func:`torchrun` with ``log_dir``, the end of each file, for a failure message."""
    paths = sorted(log_dir.glob("*/attempt_*/*/std*.log"))
    return "\n".join(f"{path.relative_to(log_dir)}:\n{path.read_text()[-3000:]}" for path in paths)
