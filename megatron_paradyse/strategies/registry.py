"""The strategy library: one table, filled by the strategy modules at import, read-only afterwards."""

from __future__ import annotations

from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_paradyse.core.comm import Zero3Gathers
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.strategies.base import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    ModelShape,
    Strategy,
    Sublayer,
)

__all__ = [
    "available_strategies",
    "get_strategy",
    "gathers_mlp_weight_ahead",
    "mlp_gathers_ahead",
    "register",
    "run_attention",
    "run_mlp",
    "strategy_names",
    "unsupported_reason",
]

_LIBRARY: dict[tuple[Sublayer, str], Strategy] = {}


def register(strategy: Strategy) -> Strategy:
    key = (strategy.sublayer, strategy.name)
    if strategy.memory is None and strategy.sublayer != "mlp":
        raise ValueError(
            f"{strategy.sublayer} strategy {strategy.name!r} gives no memory script: only an MLP strategy's memory "
            "is recorded from its code (strategies/recorded.py); write one from attention_allocations.py"
        )
    if key in _LIBRARY:
        raise ValueError(f"{strategy.sublayer} strategy {strategy.name!r} is already registered")
    _LIBRARY[key] = strategy
    return strategy


def strategy_names(sublayer: Sublayer) -> list[str]:
    return [name for (sub, name) in _LIBRARY if sub == sublayer]


def get_strategy(sublayer: Sublayer, name: str) -> Strategy:
    try:
        return _LIBRARY[(sublayer, name)]
    except KeyError:
        raise ValueError(
            f"unknown {sublayer} strategy {name!r}; known: {', '.join(strategy_names(sublayer))}"
        ) from None


def unsupported_reason(sublayer: Sublayer, name: str, shape: ModelShape, p: int) -> str | None:
    """Why strategy ``name`` cannot run ``shape`` on ``p`` ranks, or None when it can."""
    strategy = get_strategy(sublayer, name)
    problems = shape.shard_problems(p)
    if problems:
        return "; ".join(problems)
    return strategy.unsupported(shape, p)


def gathers_mlp_weight_ahead(option: LayerOption, p: int) -> bool:
    """Whether a layer under ``option`` on ``p`` ranks gathers its MLP's first ZeRO-3 weight during the
    attention: the attention strategy ``starts_mlp_gather``, the MLP's weights are gathered
    (``weight_gathers``), and the MLP runs whole (a tiled MLP gathers its weights for every tile). What
    the layers run (:func:`mlp_gathers_ahead`) and what the cost model prices."""
    attention, mlp = get_strategy("attention", option.attention), get_strategy("mlp", option.mlp)
    return p > 1 and attention.starts_mlp_gather and mlp.weight_gathers is not None and not option.mlp_tile_tokens


def mlp_gathers_ahead(option: LayerOption, weights: MLPWeights, group: ProcessGroup) -> Zero3Gathers | None:
    """For one run of a layer under ``option``: the MLP's weight gathers over ``group`` (the ranks
    holding its shards), which its attention starts (:attr:`AttentionContext.mlp_gathers`,
    :attr:`MLPContext.gathers`), or None where it does not (:func:`gathers_mlp_weight_ahead`). One per
    run: a recomputed forward needs its own."""
    if not gathers_mlp_weight_ahead(option, group.size()):
        return None
    return get_strategy("mlp", option.mlp).weight_gathers(weights, group)


def available_strategies(sublayer: Sublayer, shape: ModelShape, p: int) -> tuple[list[str], dict[str, str]]:
    """(strategies that can run, {excluded strategy: reason}) for ``shape`` on ``p`` ranks."""
    usable, excluded = [], {}
    for name in strategy_names(sublayer):
        reason = unsupported_reason(sublayer, name, shape, p)
        if reason is None:
            usable.append(name)
        else:
            excluded[name] = reason
    return usable, excluded


def _checked(sublayer: Sublayer, name: str, ctx: AttentionContext | MLPContext) -> Strategy:
    """The strategy, if it can run the model on ``ctx``'s ranks (on a sub-group of the shards' ranks:
    sharded over both, and :attr:`Strategy.runs_on_subgroup`)."""
    strategy = get_strategy(sublayer, name)
    p, shards = ctx.group.size(), ctx.weights_over.size()
    if shards % p:
        raise ValueError(
            f"a micro-batch on {p} ranks cannot be a sub-group of the {shards} holding the weights' TP shards: "
            f"its size must divide {shards}"
        )
    if p != shards and not strategy.runs_on_subgroup:
        able = [n for n in strategy_names(sublayer) if get_strategy(sublayer, n).runs_on_subgroup]
        raise ValueError(
            f"{sublayer} strategy {name!r} cannot run a micro-batch on {p} of the {shards} ranks holding the "
            f"weights' TP shards; the strategies that gather their weights whole can: {', '.join(able)}"
        )
    for ranks in dict.fromkeys((p, shards)):
        reason = unsupported_reason(sublayer, name, ctx.shape, ranks)
        if reason is not None:
            raise ValueError(f"{sublayer} strategy {name!r} cannot run this model on p={ranks} ranks: {reason}")
    return strategy


def run_attention(name: str, x_local: Tensor, weights: AttentionWeights, ctx: AttentionContext) -> Tensor:
    """Run attention strategy ``name`` after checking that it fits the model, layout and input."""
    p = ctx.group.size()
    if ctx.layout.p != p:
        raise ValueError(f"the sequence layout is for p={ctx.layout.p} ranks, but the group has {p}")
    strategy = _checked("attention", name, ctx)
    ctx.layout.check_local(x_local)
    weights.check(ctx.shape, ctx.weights_over.size())
    return strategy.forward(x_local, weights, ctx)


def run_mlp(name: str, x_local: Tensor, weights: MLPWeights, ctx: MLPContext) -> Tensor:
    """Run MLP strategy ``name`` after checking that it fits the model."""
    p = ctx.group.size()
    strategy = _checked("mlp", name, ctx)
    weights.check(ctx.shape, ctx.weights_over.size())
    if x_local.shape[0] * p % (2 * p):
        raise ValueError(
            f"x_local has {x_local.shape[0]} tokens; the padded sequence ({x_local.shape[0] * p}) must be a "
            f"multiple of 2p={2 * p}"
        )
    return strategy.forward(x_local, weights, ctx)
