"""The sizes a strategy's time terms and memory are written in, for one micro-batch on one rank
(:class:`Dims`), and the ring's hops a rank runs (:func:`ring_hops`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from megatron_paradyse.core.layout import Segment, SequenceLayout
from megatron_paradyse.strategies.base import ModelShape

__all__ = ["Dims", "ring_hops"]


@dataclasses.dataclass(frozen=True, slots=True)
class Dims:
    """The sizes a strategy's terms are written in, for one micro-batch on one rank."""

    shape: ModelShape
    p: int
    s: int
    """Padded sequence length (a multiple of 2p)."""
    b: int
    e: int
    """Bytes per activation/weight element."""
    rotary_dim: int = 0
    """Channels of each head that RoPE rotates (0: no RoPE)."""
    bias: bool = True
    """The linear layers have biases (GPT-2 style; LLaMA has none)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """The layer's norms (Megatron's ``config.normalization``)."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the layer runs: norms keep other tensors on each
    (:func:`~megatron_paradyse.strategies.attention_allocations.norm_forward`)."""
    grads_held: bool = False
    """Autograd holds the weight gradients the backward hands it
    (:meth:`~megatron_paradyse.strategies.allocations.Allocations.to_autograd`): the weights have other
    uses whose gradients are still to come, as the tiles of a tiled MLP have."""
    grads_before: tuple[float, ...] = ()
    """Weight gradients autograd holds from the weights' earlier uses when the backward starts, in the
    order the backward hands its own over (each is added to its weight's)."""
    mlp_weight_ahead: bool = False
    """The layer gathers its MLP's first weight during the attention
    (:func:`~megatron_paradyse.strategies.gathers_mlp_weight_ahead`): the attention starts that gather
    after its projection's and hands the weight on, the MLP's forward starts with it."""

    hidden_dropout: bool = False
    """Megatron's hidden dropout is on: the layer drops out each sublayer's output before adding it to the
    residual stream, keeping the mask for backward (:func:`~megatron_paradyse.cost.layer_memory.layer_memory`)."""
    core_kept: bool = False
    """The attention core's results exist before this forward: the rerun of a layer that keeps them
    (``+rc+keepcore``, :mod:`megatron_paradyse.attention.kept`) runs no attention kernel, and they count
    from its start (:meth:`~megatron_paradyse.strategies.allocations.Allocations.kept`)."""

    shards: int = 0
    """The ranks holding the weights' TP shards, where the micro-batch runs on a sub-group of ``p`` of them
    (:attr:`~megatron_paradyse.strategies.base.Strategy.runs_on_subgroup`); 0: the ``p`` ranks themselves."""

    def __post_init__(self) -> None:
        if self.shards and self.shards % self.p:
            raise ValueError(f"Dims(shards={self.shards}): a sub-group of p={self.p} ranks must divide it")
        if self.mlp_weight_ahead and self.weight_ranks == 1:
            raise ValueError(
                "Dims(mlp_weight_ahead=True) needs p > 1: one rank gathers no weight, ahead or not "
                "(strategies.gathers_mlp_weight_ahead says where a layer gathers it)"
            )

    @property
    def weight_ranks(self) -> int:
        """The ranks the weights are sharded over: gathered from, gradients reduce-scattered to."""
        return self.shards or self.p

    @property
    def acc(self) -> int:
        """Bytes per element of the accumulation dtype (log-sum-exp, ring accumulators, weight
        gradients summed over ranks): fp32 for half precision, the activations' own otherwise."""
        return max(self.e, 4)

    @property
    def half(self) -> bool:
        """Half-precision activations: accumulators are cast from and back to them."""
        return self.e < self.acc

    @property
    def t(self) -> int:
        return self.s // self.p

    @property
    def h(self) -> int:
        return self.shape.hidden_size

    @property
    def hn(self) -> int:
        return self.shape.kv_channels

    @property
    def nq(self) -> int:
        return self.shape.num_attention_heads

    @property
    def ng(self) -> int:
        return self.shape.num_query_groups

    @property
    def qkv(self) -> int:
        """Columns of the full QKV projection: ``(nq + 2 ng) hn``."""
        return (self.nq + 2 * self.ng) * self.hn

    @property
    def a(self) -> int:
        """Columns of the full attention output: ``nq hn``."""
        return self.nq * self.hn

    @property
    def f(self) -> int:
        return self.shape.ffn_hidden_size

    @property
    def f1(self) -> int:
        """Rows of the full ``linear_fc1``: ``g f``."""
        return (2 if self.shape.gated_mlp else 1) * self.f

    @property
    def x(self) -> int:
        """Bytes of one ``[t, b, h]`` activation."""
        return self.t * self.b * self.h * self.e

    @property
    def dropout_mask(self) -> int:
        """Bytes of the mask a dropout of ``[t, b, h]`` keeps for its backward: on CUDA one kernel's bool
        mask, on the CPU torch's unfused dropout's noise tensor, in the activations' dtype."""
        return self.x if self.device == "cpu" else self.t * self.b * self.h

    @property
    def norm_stats(self) -> int:
        """Bytes of the statistics one norm of ``[t, b]`` tokens keeps for its backward."""
        return self.norm_stats_of(self.t * self.b)

    def norm_stats_of(self, vectors: int) -> int:
        """Bytes of the statistics a norm of ``vectors`` vectors keeps for its backward: LayerNorm's mean
        and rstd (fp32 on CUDA, the input's dtype on the CPU), RMSNorm's rstd (fp32)."""
        if self.normalization == "LayerNorm":
            return 2 * vectors * (self.acc if self.device == "cuda" else self.e)
        return vectors * self.acc

    @property
    def qk_transformed(self) -> bool:
        """Queries and keys are transformed (RoPE, q/k norms) into tensors of their own."""
        return bool(self.rotary_dim) or self.shape.qk_norm

    def q_copied(self, groups: int) -> bool:
        """Whether ``split_qkv`` copies q out of a QKV tensor holding ``groups`` key/value groups: the
        query heads of a group are contiguous, so q is a view with one query head per group (MHA) or
        a single group, a copy otherwise."""
        return groups > 1 and self.shape.heads_per_group > 1


def ring_hops(layout: SequenceLayout, rank: int) -> tuple[tuple[Segment, ...], ...]:
    """The visible segments of each ring hop of ``rank``: its queries against the keys of ``rank - hop``."""
    return tuple(layout.ring_segments(rank, (rank - hop) % layout.p) for hop in range(layout.p))
