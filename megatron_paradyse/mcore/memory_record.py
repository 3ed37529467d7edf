"""Recording a strategy's memory from its own code (:mod:`megatron_paradyse.strategies.recorded`).

One sublayer runs its forward and backward as rank ``r`` of a fake ``p``-rank process group under
``FakeTensorMode``: collectives move nothing, tensors have sizes but no data, and the storage tracker
(:mod:`megatron_paradyse.core.memory`) keeps every storage made and freed, in order. The group is made in
this process, beside any real one it belongs to (a training job's, a test's gloo ranks), and Megatron's
global gather buffer is a private one for the recording: nothing of the process's own state is touched.

The recording is what the sublayer measurements count (``tests/helpers/memory_cells.py``): the input made
in the window and dropped by the caller after the forward; the output dropped before the backward, which
starts from its gradient (made inside the backward, freed once used); the input's gradient left alive.
Weight gradients are marked where autograd receives them (a hook on each weight), and the backward's
first read of a saved tensor where it happens (saved-tensor hooks around the forward).

Recordings are kept on disk (:func:`cached_record`, in ``$PARADYSE_RECORDINGS`` or
``~/.cache/megatron_paradyse/recordings``), named by the key and by the code that made them (this package's
sources, torch's and megatron-core's versions): processes of a job, or a test's ranks, record each once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.functional as F
from torch._C._distributed_c10d import FakeProcessGroup, ProcessGroup
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from megatron_paradyse.core.memory import GradientRoot, _StorageTracker
from megatron_paradyse.mcore.bare_layer import make_layer_params
from megatron_paradyse.mcore.linears import reserve_gather_buffer
from megatron_paradyse.strategies import MLPContext, get_strategy, run_mlp
from megatron_paradyse.strategies.recorded import Event, Recording, RecordingKey, install_recorder

from megatron.core import parallel_state

__all__ = ["FAKE_GROUP_DESC", "LENGTHS", "cached_record", "fake_groups", "record"]

FAKE_GROUP_DESC = "fake: a strategy's memory recorded"
"""The description of the fake groups a recording runs on (``ProcessGroup.group_desc``): they connect to
no one and hold no memory."""

LENGTHS = (16, 24, 40)
"""Tokens a rank the code runs at: each size is fitted on the first two and checked at the third."""


def record(key: RecordingKey) -> Recording:
    """``key``'s sublayer strategy, recorded at :data:`LENGTHS` and fitted (every size linear in the
    tokens, checked). What the code warns about as it runs (Megatron's advice on CUDA's connections,
    torch's deprecations) is about the code, not the recording: left unsaid here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [_run(key, t) for t in LENGTHS]
    (inputs_1, events_1, *ids), (inputs_2, events_2, *_), (inputs_3, events_3, *_) = runs
    t1, t2, t3 = LENGTHS

    def fitted(one: tuple[Event, ...], two: tuple[Event, ...], three: tuple[Event, ...]) -> tuple[Event, ...]:
        if not (
            [(e.kind, e.storage) for e in one]
            == [(e.kind, e.storage) for e in two]
            == [(e.kind, e.storage) for e in three]
        ):
            raise AssertionError(f"memory of {_what(key)}: the code allocates differently at {LENGTHS} tokens a rank")
        out = []
        for a, b, c in zip(one, two, three, strict=True):
            per_token = (b.constant - a.constant) / (t2 - t1)
            event = dataclasses.replace(a, per_token=per_token, constant=a.constant - per_token * t1)
            if event.per_token * t3 + event.constant != c.constant:
                raise AssertionError(f"memory of {_what(key)}: storage {a.storage} is not linear in the tokens")
            out.append(event)
        return tuple(out)

    return Recording(fitted(inputs_1, inputs_2, inputs_3), fitted(events_1, events_2, events_3), *ids)


def _what(key: RecordingKey) -> str:
    return f"{key.sublayer} strategy {key.name!r} at p={key.p}"


@contextlib.contextmanager
def fake_groups(rank: int, p: int, shards: int) -> Iterator[tuple[ProcessGroup, ProcessGroup]]:
    """(the micro-batch's group, the weights' group): rank ``rank`` of a fake process group of ``shards``
    ranks holding the weights, and the sub-group of ``p`` of them it runs a micro-batch on (the same
    group where ``p == shards``), made in this process whatever group it is in. A process in no group
    is made rank ``rank`` of a fake world for the block (Megatron's linears take their group only where
    ``torch.distributed`` is initialised), on the fake backend alone: torch warns when it destroys a
    world with a backend per device."""
    with contextlib.ExitStack() as stack:
        if dist.is_initialized():
            weights = stack.enter_context(_side_group(rank, shards))
        else:
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=shards)
            stack.callback(dist.destroy_process_group)
            weights = dist.group.WORLD
        yield (weights if p == shards else stack.enter_context(_side_group(rank % p, p))), weights


