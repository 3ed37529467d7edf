"""What a plan is: one (attention strategy, MLP strategy, recompute) option per layer of a stage.

A plan is data: the planner makes one per micro-batch, the Megatron layers look their entry up at
forward time, the logs print it. It holds no tensors and no groups.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence

__all__ = ["LayerOption", "Plan"]


@dataclasses.dataclass(frozen=True, order=True, slots=True)
class LayerOption:
    """How one transformer layer runs: its attention strategy, its MLP strategy, and whether the whole
    layer is recomputed from its ``[s/p, b, h]`` input in backward."""

    attention: str
    mlp: str
    recompute: bool = False

    def __str__(self) -> str:
        return f"{self.attention}/{self.mlp}{'+rc' if self.recompute else ''}"

    @classmethod
    def parse(cls, text: str) -> LayerOption:
        """Inverse of ``str``: ``"ring/zero3+rc"`` -> ``LayerOption("ring", "zero3", True)``."""
        body, plus, flag = text.strip().partition("+")
        attention, slash, mlp = body.partition("/")
        if not slash or not attention or not mlp or (plus and flag != "rc"):
            raise ValueError(f"a layer option reads 'attention/mlp' or 'attention/mlp+rc', got {text!r}")
        return cls(attention, mlp, bool(plus))


@dataclasses.dataclass(frozen=True)
class Plan:
    """The options of every layer of a pipeline stage, with what the cost model predicted for them."""

    layers: tuple[LayerOption, ...]
    predicted_time_s: float | None = None
    """Predicted forward+backward time of the stage's layers for this micro-batch."""
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
        """Run-length form for logs: ``"6x tp_sp/tp_sp, 2x ring/zero3+rc"``."""
        return ", ".join(f"{len(list(run))}x {option}" for option, run in itertools.groupby(self.layers))
