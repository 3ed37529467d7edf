"""The shipped presets (and the GPU runs' configs in scripts/gpu): Megatron accepts their flags, the library
can run their models, and the paper presets hold the paper's setting (ParaDySe, Table 4 and section 7)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_paradyse.config import load_config
from megatron_paradyse.planner import layer_options
from megatron_paradyse.run.config_cli import model_shape_from_args
from megatron_paradyse.run.megatron_flags import parse_megatron_args

from helpers.paths import ROOT

PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
GPU_RUNS = sorted((ROOT / "scripts" / "gpu").glob("*.yaml"))


def _load(path: Path):
    config = load_config(path)
    return config, parse_megatron_args(config.megatron_args)


@pytest.mark.parametrize("preset", PRESETS + GPU_RUNS, ids=lambda p: p.name)
def test_megatron_accepts_the_flags_and_every_strategy_can_run_the_model(preset):
    config, args = _load(preset)
    shape = model_shape_from_args(args)
    _, excluded = layer_options(config.planner, shape, args.tensor_model_parallel_size)
    assert excluded == {}
    if args.seq_length is not None:  # the longest micro-batch Megatron is told about (RoPE table)
        assert args.seq_length >= (config.data.token_budget or config.data.max_len)
        assert args.max_position_embeddings >= args.seq_length


PAPER = {  # Table 4: h, n, layers trained on the node; BERT is bidirectional
    "paper-bert.yaml": (1024, 16, 24, "bidirectional"),
    "paper-llama.yaml": (8192, 64, 8, "causal"),
    "paper-gpt.yaml": (12288, 96, 8, "causal"),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_presets_hold_the_papers_setting(name):
    config, args = _load(next(p for p in PRESETS if p.name == name))
    h, n, layers, mask = PAPER[name]
    assert (args.hidden_size, args.num_attention_heads, args.num_layers, config.attention_mask) == (h, n, layers, mask)
    assert (args.ffn_hidden_size, args.swiglu, args.group_query_attention) == (4 * h, False, False)  # Eqs. 1-4
    assert (args.tensor_model_parallel_size, args.micro_batch_size, args.global_batch_size) == (8, 1, 1)
    planner = config.planner
    assert planner.space.pairs == ("tp_sp/tp_sp", "ring/zero3", "ulysses/zero3", "lean/lean")
    assert (planner.space.recompute, planner.cache.hysteresis) == (False, 0.05)
    assert (config.data.sampler, config.data.token_budget, config.data.max_len) == ("curriculum", None, 624 * 1024)
