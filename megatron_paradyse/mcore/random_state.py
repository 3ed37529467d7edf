"""Megatron's random number generators kept across work that must not draw from them: torch's own, the
device's, and the named states of Megatron's tracker (``get_cuda_rng_tracker``, the dropout's under tensor
parallelism). Megatron's own ``_fork_rng`` reads the CUDA generator unconditionally, which a machine without
CUDA does not have."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron.core import tensor_parallel

__all__ = ["random_state_kept"]


@contextlib.contextmanager
def random_state_kept(device: torch.device) -> Iterator[None]:
    """Inside, draw as much as you like: on leaving, every generator is as it was on entering (``device``:
    the one whose generator is kept beside the CPU's)."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    tracker = tensor_parallel.get_cuda_rng_tracker()
    named = {name: _copy(state) for name, state in tracker.get_states().items()}
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        tracker.set_states(named)


def _copy(state):
    """A tracker's state, apart from the one that goes on drawing: a state tensor, or (where Megatron keeps
    graph-safe states) a generator."""
    if isinstance(state, torch.Generator):
        copy = torch.Generator(state.device)
        copy.set_state(state.get_state())
        return copy
    return state.clone()
