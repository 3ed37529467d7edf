"""Micro-batch assembly: group samples (one each, or packed to a token budget) and build the tensors.

A micro-batch is one row of ``s_padded`` tokens (``b = 1``, as in the paper and in Megatron's THD
packing): its samples back to back, each a document of its own, padded to a multiple of ``2p`` and
put in the canonical order of :class:`~megatron_paradyse.core.layout.SequenceLayout`. The dictionary
:func:`make_micro_batch` returns:

============== ============ ============================================================================
key            type         meaning
============== ============ ============================================================================
tokens         int64 [1, s] input ids, canonical order; padding holds ``pad_id``
labels         int64 [1, s] the next token of the same document; ``pad_id`` where there is none
loss_mask      fp32 [1, s]  1 where a label exists; 0 on the last token of a document and on padding
position_ids   int64 [1, s] rotary position, restarting at 0 in every document (``layout.position_ids``)
cu_seqlens     int32 [d+1]  natural-order bounds of the documents, the padding block last (if any):
                            ``cu_seqlens[-1] == s``, for THD ``PackedSeqParams``
max_seqlen     int          longest segment of ``cu_seqlens``
layout         SequenceLayout  document lengths, ``p``, causal; the strategies' view of the batch
samples        tuple[int]   the sample (span) ids it holds, in order
============== ============ ============================================================================

Packing never teaches a document to predict the next one: labels stop at each document's end.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from megatron_paradyse.core.layout import SequenceLayout

__all__ = ["make_micro_batch", "pack"]


def pack(order: np.ndarray, lengths: np.ndarray, token_budget: int | None) -> list[tuple[int, ...]]:
    """Cut ``order`` into micro-batches: one sample each (``token_budget=None``), or runs of
    consecutive samples whose lengths sum to at most ``token_budget`` (order kept, greedy)."""
    order = [int(i) for i in order]
    if token_budget is None:
        return [(i,) for i in order]
    groups: list[tuple[int, ...]] = []
    current: list[int] = []
    used = 0
    for i in order:
        n = int(lengths[i])
        if n > token_budget:
            raise ValueError(f"sample {i} has {n} tokens, more than the token budget {token_budget}")
        if used + n > token_budget:
            groups.append(tuple(current))
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(tuple(current))
    return groups


def make_micro_batch(
    pieces: Sequence[np.ndarray],
    continues: Sequence[bool],
    *,
    p: int,
    causal: bool,
    pad_id: int,
    samples: tuple[int, ...] = (),
) -> dict:
    """The micro-batch of samples whose tokens are ``pieces``.

    ``pieces[i]`` holds sample ``i``'s tokens, plus one more when ``continues[i]``: the next token of
    its document, the label of its last token.
    """
    inputs = [piece[: len(piece) - bool(more)] for piece, more in zip(pieces, continues)]
    if any(len(x) < 1 for x in inputs):
        raise ValueError(f"every sample needs at least one input token, got lengths {[len(x) for x in inputs]}")
    layout = SequenceLayout.build([len(x) for x in inputs], p, causal=causal)
    tokens = torch.from_numpy(np.concatenate(inputs).astype(np.int64))
    labels, mask = [], []
    for piece, x, more in zip(pieces, inputs, continues):
        labels.append(piece[1 : len(x) + 1].astype(np.int64))
        mask.append(np.ones(len(x), dtype=np.float32))
        if not more:  # the document's last token: nothing to predict
            labels.append(np.array([pad_id], dtype=np.int64))
            mask[-1][-1] = 0.0
    bounds = [0, *(end for _, end in layout.doc_bounds)]
    return {
        "tokens": layout.to_canonical(tokens, pad_value=pad_id)[None],
        "labels": layout.to_canonical(torch.from_numpy(np.concatenate(labels)), pad_value=pad_id)[None],
        "loss_mask": layout.to_canonical(torch.from_numpy(np.concatenate(mask)), pad_value=0.0)[None],
        "position_ids": layout.position_ids[None],
        "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
        "max_seqlen": max(b - a for a, b in zip(bounds, bounds[1:])),
        "layout": layout,
        "samples": tuple(samples),
    }
