"""An out-of-memory error that slips past the planner costs a step, never the run; a rank that dies
without a word stops every rank within seconds.

The rank that runs out of memory shrinks the memory budget (``memory.oom_shrink``), saves it with the
run (``paradyse_state.json`` in the ``--save`` directory) and stops every rank at once; a relaunch with
``--load`` (``torchrun --max-restarts`` does it) resumes from the last checkpoint, plans under the
smaller budget and runs the failed step's global batch again. The step's partial gradients die with
the processes; the checkpoint and the data loader's saved position make the re-run exact. After
``memory.oom_retries`` failures of one iteration the run stops for good, with a message.

Why stop and relaunch rather than retry in place: the failing rank's peers are blocked inside a
collective of the same step, and neither gloo nor NCCL releases them reliably short of the
collective timeout (aborting process groups released gloo peers only sometimes); Megatron holds its
process groups in hundreds of places, so rebuilding them in process means rebinding every one. Exiting
the process frees every rank at once.

The ranks talk through the default process group's store (a failed rank cannot join a collective):

1. every rank runs a watcher thread blocked on its own wake key;
2. the failing rank claims the fault (the first claim wins when several ranks fail at once), saves the
   state, sets every other rank's wake key to the fault and prints its message;
3. a woken watcher prints one line and exits with :data:`FAULT_EXIT_CODE` (:data:`STOP_EXIT_CODE`
   when the retries are spent), as does the failing rank. The store's server may live in rank 0 (it
   does without torchrun): rank 0 exits last, once every rank has counted itself out.

A clean end wakes the rank's own watcher with a stop value, and rank 0 again waits until every rank
has stopped watching. The keys carry a token rank 0 draws at start-up: a store can outlive a launch
(torchrun's shared rendezvous store does), and the relaunch must not read the fault that ended it.

A rank that dies without a word (killed, crashed, its node lost) cannot announce anything, and under
NCCL its peers would wait in their next collective until its timeout (gloo's raise at once, naming an
address, not a rank). So every other rank adds to its beat key in the store once a second, and rank 0
reads them all: a rank whose beat has not moved for :data:`_SILENT_S` is gone, and rank 0 claims the
fault and wakes every rank with it, itself included; it prints the one line, every rank exits with
:data:`PEER_EXIT_CODE`. Rank 0's own death closes the store it hosts (without torchrun): every watcher's
wait fails at once (torch's store client logs a warning about it), and rank 1 prints the line. Under
torchrun, which ends every rank itself when one dies (in a tenth of a second), none of this gets to run.
A heartbeat, because the store tells nobody that a client left; in a thread of its own, because a store
wait that times out logs a warning, so the watcher cannot wake every second.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import functools
import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import torch.distributed as dist
from torch.distributed import distributed_c10d

from megatron_paradyse.run.startup import rank_list

if TYPE_CHECKING:
    from megatron_paradyse.config import MemorySection

__all__ = [
    "FAULT_EXIT_CODE",
    "PEER_EXIT_CODE",
    "STATE_FILE",
    "STOP_EXIT_CODE",
    "BudgetState",
    "FaultWatch",
    "OutOfMemoryEvent",
    "children_die_with_this_process",
    "end_process",
    "read_state",
    "write_state",
]

logger = logging.getLogger(__name__)

FAULT_EXIT_CODE = 3
"""Every rank's exit code after an out-of-memory error the run survives (relaunch with ``--load``)."""
STOP_EXIT_CODE = 2
"""Every rank's exit code when one iteration ran out of memory more often than ``memory.oom_retries``
allows: a configuration-level error, as ``paradyse: error:`` elsewhere."""
PEER_EXIT_CODE = 4
"""Every rank's exit code when a rank stopped without a word (killed, crashed, its node lost): relaunch with
``--load`` to resume from the last checkpoint."""
STATE_FILE = "paradyse_state.json"

_GIB = 2**30
_STOP = b"stop"
_GONE = b"gone:"
"""A wake value: rank 0 heard these ranks fall silent (``gone:1,5``)."""
_LEFT = b"left"
"""A rank's beat once it stopped watching: its silence is no death."""
_BEAT_S = 1.0
"""How often every other rank tells rank 0 it is alive, and rank 0 looks."""
_SILENT_S = 10.0
"""How long a rank may stay silent before rank 0 takes it for dead. Its beat is a thread's, which runs while
the main thread computes or waits in a collective (PyTorch's operators release the GIL); a rank starved of
CPU (an oversubscribed host) or in a long call that holds the GIL was seen silent for over 3 s, alive."""
_VERDICT_S = _SILENT_S + 3 * _BEAT_S
"""How long a rank whose collective broke waits for its watcher to say whether a rank died."""
_WATCH_CHUNK = datetime.timedelta(hours=12)
"""A watcher renews its wait this often (a store's wait always has a timeout)."""
_GATHER_TIMEOUT = datetime.timedelta(seconds=10)
"""How long rank 0 waits for the other ranks to count themselves out (and a rank for its watcher)."""
_CHILD_EXIT_S = 5.0
"""How long an ending rank waits for each process it started to stop when asked, before killing it."""


