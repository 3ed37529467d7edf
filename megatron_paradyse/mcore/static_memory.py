"""What every plan of a pipeline stage shares: its parameters, gradients and optimizer state.

The planner's budget covers the stage's whole peak (DESIGN.md section 4: static + saved + transient),
so the cost model needs the static part. It is counted here from the model config and the training
arguments rather than read from a built model, so that every rank knows it for *every* stage of its
pipeline: a micro-batch too long for any stage must be skipped by all of them
(:mod:`megatron_paradyse.run.planned_loader`). The entry point checks the count against the model it
trains.

Bytes per parameter, as Megatron keeps them (``e`` = parameter element size, ``d`` = data-parallel
size when the optimizer state is distributed, else 1)::

    e                          the parameter
  + 4 or e                     its gradient (fp32 when gradients accumulate in fp32)
  + (4 if e < 4) / d           the fp32 main copy of a bf16/fp16 parameter
  + (4 * optimizer states) / d Adam: exp_avg and exp_avg_sq; SGD: momentum
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

__all__ = ["StageFootprint", "layer_parameters", "pipeline_footprints"]


@dataclasses.dataclass(frozen=True)
class StageFootprint:
    """One pipeline stage of one tensor-parallel rank."""

    stage: int
    layers: int
    """Transformer layers on the stage (all its virtual-pipeline chunks)."""
    parameters: int
    """Parameters this rank holds for the stage (its tensor-parallel shards)."""
    has_output_layer: bool
    """The stage computes the logits and the loss (the last stage)."""
    static_bytes: float


def layer_parameters(config: TransformerConfig) -> int:
    """Parameters of one dense transformer layer on one tensor-parallel rank (Megatron's TP shards)."""
    p = config.tensor_model_parallel_size
    h, hn = config.hidden_size, config.kv_channels
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    ffn_out = config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)
    norm = 2 if config.normalization == "LayerNorm" else 1
    qkv = (heads + 2 * groups) * hn
    count = (qkv * h + heads * hn * h + h * ffn_out + config.ffn_hidden_size * h) // p
    count += 2 * norm * h  # input and pre-MLP norms, replicated
    if config.qk_layernorm:
        count += 2 * norm * hn
    if config.add_qkv_bias or config.add_bias_linear:
        count += qkv // p
    if config.add_bias_linear:
        count += ffn_out // p + 2 * h  # fc1 bias sharded; proj and fc2 biases replicated
    return count


def pipeline_footprints(
    config: TransformerConfig,
    *,
    vocab_size: int,
    tied_embeddings: bool,
    learned_positions: int,
    optimizer_states: int,
    grads_in_fp32: bool,
    optimizer_shards: int,
) -> list[StageFootprint]:
    """The footprint of every pipeline stage of ``config`` on one tensor-parallel rank.

    Args:
        vocab_size: the padded vocabulary (a multiple of the tensor-parallel size).
        tied_embeddings: the output layer shares the word embedding (a copy on the last stage when
            there are several).
        learned_positions: rows of a learned absolute position embedding (0 for RoPE).
        optimizer_states: fp32 tensors the optimizer keeps per parameter (Adam 2, SGD 1 or 0).
        grads_in_fp32: gradients accumulate in fp32 whatever the parameter dtype.
        optimizer_shards: ranks the optimizer state is split over (the data-parallel size with the
            distributed optimizer, else 1).
    """
    p, pp, h = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.hidden_size
    element = torch.empty((), dtype=config.params_dtype).element_size()
    per_parameter = element + (4 if grads_in_fp32 else element)
    per_parameter += ((4 if element < 4 else 0) + 4 * optimizer_states) / optimizer_shards
    vocab_rows = vocab_size // p * h
    norm = 2 if config.normalization == "LayerNorm" else 1
    footprints = []
    for stage in range(pp):
        chunks = (
            [None]
            if config.virtual_pipeline_model_parallel_size is None
            else range(config.virtual_pipeline_model_parallel_size)
        )
        layers = sum(get_num_layers_to_build(config, vp_stage=c, pp_rank=stage) for c in chunks)
        first, last = stage == 0, stage == pp - 1
        parameters = layers * layer_parameters(config)
        if first:
            parameters += vocab_rows + learned_positions * h
        if last:
            parameters += norm * h
            if not tied_embeddings or pp > 1:
                parameters += vocab_rows
        footprints.append(StageFootprint(stage, layers, parameters, last, parameters * per_parameter))
    return footprints
