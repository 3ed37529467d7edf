"""Megatron-Core GPT models on gloo ranks, for tests: configs, Megatron's stock spec as the reference,
batches in natural and canonical order, and gradients compared shard by shard.

Imported inside rank processes only (it imports megatron.core, after the CPU patches).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.mcore import compat

compat.install()

from megatron_paradyse.core.layout import SequenceLayout  # noqa: E402
from megatron_paradyse.core.memory import freeze_what_lives_now as freeze_what_lives_now  # noqa: E402 - re-exported for the tests
from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope  # noqa: E402
from megatron_paradyse.core.plan import Plan  # noqa: E402
from megatron_paradyse.mcore.chunked_loss import output_processor  # noqa: E402
from megatron_paradyse.mcore.stock_spec import stock_block_spec as stock_block_spec  # noqa: E402 - re-exported for the tests

from megatron.core import parallel_state  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.spec_utils import import_module  # noqa: E402
from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig  # noqa: E402

from helpers.numerics import rel_err as rel_err  # noqa: E402 - re-exported for the tests

VOCAB = 128
BATCH = 2
NUM_LAYERS = 4

VARIANTS = {
    # GPT-2 style: LayerNorm, MHA, GELU, biases.
    "gpt": dict(normalization="LayerNorm", add_bias_linear=True, activation_func=F.gelu),
    # LLaMA style: RMSNorm, GQA, SwiGLU, no biases, q/k layernorm.
    "llama": dict(
        normalization="RMSNorm",
        add_bias_linear=False,
        num_query_groups=4,
        gated_linear_unit=True,
        activation_func=F.silu,
        qk_layernorm=True,
    ),
}


def make_config(variant: str, tp: int, pp: int = 1, **overrides) -> TransformerConfig:
    """A tiny fp32 model of ``variant``: 4 layers, 8 heads of 8 channels, hidden 64, FFN 96, no dropout."""
    fields = dict(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=8,
        ffn_hidden_size=96,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=tp > 1,
        pipeline_model_parallel_size=pp,
    )
    return TransformerConfig(**{**fields, **VARIANTS[variant], **overrides})


def init_parallel(tp: int, pp: int = 1, vpp: int | None = None) -> None:
    """(Re)build Megatron's process groups on the running gloo world."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp
    )
    model_parallel_cuda_manual_seed(1234)


def build_gpt(
    config: TransformerConfig, spec, seed: int = 0, vp_stage: int | None = None, vocab_size: int = VOCAB
) -> GPTModel:
    """A GPT model (this rank's pipeline stage, or its chunk ``vp_stage``) with weights drawn from ``seed``;
    ``vocab_size`` must divide by the TP size (tokens are drawn below :data:`VOCAB`)."""
    torch.manual_seed(seed)
    vp_size = config.virtual_pipeline_model_parallel_size
    first_chunk = vp_stage in (None, 0)
    last_chunk = vp_stage is None or vp_stage == vp_size - 1
    return GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=512,
        position_embedding_type="rope",
        pre_process=first_chunk and parallel_state.is_pipeline_first_stage(ignore_virtual=True),
        post_process=last_chunk and parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        vp_stage=vp_stage,
    )


def build_gpt_from_spec_flag(config: TransformerConfig, spec_name: str, seed: int = 0) -> GPTModel:
    """A GPT model built as ``pretrain_gpt.py --spec megatron_paradyse.spec <spec_name>`` builds it:
    Megatron resolves the name with ``import_module`` and its model builder uses (or calls) it."""
    torch.manual_seed(seed)
    model_config = GPTModelConfig(
        transformer=config,
        transformer_layer_spec=import_module(("megatron_paradyse.spec", spec_name)),
        vocab_size=VOCAB,
        seq_length=512,
        position_embedding_type="rope",
    )
    return GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())


# -- batches ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Batch:
    """One micro-batch: padded tokens and labels ``[b, s]`` in natural order, and their layout."""

    layout: SequenceLayout
    tokens: torch.Tensor
    labels: torch.Tensor

    @classmethod
    def make(cls, doc_lengths, p: int, seed: int) -> Batch:
        layout = SequenceLayout.build(doc_lengths, p, causal=True)
        gen = torch.Generator().manual_seed(seed)
        tokens, labels = torch.randint(0, VOCAB, (2, BATCH, layout.padded_len), generator=gen)
        return cls(layout, tokens, labels)

    def natural_mask(self) -> torch.Tensor:
        """Megatron's explicit mask ``[1, 1, s, s]`` (True = hidden): causal within each document."""
        doc = torch.empty(self.layout.padded_len, dtype=torch.long)
        for i, (start, end) in enumerate(self.layout.doc_bounds):
            doc[start:end] = i
        s = self.layout.padded_len
        visible = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
        return ~visible[None, None]

    def natural_loss_mask(self) -> torch.Tensor:
        return (torch.arange(self.layout.padded_len) < self.layout.valid_len).float()

    def canonical(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, labels, position ids) ``[b, s]`` in the layout's canonical order."""
        to_canonical = functools.partial(self.layout.to_canonical, dim=1)
        positions = self.layout.position_ids.expand(BATCH, -1)
        return to_canonical(self.tokens), to_canonical(self.labels), positions


