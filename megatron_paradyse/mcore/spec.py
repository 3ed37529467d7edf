"""The Paradyse layer spec: a drop-in for Megatron-Core's GPT layer spec.

Two forms, for the two ways Megatron takes a spec:

- :func:`get_paradyse_layer_spec` ``(config, vp_stage=None)``: the block spec of one pipeline stage
  (one Paradyse layer spec per layer, and a final norm that works with sequence parallelism). Pass it
  as ``GPTModel(transformer_layer_spec=get_paradyse_layer_spec(config))``, or give Megatron the
  function itself (``--spec megatron_paradyse.spec get_paradyse_layer_spec``; ``build_model`` calls it
  with its model config and ``vp_stage``).
- :data:`paradyse_layer_spec`: one layer's ``ModuleSpec``
  (``--spec megatron_paradyse.spec paradyse_layer_spec``). Megatron then picks the final norm itself
  (TransformerEngine's or apex's; its torch fallback refuses sequence parallelism).

The linear modules are those of the configured transformer implementation: Megatron's local
``ColumnParallelLinear``/``RowParallelLinear``, or, with ``transformer_impl="transformer_engine"`` where
Transformer Engine is installed, TE's (``linear_qkv``/``linear_fc1`` with the input norm fused, the
layer's own norms identities), as in Megatron's stock GPT specs. The weights, their state-dict keys and
the sharded (distributed-checkpoint) keys are those of the stock spec of the same implementation, so
checkpoints move between the two. :data:`paradyse_layer_spec` is the local one.
"""

from __future__ import annotations

import dataclasses
import functools

from megatron_paradyse.mcore.modules import ParadyseMLP, ParadyseSelfAttention, ParadyseTransformerLayer
from megatron_paradyse.mcore.norm import sequence_parallel_norm

from megatron.core.extensions.transformer_engine import HAVE_TE, TELayerNormColumnParallelLinear, TERowParallelLinear
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

__all__ = ["get_paradyse_layer_spec", "paradyse_layer_spec"]

paradyse_layer_spec = ModuleSpec(
    module=ParadyseTransformerLayer,
    submodules=TransformerLayerSubmodules(
        input_layernorm=sequence_parallel_norm,
        self_attention=ModuleSpec(
            module=ParadyseSelfAttention,
            params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=ColumnParallelLinear,
                core_attention=IdentityOp,  # unused: the strategies attend
                linear_proj=RowParallelLinear,
            ),
        ),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=sequence_parallel_norm,
        mlp=functools.partial(
            ParadyseMLP.as_mlp_submodule,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        ),
        mlp_bda=get_bias_dropout_add,
        # As in Megatron's local spec: checkpoint keys of the norms are those of the TE spec's fused
        # layernorm-linear modules, so distributed checkpoints move between local and TE models.
        sharded_state_dict_keys_map={
            "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
            "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
        },
    ),
)
"""One causal Paradyse GPT layer with Megatron's local linear modules. q/k norms follow
``config.qk_layernorm``; norms follow ``config.normalization``."""


def _transformer_engine_layer() -> ModuleSpec:
    """The layer with Transformer Engine's linear modules, as Megatron's TE GPT spec has them: the input
    and pre-MLP norms fused into ``linear_qkv`` and ``linear_fc1`` (checkpoint keys
    ``linear_qkv.layer_norm_weight``...), no key map. Unverified: TE does not run on the CPU test machine."""
    layer = paradyse_layer_spec.submodules
    attention = layer.self_attention
    attention = dataclasses.replace(
        attention,
        submodules=dataclasses.replace(
            attention.submodules, linear_qkv=TELayerNormColumnParallelLinear, linear_proj=TERowParallelLinear
        ),
    )
    mlp = functools.partial(
        ParadyseMLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=TELayerNormColumnParallelLinear, linear_fc2=TERowParallelLinear),
    )
    submodules = dataclasses.replace(
        layer,
        input_layernorm=IdentityOp,
        self_attention=attention,
        pre_mlp_layernorm=IdentityOp,
        mlp=mlp,
        sharded_state_dict_keys_map={},
    )
    return dataclasses.replace(paradyse_layer_spec, submodules=submodules)


def _layer_spec(config: TransformerConfig) -> ModuleSpec:
    """The layer of ``config.transformer_impl``: Transformer Engine's modules where TE is installed."""
    if config.transformer_impl != "transformer_engine":
        return paradyse_layer_spec
    return _transformer_engine_layer() if HAVE_TE else paradyse_layer_spec


def get_paradyse_layer_spec(
    config: TransformerConfig, vp_stage: int | None = None, *, attn_mask_type: AttnMaskType = AttnMaskType.causal
) -> TransformerBlockSubmodules:
    """The Paradyse block spec of this pipeline stage (chunk ``vp_stage`` with virtual pipelining).

    ``config`` is the model's ``TransformerConfig``, or a ``megatron.training`` model config that holds
    one as ``.transformer``. ``attn_mask_type``: ``causal`` (GPT) or ``no_mask`` (bidirectional, BERT-style);
    the micro-batches' layouts must be built alike.
    """
    config = getattr(config, "transformer", config)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    layer = _layer_spec(config)
    if attn_mask_type != AttnMaskType.causal:
        attention = layer.submodules.self_attention
        attention = dataclasses.replace(attention, params={**attention.params, "attn_mask_type": attn_mask_type})
        layer = dataclasses.replace(layer, submodules=dataclasses.replace(layer.submodules, self_attention=attention))
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=sequence_parallel_norm)
