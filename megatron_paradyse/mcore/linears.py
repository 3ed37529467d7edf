"""Megatron's local linear modules around one layer's shards, for code that runs strategies without a model.

A Paradyse layer hands the strategies its own ``linear_qkv``, ``linear_proj``, ``linear_fc1`` and
``linear_fc2`` (:meth:`AttentionWeights.of`). The cost measurements and the tests run strategies on bare
shards; :func:`layer_linears` builds the modules Megatron's local spec (``--transformer-impl local``)
builds, as ``SelfAttention`` and ``MLP`` configure them, so that ``tp_sp`` runs Megatron's code there too.

Megatron's sequence-parallel column linears all-gather into its global memory buffer
(``parallel_state.get_global_memory_buffer()``, name ``"mpu"``), which they keep: the buffer lives
outside any layer, at the size of the largest gather so far. :func:`reserve_gather_buffer` sizes it
before a measured window, as a step's earlier layers (or the output layer) leave it; where Megatron's
parallel state is not set up, the buffer is made here, and :func:`gather_buffer_scope` releases it: what
measures with these linears (``measure_layer``, a ``run_layer`` ``RankTracer``) holds one, so the process is
left as Megatron's ``initialize_model_parallel`` expects it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed import ProcessGroup

from megatron_paradyse.strategies.base import AttentionWeights, MLPWeights, ModelShape

from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["gather_buffer_scope", "layer_linears", "reserve_gather_buffer"]


def layer_linears(
    shape: ModelShape,
    group: ProcessGroup,
    *,
    bias: bool,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> tuple[AttentionWeights, MLPWeights]:
    """This rank's ``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2`` for ``group``, with
    uninitialised ``dtype`` parameters on ``device`` (the caller fills them)."""
    p = group.size()
    config = ModelParallelConfig(
        tensor_model_parallel_size=p,
        sequence_parallel=p > 1,
        params_dtype=dtype,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    h, a = shape.hidden_size, shape.num_attention_heads * shape.kv_channels
    qkv = shape.qkv_rows(1)
    common = dict(config=config, init_method=None, bias=bias, tp_group=group)

    def column(size_in: int, size_out: int, *, skip_bias_add: bool) -> ColumnParallelLinear:
        return ColumnParallelLinear(size_in, size_out, gather_output=False, skip_bias_add=skip_bias_add, **common)

    def row(size_in: int, size_out: int) -> RowParallelLinear:
        return RowParallelLinear(size_in, size_out, input_is_parallel=True, skip_bias_add=True, **common)

    # as Megatron's SelfAttention and MLP build them: qkv adds its bias, the others return theirs
    linear_qkv, linear_proj = column(h, qkv, skip_bias_add=False), row(a, h)
    linear_fc1, linear_fc2 = column(h, shape.fc1_rows(1), skip_bias_add=True), row(shape.ffn_hidden_size, h)
    if torch.device(device) != torch.device("cpu"):  # built on the CPU (and left there: fake tensors cannot move)
        for module in (linear_qkv, linear_proj, linear_fc1, linear_fc2):
            module.to(device)
    if p > 1:
        _global_buffer()  # what they gather into
    return AttentionWeights.of(linear_qkv, linear_proj), MLPWeights.of(linear_fc1, linear_fc2)


def reserve_gather_buffer(tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str) -> None:
    """Size Megatron's global all-gather buffer for ``tokens x hidden_size`` ``dtype`` elements (creating
    it when Megatron's parallel state has not), as the sequence-parallel linears of a step leave it."""
    buffer = _global_buffer()
    held = buffer.buffer.get(("mpu", dtype))
    if held is None or held.numel() < tokens * hidden_size or held.device != torch.device(device):
        buffer.buffer[("mpu", dtype)] = torch.empty(tokens * hidden_size, dtype=dtype, device=device)


@contextlib.contextmanager
def gather_buffer_scope() -> Iterator[None]:
    """Measurements inside the block may make Megatron's global memory buffer (where Megatron's parallel
    state is not set up); one made inside is released at the end, so the process is left as it was:
    ``initialize_model_parallel`` refuses a buffer that already exists, and the device memory is freed."""
    made_inside = parallel_state._GLOBAL_MEMORY_BUFFER is None
    try:
        yield
    finally:
        if made_inside:
            parallel_state.destroy_global_memory_buffer()


def _global_buffer():
    """Megatron's global memory buffer; created here where Megatron's parallel state is not set up (the
    linears take their group explicitly, the buffer is all they need of that state)."""
    if parallel_state._GLOBAL_MEMORY_BUFFER is None:
        parallel_state._set_global_memory_buffer()
    return parallel_state.get_global_memory_buffer()
