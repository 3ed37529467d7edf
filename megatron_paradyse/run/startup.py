"""A start-up failure on any rank stops every rank within seconds, with one message naming the rank and the cause.

Every rank of a job reads its own copy of the config, the cost profile and the dataset. One that cannot
(a file missing on one node, a corrupt copy, token ids outside the vocabulary) must not leave the others
waiting in a collective until the distributed timeout (10 minutes by default), nor depend on the
launcher to kill them (torchrun does, ``srun`` only with ``--kill-on-bad-exit``). So every rank joins
the job's default process group as Megatron's ``initialize_megatron`` would (:func:`init_distributed`;
Megatron then skips its own), a rank that already failed included, and :func:`agree` gathers every
rank's problem: if any rank has one, every rank raises the same :class:`StartupError`.

A rank that ends its work leaves the process groups itself (:func:`leaving_process_groups`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_paradyse.run.megatron_flags import RaisingParser

__all__ = [
    "StartupError",
    "agree",
    "attempt",
    "distributed_launch",
    "distributed_settings",
    "init_distributed",
    "leaving_process_groups",
    "rank_list",
]


class StartupError(ValueError):
    """Some rank could not start; the message names the ranks and their problems."""


def distributed_launch() -> bool:
    """True when this process is one rank of several (``WORLD_SIZE`` > 1, as torchrun and srun scripts set)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def distributed_settings(flags: Sequence[str]) -> tuple[str, datetime.timedelta]:
    """(backend, timeout) of the default process group, as Megatron reads them from ``flags``
    (``--distributed-backend``, ``--distributed-timeout-minutes``; the last occurrence wins). A rank whose
    config could not be read knows only its command line: the defaults are Megatron's (NCCL where CUDA
    is, 10 minutes), with gloo on a machine without CUDA, as this package's entry point passes there; so
    are they where a value is bad (what this rank reports, as Megatron's parser refuses it too)."""
    parser = RaisingParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--distributed-backend", default="nccl" if torch.cuda.is_available() else "gloo")
    parser.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    try:
        known, _ = parser.parse_known_args(list(flags))
    except ValueError:
        known = parser.parse_args([])
    return known.distributed_backend, datetime.timedelta(minutes=known.distributed_timeout_minutes)


def init_distributed(backend: str, timeout: datetime.timedelta) -> None:
    """Join the job's default process group from the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``), with the device Megatron would select; nothing if already joined."""
    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        timeout=timeout,
    )


def agree(problem: str | None) -> None:
    """Called once by every rank at the same point: raises :class:`StartupError` on every rank if any rank
    has a ``problem`` (a one-line description), naming the ranks that have it."""
    problems: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    by_problem: dict[str, list[int]] = {}
    for rank, text in enumerate(problems):
        if text is not None:
            by_problem.setdefault(text, []).append(rank)
    if not by_problem:
        return
    if len(by_problem) == 1 and len(next(iter(by_problem.values()))) == len(problems):
        raise StartupError(next(iter(by_problem)))  # every rank: nothing rank-specific to say
    parts = [f"{rank_list(ranks)}: {text}" for text, ranks in by_problem.items()]
    raise StartupError("; ".join(parts) + f" (every rank of {len(problems)} stops)")


def rank_list(ranks: list[int]) -> str:
    """``rank 3``, or ``ranks 1, 5``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


@contextlib.contextmanager
def leaving_process_groups() -> Iterator[None]:
    """The block is this rank's work. Where it ends without a failure (it returns, or Megatron's
    ``--exit-interval`` exits with status 0), destroy the default process group and its subgroups, as
    PyTorch asks of every script: left to the interpreter's shutdown, a gloo group's worker thread can
    release a tensor while Python finalises and abort the rank (SIGABRT after a finished run, seen in CI
    with torch 2.13). Not after a failure: the rank may be inside a collective the others never joined,
    and destroying a gloo group joins its worker threads, so the rank would wait for it."""
    try:
        yield
    except SystemExit as e:
        if e.code in (None, 0):
            _leave()
        raise
    _leave()


def _leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def attempt(fn):
    """``(fn(), None)``, or ``(None, what went wrong)`` for the errors of reading a file or a dataset: the
    one-line description :func:`agree` shares."""
    try:
        return fn(), None
    except ValueError as e:
        return None, str(e)
    except OSError as e:
        return None, f"{type(e).__name__}: {e}"
