"""Megatron-Core modules whose attention and MLP run the strategy the micro-batch's plan names.

The modules subclass Megatron's own (``TransformerLayer``, ``SelfAttention``, ``MLP``) and keep
Megatron's linear modules of the configured transformer implementation (the local
``ColumnParallelLinear``/``RowParallelLinear``, or Transformer Engine's), so initialisation, parameter
attributes, state-dict keys and ``sharded_state_dict`` are exactly those of a stock model with
``tensor_model_parallel_size = p``. Each sublayer hands its input ``[s/p, b, h]`` (sequence parallel,
canonical order) and its linear modules to the strategy library: ``tp_sp`` calls them, as a stock layer
does; the others read their TP shards.

A layer finds its option in ``current_micro_batch().plan`` at the index of its position within the
pipeline stage, checks that both strategies can run the model before any communication, and, when
the option asks for it, recomputes itself in backward from its ``[s/p, b, h]`` input under the
micro-batch it captured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.micro_batch import MicroBatch, active_micro_batch, current_micro_batch, micro_batch_scope
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore.compat import drop_unavailable_gradient_accumulation_fusion
from megatron_paradyse.mcore.drop_in import implicit_micro_batch
from megatron_paradyse.mcore.model_shape import model_shape, stage_chunk_layers
from megatron_paradyse.mcore.norm import fused_input_norm, sequence_parallel_norm
from megatron_paradyse.mcore.rotary import rotate
from megatron_paradyse.strategies import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    available_strategies,
    get_strategy,
    mlp_gathers_ahead,
    run_attention,
    run_mlp,
    unsupported_reason,
)
from megatron_paradyse.strategies.common import gated_activation_problem
from megatron_paradyse.strategies.recompute import recompute
from megatron_paradyse.strategies.tiling import over_row_tiles

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.utils import get_pg_rank

__all__ = ["ParadyseMLP", "ParadyseSelfAttention", "ParadyseTransformerLayer", "config_problems"]


def config_problems(config: TransformerConfig) -> list[str]:
    """What in ``config`` the Paradyse layers cannot run (empty: nothing)."""
    problems = []
    tp = config.tensor_model_parallel_size
    if tp > 1 and not config.sequence_parallel:
        problems.append("sequence_parallel=False: every strategy reads and writes [s/p, b, h]; set it to True")
    if config.context_parallel_size != 1:
        problems.append(
            f"context_parallel_size={config.context_parallel_size}: the strategies parallelise the sequence "
            f"inside the tensor-parallel group; set it to 1"
        )
    if config.recompute_granularity is not None:
        problems.append(
            f"recompute_granularity={config.recompute_granularity!r}: Megatron's recompute would rerun layers "
            f"without their micro-batch's plan; set it to None and recompute per layer through the plan "
            f"(LayerOption(..., recompute=True), written 'attention/mlp+rc')"
        )
    if config.attention_dropout:
        problems.append(f"attention_dropout={config.attention_dropout}: the attention kernels have no dropout; set 0")
    if config.rotary_interleaved:
        problems.append("rotary_interleaved=True is not supported: the layers rotate the halves of each head")
    if config.gated_linear_unit and not config.bias_activation_fusion:
        if (problem := gated_activation_problem(config.activation_func)) is not None:
            problems.append(f"activation_func: {problem}")
    for flag in ("multi_latent_attention", "attention_output_gate", "use_te_activation_func"):
        if getattr(config, flag):
            problems.append(f"{flag}=True is not supported")
    for flag in ("num_moe_experts", "fp8", "fp4", "experimental_attention_variant", "activation_func_clamp_value"):
        if getattr(config, flag) is not None:
            problems.append(f"{flag}={getattr(config, flag)!r} is not supported; leave it None")
    if config.glu_linear_offset:
        problems.append(f"glu_linear_offset={config.glu_linear_offset} is not supported; leave it 0")
    if config.gtp_weight_remat_size > 1:
        problems.append(f"gtp_weight_remat_size={config.gtp_weight_remat_size} is not supported; leave it 1")
    shard_problems = model_shape(config).shard_problems(tp)
    if shard_problems:
        problems.append(
            f"no strategy can split this model over tensor_model_parallel_size={tp}: " + "; ".join(shard_problems)
        )
    return problems


def _mlp_activation(config: TransformerConfig) -> Callable[[Tensor], Tensor]:
    """The activation Megatron's MLP computes for ``config`` (applied to the gate half when gated)."""
    if not config.bias_activation_fusion:
        return config.activation_func
    if config.activation_func is F.gelu:
        # Megatron's fused bias-GeLU and bias-GeGLU kernels use the tanh approximation.
        return functools.partial(F.gelu, approximate="tanh")
    if config.activation_func is F.silu and config.gated_linear_unit:
        return F.silu
    raise ValueError("bias_activation_fusion=True supports gelu and gated silu (SwiGLU) only, as in Megatron")