# -- the persisted state ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class OutOfMemoryEvent:
    iteration: int
    """The step that failed (Megatron's 1-based iteration number)."""
    rank: int
    where: str
    """The error's first line and where it was raised."""
    budget_before_bytes: float
    budget_after_bytes: float
    stopped: bool = False
    """The retries were spent: the budget did not shrink and the run stopped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetState:
    """What ``paradyse_state.json`` holds: the budget a run has shrunk to, and every out-of-memory error
    behind it."""

    budget_bytes: float
    out_of_memory: tuple[OutOfMemoryEvent, ...] = ()

    def failures(self, iteration: int) -> list[OutOfMemoryEvent]:
        return [e for e in self.out_of_memory if e.iteration == iteration]

    def after_out_of_memory(
        self, *, iteration: int, rank: int, where: str, budget_bytes: float, memory: MemorySection
    ) -> BudgetState:
        """This state with one more out-of-memory error: the budget (``budget_bytes``, what the run planned
        with) shrinks by ``memory.oom_shrink``, unless ``iteration`` already failed ``memory.oom_retries``
        times; then it stays and the event says the run stopped."""
        stopped = len(self.failures(iteration)) >= memory.oom_retries
        event = OutOfMemoryEvent(
            iteration=iteration,
            rank=rank,
            where=where,
            budget_before_bytes=budget_bytes,
            budget_after_bytes=budget_bytes if stopped else budget_bytes * (1.0 - memory.oom_shrink),
            stopped=stopped,
        )
        return BudgetState(budget_bytes=event.budget_after_bytes, out_of_memory=(*self.out_of_memory, event))

    def check_retries(self, retries: int, path: Path) -> None:
        """Raise ``ValueError`` if an iteration already failed more often than ``retries`` allows: a
        relaunch would run out of memory there again."""
        for event in self.out_of_memory:
            failures = self.failures(event.iteration)
            if len(failures) > retries:
                raise ValueError(
                    f"iteration {event.iteration} ran out of memory {len(failures)} times, under budgets "
                    f"{_gib_list(e.budget_before_bytes for e in failures)} GiB ({path}), more than "
                    f"memory.oom_retries = {retries} allows. {_HOW_TO_GO_ON}"
                )


_HOW_TO_GO_ON = (
    "To go on, raise memory.oom_retries (each retry shrinks the budget by memory.oom_shrink) and relaunch "
    f"with --load; or shorten the sequences or lower memory.budget_gib, and delete {STATE_FILE}"
)


def read_state(directory: str | None) -> BudgetState | None:
    """The state saved in ``directory`` (a run's ``--load``), or None if there is none."""
    if directory is None:
        return None
    path = Path(directory) / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path} ({e}); delete it to plan with memory.budget_gib") from e
    try:
        events = tuple(OutOfMemoryEvent(**event) for event in data["out_of_memory"])
        return BudgetState(budget_bytes=float(data["budget_bytes"]), out_of_memory=events)
    except (KeyError, TypeError) as e:  # a key missing, or one OutOfMemoryEvent does not have
        raise ValueError(
            f"{path} is not a megatron-paradyse state file ({type(e).__name__}: {e}); delete it to plan with "
            f"memory.budget_gib"
        ) from e


def write_state(directory: str, state: BudgetState) -> Path:
    """Write ``state`` into ``directory`` atomically (a rank killed halfway leaves the old file)."""
    path = Path(directory) / STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"budget_bytes": state.budget_bytes, "out_of_memory": [dataclasses.asdict(e) for e in state.out_of_memory]}
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(partial, path)
    return path


