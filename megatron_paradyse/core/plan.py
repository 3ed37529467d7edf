"""What a plan is: one (attention strategy, MLP strategy, recompute, offload, MLP tiling) option per layer
of a stage, and how the stage's output layer and loss run.

A plan is data: the planner makes one per micro-batch, the Megatron layers look their entry up at
forward time, the logs print it. It holds no tensors and no groups.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

__all__ = ["LayerOption", "Plan", "loss_chunk_rows", "mlp_tile_rows"]


@dataclasses.dataclass(frozen=True, order=True, slots=True)
class LayerOption:
    """How one transformer layer runs: its attention strategy, its MLP strategy, whether the whole
    layer is recomputed from its ``[s/p, b, h]`` input in backward, whether that input waits for the
    backward in host memory (``offload``, with recompute only: :mod:`megatron_paradyse.core.offload`),
    and whether the MLP runs over sequence tiles of ``mlp_tile_tokens`` gathered tokens, each recomputed in
    backward (:mod:`megatron_paradyse.strategies.tiling`; 0: at once). ``keep_core`` (with recompute): the
    attention core's output and log-sum-exp are kept from the forward, on the device (the input may be
    offloaded beside), so the rerun recomputes the norms, projections and MLP but not the attention
    kernel (:mod:`megatron_paradyse.attention.kept`).

    Written ``attention/mlp``, then ``+tile<tokens>``, ``+rc``, ``+keepcore``, ``+off`` as they apply:
    ``ulysses/lean+tile65536+rc+off``, ``ulysses/zero3+rc+keepcore+off``.
    """

    attention: str
    mlp: str
    recompute: bool = False
    offload: bool = False
    mlp_tile_tokens: int = 0
    keep_core: bool = False

    def __post_init__(self) -> None:
        if self.offload and not self.recompute:
            raise ValueError(
                f"{self.attention}/{self.mlp}: offload moves a recomputed layer's input to host memory; "
                f"it needs recompute (write '{self.attention}/{self.mlp}+rc+off')"
            )
        if self.keep_core and not self.recompute:
            raise ValueError(
                f"{self.attention}/{self.mlp}: keeping the attention core spares its rerun in a recomputed layer; "
                f"it needs recompute (write '{self.attention}/{self.mlp}+rc+keepcore')"
            )
        if not isinstance(self.mlp_tile_tokens, int) or self.mlp_tile_tokens < 0:
            raise ValueError(f"mlp_tile_tokens must be a non-negative int (0: no tiles), got {self.mlp_tile_tokens!r}")

    def __str__(self) -> str:
        flags = [f"tile{self.mlp_tile_tokens}"] * bool(self.mlp_tile_tokens) + [
            flag for flag, on in (("rc", self.recompute), ("keepcore", self.keep_core), ("off", self.offload)) if on
        ]
        return "+".join((f"{self.attention}/{self.mlp}", *flags))

    @classmethod
    def parse(cls, text: str) -> LayerOption:
        """Inverse of ``str``: ``"ring/zero3+rc"`` -> ``LayerOption("ring", "zero3", True)``,
        ``"ring/lean+tile65536+rc+off"`` -> ``LayerOption("ring", "lean", True, True, 65536)``,
        ``"ring/zero3+rc+keepcore"`` -> ``LayerOption("ring", "zero3", True, keep_core=True)``."""
        body, *flags = text.strip().split("+")
        attention, slash, mlp = body.partition("/")
        tile = flags[0].removeprefix("tile") if flags and flags[0].startswith("tile") else None
        rest = flags[1:] if tile is not None else flags
        if (
            not slash
            or not attention
            or not mlp
            or rest not in ([], ["rc"], ["rc", "off"], ["rc", "keepcore"], ["rc", "keepcore", "off"])
            or tile is not None
            and not (tile.isdigit() and int(tile) > 0)
        ):
            raise ValueError(
                f"a layer option reads 'attention/mlp', then '+tile<tokens>', '+rc', '+keepcore', '+off' as they "
                f"apply (e.g. 'ulysses/lean+tile65536+rc+off', 'ulysses/zero3+rc+keepcore'), got {text!r}"
            )
        return cls(attention, mlp, bool(rest), "off" in rest, int(tile or 0), "keepcore" in rest)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The options of every layer of a pipeline stage, with what the cost model predicted for them."""

    layers: tuple[LayerOption, ...]
    loss_chunk_tokens: int = 0
    """On the stage that holds the output layer: the output layer and loss run over chunks of this many
    gathered tokens, recomputed in backward (:mod:`megatron_paradyse.mcore.chunked_loss`); 0: at once."""
    predicted_time_s: float | None = None
    """Predicted forward+backward time of the stage's layers for this micro-batch (with a chunked loss, its
    recompute too)."""
    predicted_peak_bytes: float | None = None
    """Predicted peak memory of the stage for this micro-batch."""

    @classmethod
    def uniform(cls, option: LayerOption, num_layers: int) -> Plan:
        return cls((option,) * num_layers)

    @classmethod
    def from_options(cls, options: Sequence[LayerOption | str]) -> Plan:
        return cls(tuple(o if isinstance(o, LayerOption) else LayerOption.parse(o) for o in options))

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> LayerOption:
        return self.layers[layer]

    def __iter__(self) -> Iterator[LayerOption]:
        return iter(self.layers)

    def compact(self) -> str:
        """Run-length form for logs: ``"6x tp_sp/tp_sp, 2x ring/zero3+rc"``, and ``"; loss in 8192-token
        chunks"`` where the loss is chunked."""
        layers = ", ".join(f"{len(list(run))}x {option}" for option, run in itertools.groupby(self.layers))
        return f"{layers}; loss in {self.loss_chunk_tokens}-token chunks" if self.loss_chunk_tokens else layers


def mlp_tile_rows(tile_tokens: int, p: int, local_rows: int) -> int:
    """Local rows in one MLP tile of ``tile_tokens`` gathered tokens on ``p`` sequence-parallel ranks that
    hold ``local_rows`` each (even, as every strategy takes them; the last tile may be shorter)."""
    return min(local_rows, max(2, tile_tokens // p // 2 * 2))


def loss_chunk_rows(chunk_tokens: int, p: int, local_rows: int) -> int:
    """Local rows in one chunk of a loss chunked by ``chunk_tokens`` gathered tokens, on ``p``
    sequence-parallel ranks that hold ``local_rows`` each (the last chunk may be shorter)."""
    return min(local_rows, max(1, chunk_tokens // p))
