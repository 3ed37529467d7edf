"""Tiled MLP: a position-wise sublayer run over tiles of its input's rows, each recomputed in backward.

Every MLP strategy treats tokens independently, and every rank holds the same number of local rows, so
the MLP of the ``[t, b, h]`` shard can run on row tiles one after another: each tile is the same
strategy call on fewer rows (the same collectives on every rank), so its intermediate activations (the
``[rows, b, ffn/p]`` pre-activation and its gradient, a gathered tile for ``tp_sp``) are bounded by the
tile. Each tile is recomputed in backward from its rows of the input, which the sublayer keeps; the
tiles' outputs are joined into the sublayer's output. Weights are read (``zero3``, ``lean``: gathered
or streamed) once per tile and pass, which the cost model prices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_paradyse.core.plan import mlp_tile_rows
from megatron_paradyse.strategies.recompute import recompute

__all__ = ["over_row_tiles"]


def over_row_tiles(fn: Callable[[Tensor], Tensor], x: Tensor, tile_tokens: int, p: int) -> Tensor:
    """``fn(x)`` for a row-wise ``fn`` of one of ``p`` ranks' ``[t, b, h]`` shards, computed over tiles of
    ``tile_tokens`` gathered tokens (:func:`~megatron_paradyse.core.plan.mlp_tile_rows` rows of ``x``),
    each recomputed in backward."""
    return torch.cat([recompute(fn, tile) for tile in x.split(mlp_tile_rows(tile_tokens, p, x.shape[0]))])
