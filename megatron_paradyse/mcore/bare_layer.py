"""One pre-norm transformer layer on bare TP shards held by Megatron's local linear modules (which
``tp_sp`` calls), run under a :class:`~megatron_paradyse.core.plan.LayerOption`: what the cost models'
layer is, measured (:mod:`megatron_paradyse.calibration.measure`) and traced
(:mod:`megatron_paradyse.mcore.trace`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore.linears import layer_linears
from megatron_paradyse.strategies import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    ModelShape,
    mlp_gathers_ahead,
    run_attention,
    run_mlp,
)
from megatron_paradyse.strategies.recompute import recompute
from megatron_paradyse.strategies.tiling import over_row_tiles

__all__ = ["LayerParams", "make_layer_params", "run_layer"]


@dataclasses.dataclass(frozen=True)
class LayerParams:
    """This rank's parameters of one layer: Megatron TP shards and the replicated norms."""

    attention: AttentionWeights
    mlp: MLPWeights
    norms: tuple[Tensor, Tensor, Tensor, Tensor]
    """LN1 weight, LN1 bias, LN2 weight, LN2 bias: ``[h]`` each."""

    def tensors(self) -> list[Tensor]:
        """Every parameter (biases the layer has)."""
        return [*_tensors(self.attention), *_tensors(self.mlp), *self.norms]


def make_layer_params(
    shape: ModelShape,
    p: int,
    rank: int,
    *,
    group: ProcessGroup | None = None,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> LayerParams:
    """Random TP shards of one layer for ``rank`` of ``p`` (distinct per rank), with zeroed gradients,
    held by Megatron's local linear modules for ``group`` (default: the world; ``p`` its size), which
    ``tp_sp`` calls.

    The gradient buffers exist before any measurement: like the weights they are static memory.
    """
    group = dist.group.WORLD if group is None else group
    if group.size() != p:
        raise ValueError(f"make_layer_params: p={p}, but the group has {group.size()} ranks")
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    attention, mlp = layer_linears(shape, group, bias=bias, dtype=dtype, device=device)
    for t in (*_tensors(attention), *_tensors(mlp)):
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5)
        t.grad = torch.zeros_like(t)

    def rand(size: int) -> Tensor:
        t = (torch.randn(size, generator=gen) / size**0.5).to(device, dtype).requires_grad_()
        t.grad = torch.zeros_like(t)
        return t

    h = shape.hidden_size
    return LayerParams(attention, mlp, (rand(h), rand(h), rand(h), rand(h)))


def _tensors(weights: AttentionWeights | MLPWeights) -> list[Tensor]:
    """A weights dataclass's parameters (its biases where it has them)."""
    fields = [getattr(weights, f.name) for f in dataclasses.fields(weights)]
    return [t for t in fields if isinstance(t, Tensor)]


def run_layer(
    x_local: Tensor,
    params: LayerParams,
    option: LayerOption,
    actx: AttentionContext,
    mctx: MLPContext,
) -> Tensor:
    """``[s/p, b, h] -> [s/p, b, h]``: one pre-norm transformer layer under ``option``."""
    h = x_local.shape[-1]
    ln1_w, ln1_b, ln2_w, ln2_b = params.norms

    def layer(x: Tensor) -> Tensor:
        gathers = mlp_gathers_ahead(option, params.mlp, mctx.weights_over)  # this run's (a rerun makes its own)
        attention_ctx = dataclasses.replace(actx, mlp_gathers=gathers)
        x = x + run_attention(option.attention, F.layer_norm(x, (h,), ln1_w, ln1_b), params.attention, attention_ctx)
        mlp_input = F.layer_norm(x, (h,), ln2_w, ln2_b)
        mlp_ctx = dataclasses.replace(mctx, gathers=gathers)
        mlp = lambda tile: run_mlp(option.mlp, tile, params.mlp, mlp_ctx)  # noqa: E731
        if not option.mlp_tile_tokens:
            return x + mlp(mlp_input)
        return x + over_row_tiles(mlp, mlp_input, option.mlp_tile_tokens, mctx.group.size())

    if not option.recompute:
        return layer(x_local)
    offload = ActivationOffload() if option.offload else None
    return recompute(layer, x_local, offload=offload, keep_core=option.keep_core)