# -- the fault ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class _Fault:
    """What the failing rank tells the others (one line of JSON in the store)."""

    event: OutOfMemoryEvent
    failures: int
    """How many times this iteration has now run out of memory."""
    retries: int
    state_path: str | None
    """Where the shrunk budget was saved; None: the run has no ``--save``."""
    save_dir: str | None

    @property
    def exit_code(self) -> int:
        return STOP_EXIT_CODE if self.event.stopped else FAULT_EXIT_CODE

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> _Fault:
        fields = json.loads(data)
        return cls(**{**fields, "event": OutOfMemoryEvent(**fields["event"])})

    def message(self, budgets_tried: list[float]) -> str:
        """The failing rank's line."""
        e = self.event
        head = f"rank {e.rank} ran out of memory at iteration {e.iteration}: {e.where}"
        if e.stopped:
            return (
                f"paradyse: error: {head}; this is failure {self.failures} of iteration {e.iteration}, under budgets "
                f"{_gib_list(budgets_tried)} GiB, and memory.oom_retries is {self.retries}: every rank stops. "
                f"{_HOW_TO_GO_ON}"
            )
        shrink = f"{e.budget_before_bytes / _GIB:.4g} to {e.budget_after_bytes / _GIB:.4g} GiB"
        if self.state_path is None:
            return (
                f"paradyse: {head}; every rank stops. The run has no --save, so it cannot resume by itself: set "
                f"memory.budget_gib: {e.budget_after_bytes / _GIB:.4g} (it was {e.budget_before_bytes / _GIB:.4g}) "
                f"and start again"
            )
        return (
            f"paradyse: {head}; every rank stops and the memory budget shrinks from {shrink} (saved in "
            f"{self.state_path}): relaunch with --load {self.save_dir} to re-plan and re-run iteration "
            f"{e.iteration} from the last checkpoint (torchrun --max-restarts does it)"
        )

    def peer_message(self, rank: int) -> str:
        """The line of every other rank."""
        e = self.event
        if e.stopped:
            return (
                f"paradyse: error: rank {rank} stops: rank {e.rank} ran out of memory at iteration {e.iteration} "
                f"{self.failures} times, more than memory.oom_retries = {self.retries} allows (rank {e.rank} says more)"
            )
        return (
            f"paradyse: rank {rank} stops: rank {e.rank} ran out of memory at iteration {e.iteration} (the memory "
            f"budget shrinks from {e.budget_before_bytes / _GIB:.4g} to {e.budget_after_bytes / _GIB:.4g} GiB; "
            f"rank {e.rank} says more)"
        )


