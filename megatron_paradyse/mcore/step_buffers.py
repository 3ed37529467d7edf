"""What Megatron keeps from one micro-batch to the next that the plan prices as each micro-batch's own.

The cost model counts, per micro-batch, the all-gather buffer of Megatron's sequence-parallel linears
and GPTModel's rotary table at that micro-batch's length (:meth:`AnalyticCostModel.stage_bytes`).
Megatron keeps both across micro-batches: the global buffer at the longest sequence gathered so far
(grown with the old one still held), the rotary tables of the last 32 lengths (an ``lru_cache`` on
``RotaryEmbedding.forward``). With lengths that vary, both hold memory no plan of the current
micro-batch accounts for. Releasing them before each micro-batch makes them its own; the caching
allocator serves the new ones from the freed blocks.

Megatron's pipeline schedules also leave each model chunk that receives its input holding the input of
the step's last micro-batch (``set_input_tensor``) until the next step's first forward on that chunk
replaces it: one activation of the last step, beside the next step's forwards (under the interleaved
schedule, a stage's first chunk runs several before its second chunk's first). Releasing it when the
schedule returns (:func:`leaving_nothing`) lets the planner budget each step for its own micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.utils import get_attr_wrapped_model

__all__ = ["leaving_nothing", "release_step_buffers"]


def release_step_buffers() -> None:
    """Drop Megatron's global all-gather buffer and GPTModel's cached rotary tables."""
    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:
        buffers = parallel_state.get_global_memory_buffer().buffer
        for key in [key for key in buffers if key[0] == "mpu"]:
            del buffers[key]
    RotaryEmbedding.forward.cache_clear()


def leaving_nothing(schedule: Callable) -> Callable:
    """Megatron's ``schedule`` (a ``forward_backward_func``), releasing the inputs its model chunks keep of
    the step's last micro-batch when it returns."""

    @functools.wraps(schedule)
    def run(*args, model, **kwargs):
        try:
            return schedule(*args, model=model, **kwargs)
        finally:
            for chunk in model if isinstance(model, list) else [model]:
                get_attr_wrapped_model(chunk, "set_input_tensor")(None)

    return run
