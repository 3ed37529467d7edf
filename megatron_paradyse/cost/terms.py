"""A layer's terms on one rank: what each sublayer's strategy computes and sends (its own ``terms``,
:mod:`megatron_paradyse.strategies.terms`) and what the layer keeps (:mod:`cost.layer_memory`)."""

from __future__ import annotations

import dataclasses

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.layer_memory import layer_memory, sublayer_memory, tiled_mlp_memory
from megatron_paradyse.strategies import Sublayer, gathers_mlp_weight_ahead, get_strategy
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.terms import SublayerTerms

__all__ = ["LayerTerms", "layer_terms", "sublayer_terms"]


def sublayer_terms(sublayer: Sublayer, name: str, d: Dims, layout: SequenceLayout, rank: int = 0) -> SublayerTerms:
    """The terms of strategy ``name`` running ``sublayer`` on ``rank`` for a micro-batch laid out as ``layout``."""
    if d.weight_ranks != d.p:
        raise ValueError(
            f"the time of {sublayer} strategy {name!r} on a sub-group of {d.p} of the {d.weight_ranks} ranks "
            "holding its shards is not modelled: its collectives' prices need the sub-group's rates"
        )
    return get_strategy(sublayer, name).terms(d, layout, rank)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerTerms:
    """A whole layer (``x + attn(LN1(x))``, ``+ mlp(LN2(.))``) under one option, on one rank."""

    attention: SublayerTerms
    mlp: SublayerTerms
    recompute: bool
    activation_bytes: float
    """One ``[t, b, h]`` activation (the layer's input, output, residual)."""
    saved_bytes: float
    """Kept from the layer's forward to its backward (with recompute: its output only; offloaded: none)."""
    peak_bytes: float
    """High-water mark over forward (+ recompute) and backward, above the layer's input."""

    @property
    def transient_bytes(self) -> float:
        return self.peak_bytes - self.saved_bytes


def layer_terms(option: LayerOption, d: Dims, layout: SequenceLayout, rank: int = 0) -> LayerTerms:
    """Terms and memory (:mod:`cost.layer_memory`) of one layer on ``rank``."""
    d = dataclasses.replace(d, mlp_weight_ahead=gathers_mlp_weight_ahead(option, d.p))
    if option.mlp_tile_tokens:
        mlp = tiled_mlp_memory(option.mlp, d, layout, option.mlp_tile_tokens)
    else:
        mlp = sublayer_memory("mlp", option.mlp, d, layout, rank)
    attention = sublayer_memory("attention", option.attention, d, layout, rank)
    kept_core = None
    if option.keep_core:
        kept_core = sublayer_memory("attention", option.attention, dataclasses.replace(d, core_kept=True), layout, rank)
    memory = layer_memory(attention, mlp, d, kept_core)
    return LayerTerms(
        sublayer_terms("attention", option.attention, d, layout, rank),
        sublayer_terms("mlp", option.mlp, d, layout, rank),
        option.recompute,
        d.x,
        *memory.saved_and_peak(recompute=option.recompute, offload=option.offload, keep_core=option.keep_core),
    )