def stock_loss(model: GPTModel, batch: Batch) -> torch.Tensor:
    """Masked sum of the per-token loss of Megatron's stock model, natural order and explicit mask."""
    positions = torch.arange(batch.layout.padded_len).expand(BATCH, -1)
    per_token = model(batch.tokens, positions, batch.natural_mask(), labels=batch.labels)  # [b, s]
    return (per_token * batch.natural_loss_mask()).sum()


def paradyse_forward(model: GPTModel, batch: Batch, plan: Plan) -> torch.Tensor:
    """A Paradyse model's output for ``batch`` (canonical order, no mask): per-token loss ``[b, s]``
    on the last pipeline stage, hidden states elsewhere."""
    tokens, labels, positions = batch.canonical()
    with micro_batch_scope(MicroBatch(layout=batch.layout, plan=plan)):
        return model(tokens, positions, None, labels=labels, output_processor=output_processor(plan))


def paradyse_loss(model: GPTModel, batch: Batch, plan: Plan) -> torch.Tensor:
    """Masked sum of the per-token loss of a Paradyse model."""
    return (paradyse_forward(model, batch, plan) * batch.layout.loss_mask).sum()


# -- runs and their comparison ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    """The loss of one forward and this rank's full-loss gradients of every parameter."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor]

    def __add__(self, other: Run) -> Run:
        return Run(self.loss + other.loss, {k: g + other.grads[k] for k, g in self.grads.items()})


def backward(model: torch.nn.Module, loss: torch.Tensor) -> Run:
    """Backward ``loss``, then take (and zero) the gradients, reduced over TP where Megatron's
    ``finalize_model_grads`` reduces them (parameters marked ``sequence_parallel``)."""
    loss.backward()
    return take_grads(model, loss.detach())


def take_grads(model: torch.nn.Module, loss: torch.Tensor) -> Run:
    group = parallel_state.get_tensor_model_parallel_group()
    grads = {}
    for name, param in model.named_parameters():
        if getattr(param, "sequence_parallel", False) and group.size() > 1:
            dist.all_reduce(param.grad, group=group)
        grads[name] = param.grad.clone()
    model.zero_grad(set_to_none=True)
    return Run(loss, grads)


def shard_of(full: torch.Tensor, param: torch.Tensor, rank: int, p: int) -> torch.Tensor:
    """This rank's TP shard of a full (TP=1) tensor, cut as Megatron cuts ``param`` (strided for SwiGLU)."""
    if not getattr(param, "tensor_model_parallel", False) or p == 1:
        return full
    stride = getattr(param, "partition_stride", 1)
    pieces = full.chunk(p * stride, dim=param.partition_dim)
    return torch.cat(pieces[rank::p], dim=param.partition_dim)


def sharded_state_dict_from_full(model: torch.nn.Module, full: dict[str, torch.Tensor], rank: int, p: int) -> dict:
    """A TP=1 state dict cut into ``model``'s TP shards."""
    params = dict(model.named_parameters())
    return {k: shard_of(v, params[k], rank, p) if k in params else v for k, v in full.items()}


def compare(run: Run, reference: Run, model: torch.nn.Module, rank: int, cut_p: int, what: str) -> dict[str, float]:
    """Relative errors of ``run``'s loss and of its worst parameter gradient against ``reference``.

    ``reference`` holds full (TP=1) gradients, cut here into ``model``'s shards for ``cut_p`` ranks;
    with ``cut_p=1``, gradients shaped like ``run``'s already.
    """
    if set(run.grads) != set(reference.grads):
        raise AssertionError(f"parameter names differ: {sorted(set(run.grads) ^ set(reference.grads))}")
    params = dict(model.named_parameters())
    errors = {
        name: rel_err(grad, shard_of(reference.grads[name], params[name], rank, cut_p))
        for name, grad in run.grads.items()
    }
    worst = max(errors, key=errors.get)
    return {f"loss vs {what}": rel_err(run.loss, reference.loss), f"grad {worst} vs {what}": errors[worst]}
