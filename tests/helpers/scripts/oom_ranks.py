"""Run ``megatron_paradyse.pretrain_gpt.main`` on N local ranks, one of which may run out of memory, or
die, on purpose (tests only).

    python tests/oom_ranks.py --world-size 4 --out DIR [--inject SITE --rank R --iteration I
        [--marker FILE]] -- <entry point flags>

Each rank is a process with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
set, as torchrun or srun would start it, but nothing here ends a rank when another exits: that is the
behaviour under test. The ranks are forked from this process after it imported torch and Megatron
once (four imports on two cores cost more than the training). Rank r writes ``DIR/rank{r}.out`` and
``.err``; the last line of stdout is JSON: every rank's exit code and the time.time() it exited.

``--inject SITE`` raises ``torch.OutOfMemoryError`` on rank R in training iteration I (Megatron's
1-based number): ``attention-forward`` where the Paradyse layers call the attention strategy,
``mlp-backward`` in the backward of an MLP strategy's output (the step's first MLP backward). With
``--marker`` it fires once: it writes the marker (the time.time() of the raise) and does not fire
while the marker exists, so the relaunch of the same command runs clean; without, it fires every time.

``--inject death``: in iteration I every rank starts a child process as Megatron starts a checkpoint
writer (forked by multiprocessing, daemonic; its pid in ``DIR/child{r}.pid``), then rank R kills itself
(SIGKILL: it dies without a word), having written the marker.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

import torch

from megatron_paradyse.mcore import compat

_DEADLINE_S = 280.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--inject", choices=["attention-forward", "mlp-backward", "death"])
    parser.add_argument("--rank", type=int)
    parser.add_argument("--iteration", type=int)
    parser.add_argument("--marker", type=Path)
    split = argv.index("--")
    args, entry_argv = parser.parse_args(argv[:split]), argv[split + 1 :]
    compat.install()  # before megatron.core is imported
    from megatron_paradyse import pretrain_gpt
    from megatron_paradyse.run import training as paradyse_training  # noqa: F401

    from megatron.training import training  # noqa: F401 - imported once, before the fork

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(args.world_size):
        pid = os.fork()
        if pid == 0:
            _rank(rank, args, port, lambda: pretrain_gpt.main(entry_argv))
        pids[pid] = rank
    codes, ends = [None] * args.world_size, [None] * args.world_size
    deadline = time.monotonic() + _DEADLINE_S
    while pids and time.monotonic() < deadline:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.005)
            continue
        rank = pids.pop(pid)
        codes[rank], ends[rank] = os.waitstatus_to_exitcode(status), time.time()
    for pid in pids:  # past the deadline: the test fails on the missing exit codes
        os.kill(pid, signal.SIGKILL)
    print(json.dumps({"exit_codes": codes, "exit_times": ends}))
    return 0


def _rank(rank: int, args: argparse.Namespace, port: int, entry) -> None:
    """The forked rank: its environment and output files, the injection, the entry point; never returns."""
    code = 1
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for fd, suffix in ((1, "out"), (2, "err")):
            with open(args.out / f"rank{rank}.{suffix}", "w") as f:
                os.dup2(f.fileno(), fd)
        env = {"RANK": rank, "WORLD_SIZE": args.world_size, "LOCAL_RANK": rank, "MASTER_PORT": port}
        os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
        if args.inject == "death":
            _inject_death(args, rank)
        elif args.inject:
            _inject(args)
        code = entry()
    except SystemExit as e:  # Megatron's own exits (--exit-interval)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 - the rank's traceback goes to its stderr file
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _inject_death(args: argparse.Namespace, rank: int) -> None:
    import multiprocessing

    from megatron_paradyse.mcore import modules

    from megatron.training import get_args

    run_attention = modules.run_attention
    children = []

    def attention(*a, **kw):
        if not children and torch.is_grad_enabled() and get_args().curr_iteration + 1 == args.iteration:
            children.append(multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,), daemon=True))
            children[0].start()
            (args.out / f"child{rank}.pid").write_text(f"{children[0].pid}\n")
            if rank == args.rank:
                args.marker.write_text(f"{time.time()}\n")
                os.kill(os.getpid(), signal.SIGKILL)
        return run_attention(*a, **kw)

    modules.run_attention = attention


def _inject(args: argparse.Namespace) -> None:
    from megatron_paradyse.mcore import modules

    from megatron.training import get_args

    message = f"injected by the test: out of memory in the {args.inject} (rank {args.rank}, iteration {args.iteration})"

    def fires() -> bool:
        if not torch.is_grad_enabled() or torch.distributed.get_rank() != args.rank:
            return False
        if get_args().curr_iteration + 1 != args.iteration:  # curr_iteration counts the steps done
            return False
        return args.marker is None or not args.marker.exists()

    def out_of_memory() -> torch.OutOfMemoryError:
        if args.marker is not None:
            args.marker.write_text(f"{time.time()}\n")
        return torch.OutOfMemoryError(message)

    if args.inject == "attention-forward":
        run_attention = modules.run_attention

        def attention(*a, **kw):
            if fires():
                raise out_of_memory()
            return run_attention(*a, **kw)

        modules.run_attention = attention
    else:
        run_mlp = modules.run_mlp

        class RaiseInBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, y_local):
                return y_local.view_as(y_local)

            @staticmethod
            def backward(ctx, grad):
                raise out_of_memory()

        def mlp(*a, **kw):
            y_local = run_mlp(*a, **kw)
            return RaiseInBackward.apply(y_local) if fires() else y_local

        modules.run_mlp = mlp


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
