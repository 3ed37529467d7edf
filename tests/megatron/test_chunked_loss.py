"""The output layer and loss in sequence chunks (:mod:`megatron_paradyse.mcore.chunked_loss`), on 3 gloo ranks.

Megatron GPT models (GPT-style, tied output layer; LLaMA-style, untied) with the Paradyse layer spec,
6 heads so that TP=3 shards them. At TP=1 and at TP=3 with sequence parallelism, every strategy family
(uniform, with and without recompute) and mixed plans run with the loss in chunks of 1 row, of 4 rows
(an uneven tail) and in one chunk, on one document or three packed (each pair of plan, chunk size and
documents run); loss and every gradient must equal Megatron's stock TP=1 model
(fp32, 1e-5). Forward leaves the weights untouched. In bf16 the chunked loss and gradients equal the
unchunked ones within bf16 round-off. TP=2 and TP=4 run the chunked loss with mixed plans in
``tests/megatron/test_megatron_spec.py``.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption, Plan

P = 3
VOCAB = 129  # divides by 3
TOLERANCE = 1e-5
BF16_TOLERANCE = 1.5e-2
"""bf16 keeps 8 bits: a weight gradient summed over chunks rounds differently (measured up to 5.6e-3)."""
SHAPE = dict(num_attention_heads=6, kv_channels=8, ffn_hidden_size=96)
VARIANTS = {"gpt": (dict(SHAPE), True), "llama": (dict(SHAPE, num_query_groups=3), False)}
PLANS = ("tp_sp/tp_sp", "ulysses/zero3+rc", "ring/zero3", "lean/lean+rc", "mix", "mix+rc")
DOCUMENTS = ((31,), (7, 17, 12))


def _plan(name: str, layers: int, seed: int) -> Plan:
    if not name.startswith("mix"):
        return Plan.uniform(LayerOption.parse(name), layers)
    rng = random.Random(seed)
    pairs = [("tp_sp", "tp_sp"), ("ulysses", "zero3"), ("ring", "lean"), ("lean", "lean"), ("ring", "tp_sp")]
    return Plan(
        tuple(LayerOption(*rng.choice(pairs), name.endswith("rc") and rng.random() < 0.5) for _ in range(layers))
    )


def _build(H, variant: str, tp: int, seed: int, **overrides):
    fields, tied = VARIANTS[variant]
    config = H.make_config(variant, tp=tp, **{**fields, **overrides})
    from megatron_paradyse.mcore.spec import get_paradyse_layer_spec

    spec = H.stock_block_spec(config) if seed == 0 else get_paradyse_layer_spec(config)
    torch.manual_seed(seed)
    model = H.GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=512,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=tied,
    )
    return config, model


def _cases(rank: int, p: int) -> dict:
    from helpers import megatron_harness as H

    out = {}
    from megatron_paradyse.core.layout import SequenceLayout

    # the same tokens at both TP sizes: padded for p, laid out for 1 rank at TP=1
    batches = {p: [H.Batch.make(docs, p, seed=i) for i, docs in enumerate(DOCUMENTS)]}
    batches[1] = [
        dataclasses.replace(b, layout=SequenceLayout(b.layout.doc_lengths, 1, True, b.layout.padded_len))
        for b in batches[p]
    ]
    references = {}
    H.init_parallel(tp=1)
    for variant in VARIANTS:
        _, stock = _build(H, variant, 1, seed=0)
        references[variant] = (stock.state_dict(), [H.backward(stock, H.stock_loss(stock, b)) for b in batches[p]])
    for tp in (1, p):
        H.init_parallel(tp=tp)
        for variant in VARIANTS:
            full_state, stock_runs = references[variant]
            config, model = _build(H, variant, tp, seed=1)
            model.load_state_dict(H.sharded_state_dict_from_full(model, full_state, rank, tp))
            # every plan with every chunk size, the documents alternating: each pair of the three covered
            for i, name in enumerate(PLANS):
                for k, rows in enumerate((1, 4, None)):
                    j = (i + k) % len(batches[tp])
                    batch = batches[tp][j]
                    plan = _plan(name, config.num_layers, seed=10 * j + tp)
                    rows = rows or batch.layout.padded_len
                    chunked = dataclasses.replace(plan, loss_chunk_tokens=rows * tp)
                    before = [param.detach().clone() for param in model.parameters()]
                    loss = H.paradyse_loss(model, batch, chunked)
                    untouched = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                    run = H.backward(model, loss)
                    out[f"tp{tp}-{variant}-{name}-doc{j}-rows{rows}"] = {
                        **H.compare(run, stock_runs[j], model, rank, tp, "stock TP=1"),
                        "weights changed by forward": 0.0 if untouched else 1.0,
                    }
            # bf16: the chunked loss against the unchunked one, same model and plan
            config, model = _build(H, variant, tp, seed=1, params_dtype=torch.bfloat16, bf16=True)
            state = {
                k: v.bfloat16() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in full_state.items()
            }
            model.load_state_dict(H.sharded_state_dict_from_full(model, state, rank, tp))
            batch = batches[tp][1]
            plan = _plan("mix+rc", config.num_layers, seed=tp)
            whole = H.backward(model, H.paradyse_loss(model, batch, plan))
            run = H.backward(model, H.paradyse_loss(model, batch, dataclasses.replace(plan, loss_chunk_tokens=4 * tp)))
            out[f"bf16-tp{tp}-{variant}"] = H.compare(run, whole, model, rank, 1, "unchunked bf16")
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(_cases, P, timeout_s=900)


def _check(results: list[dict], prefix: str, tolerance: float) -> None:
    checked = 0
    for rank, cases in enumerate(results):
        for case, errors in cases.items():
            if case.startswith(prefix):
                checked += 1
                for what, err in errors.items():
                    assert err <= tolerance, f"rank {rank}, {case}: {what} off by {err:.2e}"
    assert checked, f"no case starts with {prefix!r}"


@pytest.mark.parametrize("tp", [1, P])
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_loss_matches_stock_tp1(results, tp, variant):
    _check(results, f"tp{tp}-{variant}-", TOLERANCE)


@pytest.mark.parametrize("tp", [1, P])
@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_loss_in_bf16_matches_unchunked(results, tp, variant):
    _check(results, f"bf16-tp{tp}-{variant}", BF16_TOLERANCE)
