"""Megatron's layer as training runs it (``megatron_paradyse.spec``: LayerNorm or RMSNorm, RoPE, no biases)
against the memory scripts of its options, on real gloo ranks, every rank, to the byte (the strategies'
own sublayers and layers: ``tests/ranks/test_memory_scripts.py``; the cells: ``tests/helpers/memory_cells.py``):

- bf16: options with every attention and MLP strategy, recompute among them;
- with q/k norms (``qk_layernorm``: MHA, where the norms keep views of the projection, and GQA, where the q
  norm keeps q's copy) under every attention strategy, in fp32, bf16 and fp16, one and packed documents;
- recomputed around a kept attention core (``ring``'s, ``lean``'s per head group), with q/k norms;
- where the MLP's first weight, gathered during the attention, sets the layer's peak (and the rebuilt
  one's);
- with hidden dropout (its masks; each sublayer's backward from a gradient only autograd holds, dead once
  used), every attention and MLP strategy, with and without recompute, in fp32, bf16 and fp16 (one cell
  with biases).
"""

from __future__ import annotations

import functools

import pytest

from megatron_paradyse.core.multiprocess import run_on_ranks

from helpers.memory_cells import assert_every_rank_allocates_what_the_scripts_say, measure_all, megatron_cells


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"p{p}")
def measured(request):
    p = request.param
    return p, run_on_ranks(functools.partial(measure_all, cells_of=megatron_cells), p, timeout_s=900)


def test_megatrons_layer_allocates_what_the_scripts_say_on_every_rank(measured):
    assert_every_rank_allocates_what_the_scripts_say(*measured)
