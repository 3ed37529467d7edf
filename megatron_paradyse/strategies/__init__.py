"""The strategy library: per-sublayer parallel strategies over one activation layout and Megatron's TP shards.

Attention: ``tp_sp``, ``ulysses``, ``ring``, ``lean``. MLP: ``tp_sp``, ``zero3``, ``lean``. Importing this package
registers them; look one up with :func:`get_strategy` or run it, checked, with :func:`run_attention`
/ :func:`run_mlp`.
"""

# Registration, in the order the library lists them: fastest first, leanest last.
from megatron_paradyse.strategies import tp_sp  # noqa: F401, I001
from megatron_paradyse.strategies import ulysses  # noqa: F401
from megatron_paradyse.strategies import ring  # noqa: F401
from megatron_paradyse.strategies import zero3  # noqa: F401
from megatron_paradyse.strategies import lean  # noqa: F401
from megatron_paradyse.strategies.base import (
    AttentionContext,
    AttentionWeights,
    MLPContext,
    MLPWeights,
    ModelShape,
    ParallelLinear,
    QKTransform,
    Strategy,
    Sublayer,
)
from megatron_paradyse.strategies.registry import (
    available_strategies,
    gathers_mlp_weight_ahead,
    get_strategy,
    mlp_gathers_ahead,
    register,
    run_attention,
    run_mlp,
    strategy_names,
    unsupported_reason,
)

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
    "available_strategies",
    "gathers_mlp_weight_ahead",
    "get_strategy",
    "mlp_gathers_ahead",
    "register",
    "run_attention",
    "run_mlp",
    "strategy_names",
    "unsupported_reason",
]
