"""The one-rank memory trace (:mod:`megatron_paradyse.mcore.trace`) against real ranks (the commands built
on it, ``bench memory --trace`` and ``bench allocator``: ``tests/e2e/test_bench_memory.py``).

A fake trace must allocate what the real run allocates: on the same 2 gloo ranks, each rank first
measures every cell for real (``calibration.measure.measure_layer`` for ``run_layer``; the same tracer with
real tensors for Megatron's layer), then leaves the gloo group and traces the same cells as the same
rank of a fake group under ``FakeTensorMode``. Saved and peak bytes must be equal to the byte.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.distributed as dist

from megatron_paradyse.bench import memory as memory_bench
from megatron_paradyse.bench.memory import TRACE_MODELS, TraceConfig, trace_cases
from megatron_paradyse.calibration.measure import measure_layer
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import recurring_least
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore.trace import LayerModel, RankTracer, fake_world
from megatron_paradyse.strategies import ModelShape

P = 2
LENGTH = 256
MODELS = {
    # LayerNorm, MHA, GELU, linear biases, RoPE
    "gpt": LayerModel(
        shape=ModelShape(
            hidden_size=64, num_attention_heads=4, num_query_groups=4, kv_channels=16, ffn_hidden_size=256
        ),
        bias=True,
    ),
    # RMSNorm, GQA (two query heads per key/value head), SwiGLU, RoPE
    "llama": LayerModel(
        shape=ModelShape(
            hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=8, ffn_hidden_size=96, gated_mlp=True
        ),
        normalization="RMSNorm",
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (model, dtype, options): every strategy, the rank-dependent ones (ring, lean) and recompute among them
CELLS = [
    ("gpt", "fp32", ("tp_sp/tp_sp", "ring/lean", "lean/zero3+rc")),
    ("llama", "bf16", ("ulysses/zero3", "ring/zero3+rc", "lean/lean")),
]
KEYS = [(model, dtype, option) for model, dtype, options in CELLS for option in options]
MEMORY_RUNS = 6
"""Real runs per cell at most, the least figures once they recur: gloo's thread may drop a sent buffer a
moment late."""


def _real_then_fake(rank: int, p: int) -> dict:
    from helpers import megatron_harness as H  # megatron-core for the Megatron layer, after the CPU patches

    H.freeze_what_lives_now()
    layout = SequenceLayout.build(LENGTH, p, causal=True)
    real, fake = {}, {}
    groups = [_process_groups()]
    for model, dtype, options in CELLS:
        m, dt = MODELS[model], DTYPES[dtype]
        for text in options:
            option = LayerOption.parse(text)
            measured = measure_layer(
                option, layout, m.shape, dist.group.WORLD, dtype=dt, bias=m.bias, repeats=0, memory_runs=MEMORY_RUNS
            )
            real["run_layer", model, dtype, text] = (measured.saved_bytes, measured.peak_bytes)
        with RankTracer(m, layer="megatron", dtype=dt, fake=False) as tracer:
            for text in options:

                def run(text=text) -> tuple[int, int]:
                    trace = tracer.trace(LayerOption.parse(text), layout)
                    return trace.saved_bytes, trace.peak_bytes

                real["megatron", model, dtype, text] = recurring_least(run, most_runs=MEMORY_RUNS)
        groups.append(_process_groups())
    dist.destroy_process_group()  # the same rank again, alone, on a fake group
    with fake_world(rank, p):
        for model, dtype, options in CELLS:
            for layer in ("run_layer", "megatron"):
                with RankTracer(MODELS[model], layer=layer, dtype=DTYPES[dtype]) as tracer:
                    for text in options:
                        trace = tracer.trace(LayerOption.parse(text), layout)
                        fake[layer, model, dtype, text] = (trace.saved_bytes, trace.peak_bytes)
    return {"real": real, "fake": fake, "process groups": groups}


def _process_groups() -> int:
    """The process groups c10d holds in this process (each gloo one with a TCP loop and two worker threads)."""
    return len(dist.distributed_c10d._world.pg_map)


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(_real_then_fake, P, timeout_s=600)


@pytest.mark.parametrize("layer", ["run_layer", "megatron"])
@pytest.mark.parametrize("key", KEYS, ids=lambda k: "-".join(k))
def test_fake_trace_allocates_what_the_real_ranks_allocate(per_rank, layer, key):
    for rank, results in enumerate(per_rank):
        real, fake = results["real"][(layer, *key)], results["fake"][(layer, *key)]
        assert fake == real, f"rank {rank}: fake (saved, peak) {fake} != real {real}"


def test_a_megatron_tracer_leaves_no_process_group_behind(per_rank):
    """Each real tracer of Megatron's layer sets up Megatron's parallel state (20 process groups): once it
    is closed, the process holds the groups it held before it."""
    for rank, results in enumerate(per_rank):
        assert results["process groups"] == [1] * (len(CELLS) + 1), f"rank {rank}"


def test_traced_rank_is_the_one_the_model_predicts_the_largest_peak_for(monkeypatch):
    """ring and lean attention: the rank of the largest predicted peak (the lowest of equals); others: rank 0."""
    predicted_peaks = [5, 7, 9, 6, 9, 1, 0, 2]
    asked = []

    def layer_terms(option, dims, layout, rank):
        asked.append(option.attention)
        return types.SimpleNamespace(peak_bytes=predicted_peaks[rank])

    monkeypatch.setattr(memory_bench, "layer_terms", layer_terms)
    options = tuple(map(LayerOption.parse, ("tp_sp/zero3", "ring/zero3", "ulysses/lean+rc", "lean/lean+rc")))
    cfg = TraceConfig(
        models={"gpt": TRACE_MODELS["gpt"]},
        p=8,
        lengths=(65536,),
        options=options,
        layer="megatron",
        dtype=torch.bfloat16,
        all_ranks=False,
        batch=1,
    )
    assert [(str(c.option), c.rank) for c in trace_cases(cfg)] == [
        ("tp_sp/zero3", 0),
        ("ring/zero3", 2),
        ("ulysses/lean+rc", 0),
        ("lean/lean+rc", 2),
    ]
    assert set(asked) == {"ring", "lean"}
    all_ranks = trace_cases(dataclasses.replace(cfg, all_ranks=True))
    assert [c.rank for c in all_ranks] == list(range(8)) * len(options)
