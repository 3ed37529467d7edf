"""What every strategy takes and returns.

A strategy is a function ``(x_local [s/p, b, h], weights, ctx) -> y_local [s/p, b, h]`` for one
sublayer. ``weights`` are the sublayer's Megatron linear modules and their TP shards for
``tensor_model_parallel_size = p``: ``tp_sp`` calls the modules (Megatron's own TP+SP), the other
strategies read the shards and never write them. ``ctx`` carries the process group, the micro-batch's
:class:`SequenceLayout` and the model's shape. Strategies keep nothing between calls, so a layer may
run a different one on every call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.attention.kernels import AttentionKernel
from megatron_paradyse.core.comm import Zero3Gathers
from megatron_paradyse.core.layout import SequenceLayout

if TYPE_CHECKING:
    from megatron_paradyse.strategies.allocations import SublayerMemory
    from megatron_paradyse.strategies.dims import Dims
    from megatron_paradyse.strategies.terms import SublayerTerms

__all__ = [
    "AttentionContext",
    "AttentionWeights",
    "MLPContext",
    "MLPWeights",
    "ModelShape",
    "ParallelLinear",
    "QKTransform",
    "Strategy",
    "Sublayer",
]

Sublayer = Literal["attention", "mlp"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The dimensions of one transformer layer that strategies and cost models need."""

    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    """Key/value heads (GQA); equal to ``num_attention_heads`` for MHA."""
    kv_channels: int
    """Head dimension."""
    ffn_hidden_size: int
    gated_mlp: bool = False
    """SwiGLU-style MLP: ``linear_fc1`` produces gate and up projections."""
    qk_norm: bool = False
    """Queries and keys are normalised per head before RoPE (Megatron's ``qk_layernorm``); the
    strategies run the norms their context's ``qk_transform`` brings, the cost model prices them."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "int" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"ModelShape.{field.name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def qkv_rows(self, p: int) -> int:
        """Rows of the ``linear_qkv`` shard: ``ng/p * (np/ng + 2) * hn``."""
        return self.num_query_groups // p * (self.heads_per_group + 2) * self.kv_channels

    def fc1_rows(self, p: int) -> int:
        return (2 if self.gated_mlp else 1) * self.ffn_hidden_size // p

    def shard_problems(self, p: int) -> list[str]:
        """Why Megatron's TP shards for ``p`` ranks do not split cleanly by head and unit (empty: they do)."""
        problems = []
        if self.num_attention_heads % p:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible by p={p}")
        if self.num_query_groups % p:
            problems.append(
                f"num_query_groups={self.num_query_groups} is not divisible by p={p} (Megatron would split "
                f"a key/value head across ranks)"
            )
        if self.ffn_hidden_size % p:
            problems.append(f"ffn_hidden_size={self.ffn_hidden_size} is not divisible by p={p}")
        return problems


class ParallelLinear(Protocol):
    """One of Megatron's tensor-parallel linear modules with sequence parallelism, as its layer calls it.

    Megatron's local ``ColumnParallelLinear``/``RowParallelLinear`` or Transformer Engine's modules (in a
    TE layer ``linear_qkv``/``linear_fc1`` also hold the input norm, fused). Column-parallel: ``[s/p, b,
    in] -> [s, b, out/p]``, the sequence all-gathered inside; row-parallel: ``[s, b, in/p] -> [s/p, b,
    out]``, the partial sums reduce-scattered inside. Either returns ``(output, bias)``: the bias still
    to add (``skip_bias_add``), or None.
    """

    weight: Tensor
    bias: Tensor | None

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor | None]: ...


def _bias(linear: ParallelLinear) -> Tensor | None:
    """A linear module's bias; Transformer Engine keeps an empty tensor where there is none."""
    bias = getattr(linear, "bias", None)
    return bias if bias is not None and bias.numel() else None


