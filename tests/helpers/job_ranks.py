"""A job's ranks as ``srun`` starts them, forked from the tests' fork server: one process per rank with
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set,
running a program as ``python -m module ...`` or ``python script.py ...`` would, its stdout and stderr in
``rank{r}.out`` and ``rank{r}.err``. Nothing ends a rank when another exits: where a job must stop every
rank itself, this shows whether it does (torchrun would end them and hide a rank left waiting).

The fork server imported torch, megatron-core, Megatron's training loop and the package once
(``helpers.rank_imports``): a launch costs a fork per rank, not a Python start and those imports (about
10 s of CPU a rank). What is torchrun's own (its agent's store, its restarts, its report of a failure) is
tested through :mod:`helpers.torchrun`, which launches as a user does.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path

from helpers.processes import marked

Program = Sequence[str]
"""``["-m", "package.module", *flags]`` or ``[script, *flags]``: what follows ``python`` on a command line."""

MARK = "PARADYSE_TEST_LAUNCH"
"""An environment variable marking the processes of one launch: every process its ranks execute inherits it
(and a process a rank forks inherits the mark file it holds open)."""


@dataclass(frozen=True)
class Rank:
    code: int
    """The exit status; -N: killed by signal N."""
    at: float
    """When it exited (``time.time()``)."""
    out: str
    err: str


@dataclass(frozen=True)
class Job:
    ranks: tuple[Rank, ...]
    left: tuple[int, ...]
    """Processes the ranks started that still ran after every rank exited (killed since)."""

    @property
    def codes(self) -> list[int]:
        return [rank.code for rank in self.ranks]

    @property
    def ok(self) -> bool:
        """Every rank exited with status 0."""
        return not any(self.codes)

    @property
    def stdout(self) -> str:
        """Every rank's stdout, in rank order."""
        return "".join(rank.out for rank in self.ranks)

    @property
    def stderr(self) -> str:
        """Every rank's stderr, in rank order."""
        return "".join(rank.err for rank in self.ranks)

    def output(self) -> str:
        """The end of every rank's stdout and stderr, for a failure's message."""
        return "\n".join(
            f"rank {r} {name}:\n{text[-3000:]}"
            for r, rank in enumerate(self.ranks)
            for name, text in (("stdout", rank.out), ("stderr", rank.err))
        )


def launch(
    world_size: int,
    program: Program | Callable[[int], Program],
    folder: Path,
    *,
    env: dict[str, str] | None = None,
    before: Callable[[int], None] | None = None,
    timeout: float = 300,
) -> Job:
    """Run ``program`` (or ``program(rank)``) on ``world_size`` ranks, with ``env`` added to the
    environment, ``before(rank)`` (an importable function) called in each rank first; wait for every rank
    to exit. A rank still running after ``timeout`` seconds is killed and fails the launch."""
    folder.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mark_file = (folder / "launch.mark").resolve()
    mark_file.touch()
    mark = f"{os.getpid()}-{port}"
    environment = {
        **(env or {}),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
        MARK: mark,
    }
    ctx = mp.get_context("forkserver")
    procs = []
    for rank in range(world_size):
        argv = list(program(rank) if callable(program) else program)
        args = (rank, argv, folder, environment, before, mark_file)
        procs.append(ctx.Process(target=_rank, args=args, daemon=False))
    for proc in procs:
        proc.start()
    exited = _wait(procs, timeout)
    left = tuple(marked(MARK, mark, mark_file))
    for pid in left:  # not to outlive the test
        os.kill(pid, signal.SIGKILL)
    ranks = tuple(
        Rank(
            code=procs[r].exitcode,
            at=exited[r],
            out=(folder / f"rank{r}.out").read_text(),
            err=(folder / f"rank{r}.err").read_text(),
        )
        for r in range(world_size)
    )
    return Job(ranks, left)


def _wait(procs: list, timeout: float) -> dict[int, float]:
    """When each rank exited; past ``timeout``, kill the rest and fail."""
    exited: dict[int, float] = {}
    sentinels = {proc.sentinel: rank for rank, proc in enumerate(procs)}
    deadline = time.monotonic() + timeout
    while sentinels and time.monotonic() < deadline:
        for sentinel in wait(list(sentinels), timeout=deadline - time.monotonic()):
            exited[sentinels.pop(sentinel)] = time.time()
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    running = sorted(sentinels.values())
    assert not running, f"ranks {running} were still running after {timeout} s"
    return exited


def _rank(rank: int, argv: list[str], folder: Path, env: dict, before, mark_file: Path) -> None:
    """The forked rank: its environment and output files, ``before``, the program, and the exit Python's
    would make (its exit handlers, the status); never returns."""
    code = 1
    try:
        for fd, suffix in ((1, "out"), (2, "err")):
            with open(folder / f"rank{rank}.{suffix}", "w") as f:
                os.dup2(f.fileno(), fd)
        os.set_inheritable(os.open(mark_file, os.O_RDONLY), True)  # held until this process and its forks end
        os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
        _as_a_started_process()
        if before is not None:
            before(rank)
        code = _run(argv)
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException:  # noqa: BLE001 - the rank's traceback goes to its stderr file, as Python's would
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # as the interpreter's exit would (a program may write its results there)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _as_a_started_process() -> None:
    """What a Python process started with this rank's environment would have, where a child of the fork
    server has what the server took at its own start: the import path, torch's threads and compiler switch,
    multiprocessing's start method (unchosen; the server's children inherit its own)."""
    import torch

    added = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path and path not in sys.path]
    sys.path[:0] = added
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch._dynamo.config.disable = os.environ.get("TORCH_COMPILE_DISABLE", "0") == "1"
    mp.set_start_method(None, force=True)


def _run(argv: list[str]) -> int:
    """``python *argv`` in this process: ``-m module`` or a script, as ``__main__``."""
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        runpy.run_path(argv[0], run_name="__main__")
    return 0


def _exit_status(e: SystemExit) -> int:
    """What Python's exit makes of ``e``: None is 0, a message is printed and is 1."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1