def _sublayer_input(sublayer: str, name: str, x: Tensor, *linears: torch.nn.Module) -> Tensor:
    """What strategy ``name`` takes for ``sublayer``'s input ``x``. A strategy that calls the linear modules
    (``tp_sp``) takes ``x`` itself: the modules run their forward pre-hooks and a norm fused into the first
    one. The others read the modules' weights: the hooks run here, as the modules' call would (with
    ``--overlap-param-gather`` Megatron's DDP waits there for the all-gather of their parameters, which the
    distributed optimizer's step left running, and starts the next bucket's), then the fused norm, if any."""
    if get_strategy(sublayer, name).calls_linears:
        return x
    for module in linears:
        for key, hook in tuple(module._forward_pre_hooks.items()):
            if key in module._forward_pre_hooks_with_kwargs:
                hook(module, (), {})
            else:
                hook(module, ())
    norm = fused_input_norm(linears[0])
    return x if norm is None else norm(x)


def _stage_position(config: TransformerConfig, layer_number: int, pp_rank: int) -> tuple[int, int]:
    """(index of global layer ``layer_number`` among the layers of pipeline rank ``pp_rank``, their count).

    The stage's layers are those of all its virtual-pipeline chunks, in layer order.
    """
    vp_size = config.virtual_pipeline_model_parallel_size
    index, count = None, 0
    for chunk, layers in zip([None] if vp_size is None else range(vp_size), stage_chunk_layers(config, pp_rank)):
        offset = get_transformer_layer_offset(config, chunk, pp_rank)
        if offset < layer_number <= offset + layers:
            index = count + layer_number - offset - 1
        count += layers
    assert index is not None, (layer_number, pp_rank)
    return index, count


