"""The output layer and its loss over sequence chunks, so the whole shard's logits never exist at once.

With sequence parallelism Megatron's output layer gathers the stage's output ``[s/p, b, h]`` to
``[s, b, h]`` and makes the logits ``[s, b, V/p]``, which the vocab-parallel cross-entropy copies to
fp32 and keeps as its softmax until backward: at a long sequence (Llama-3's 128K vocabulary, 1M tokens)
that is tens of GiB per rank, more than every transformer layer's activations. Here the stage's output
is cut into chunks of local rows; each chunk runs Megatron's own output layer (which gathers the chunk
from every rank: ``p`` times the rows) and Megatron's configured cross-entropy under activation
recompute, so its logits live only while that chunk runs, in forward and again in backward. The
per-token loss is the unchunked one, gathered rank-major like Megatron's: a chunk of rows
``[a, a + c)`` on every rank holds the tokens ``r * s/p + [a, a + c)`` of rank ``r``.

Used as Megatron ``GPTModel.forward``'s ``output_processor``: :func:`output_processor` gives the one a
micro-batch's plan asks for (:attr:`~megatron_paradyse.core.plan.Plan.loss_chunk_tokens`).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
from megatron_paradyse.core.plan import Plan, loss_chunk_rows
from megatron_paradyse.strategies.recompute import recompute

__all__ = ["ChunkedLanguageModelLoss", "micro_batch_loss", "output_processor"]


def output_processor(plan: Plan) -> ChunkedLanguageModelLoss | None:
    """What to pass as ``GPTModel.forward(..., output_processor=...)`` for a micro-batch of ``plan``:
    None (Megatron's own output layer and loss) unless the plan chunks the loss."""
    return ChunkedLanguageModelLoss(plan.loss_chunk_tokens) if plan.loss_chunk_tokens else None


def micro_batch_loss(model, batch: dict, micro_batch: MicroBatch) -> Tensor:
    """The mean loss over ``batch``'s loss mask of a Paradyse ``GPTModel`` (or a wrapper that calls it)
    running ``micro_batch`` (its layout and plan; the plan's output processor); ``batch``: the tensors of
    :func:`~megatron_paradyse.data.make_micro_batch`."""
    with micro_batch_scope(micro_batch):
        per_token = model(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            output_processor=output_processor(micro_batch.plan),
        )
    return (per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkedLanguageModelLoss:
    """``GPTModel`` output processor: the per-token loss ``[b, s]`` computed ``chunk_tokens`` gathered
    tokens at a time (``chunk_tokens / p`` local rows with sequence parallelism)."""

    chunk_tokens: int

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be a positive int, got {self.chunk_tokens!r}")

    def __call__(
        self,
        *,
        hidden_states: Tensor,
        output_layer: torch.nn.Module,
        output_weight: Tensor | None,
        labels: Tensor | None,
        runtime_gather_output: bool | None,
        compute_language_model_loss,
        scale_logits,
        **_,
    ) -> Tensor:
        if labels is None:
            raise ValueError("a chunked output layer computes the loss; it needs labels (use it for training)")
        p = output_layer.tp_group.size() if output_layer.sequence_parallel else 1
        local, batch = hidden_states.shape[:2]
        if labels.shape != (batch, p * local):
            raise ValueError(
                f"labels are {tuple(labels.shape)}, the output layer's input {tuple(hidden_states.shape)} on "
                f"{p} sequence-parallel ranks needs ({batch}, {p * local})"
            )
        by_rank = labels.view(batch, p, local)
        rows = loss_chunk_rows(self.chunk_tokens, p, local)
        pieces = []
        for start, x in zip(range(0, local, rows), torch.split(hidden_states, rows)):
            loss = functools.partial(
                _chunk_loss,
                labels=by_rank[:, :, start : start + x.shape[0]],
                output_layer=output_layer,
                output_weight=output_weight,
                runtime_gather_output=runtime_gather_output,
                compute_language_model_loss=compute_language_model_loss,
                scale_logits=scale_logits,
            )
            pieces.append(recompute(loss, x).view(batch, p, x.shape[0]))
        return torch.cat(pieces, dim=2).view(batch, p * local)


def _chunk_loss(
    x: Tensor,
    *,
    labels: Tensor,
    output_layer,
    output_weight,
    runtime_gather_output,
    compute_language_model_loss,
    scale_logits,
) -> Tensor:
    """One chunk's per-token loss ``[b, p * rows]``, rank-major; ``labels`` is ``[b, p, rows]``."""
    logits, _ = output_layer(x, weight=output_weight, runtime_gather_output=runtime_gather_output)
    return compute_language_model_loss(labels.reshape(labels.shape[0], -1), scale_logits(logits))
