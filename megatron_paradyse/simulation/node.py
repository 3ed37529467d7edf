"""A model's layers on one node of a GPU kind, as the simulated benchmarks price them: the cost model of
a group of its GPUs (:func:`~megatron_paradyse.cost.hardware.node_group`) with the static bytes the
group's ranks hold. **Simulated**: the rates are published figures (:mod:`megatron_paradyse.cost.hardware`).
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.hardware import hardware_profile, node_group, stage_static_bytes
from megatron_paradyse.planner import PlannerConfig
from megatron_paradyse.strategies import ModelShape

__all__ = ["NodeModel"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeModel:
    """The layers one node trains, its budget per GPU, and the planner of its adaptive runs."""

    gpu: str
    """A kind of :data:`~megatron_paradyse.cost.hardware.HARDWARE`."""
    shape: ModelShape
    num_layers: int
    causal: bool
    budget_bytes: float
    planner: PlannerConfig
    vocab_size: int = 0
    """Megatron's padded vocabulary where the node holds the embedding, output layer and loss; else 0."""
    rotary_dim: int = 0
    bias: bool = False
    normalization: str = "LayerNorm"

    def cost_model(self, p: int, *, dp: int = 1) -> AnalyticCostModel:
        """bf16 layers on ``p`` of the node's GPUs sharing their weights' tensor-parallel shards, the
        optimizer state sharded over ``dp`` replicas of them (:func:`stage_static_bytes`)."""
        return AnalyticCostModel(
            hardware_profile(node_group(self.gpu, p)),
            self.shape,
            p,
            dtype=torch.bfloat16,
            static_bytes=stage_static_bytes(self.shape, self.num_layers, p, vocab_size=self.vocab_size, dp=dp),
            vocab_size=self.vocab_size,
            rotary_dim=self.rotary_dim,
            bias=self.bias,
            normalization=self.normalization,
        )
