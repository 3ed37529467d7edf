"""Run a function on ``world_size`` local processes joined by one process group (gloo on CPU).

Used by the tests and the CPU benchmarks. The first failure is re-raised with its rank and
traceback; a rank that dies without reporting, or a run that outlives ``timeout_s``, kills every
process instead of leaving the caller waiting in a collective.

Ranks are forked from multiprocessing's fork server, a fresh process that imports what
``multiprocessing.set_forkserver_preload`` names once, before the first launch: a caller that launches
often (the tests preload torch, megatron-core and this package) pays for a fork per rank, not for a
Python start and its imports (4 ranks importing megatron-core took 24 s on a 2-core machine).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
import torch.distributed as dist

from megatron_paradyse.core.memory import freeze_what_lives_now

__all__ = ["RankFailure", "run_on_ranks"]

_EXIT_GRACE_S = 10.0
"""How long a rank that reported may take to exit before it is killed."""


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message holds its rank and traceback."""


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    timeout_s: float = 600.0,
    backend: str = "gloo",
    collective_timeout_s: float = 120.0,
    threads_per_rank: int = 1,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on each of ``world_size`` processes; their stdout and stderr
    are the caller's.

    ``fn`` must be importable (a module-level function) and return something ``torch.save`` can
    write. Returns the results in rank order.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("forkserver")
    results: dict[int, Any] = {}
    with tempfile.TemporaryDirectory(prefix="paradyse-ranks-") as tmp:
        reports = ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    fn,
                    rank,
                    world_size,
                    args,
                    os.path.join(tmp, "store"),
                    backend,
                    collective_timeout_s,
                    threads_per_rank,
                    reports,
                    _CallersOutput(),
                ),
                # Not daemonic: a rank may start processes of its own (Megatron's checkpoint writer,
                # data-loader workers), which it shuts down when it exits; see the joins below.
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        try:
            deadline = time.monotonic() + timeout_s
            while len(results) < world_size:
                missing = [r for r in range(world_size) if r not in results]
                if time.monotonic() > deadline:
                    raise RankFailure(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                try:
                    rank, ok, payload = reports.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r in missing if not procs[r].is_alive()]
                    if dead and not _drained(reports, results):
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankFailure(f"ranks {dead} exited without a result (exit codes {codes})") from None
                    continue
                _record(rank, ok, payload, results)
            for proc in procs:  # let finished ranks exit by themselves, taking their children along
                proc.join(timeout=_EXIT_GRACE_S)
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
                proc.join()
    return [results[r] for r in range(world_size)]


def _record(rank: int, ok: bool, payload: bytes | str, results: dict[int, Any]) -> None:
    if not ok:
        raise RankFailure(f"rank {rank} failed:\n{payload}")
    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)


def _drained(reports, results: dict[int, Any]) -> bool:
    """Read reports a dead rank may have left behind; True if any arrived."""
    arrived = False
    while True:
        try:
            rank, ok, payload = reports.get(timeout=0.5)
        except queue.Empty:
            return arrived
        _record(rank, ok, payload, results)
        arrived = True


class _CallersOutput:
    """The caller's stdout and stderr as they are when it launches (a terminal, a file, a test's capture),
    for a rank forked from the fork server, which would otherwise write to the server's own."""

    def __reduce__(self):
        return _CallersOutput._rebuild, (reduction.DupFd(1), reduction.DupFd(2))

    @staticmethod
    def _rebuild(out, err) -> _CallersOutput:
        adopted = _CallersOutput()
        adopted.fds = (out.detach(), err.detach())
        return adopted

    def adopt(self) -> None:
        for stream, fd, target in ((sys.stdout, self.fds[0], 1), (sys.stderr, self.fds[1], 2)):
            stream.flush()
            os.dup2(fd, target)
            os.close(fd)


def _worker(fn, rank, world_size, args, store_path, backend, collective_timeout_s, threads, reports, output) -> None:
    output.adopt()
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        freeze_what_lives_now()  # the imports: a measured window's collection then scans what fn makes only
        result = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        reports.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
        reports.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
