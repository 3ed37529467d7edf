"""Megatron's parallel state for a block of code, leaving no process group behind.

``destroy_model_parallel`` forgets the process groups ``initialize_model_parallel`` made, but c10d keeps
them alive: each gloo group holds a TCP loop thread and two worker threads, which wake while idle. Some
20 groups an initialisation, a process that set Megatron up once per measured layer held 1,200 threads
after 20 layers, and they took more of its CPU time than the layers did. :func:`model_parallel_state`
destroys the groups too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from megatron.core import parallel_state

__all__ = ["model_parallel_state"]


@contextlib.contextmanager
def model_parallel_state(**sizes) -> Iterator[None]:
    """Megatron's parallel state (``initialize_model_parallel(**sizes)``) inside the block; at its end the
    state is destroyed, and so are the process groups it made (this rank's)."""
    parallel_state.initialize_model_parallel(**sizes)
    made = [group for group in parallel_state._global_process_group_list if group is not None]
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()  # which destroys its gloo groups itself
        for group in made:
            if group in dist.distributed_c10d._world.pg_map:  # c10d's registry of live groups
                dist.destroy_process_group(group)