@contextlib.contextmanager
def _side_group(rank: int, size: int) -> Iterator[ProcessGroup]:
    """Rank ``rank`` of a fake group of ``size`` ranks beside the process's own, known to
    ``torch.distributed`` (for point-to-point ranks) inside the block only."""
    group = ProcessGroup(rank, size)
    backend = FakeProcessGroup._create_internal(rank, size, FakeProcessGroup.Options())
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.CUSTOM, backend)
    group._set_default_backend(ProcessGroup.BackendType.CUSTOM)
    group._set_group_name(f"paradyse_memory_record_{size}")  # what tools that watch collectives print
    group._set_group_desc(FAKE_GROUP_DESC)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    try:
        yield group
    finally:
        del c10d._world.pg_group_ranks[group]


@contextlib.contextmanager
def _private_gather_buffer() -> Iterator[None]:
    """Megatron's global gather buffer, a fresh one inside the block: the recording's fake tensors must
    not take the place of the process's own."""
    held = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = None
    try:
        yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = held


def _run(key: RecordingKey, t: int) -> tuple[tuple[Event, ...], tuple[Event, ...], int, int, int]:
    """One run at ``t`` tokens a rank: (inputs, events, x's, dy's and dx's storage), sizes as constants."""
    dtype = torch.float32 if key.e == 4 else torch.bfloat16
    shape, p = key.shape, key.p
    groups = fake_groups(key.rank, p, key.shards)
    with groups as (group, shards), _private_gather_buffer(), FakeTensorMode(allow_non_fake_inputs=True):
        params = make_layer_params(shape, key.shards, key.rank, group=shards, bias=key.bias, dtype=dtype)
        strategy = get_strategy(key.sublayer, key.name)
        gathers = strategy.weight_gathers(params.mlp, shards) if key.mlp_weight_ahead else None
        activation = F.silu if shape.gated_mlp else F.gelu
        weight_group = None if shards is group else shards
        ctx = MLPContext(group=group, shape=shape, activation=activation, gathers=gathers, weight_group=weight_group)
        x0 = torch.empty(t, key.b, shape.hidden_size, dtype=dtype, requires_grad=True)
        dy = torch.empty(t, key.b, shape.hidden_size, dtype=dtype)
        if p > 1:  # Megatron's sequence-parallel gather buffer, held outside the sublayer
            reserve_gather_buffer(t * p * key.b, shape.hidden_size, dtype, "cpu")
        marks: list[tuple[int, Event]] = []
        with _StorageTracker(record=True) as tracker:

            def mark(kind: str, tensor: torch.Tensor | None = None) -> None:
                storage = 0 if tensor is None else tracker.creation_of(tensor)
                if storage is None:
                    raise AssertionError(f"memory of {_what(key)}: a {kind} tensor made outside the window")
                marks.append((len(tracker.events), Event(kind, storage)))

            def unpack(saved: torch.Tensor) -> torch.Tensor:
                if backward and not any(event.kind == "read" for _, event in marks):
                    mark("read")
                return saved

            backward = False
            ids = {}

            def storage_of(name: str):  # a gradient hook that notes the gradient's storage (and returns None)
                return lambda grad: ids.update({name: tracker.creation_of(grad)})

            x0.register_hook(storage_of("dx"))
            for weight in (params.mlp.fc1, params.mlp.fc2, params.mlp.fc1_bias, params.mlp.fc2_bias):
                if weight is not None:
                    weight.register_hook(lambda g: _mark_once(marks, mark, g, tracker))
            x = x0.clone()
            if gathers is not None:
                gathers.start(0)  # as the attention before it does
            mark("start")
            with torch.autograd.graph.saved_tensors_hooks(lambda saved: saved, unpack):
                y = run_mlp(strategy.name, x, params.mlp, ctx)
            ids["x"] = tracker.creation_of(x)
            del x, ctx, gathers
            mark("return", y)
            root = GradientRoot(y, dy)
            y.register_hook(storage_of("dy"))
            del y
            mark("backward")
            backward = True
            root.backward()
            del root
        events = _merged(tracker, marks)
    start = next(i for i, event in enumerate(events) if event.kind == "start")
    return events[:start], events[start + 1 :], ids["x"], ids["dy"], ids["dx"]


