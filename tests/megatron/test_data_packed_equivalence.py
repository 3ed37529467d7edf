"""Packed micro-batches give every token the loss it gets when its document runs alone (p=2 gloo ranks).

The loader's micro-batches (:class:`DynamicSequenceLoader`: canonical tokens, labels, loss mask,
position ids, ``cu_seqlens``; the layout the strategies attend with) go embedding to per-token
cross-entropy twice: one sample per micro-batch, and packed (THD, up to a token budget, padded to a
multiple of 2p, zigzag or contiguous canonical order). Documents packed together must not see each
other: every labelled token's loss equals its loss in the unpacked run within 1e-5 relative. Each
packed document is cut out of the natural-order losses by the batch's ``cu_seqlens``.

Two models, one launch each:

- a small transformer of the strategy library (the strategy tests' stack) under each attention
  strategy, causal and bidirectional;
- Megatron-Core's ``GPTModel`` with the Paradyse layer spec at TP=2 with sequence parallelism (GPT-2
  and LLaMA styles, RoPE), called as the training forward step calls it (canonical tokens and
  position ids, labels, no mask, the layout and plan in :func:`micro_batch_scope`), under a uniform
  ``tp_sp`` plan and mixed ring / lean / Ulysses plans with recompute, causal. A control runs a packed
  micro-batch as if it held one document: its losses must differ, so the comparison can fail.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.core.comm import all_gather_seq
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.data.indexed import DocumentDataset, write_documents
from megatron_paradyse.data.loader import DynamicSequenceLoader, LoaderConfig

from helpers.reference_model import StackConfig, make_params, shard_layer
from helpers.strategy_stack import held_by_megatron_linears, model_shape, run_stack

P = 2
VOCAB = 128  # megatron_harness.VOCAB
DOC_LENGTHS = (37, 5, 64, 18, 2, 29, 50, 1, 71)  # 71 > MAX_LEN: split; 1: no label, left out
MAX_LEN = 64
TOKEN_BUDGET = 128
TOLERANCE = 1e-5
MEGATRON_PLANS = {
    "uniform-tp_sp": ["tp_sp/tp_sp"] * 4,
    "ring-lean": ["ring/lean", "lean/zero3+rc", "ring/tp_sp", "lean/lean"],
    "ulysses-mix": ["ulysses/zero3+rc", "tp_sp/lean", "lean/tp_sp+rc", "ring/zero3"],
}

PerTokenLoss = Callable[[dict, SequenceLayout], torch.Tensor]
"""(micro-batch, the layout to attend with) -> masked per-token loss ``[s]``, natural order, padding included."""


def packed_vs_alone(dataset: DocumentDataset, causal: bool, per_token_loss: PerTokenLoss) -> dict:
    """Every sample's losses packed against alone: worst relative error over labelled tokens, the
    samples of each packed micro-batch, and the control's error (a packed micro-batch as one document)."""

    def loader(token_budget):
        config = LoaderConfig(p=P, max_len=MAX_LEN, causal=causal, token_budget=token_budget, sampler="random")
        return DynamicSequenceLoader(dataset, config)

    def documents(batch: dict, layout: SequenceLayout) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(loss, loss mask) of each document, cut at ``cu_seqlens`` (the padding block left out)."""
        losses, mask = per_token_loss(batch, layout), layout.from_canonical(batch["loss_mask"][0])
        bounds = batch["cu_seqlens"].tolist()
        return [(losses[a:b], mask[a:b]) for a, b in zip(bounds, bounds[1 : len(batch["samples"]) + 1])]

    alone, packed = loader(None), loader(TOKEN_BUDGET)
    expected = {}
    for _ in range(len(alone.sampler.epoch_micro_batches(0))):
        batch = next(alone)
        [expected[batch["samples"][0]]] = documents(batch, batch["layout"])

    def worst_error(batch: dict, layout: SequenceLayout) -> float:
        errors = [
            ((loss - expected[sample][0]).abs() / expected[sample][0].abs())[mask.bool()].max().item()
            for sample, (loss, mask) in zip(batch["samples"], documents(batch, layout))
        ]
        return max(errors)

    worst, packed_samples, control = 0.0, [], None
    for _ in range(len(packed.sampler.epoch_micro_batches(0))):
        batch = next(packed)
        worst = max(worst, worst_error(batch, batch["layout"]))
        packed_samples.append(batch["samples"])
        if control is None and len(batch["samples"]) >= 3:
            one_document = SequenceLayout.build(batch["layout"].valid_len, P, causal=causal)
            control = worst_error(batch, one_document)
    return {"max_err": worst, "packed": packed_samples, "samples": sorted(expected), "control_err": control}


def check(result: dict, rank: int) -> None:
    packed = [s for samples in result["packed"] for s in samples]
    assert sorted(packed) == result["samples"] and len(packed) == 9  # 71 splits in two; 1 is dropped
    assert max(map(len, result["packed"])) >= 3, "no micro-batch packs several documents"
    assert result["max_err"] <= TOLERANCE, f"rank {rank}: per-token loss off by {result['max_err']:.2e}"
    assert result["control_err"] > 1e-3, "packed documents seeing each other changed no loss: the test is blind"


# -- the strategy stack -------------------------------------------------------------------------------
def stack_loss(model: dict, rank: int, group) -> PerTokenLoss:
    cfg = model["cfg"]

    def per_token_loss(batch: dict, layout: SequenceLayout) -> torch.Tensor:
        local = layout.local_slice(rank)
        x_local = model["embedding"][batch["tokens"][0, local]].unsqueeze(1)  # [s/p, 1, h]
        y_local = run_stack(x_local, *model["shards"], model["norms"], model["plan"], layout, cfg, group)
        logits = F.layer_norm(y_local[:, 0], (cfg.shape.hidden_size,)) @ model["head"].T  # [s/p, V]
        loss = F.cross_entropy(logits, batch["labels"][0, local], reduction="none") * batch["loss_mask"][0, local]
        return layout.from_canonical(all_gather_seq(loss, group))

    return per_token_loss


def stack_case(rank: int, dataset: DocumentDataset, causal: bool, attention: str) -> dict:
    group = dist.group.WORLD
    cfg = StackConfig(model_shape(P, gqa=False), num_layers=2, causal=causal)
    layers = make_params(cfg, seed=7)
    gen = torch.Generator().manual_seed(8)
    model = {
        "cfg": cfg,
        "shards": list(
            zip(
                *(
                    held_by_megatron_linears(shard_layer(layer, cfg.shape, P, rank), cfg.shape, group)
                    for layer in layers
                )
            )
        ),
        "norms": [{k: layer[k] for k in ("ln1_w", "ln1_b", "ln2_w", "ln2_b")} for layer in layers],
        "plan": [(attention, "tp_sp")] * cfg.num_layers,
        "embedding": torch.randn(VOCAB, cfg.shape.hidden_size, generator=gen),
        "head": torch.randn(VOCAB, cfg.shape.hidden_size, generator=gen) * cfg.shape.hidden_size**-0.5,
    }
    with torch.no_grad():
        return packed_vs_alone(dataset, causal, stack_loss(model, rank, group))


def stack_cases(rank: int, world_size: int, prefix: str) -> dict:
    dataset = DocumentDataset(prefix)
    return {
        (causal, attention): stack_case(rank, dataset, causal, attention)
        for causal in (True, False)
        for attention in ("tp_sp", "ulysses", "ring")
    }


# -- Megatron -----------------------------------------------------------------------------------------
def megatron_loss(model, plan) -> PerTokenLoss:
    """The per-token loss as :meth:`TrainingRun.forward_step` runs the model (before its loss mask)."""
    from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope

    def per_token_loss(batch: dict, layout: SequenceLayout) -> torch.Tensor:
        with micro_batch_scope(MicroBatch(layout=layout, plan=plan)):
            loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])  # [1, s] canonical
        return layout.from_canonical(loss[0] * batch["loss_mask"][0])

    return per_token_loss


def megatron_cases(rank: int, world_size: int, prefix: str) -> dict:
    """Per (variant, plan): a Paradyse GPT model at TP=2 with SP against itself, packed and alone."""
    from megatron_paradyse.core.plan import Plan
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from helpers import megatron_harness as H

    assert H.VOCAB == VOCAB
    H.init_parallel(tp=P)
    dataset = DocumentDataset(prefix)
    out = {}
    for variant in H.VARIANTS:
        config = H.make_config(variant, tp=P)
        model = H.build_gpt(config, get_paradyse_layer_spec(config), seed=3)
        for name, options in MEGATRON_PLANS.items():
            with torch.no_grad():
                out[(variant, name)] = packed_vs_alone(dataset, True, megatron_loss(model, Plan.from_options(options)))
    return out


# -- tests --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("packed") / "docs")
    rng = np.random.default_rng(0)
    write_documents(prefix, [rng.integers(1, VOCAB, size=n) for n in DOC_LENGTHS], vocab_size=VOCAB)
    return prefix


@pytest.fixture(scope="module")
def stack_results(prefix):
    return run_on_ranks(stack_cases, P, args=(prefix,), timeout_s=300)


@pytest.fixture(scope="module")
def megatron_results(prefix):
    return run_on_ranks(megatron_cases, P, args=(prefix,), timeout_s=300)


@pytest.mark.parametrize("attention", ["tp_sp", "ulysses", "ring"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_packed_loss_equals_documents_one_by_one(stack_results, causal, attention):
    for rank, per_rank in enumerate(stack_results):
        check(per_rank[(causal, attention)], rank)


@pytest.mark.parametrize("plan", list(MEGATRON_PLANS))
@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_megatron_packed_loss_equals_documents_one_by_one(megatron_results, variant, plan):
    for rank, per_rank in enumerate(megatron_results):
        check(per_rank[(variant, plan)], rank)
