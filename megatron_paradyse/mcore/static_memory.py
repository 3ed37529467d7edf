"""What every plan of a pipeline stage shares: its parameters, gradients and optimizer state, and the
optimizer step's working set.

The planner's budget covers the stage's whole peak (DESIGN.md section 4: static + saved + transient),
so the cost model needs the static part. It is counted here from the model config and the training
arguments rather than read from a built model, so that every rank knows it for *every* stage of its
pipeline: a micro-batch too long for any stage must be skipped by all of them
(:mod:`megatron_paradyse.run.planned_loader`). The entry point checks the count against the model it
trains.

Bytes per parameter, as Megatron keeps them (``e`` = parameter element size, ``d`` = data-parallel
size when the optimizer state is distributed, else 1)::

    e                          the parameter
  + 4 or e                     its gradient (fp32 when gradients accumulate in fp32)
  + (4 if e < 4) / d           the fp32 main copy of a bf16/fp16 parameter
  + (4 * optimizer states) / d Adam: exp_avg and exp_avg_sq; SGD: momentum

The optimizer step runs after the step's last backward, when no activation is left, and allocates on
top of that (:attr:`StageFootprint.optimizer_step_bytes`) what the optimizer class Megatron picked needs
(:func:`megatron_optimizer_implementation`), counted in fp32 elements of the rank's optimizer shard:

- ``fused``: Transformer Engine's or apex's FusedAdam/FusedSGD (multi-tensor kernels): nothing;
- ``foreach``: torch's AdamW or SGD on CUDA (their default there) apply each operation to a whole
  parameter group at once, and AdamW's denominator (SGD's weight-decayed gradient) is a new list: one
  element per parameter of the largest group (bounded here by all of them: Megatron's other group, the
  norms and biases without weight decay, is small);
- ``for-loop``: torch's default on CPU, one parameter at a time: AdamW's denominator takes a square root
  and a quotient while the previous parameter's quotient still lives (three of the largest parameter,
  at most); SGD's weight-decayed gradient, one.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_paradyse.mcore.model_shape import stage_chunk_layers

from megatron.core import optimizer
from megatron.core.transformer import TransformerConfig

__all__ = [
    "OPTIMIZER_IMPLEMENTATIONS",
    "OptimizerSetup",
    "StageFootprint",
    "layer_parameters",
    "megatron_optimizer_implementation",
    "optimizer_problem",
    "pipeline_footprints",
    "torch_optimizer_implementation",
]

OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")
OPTIMIZERS = ("adam", "sgd")
"""The optimizers whose memory is counted (Megatron's ``--optimizer``)."""


def optimizer_problem(name: str) -> str | None:
    """What is wrong with Megatron's ``--optimizer name`` for the memory count, if anything."""
    if name in OPTIMIZERS:
        return None
    return f"--optimizer {name}: the planner counts the memory of {' and '.join(OPTIMIZERS)} only; use one of them"


def torch_optimizer_implementation(device_type: str) -> str:
    """How a torch optimizer made with its defaults steps on a ``device_type`` machine."""
    return "foreach" if device_type == "cuda" else "for-loop"


def megatron_optimizer_implementation(device_type: str) -> str:
    """How Megatron's optimizer steps on a ``device_type`` machine (:data:`OPTIMIZER_IMPLEMENTATIONS`):
    ``fused`` where it imported Transformer Engine's or apex's fused optimizers, else torch's."""
    return torch_optimizer_implementation(device_type) if optimizer.USING_PYTORCH_OPTIMIZER else "fused"


@dataclasses.dataclass(frozen=True)
class OptimizerSetup:
    """What of the optimizer sets the memory of a stage's static state and of its step."""

    implementation: str
    """:data:`OPTIMIZER_IMPLEMENTATIONS`: :func:`megatron_optimizer_implementation` for Megatron's."""
    name: str = "adam"
    """:data:`OPTIMIZERS`; Adam steps as AdamW (Megatron's decoupled weight decay)."""
    sgd_momentum: bool = True
    weight_decay: bool = True
    shards: int = 1
    """Ranks the optimizer state is split over (the data-parallel size with the distributed optimizer)."""

    def __post_init__(self) -> None:
        if self.implementation not in OPTIMIZER_IMPLEMENTATIONS:
            raise ValueError(f"optimizer implementation {self.implementation!r}: one of {OPTIMIZER_IMPLEMENTATIONS}")
        if problem := optimizer_problem(self.name):
            raise ValueError(problem)
        if self.shards < 1:
            raise ValueError(f"optimizer shards must be >= 1, got {self.shards}")

    @property
    def states(self) -> int:
        """fp32 tensors kept per parameter: Adam's two moments, SGD's momentum."""
        return 2 if self.name == "adam" else int(self.sgd_momentum)

    def step_bytes(self, parameters: int, largest: int) -> float:
        """The step's working set (module docstring) on a rank holding ``parameters`` parameters of which
        the largest has ``largest`` elements."""
        shard = -(-parameters // self.shards)
        if self.implementation == "fused" or (self.name == "sgd" and not self.weight_decay):
            elements = 0
        elif self.implementation == "foreach":
            elements = shard
        else:
            elements = (3 if self.name == "adam" else 1) * min(largest, shard)
        return 4.0 * elements


@dataclasses.dataclass(frozen=True)
class StageFootprint:
    """One pipeline stage of one tensor-parallel rank."""

    stage: int
    chunk_layers: tuple[int, ...]
    """Transformer layers of each of the stage's model chunks (one without a virtual pipeline)."""
    parameters: int
    """Parameters this rank holds for the stage (its tensor-parallel shards)."""
    has_output_layer: bool
    """The stage computes the logits and the loss (the last stage)."""
    static_bytes: float
    optimizer_step_bytes: float
    """What the optimizer step allocates above :attr:`static_bytes` (module docstring)."""

    @property
    def layers(self) -> int:
        """Transformer layers on the stage (all its model chunks)."""
        return sum(self.chunk_layers)


def _projection_rows(config: TransformerConfig) -> tuple[int, int]:
    """Output rows of one layer's full QKV projection and of its fc1 (both halves of a gated unit)."""
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    return (heads + 2 * groups) * config.kv_channels, config.ffn_hidden_size * (2 if config.gated_linear_unit else 1)


def _layer_matrices(config: TransformerConfig) -> tuple[int, int, int, int]:
    """Elements of one dense layer's weight matrices on one tensor-parallel rank: QKV, the attention's
    output projection, fc1 and fc2."""
    p, h = config.tensor_model_parallel_size, config.hidden_size
    qkv, ffn_out = _projection_rows(config)
    attention = config.num_attention_heads * config.kv_channels
    return qkv * h // p, attention * h // p, h * ffn_out // p, config.ffn_hidden_size * h // p


def layer_parameters(config: TransformerConfig) -> int:
    """Parameters of one dense transformer layer on one tensor-parallel rank (Megatron's TP shards)."""
    p, h = config.tensor_model_parallel_size, config.hidden_size
    qkv, ffn_out = _projection_rows(config)
    norm = 2 if config.normalization == "LayerNorm" else 1
    count = sum(_layer_matrices(config))
    count += 2 * norm * h  # input and pre-MLP norms, replicated
    if config.qk_layernorm:
        count += 2 * norm * config.kv_channels
    if config.add_qkv_bias or config.add_bias_linear:
        count += qkv // p
    if config.add_bias_linear:
        count += ffn_out // p + 2 * h  # fc1 bias sharded; proj and fc2 biases replicated
    return count


def pipeline_footprints(
    config: TransformerConfig,
    *,
    vocab_size: int,
    tied_embeddings: bool,
    learned_positions: int,
    optimizer: OptimizerSetup,
    grads_in_fp32: bool,
) -> list[StageFootprint]:
    """The footprint of every pipeline stage of ``config`` on one tensor-parallel rank.

    Args:
        vocab_size: the padded vocabulary (a multiple of the tensor-parallel size).
        tied_embeddings: the output layer shares the word embedding (a copy on the last stage when
            there are several).
        learned_positions: rows of a learned absolute position embedding (0 for RoPE).
        optimizer: the optimizer, its implementation and its shards.
        grads_in_fp32: gradients accumulate in fp32 whatever the parameter dtype.
    """
    p, pp, h = config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.hidden_size
    element = torch.empty((), dtype=config.params_dtype).element_size()
    per_parameter = element + (4 if grads_in_fp32 else element)
    per_parameter += ((4 if element < 4 else 0) + 4 * optimizer.states) / optimizer.shards
    vocab_rows = vocab_size // p * h
    norm = 2 if config.normalization == "LayerNorm" else 1
    footprints = []
    for stage in range(pp):
        chunk_layers = stage_chunk_layers(config, stage)
        layers = sum(chunk_layers)
        first, last = stage == 0, stage == pp - 1
        parameters = layers * layer_parameters(config)
        largest = max(_layer_matrices(config)) if layers else 0
        if first:
            parameters += vocab_rows + learned_positions * h
            largest = max(largest, vocab_rows, learned_positions * h)
        if last:
            parameters += norm * h
            if not tied_embeddings or pp > 1:
                parameters += vocab_rows
                largest = max(largest, vocab_rows)
        footprints.append(
            StageFootprint(
                stage,
                chunk_layers,
                parameters,
                last,
                parameters * per_parameter,
                optimizer.step_bytes(parameters, max(largest, norm * h)),
            )
        )
    return footprints