def _say(line: str) -> None:
    """``line`` on stderr in one write: ``print`` writes the newline apart, and a warning the main thread
    prints meanwhile (the watcher is a thread) would land on the same line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class FaultWatch:
    """One rank's side of the protocol in the module docstring. :meth:`start` once the default process
    group exists; :meth:`out_of_memory` from the training step that ran out of memory; leave the ``with``
    block around the training (its end stops the watcher, its exceptions wait for a fault in progress).
    Between the two, the other ranks beat and rank 0 listens (:data:`_BEAT_S`): a rank silent for
    :data:`_SILENT_S` died without a word, and rank 0 stops every rank as a fault would."""

    def __init__(self, memory: MemorySection, *, state: BudgetState | None, save_dir: str | None, load_dir: str | None):
        self.memory = memory
        self.state = state
        """The state read from ``--load`` at start-up (None: there was none)."""
        self.save_dir = save_dir
        self.load_dir = load_dir
        self._store = None
        self._thread: threading.Thread | None = None
        self._beat_thread: threading.Thread | None = None
        self._fired = threading.Event()
        """Set once this rank's watcher has a fault to act on: the process is about to exit."""
        self._quiet = threading.Event()
        """Set when this rank stops beating (and rank 0 listening)."""

    def start(self) -> None:
        """Start watching (every rank). Rank 0 also copies the loaded state to ``--save`` when that is
        another directory, so that a resume from there keeps the shrunk budget."""
        self._store = distributed_c10d._get_default_store()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Keys of this launch only: a store can outlive a launch (torchrun's shared rendezvous store keeps
        # its keys across restarts), and a stale wake key would stop the relaunched ranks at once.
        launch = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(launch, src=0)
        self._prefix = f"paradyse/{launch[0]}/"
        self._wake_key = self._key(f"wake/{self.rank}")
        if self.rank == 0:  # the beat keys exist before rank 0 reads them (a read waits for a missing key)
            self._store.multi_set(self._beat_keys(), [b"0"] * self.world_size)
        # A store client serialises its calls, and a wait holds it: each thread gets its own connection.
        self._thread = threading.Thread(
            target=self._watch, args=(self._store.clone(),), name="paradyse-fault-watch", daemon=True
        )
        self._beat_thread = threading.Thread(
            target=self._beat, args=(self._store.clone(),), name="paradyse-heartbeat", daemon=True
        )
        self._thread.start()
        self._beat_thread.start()
        if self.rank == 0 and self.state is not None and self.save_dir and not _same_dir(self.save_dir, self.load_dir):
            write_state(self.save_dir, self.state)

    def out_of_memory(self, error: BaseException, *, iteration: int, budget_bytes: float) -> NoReturn:
        """Shrink the budget (or give up), save it, stop every rank, exit."""
        if self._store.add(self._key("claims"), 1) > 1:
            self._wait_for_exit()  # another rank's fault came first: its announcement ends this rank too
        history = self.state or BudgetState(budget_bytes=budget_bytes)
        state = history.after_out_of_memory(
            iteration=iteration, rank=self.rank, where=_where(error), budget_bytes=budget_bytes, memory=self.memory
        )
        failures = state.failures(iteration)
        state_path = None
        if self.save_dir:  # saved before anyone exits: a launcher may kill this rank once another is gone
            state_path = str(write_state(self.save_dir, state))
        fault = _Fault(
            event=state.out_of_memory[-1],
            failures=len(failures),
            retries=self.memory.oom_retries,
            state_path=state_path,
            save_dir=self.save_dir,
        )
        others = [self._key(f"wake/{r}") for r in range(self.world_size) if r != self.rank]
        if others:
            self._store.multi_set(others, [fault.to_bytes()] * len(others))
        _say(fault.message([e.budget_before_bytes for e in failures]))
        self._store.set(self._wake_key, _STOP)  # this rank's own watcher: no wait left open on the store
        self._thread.join(_GATHER_TIMEOUT.total_seconds())
        self._leave(self._store, "done")
        end_process(fault.exit_code)

    def __enter__(self) -> FaultWatch:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A peer's exit breaks a collective: the watcher is ending the process, or (a peer that died without a
        # word: gloo raises at once) soon will, once rank 0 has heard the peer's silence.
        broken = exc_type is not None and issubclass(exc_type, RuntimeError)
        if self._fired.is_set() or (broken and self._fired.wait(_VERDICT_S)):
            self._wait_for_exit()
        self.close()

    def close(self) -> None:
        """Stop watching and beating; rank 0 waits (bounded) until every rank has stopped."""
        if self._thread is None:
            return
        self._quiet.set()
        self._beat_thread.join(_GATHER_TIMEOUT.total_seconds())
        try:
            self._store.set(self._beat_keys()[self.rank], _LEFT)  # rank 0 must not take this silence for a death
            woken = self._store.compare_set(self._wake_key, "", _STOP)
        except dist.DistError as e:  # the store's server went away: nobody is left to wait for
            logger.debug("paradyse: the fault watcher stops without the store: %s", e)
            return
        if woken != _STOP:
            self._wait_for_exit()  # a fault arrived first: the watcher acts on it
        self._thread.join(_GATHER_TIMEOUT.total_seconds())
        self._thread = None
        self._leave(self._store, "left")

    def _watch(self, store) -> None:
        while True:
            try:
                store.wait([self._wake_key], _WATCH_CHUNK)
                value = store.get(self._wake_key)
                break
            except dist.DistStoreError:  # the chunk timed out
                continue
            except dist.DistError:  # the store's server went away while this rank watched: its host died
                self._store_lost()
        if value == _STOP:
            return
        self._fired.set()
        self._quiet.set()
        if value.startswith(_GONE):
            if self.rank == 0:  # the rank that heard the silence
                gone = [int(r) for r in value.removeprefix(_GONE).split(b",")]
                _say(self._gone_message(rank_list(gone), f"no heartbeat for {_SILENT_S:g} s"))
            self._leave(store, "done")
            end_process(PEER_EXIT_CODE)
        fault = _Fault.from_bytes(value)
        _say(fault.peer_message(self.rank))
        self._leave(store, "done")
        end_process(fault.exit_code)

    def _beat(self, store) -> None:
        """Every other rank tells rank 0 it is alive, once a second; rank 0 listens, and stops every rank when
        one falls silent."""
        keys = self._beat_keys()
        silence = _Silence(range(1, self.world_size), time.monotonic())
        try:
            while not self._quiet.wait(_BEAT_S):
                if self.rank != 0:
                    store.add(keys[self.rank], 1)
                elif gone := silence.gone(store.multi_get(keys[1:]), time.monotonic()):
                    self._announce_gone(store, gone)
                    return
        except dist.DistError as e:  # the store's server went away: the watcher says so
            logger.debug("paradyse: the heartbeat stops: %s", e)

    def _announce_gone(self, store, gone: list[int]) -> None:
        """Rank 0 heard ``gone`` fall silent: claim the fault (one that came first ends every rank anyway),
        count the silent ranks out (nobody waits for them to leave) and wake every rank, this one included."""
        if store.add(self._key("claims"), 1) > 1:
            return
        store.add(self._key("done"), len(gone))
        wake = [self._key(f"wake/{r}") for r in range(self.world_size)]
        store.multi_set(wake, [_GONE + ",".join(map(str, gone)).encode()] * len(wake))

    def _store_lost(self) -> NoReturn:
        """The store's server went away while this rank watched: its host stopped without a word. That is rank
        0, unless torchrun's agent hosts the store; the lowest rank still there says it."""
        self._fired.set()
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if self.rank == (0 if agent else 1):
            _say(self._gone_message("torchrun's agent" if agent else "rank 0", "the store it hosted closed"))
        end_process(PEER_EXIT_CODE)

    def _gone_message(self, who: str, how: str) -> str:
        message = f"paradyse: error: {who} stopped without a word ({how}); every rank stops"
        if self.save_dir:
            message += f". Relaunch with --load {self.save_dir} to resume from the last checkpoint"
        return message

    def _beat_keys(self) -> list[str]:
        return [self._key(f"beat/{r}") for r in range(self.world_size)]

    def _leave(self, store, name: str) -> None:
        """Count this rank out of the store. Its server may live in rank 0 (it does without torchrun), and
        a rank blocked in a wait on a vanished server fails noisily: so every other rank leaves without
        waiting, after its last use of the store, and rank 0 waits (bounded) until all have left."""
        try:
            if store.add(self._key(name), 1) == self.world_size:
                store.set(self._key(f"all_{name}"), b"1")
            if self.rank == 0:
                store.wait([self._key(f"all_{name}")], _GATHER_TIMEOUT)
        except dist.DistError as e:  # timed out, or the server went away: go on without the others
            logger.debug("paradyse: leaving the store without the other ranks: %s", e)

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _wait_for_exit(self) -> NoReturn:
        """Let the watcher end the process; if it cannot (it has not heard of the fault in time), end it."""
        threading.Event().wait(3 * _GATHER_TIMEOUT.total_seconds())
        end_process(FAULT_EXIT_CODE)


class _Silence:
    """Rank 0's ear: which ranks' beats have not moved for :data:`_SILENT_S`, by rank 0's clock (a rank 0
    that was itself held up finds every beat moved), a rank that left excepted."""

    def __init__(self, ranks, now: float):
        self.beats = dict.fromkeys(ranks, b"")
        self.moved = dict.fromkeys(ranks, now)

    def gone(self, beats: list[bytes], now: float) -> list[int]:
        for rank, beat in zip(list(self.beats), beats, strict=True):
            if beat != self.beats[rank]:
                self.beats[rank], self.moved[rank] = beat, now
        return [r for r, beat in self.beats.items() if beat != _LEFT and now - self.moved[r] >= _SILENT_S]


def _where(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    where = lines[0][:300] if lines else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    if frames:
        where += f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})"
    return where


