"""The strategy library's view of a Megatron layer: the shape the strategies and the cost model price."""

from __future__ import annotations

from megatron_paradyse.strategies import ModelShape

from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

__all__ = ["model_shape", "rotary_dim", "stage_chunk_layers"]


def model_shape(config: TransformerConfig) -> ModelShape:
    """The strategy library's view of one transformer layer of ``config``."""
    return ModelShape(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups or config.num_attention_heads,
        kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size,
        gated_mlp=config.gated_linear_unit,
        qk_norm=config.qk_layernorm,
    )


def rotary_dim(config: TransformerConfig, position_embedding_type: str, rotary_percent: float = 1.0) -> int:
    """The channels of each head GPTModel's RoPE rotates (0 without RoPE): its rotary table's width."""
    return int(config.kv_channels * rotary_percent) if position_embedding_type == "rope" else 0


def stage_chunk_layers(config: TransformerConfig, pp_rank: int) -> tuple[int, ...]:
    """Transformer layers of each model chunk of pipeline stage ``pp_rank``, in layer order (one chunk
    without a virtual pipeline)."""
    vp_size = config.virtual_pipeline_model_parallel_size
    chunks = [None] if vp_size is None else range(vp_size)
    return tuple(get_num_layers_to_build(config, vp_stage=c, pp_rank=pp_rank) for c in chunks)
