"""Megatron-Core's stock local GPT spec, runnable with sequence parallelism: the baseline.

``get_gpt_layer_local_spec`` is what a Megatron user without TransformerEngine trains with today
(``--transformer-impl local``): ``ColumnParallelLinear``/``RowParallelLinear`` with Megatron's own
sequence-parallel all-gathers and reduce-scatters, and its unfused ``DotProductAttention``. Its torch
norm refuses ``sequence_parallel=True`` (apex's and TransformerEngine's accept it, GPU-only), so every
norm slot takes :func:`~megatron_paradyse.mcore.norm.sequence_parallel_norm` instead: the same computation,
parameters marked for Megatron's tensor-parallel gradient all-reduce. Nothing else changes.
"""

from __future__ import annotations

import dataclasses

from megatron_paradyse.mcore.norm import sequence_parallel_norm

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

__all__ = ["stock_block_spec"]


def stock_block_spec(config: TransformerConfig, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """Megatron's local GPT block spec of this pipeline stage, with an SP-capable norm in every norm slot."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization, qk_layernorm=config.qk_layernorm)
    attention = spec.submodules.self_attention
    if config.qk_layernorm:
        attention = dataclasses.replace(
            attention,
            submodules=dataclasses.replace(
                attention.submodules, q_layernorm=sequence_parallel_norm, k_layernorm=sequence_parallel_norm
            ),
        )
    layer = dataclasses.replace(
        spec,
        submodules=dataclasses.replace(
            spec.submodules,
            input_layernorm=sequence_parallel_norm,
            pre_mlp_layernorm=sequence_parallel_norm,
            self_attention=attention,
        ),
    )
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=sequence_parallel_norm)