def _mark_once(marks, mark, grad: torch.Tensor, tracker: _StorageTracker) -> None:
    """A weight gradient handed to autograd, once per storage (views of one buffer come together)."""
    storage = tracker.creation_of(grad)
    if not any(event.kind == "grad" and event.storage == storage for _, event in marks):
        mark("grad", grad)


def _merged(tracker: _StorageTracker, marks: list[tuple[int, Event]]) -> tuple[Event, ...]:
    """The tracker's creations and frees as events, with the marks where they were made; storages of
    no bytes left out."""
    empty = {ev.storage for ev in tracker.events if ev.nbytes == 0}
    out, pending = [], iter(marks)
    nxt = next(pending, None)
    for i, ev in enumerate([*tracker.events, None]):
        while nxt is not None and nxt[0] == i:
            out.append(nxt[1])
            nxt = next(pending, None)
        if ev is not None and ev.storage not in empty:
            kind = "alloc" if ev.nbytes > 0 else "free"
            out.append(Event(kind, ev.storage, constant=float(abs(ev.nbytes)) if kind == "alloc" else 0.0))
    return tuple(out)


def cached_record(key: RecordingKey) -> Recording:
    """:func:`record`, read from the disk where it was recorded before by the same code; otherwise
    recorded under the folder's lock (another process recording waits, then reads it) and kept. Where the
    cache cannot be written, recorded here each time."""
    folder = Path(os.environ.get("PARADYSE_RECORDINGS") or Path.home() / ".cache/megatron_paradyse/recordings")
    path = folder / f"{hashlib.sha256(f'{key!r} {_code_digest()}'.encode()).hexdigest()[:32]}.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / "recording.lock", "w")  # noqa: SIM115  (held by the block below)
    except OSError:
        return record(key)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return _from_json(json.loads(path.read_text()))
        recording = record(key)
        with contextlib.suppress(OSError):  # kept for the next process where the folder takes it
            written = path.with_suffix(f".{os.getpid()}.tmp")
            written.write_text(json.dumps(dataclasses.asdict(recording)))
            written.replace(path)
        return recording


@functools.cache
def _code_digest() -> str:
    """This package's sources and the versions of the libraries its strategies run: what a recording
    was made by."""
    digest = hashlib.sha256(f"torch {torch.__version__} megatron-core {version('megatron-core')}".encode())
    for source in sorted(Path(__file__).parents[1].rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _from_json(fields: dict) -> Recording:
    events = {name: tuple(Event(**event) for event in fields[name]) for name in ("inputs", "events")}
    return Recording(**{**fields, **events})


install_recorder(cached_record)
