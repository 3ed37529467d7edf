"""The distributed side of the strategy tests: a stack of layers run under a plan on this rank's shards,
with the model shapes every p can split and the shards held by Megatron's local linear modules (which
``tp_sp`` calls)."""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore.linears import layer_linears
from megatron_paradyse.strategies import AttentionContext, MLPContext, ModelShape, run_attention, run_mlp
from megatron_paradyse.strategies.recompute import recompute
from megatron_paradyse.strategies.tiling import over_row_tiles

from helpers.numerics import rel_err
from helpers.reference_model import rope_transform, shard_layer


def model_shape(p: int, gqa: bool) -> ModelShape:
    """A small layer every strategy can split over ``p`` ranks: MHA with GELU, or GQA with SwiGLU."""
    heads = 2 * p
    return ModelShape(
        hidden_size=32,
        num_attention_heads=heads,
        num_query_groups=p if gqa else heads,
        kv_channels=8,
        ffn_hidden_size=24,
        gated_mlp=gqa,
    )


def fields(weights) -> tuple:
    """The weight and bias tensors of a weights dataclass, not copies (``dataclasses.astuple`` deep-copies)."""
    return tuple(getattr(weights, f.name) for f in dataclasses.fields(weights) if not f.name.startswith("linear_"))


def held_by_megatron_linears(shards, shape: ModelShape, group):
    """The shards copied into Megatron's local linear modules, which ``tp_sp`` calls."""
    attention, mlp = shards
    held = layer_linears(shape, group, bias=attention.qkv_bias is not None, dtype=torch.float32)
    for source, target in zip(shards, held):
        for src, dst in zip(fields(source), fields(target)):
            if src is not None:
                with torch.no_grad():
                    dst.copy_(src)
    return held


def gradient_errors(ref_layers, shards, norms, shape: ModelShape, p: int, rank: int) -> dict[str, float]:
    """The relative error of every weight gradient of this rank (its TP shards of each layer, the norms) against
    the reference layers' gradients, sharded as Megatron shards them for ``p`` ranks."""
    errors = {}
    for i, (ref_layer, (aw, mw), norm) in enumerate(zip(ref_layers, shards, norms)):
        ref_grads = {k: None if v is None else v.grad for k, v in ref_layer.items()}
        ref_aw, ref_mw = shard_layer(ref_grads, shape, p, rank)
        pairs = [
            *zip(("qkv", "proj", "qkv_bias", "proj_bias"), fields(aw), fields(ref_aw)),
            *zip(("fc1", "fc2", "fc1_bias", "fc2_bias"), fields(mw), fields(ref_mw)),
            *((k, norm[k], ref_grads[k]) for k in norm),
        ]
        for name, param, want in pairs:
            if param is not None:
                errors[f"layer{i}.{name}"] = rel_err(param.grad.float(), want)
    return errors


def qk_transform(replicated: dict[str, torch.Tensor]):
    """RoPE, after the layer's q/k scales when it has them."""
    if "q_scale" not in replicated:
        return rope_transform
    q_scale, k_scale = replicated["q_scale"], replicated["k_scale"]
    return lambda q, k, positions: rope_transform(q * q_scale, k * k_scale, positions)


def run_stack(x_local, attn_weights, mlp_weights, norms, plan, layout, cfg, group, weight_group=None):
    """Pre-norm layers (``cfg``: a reference ``StackConfig``) on this rank's ``[s/p, b, h]`` shard, each
    layer under its plan entry (recomputed, keeping its attention core, offloaded, its MLP in tiles as the
    entry says). ``weight_group``: the ranks holding the weights' TP shards, where ``group`` (the
    micro-batch's) is a sub-group of them."""
    h = cfg.shape.hidden_size
    actx = AttentionContext(
        group=group,
        layout=layout,
        shape=cfg.shape,
        kernel=get_kernel("torch", torch.device("cpu"), torch.float32),
        softmax_scale=cfg.shape.kv_channels**-0.5,
        qk_transform=rope_transform,
        weight_group=weight_group,
    )
    mctx = MLPContext(group=group, shape=cfg.shape, activation=cfg.activation, weight_group=weight_group)

    def layer(x_local, option, aw, mw, ln):
        layer_actx = dataclasses.replace(actx, qk_transform=qk_transform(ln))
        x_local = x_local + run_attention(
            option.attention, F.layer_norm(x_local, (h,), ln["ln1_w"], ln["ln1_b"]), aw, layer_actx
        )
        mlp_input = F.layer_norm(x_local, (h,), ln["ln2_w"], ln["ln2_b"])
        mlp = functools.partial(run_mlp, option.mlp, weights=mw, ctx=mctx)
        if option.mlp_tile_tokens:
            return x_local + over_row_tiles(mlp, mlp_input, option.mlp_tile_tokens, group.size())
        return x_local + mlp(mlp_input)

    offload = ActivationOffload()
    for option, aw, mw, ln in zip(plan, attn_weights, mlp_weights, norms):
        if not isinstance(option, LayerOption):
            option = LayerOption(*option)  # an (attention, mlp) pair
        stored = offload if option.offload else None
        run = (
            functools.partial(recompute, layer, offload=stored, keep_core=option.keep_core)
            if option.recompute
            else layer
        )
        x_local = run(x_local, option, aw, mw, ln)
    return x_local