class ParadyseTransformerLayer(TransformerLayer):
    """Megatron's ``TransformerLayer`` whose option (strategies, recompute) comes from the micro-batch's plan.

    Needs :class:`ParadyseSelfAttention` and :class:`ParadyseMLP` as its sublayers (see
    :mod:`megatron_paradyse.spec`). ``plan_index`` is the layer's position within its pipeline stage;
    ``stage_layers`` the number of layers of the stage, i.e. the length every plan must have.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        is_mtp_layer: bool = False,
        **kwargs,
    ):
        problems = config_problems(config)
        if problems:
            raise ValueError("the Paradyse layers cannot run this TransformerConfig:\n  - " + "\n  - ".join(problems))
        if is_mtp_layer:
            raise ValueError("multi-token-prediction layers are not Paradyse layers; build them with a stock spec")
        drop_unavailable_gradient_accumulation_fusion(config)  # before any linear module (or the output layer)
        super().__init__(config, submodules, layer_number, hidden_dropout, pg_collection, vp_stage, **kwargs)
        self.plan_index, self.stage_layers = _stage_position(
            config, self.layer_number, get_pg_rank(self.pg_collection.pp)
        )
        for sublayer, kind in ((self.self_attention, ParadyseSelfAttention), (self.mlp, ParadyseMLP)):
            if not isinstance(sublayer, kind):
                raise ValueError(
                    f"ParadyseTransformerLayer needs a {kind.__name__}, got {type(sublayer).__name__}; "
                    f"build the layer from megatron_paradyse.spec"
                )
            sublayer.plan_index = self.plan_index
        self.shape = model_shape(config)

    def forward(self, hidden_states: Tensor, **kwargs):
        micro_batch = active_micro_batch()
        if micro_batch is None:  # a job that does not know the Paradyse layers (megatron_paradyse.mcore.drop_in)
            micro_batch = implicit_micro_batch(self, hidden_states, kwargs.get("packed_seq_params"))
            # the layout holds the documents; Megatron's mask is causal, which the layer's mask type says
            kwargs = {**kwargs, "packed_seq_params": None}
            if self.self_attention.causal:
                kwargs["attention_mask"] = None
        option = micro_batch.option(self.plan_index, self.stage_layers)
        self._check_runnable(option, micro_batch)

        def run(x: Tensor):
            with micro_batch_scope(micro_batch), self._mlp_gathered_ahead(option):  # also what a recompute reruns
                return TransformerLayer.forward(self, x, **kwargs)

        if not option.recompute:
            return run(hidden_states)
        offload = micro_batch.offload if option.offload else None
        return recompute(run, hidden_states, offload=offload, keep_core=option.keep_core)

    @contextlib.contextmanager
    def _mlp_gathered_ahead(self, option: LayerOption) -> Iterator[None]:
        """One run of the layer's sublayers: the MLP's weight gathers that the attention starts, where the
        option has them (:func:`~megatron_paradyse.strategies.mlp_gathers_ahead`), handed to both."""
        weights = MLPWeights.of(self.mlp.linear_fc1, self.mlp.linear_fc2)
        gathers = mlp_gathers_ahead(option, weights, self.tp_group)
        self.self_attention.mlp_gathers = self.mlp.gathers_ahead = gathers
        try:
            yield
        finally:
            self.self_attention.mlp_gathers = self.mlp.gathers_ahead = None

    def _check_runnable(self, option: LayerOption, micro_batch: MicroBatch) -> None:
        """Raise before any communication if this layer cannot run ``option`` on ``step``."""
        p = self.tp_group.size()
        where = f"layer {self.layer_number} (plan entry {self.plan_index}, {option})"
        if micro_batch.layout.p != p:
            raise ValueError(
                f"{where}: the micro-batch's layout is for p={micro_batch.layout.p}, the TP group has {p} ranks"
            )
        for sublayer, name in (("attention", option.attention), ("mlp", option.mlp)):
            try:
                reason = unsupported_reason(sublayer, name, self.shape, p)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            if reason is not None:
                usable, _ = available_strategies(sublayer, self.shape, p)
                raise ValueError(
                    f"{where}: {sublayer} strategy {name!r} cannot run this model on p={p} ranks ({reason}); "
                    f"usable: {', '.join(usable)}"
                )


@dataclasses.dataclass(frozen=True)
class _QKTransform:
    """Megatron's q/k layernorm, then RoPE at each token's position in its document (:func:`rotate`:
    Megatron's unfused RoPE, keeping nothing for backward)."""

    q_norm: Callable[[Tensor], Tensor] | None
    k_norm: Callable[[Tensor], Tensor] | None
    freqs: tuple[Tensor, Tensor] | None
    """GPTModel's rotary tables for queries and keys, ``[S, 1, 1, rot_dim]`` indexed by position."""
    mscale: float

    def __call__(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.freqs is not None:
            q_table, k_table = self.freqs
            q, k = rotate(q, q_table, position_ids, self.mscale), rotate(k, k_table, position_ids, self.mscale)
        return q, k


class ParadyseSelfAttention(SelfAttention):
    """Megatron's ``SelfAttention`` (``linear_qkv``, ``linear_proj``, q/k norms) run by a strategy.

    ``core_attention`` is not used: strategies attend themselves, with the visibility the micro-batch's
    layout gives (causal for ``AttnMaskType.causal``, bidirectional for ``no_mask``). With
    ``config.qk_layernorm``, q/k norms the spec leaves ``None`` are :func:`sequence_parallel_norm`.
    Returns the output with the projection bias already added (bias ``None``).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        **kwargs,
    ):
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"attn_mask_type={attn_mask_type.name} is not supported: visibility comes from the micro-batch's "
                f"SequenceLayout; use AttnMaskType.causal or AttnMaskType.no_mask"
            )
        if config.qk_l2_norm:
            raise ValueError(
                "qk_l2_norm=True is not supported by the Paradyse layer: the planner counts the memory of q/k norms "
                "of config.normalization's kind; set qk_l2_norm=False (with qk_layernorm=True for those norms)"
            )
        if config.qk_layernorm:
            submodules = dataclasses.replace(
                submodules,
                q_layernorm=submodules.q_layernorm or sequence_parallel_norm,
                k_layernorm=submodules.k_layernorm or sequence_parallel_norm,
            )
        super().__init__(config, submodules, layer_number, attn_mask_type, **kwargs)
        self.causal = attn_mask_type == AttnMaskType.causal
        self.shape = model_shape(config)
        self.softmax_scale = config.softmax_scale if config.softmax_scale is not None else config.kv_channels**-0.5
        self.plan_index: int | None = None
        """Set by the owning :class:`ParadyseTransformerLayer`."""
        self.mlp_gathers = None
        """The MLP's weight gathers during one run of the owning layer (:attr:`AttentionContext.mlp_gathers`)."""

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        rotary_pos_emb: Tensor | tuple[Tensor, Tensor] | None = None,
        **unsupported,
    ) -> tuple[Tensor, None]:
        """``hidden_states [s/p, b, h]`` (canonical order) -> ``([s/p, b, h], None)``."""
        given = sorted(k for k, v in {"attention_mask": attention_mask, **unsupported}.items() if v is not None)
        if given:
            raise ValueError(
                f"ParadyseSelfAttention got {', '.join(given)}: attention visibility and packing come from the "
                f"micro-batch's SequenceLayout, and inference, cross-attention and attention biases are not "
                f"supported; call the model with attention_mask=None"
            )
        micro_batch = current_micro_batch()
        if micro_batch.layout.causal != self.causal:
            raise ValueError(
                f"layer {self.layer_number} is {'causal' if self.causal else 'bidirectional'}, but the micro-batch's "
                f"layout is not; build the layout with SequenceLayout.build(..., causal={self.causal})"
            )
        if self.plan_index is None:
            raise RuntimeError(
                "ParadyseSelfAttention must be built by ParadyseTransformerLayer (megatron_paradyse.spec)"
            )
        ctx = AttentionContext(
            group=self.pg_collection.tp,
            layout=micro_batch.layout,
            shape=self.shape,
            kernel=get_kernel(micro_batch.attention_kernel, hidden_states.device, hidden_states.dtype),
            softmax_scale=self.softmax_scale,
            qk_transform=self._qk_transform(rotary_pos_emb),
            mlp_gathers=self.mlp_gathers,
        )
        name = micro_batch.plan[self.plan_index].attention
        x_local = _sublayer_input("attention", name, hidden_states, self.linear_qkv, self.linear_proj)
        weights = AttentionWeights.of(self.linear_qkv, self.linear_proj)
        return run_attention(name, x_local, weights, ctx), None

    def _qk_transform(self, rotary_pos_emb: Tensor | tuple[Tensor, Tensor] | None) -> _QKTransform | None:
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary_pos_emb = None
        if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        if rotary_pos_emb is None and self.q_layernorm is None and self.k_layernorm is None:
            return None
        return _QKTransform(
            q_norm=self.q_layernorm,
            k_norm=self.k_layernorm,
            freqs=rotary_pos_emb,
            mscale=self._yarn_concentration_factor,
        )


class ParadyseMLP(MLP):
    """Megatron's dense ``MLP`` (``linear_fc1``, ``linear_fc2``) run by a strategy.

    Build it as Megatron does, ``functools.partial(ParadyseMLP.as_mlp_submodule, submodules=...)``.
    Returns the output with the ``linear_fc2`` bias already added (bias ``None``).
    """

    def __init__(self, config: TransformerConfig, submodules: MLPSubmodules, is_expert: bool = False, **kwargs):
        if is_expert:
            raise ValueError("ParadyseMLP is a dense MLP; mixture-of-experts layers are not supported")
        for key, full in (("input_size", config.hidden_size), ("ffn_hidden_size", config.ffn_hidden_size)):
            if kwargs.get(key) not in (None, full):
                raise ValueError(f"ParadyseMLP runs the model's own sizes: {key}={kwargs[key]}, the config has {full}")
        super().__init__(config, submodules, is_expert, **kwargs)
        self.shape = model_shape(config)
        self.activation = _mlp_activation(config)
        self.plan_index: int | None = None
        """Set by the owning :class:`ParadyseTransformerLayer`."""
        self.gathers_ahead = None
        """Its weight gathers during one run of the owning layer, started by the attention
        (:attr:`MLPContext.gathers`)."""

    def forward(self, hidden_states: Tensor, per_token_scale: Tensor | None = None, **kwargs) -> tuple[Tensor, None]:
        """``hidden_states [s/p, b, h]`` -> ``([s/p, b, h], None)``. ``padding_mask`` (MoE routing) is unused."""
        if per_token_scale is not None:
            raise ValueError("per_token_scale is for mixture-of-experts MLPs; ParadyseMLP is dense")
        if self.plan_index is None:
            raise RuntimeError("ParadyseMLP must be built by ParadyseTransformerLayer (megatron_paradyse.spec)")
        micro_batch = current_micro_batch()
        ctx = MLPContext(group=self.tp_group, shape=self.shape, activation=self.activation, gathers=self.gathers_ahead)
        option = micro_batch.plan[self.plan_index]
        x_local = _sublayer_input("mlp", option.mlp, hidden_states, self.linear_fc1, self.linear_fc2)
        weights = MLPWeights.of(self.linear_fc1, self.linear_fc2)
        if not option.mlp_tile_tokens:
            return run_mlp(option.mlp, x_local, weights, ctx), None
        mlp = lambda tile: run_mlp(option.mlp, tile, weights, ctx)  # noqa: E731
        return over_row_tiles(mlp, x_local, option.mlp_tile_tokens, self.tp_group.size()), None
