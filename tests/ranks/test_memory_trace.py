"""The one-rank memory trace (:mod:`megatron_paradyse.mcore.trace`) against real ranks, and the commands
built on it: ``bench memory --trace`` and ``bench allocator`` (its CUDA run skipped without a GPU).

A fake trace must allocate what the real run allocates: on the same 2 gloo ranks, each rank first
measures every cell for real (``cost.measure.measure_layer`` for ``run_layer``; the same tracer with
real tensors for Megatron's layer), then leaves the gloo group and traces the same cells as the same
rank of a fake group under ``FakeTensorMode``. Saved and peak bytes must be equal to the byte.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types

import pytest
import torch
import torch.distributed as dist

from megatron_paradyse.bench import memory as memory_bench
from megatron_paradyse.bench.memory import TRACE_MODELS, TraceConfig, trace_cases
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import recurring_least
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.measure import measure_layer
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.mcore.trace import LayerModel, RankTracer, fake_world
from megatron_paradyse.strategies import ModelShape

from helpers.paths import ROOT

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
    dist.destroy_process_group()  # the same rank again, alone, on a fake group
    with fake_world(rank, p):
        for model, dtype, options in CELLS:
            for layer in ("run_layer", "megatron"):
                with RankTracer(MODELS[model], layer=layer, dtype=DTYPES[dtype]) as tracer:
                    for text in options:
                        trace = tracer.trace(LayerOption.parse(text), layout)
                        fake[layer, model, dtype, text] = (trace.saved_bytes, trace.peak_bytes)
    return {"real": real, "fake": fake}


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(_real_then_fake, P, timeout_s=600)


@pytest.mark.parametrize("layer", ["run_layer", "megatron"])
@pytest.mark.parametrize("key", KEYS, ids=lambda k: "-".join(k))
def test_fake_trace_allocates_what_the_real_ranks_allocate(per_rank, layer, key):
    for rank, results in enumerate(per_rank):
        real, fake = results["real"][(layer, *key)], results["fake"][(layer, *key)]
        assert fake == real, f"rank {rank}: fake (saved, peak) {fake} != real {real}"


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


def _last_line_figures(stdout: str) -> dict[str, str]:
    return dict(pair.split("=") for pair in stdout.strip().splitlines()[-1].split())


def test_bench_memory_trace_prints_its_table_and_last_line(tmp_path):
    out = tmp_path / "trace.json"
    options = "tp_sp/tp_sp,ring/zero3+rc"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_paradyse.bench", "memory", "--trace", "--models", "llama3-8b"]
        + ["--lengths", "4096", "--options", options, "--events", "--json", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    lines = run.stdout.strip().splitlines()
    assert re.fullmatch(r"traced_mem_err_max=\d+\.\d\d traced_cases=2", lines[-1]), lines[-1]
    table = [line for line in lines if line.startswith("llama3-8b ")]
    assert [line.split()[2] for line in table] == options.split(",")
    assert lines[-2].startswith("# saved-bytes error: max |err| ")
    assert "[2/2]" in run.stderr  # progress

    rows = json.loads(out.read_text())["rows"]
    figures = _last_line_figures(run.stdout)
    assert figures["traced_mem_err_max"] == f"{max(abs(r['peak_err_pct']) for r in rows):.2f}"
    tp_sp, recomputed = rows
    # a recomputed layer keeps its output only: one [s/p, b, h] bf16 activation
    assert recomputed["traced_saved_bytes"] == 4096 // 8 * 4096 * 2
    assert tp_sp["traced_peak_bytes"] > tp_sp["traced_saved_bytes"] > recomputed["traced_saved_bytes"]
    for row in rows:  # the events account for the figures
        assert sum(e["nbytes"] for e in row["alive_at_peak"]) == row["traced_peak_bytes"]
        assert row["events"][row["forward_events"] - 1]["live"] == row["traced_saved_bytes"]
    layout = SequenceLayout.build(4096, 8, causal=True)
    dims = TRACE_MODELS["llama3-8b"].dims("megatron", 8, layout, 1, torch.bfloat16)
    predicted = layer_terms(LayerOption.parse("ring/zero3+rc"), dims, layout, recomputed["rank"])
    assert recomputed["predicted_peak_bytes"] == predicted.peak_bytes


def test_bench_allocator_runs_each_allocator_setting_in_a_child(tmp_path):
    """On CPU the command runs its children and its tables with the tracker's figures only."""
    out = tmp_path / "allocator.json"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_paradyse.bench", "allocator", "--device", "cpu", "--model", "tiny"]
        + ["--lengths", "64", "--options", "tp_sp/tp_sp,ulysses/lean+rc", "--sequence", "64,32", "--json", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    figures = _last_line_figures(run.stdout)
    assert figures["cases"] == "2" and figures["oom"] == "0" and figures["longest"] == "64"
    assert figures["alloc_err_max"] == figures["slack"] == "nan"  # no CUDA allocator on CPU
    results = json.loads(out.read_text())["results"]
    assert results["default"]["alloc_conf"] is None
    assert results["expandable"]["alloc_conf"] == "expandable_segments:True"
    for setting in results.values():
        assert [r["length"] for r in setting["sequence"]] == [64, 32]
        assert all(r["traced_peak_bytes"] > 0 for r in setting["sweep"] + setting["sequence"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA allocator needs a CUDA device")
def test_bench_allocator_on_a_gpu(tmp_path):
    out = tmp_path / "allocator.json"
    run = subprocess.run(
        [sys.executable, "-m", "megatron_paradyse.bench", "allocator", "--lengths", "4096,8192"]
        + ["--options", "tp_sp/tp_sp,lean/lean+rc", "--sequence", "8192,4096", "--json", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    figures = _last_line_figures(run.stdout)
    assert figures["cases"] == "4" and figures["longest"] == "8192"
    assert float(figures["slack"]) >= 1.0 and float(figures["expandable_slack"]) >= 1.0
    for row in json.loads(out.read_text())["results"]["default"]["sweep"]:
        # the allocator rounds every block up (to 512 B at least) and reserves whole segments; what it
        # reserved can grow less than what it allocated where its cache held free blocks at the start
        # (on an H200: 394 MB more reserved, 414 MB more allocated), so reserved holds allocated in total
        assert row["allocated_peak_bytes"] >= row["traced_peak_bytes"] > 0
        held = row["held_reserved_bytes"] - row["held_allocated_bytes"]
        assert row["reserved_peak_bytes"] + held >= row["allocated_peak_bytes"]