def _gib_list(values) -> str:
    return ", ".join(f"{v / _GIB:.4g}" for v in values)


def _same_dir(a: str, b: str | None) -> bool:
    return b is not None and Path(a).resolve() == Path(b).resolve()


def end_process(code: int) -> NoReturn:
    """End the process now, its output flushed, and the processes it started (Megatron's checkpoint
    writers, data-loader workers): its main thread may be blocked inside a collective that only exit
    frees, the interpreter's shutdown may abort on its process group's threads, and a child left behind
    would keep the launcher's pipes open (and the launcher waiting on them)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(_CHILD_EXIT_S)
        if child.is_alive():
            child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent dies."""


@functools.cache
def children_die_with_this_process() -> None:
    """From now on, every process this one forks from its main thread is killed when this one dies (Linux).
    :func:`end_process` ends a rank's children when the rank ends itself; a rank that is killed or crashes
    cannot, and its checkpoint writers or data-loader workers would run on, orphaned, waiting for work that
    never comes. Not for a fork from another thread: the kernel signals the child when the forking thread
    ends. Nor for a child started by exec (``subprocess``, multiprocessing's spawn and forkserver), which
    runs no Python at the fork: TorchInductor's compile workers end by themselves when their parent's pipe
    closes (within seconds, measured)."""
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    main_thread = threading.main_thread().ident
    parent = [os.getpid()]

    def before_fork() -> None:
        parent[0] = os.getpid()

    def in_child() -> None:
        if threading.get_ident() != main_thread:  # the child's thread is the one that forked
            return
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent[0]:  # the parent died before the call: no signal will come
            os._exit(1)

    os.register_at_fork(before=before_fork, after_in_child=in_child)
