"""What Megatron keeps from one micro-batch to the next that the plan prices as each micro-batch's own.

The cost model counts, per micro-batch, the all-gather buffer of Megatron's sequence-parallel linears
and GPTModel's rotary table at that micro-batch's length (:meth:`AnalyticCostModel.stage_bytes`).
Megatron keeps both across micro-batches: the global buffer at the longest sequence gathered so far
(grown with the old one still held), the rotary tables of the last 32 lengths (an ``lru_cache`` on
``RotaryEmbedding.forward``). With lengths that vary, both hold memory no plan of the current
micro-batch accounts for. Releasing them before each micro-batch makes them its own; the caching
allocator serves the new ones from the freed blocks.
"""

from __future__ import annotations

__all__ = ["release_step_buffers"]


def release_step_buffers() -> None:
    """Drop Megatron's global all-gather buffer and GPTModel's cached rotary tables."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if parallel_state._GLOBAL_MEMORY_BUFFER is not None:
        buffers = parallel_state.get_global_memory_buffer().buffer
        for key in [key for key in buffers if key[0] == "mpu"]:
            del buffers[key]
    RotaryEmbedding.forward.cache_clear()