@dataclasses.dataclass(frozen=True)
class AttentionWeights:
    """Megatron's TP shards of one self-attention sublayer and the modules that hold them."""

    qkv: Tensor
    """``linear_qkv`` column shard ``[ng/p * (np/ng + 2) * hn, h]``: per key/value group, its query
    heads, then k, then v."""
    proj: Tensor
    """``linear_proj`` row shard ``[h, np/p * hn]``."""
    qkv_bias: Tensor | None = None
    """``[ng/p * (np/ng + 2) * hn]``, sharded like ``qkv``."""
    proj_bias: Tensor | None = None
    """``[h]``, replicated over the group."""
    linear_qkv: ParallelLinear | None = None
    """The module holding ``qkv`` (column-parallel): what ``tp_sp`` calls."""
    linear_proj: ParallelLinear | None = None
    """The module holding ``proj`` (row-parallel)."""

    @classmethod
    def of(cls, linear_qkv: ParallelLinear, linear_proj: ParallelLinear) -> AttentionWeights:
        """The weights of a layer's ``linear_qkv`` and ``linear_proj``."""
        return cls(
            qkv=linear_qkv.weight,
            proj=linear_proj.weight,
            qkv_bias=_bias(linear_qkv),
            proj_bias=_bias(linear_proj),
            linear_qkv=linear_qkv,
            linear_proj=linear_proj,
        )

    def check(self, shape: ModelShape, p: int) -> None:
        _check_shapes(
            {
                "linear_qkv.weight": (self.qkv, (shape.qkv_rows(p), shape.hidden_size)),
                "linear_proj.weight": (
                    self.proj,
                    (shape.hidden_size, shape.num_attention_heads // p * shape.kv_channels),
                ),
                "linear_qkv.bias": (self.qkv_bias, (shape.qkv_rows(p),)),
                "linear_proj.bias": (self.proj_bias, (shape.hidden_size,)),
            },
            p,
        )


@dataclasses.dataclass(frozen=True)
class MLPWeights:
    """Megatron's TP shards of one MLP sublayer and the modules that hold them."""

    fc1: Tensor
    """``linear_fc1`` column shard ``[ffn/p, h]``, or ``[2*ffn/p, h]`` gated: this rank's gate rows,
    then its up rows."""
    fc2: Tensor
    """``linear_fc2`` row shard ``[h, ffn/p]``."""
    fc1_bias: Tensor | None = None
    fc2_bias: Tensor | None = None
    """``[h]``, replicated over the group."""
    linear_fc1: ParallelLinear | None = None
    """The module holding ``fc1`` (column-parallel): what ``tp_sp`` calls."""
    linear_fc2: ParallelLinear | None = None
    """The module holding ``fc2`` (row-parallel)."""

    @classmethod
    def of(cls, linear_fc1: ParallelLinear, linear_fc2: ParallelLinear) -> MLPWeights:
        """The weights of a layer's ``linear_fc1`` and ``linear_fc2``."""
        return cls(
            fc1=linear_fc1.weight,
            fc2=linear_fc2.weight,
            fc1_bias=_bias(linear_fc1),
            fc2_bias=_bias(linear_fc2),
            linear_fc1=linear_fc1,
            linear_fc2=linear_fc2,
        )

    def check(self, shape: ModelShape, p: int) -> None:
        _check_shapes(
            {
                "linear_fc1.weight": (self.fc1, (shape.fc1_rows(p), shape.hidden_size)),
                "linear_fc2.weight": (self.fc2, (shape.hidden_size, shape.ffn_hidden_size // p)),
                "linear_fc1.bias": (self.fc1_bias, (shape.fc1_rows(p),)),
                "linear_fc2.bias": (self.fc2_bias, (shape.hidden_size,)),
            },
            p,
        )


def _check_shapes(expected: dict[str, tuple[Tensor | None, tuple[int, ...]]], p: int) -> None:
    for name, (tensor, want) in expected.items():
        if tensor is not None and tuple(tensor.shape) != want:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, but the model's TP shard for p={p} is {want}")


class QKTransform(Protocol):
    """Token- and head-local transform of queries and keys after the QKV projection (q/k norm, RoPE).

    ``q`` is ``[s, b, nq, d]``, ``k`` is ``[s, b, nk, d]``; ``position_ids`` ``[s]`` gives each token's
    rotary position, whatever order the strategy holds the tokens in.
    """

    def __call__(self, q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionContext:
    """Everything an attention strategy needs besides its input and weights."""

    group: ProcessGroup
    layout: SequenceLayout
    shape: ModelShape
    kernel: AttentionKernel
    softmax_scale: float
    qk_transform: QKTransform | None = None
    mlp_gathers: Zero3Gathers | None = None
    """The MLP's ZeRO-3 weight gathers, where the layer gathers its first weight during the attention
    (:func:`~megatron_paradyse.strategies.registry.mlp_gathers_ahead`): a strategy that
    ``starts_mlp_gather`` starts it (:meth:`start_mlp_gather`) where compute follows to hide it."""

    weight_group: ProcessGroup | None = None
    """The ranks whose Megatron TP shards hold the weights, where ``group`` is a sub-group of them (a
    micro-batch of its own on ``group``: :attr:`Strategy.runs_on_subgroup`); None: ``group``."""

    @property
    def weights_over(self) -> ProcessGroup:
        """The ranks the weights are sharded over: gathered from, gradients reduce-scattered to."""
        return self.group if self.weight_group is None else self.weight_group

    def start_mlp_gather(self) -> None:
        """Start gathering the MLP's first weight, if the layer gathers it during the attention."""
        if self.mlp_gathers is not None:
            self.mlp_gathers.start(0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPContext:
    """Everything an MLP strategy needs besides its input and weights."""

    group: ProcessGroup
    shape: ModelShape
    activation: Callable[[Tensor], Tensor]
    """Megatron's ``config.activation_func``; applied to the gate half when ``shape.gated_mlp``."""
    gathers: Zero3Gathers | None = None
    """The strategy's own ZeRO-3 weight gathers (its ``weight_gathers``), the first started during the
    attention (:attr:`AttentionContext.mlp_gathers`); None: it makes its own."""
    weight_group: ProcessGroup | None = None
    """As :attr:`AttentionContext.weight_group`."""

    @property
    def weights_over(self) -> ProcessGroup:
        """The ranks the weights are sharded over: gathered from, gradients reduce-scattered to."""
        return self.group if self.weight_group is None else self.weight_group


@dataclasses.dataclass(frozen=True, kw_only=True)
class Strategy:
    """One entry of the strategy library: what a strategy runs and what that costs, in one record that
    every list of strategies reads (the planner's options, the cost model, the CLI, config validation)."""

    name: str
    sublayer: Sublayer
    forward: Callable[..., Tensor]
    """``(x_local, weights, ctx) -> y_local``."""
    terms: Callable[[Dims, SequenceLayout, int], SublayerTerms]
    """``(dims, layout, rank) ->`` what ``forward`` computes and sends on ``rank``
    (:mod:`~megatron_paradyse.strategies.terms`), which :mod:`~megatron_paradyse.cost.analytic` prices."""
    summary: str
    """One line: what it communicates and what it keeps in memory."""
    memory: Callable[[Dims, SequenceLayout, int], SublayerMemory] | None = None
    """``(dims, layout, rank) ->`` what ``forward`` and its backward keep and allocate on ``rank``, written
    as a script (:mod:`~megatron_paradyse.strategies.allocations`) where the code's allocations depend on
    the layout beyond its length; None: recorded from ``forward`` itself
    (:mod:`~megatron_paradyse.strategies.recorded`). Either is checked to the byte against ``forward``
    by ``tests/ranks/test_memory_scripts.py``."""
    unsupported: Callable[[ModelShape, int], str | None] = lambda shape, p: None
    """Why this strategy cannot run a model on ``p`` ranks beyond the shard layout itself, or None."""
    depends_on_rank: bool = False
    """Its terms and memory differ from rank to rank (the ring blocks a rank sees, the shard gradient it
    keeps): the cost model prices every rank, not rank 0 for all."""
    qk_norm_grads_in_parts: str | None = None
    """How often its backward hands the q/k norm weights' gradients to autograd, where more than once
    (``lean``: ``"once per head group"``): Megatron's overlapped gradient reduction would take the first
    part as the whole gradient."""
    calls_linears: bool = False
    """It calls the weights' Megatron linear modules (``tp_sp``) rather than reading their shards: the
    modules run their own forward pre-hooks and any norm fused into them (Transformer Engine's
    ``linear_qkv``/``linear_fc1``); for the other strategies the layer does both. Those modules gather
    the whole sequence into Megatron's buffer, which a pipeline stage must have."""
    starts_mlp_gather: bool = False
    """An attention strategy that starts the MLP's first ZeRO-3 weight gather
    (:meth:`AttentionContext.start_mlp_gather`) where its own compute hides it: after its own
    collectives up to the attention core are issued, so that on NCCL's one stream the gather queues
    behind them, not they behind it."""
    weight_gathers: Callable[[MLPWeights, ProcessGroup], Zero3Gathers] | None = None
    """An MLP strategy whose weights are ZeRO-3 gathered: its :class:`Zero3Gathers`, whose first weight
    an attention strategy that ``starts_mlp_gather`` gathers ahead."""
    runs_on_subgroup: bool = False
    """It gathers every weight whole from the TP shards (ZeRO-3) and needs nothing else of the shards'
    ranks, so it can run a micro-batch on a sub-group of them while the others run theirs
    (:attr:`AttentionContext.weight_group`): the weights gathered over all the shards' ranks, the
    gradients reduce-scattered back to them, the sequence's collectives within the sub-group."""
