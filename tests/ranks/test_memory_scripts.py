"""Every strategy's memory against its own code, on real gloo ranks, every rank, every dtype.

The cost model's memory (:mod:`megatron_paradyse.cost.layer_memory`) is recorded from the MLP strategies'
code under fake tensors (:mod:`megatron_paradyse.strategies.recorded`) and written by hand for the attention
strategies; this is the check that fails when either diverges from what the code allocates for real. One
launch per group size ``p`` in 1..4; every rank runs every cell for real, counts its own allocations with the storage
tracker (:mod:`megatron_paradyse.core.memory`: every storage an operator creates, until it is freed) and
compares them with the scripts for its rank, to the byte:

- attention: ``tp_sp``, ``ulysses``, ``ring``, ``lean`` x causal / bidirectional x one document, one
  padded, three packed x MHA / GQA x fp32 / bf16 (linear biases on every other cell), and fp16 on
  packed GQA (its sizes are bf16's), and two samples per micro-batch on packed MHA: saved bytes, the
  forward's and the backward's high-water marks;
- MLP: ``tp_sp``, ``zero3``, ``lean`` x GELU / SwiGLU x fp32 / bf16 / fp16 x with and without biases;
  ``zero3_actrc`` (fc2's input recomputed in backward) x GELU / SwiGLU x fp32 / bf16 / fp16;
- the MLP's first weight gathered during the attention (``ulysses``, ``ring`` then ``zero3``, p > 1):
  each sublayer on its own in every dtype, the weight the attention hands on counted too, and two
  Megatron layers where that weight sets the layer's peak (and the rebuilt one);
- the whole layer (norms, residuals, recompute): every option, in fp32, bf16 and fp16 in turn, GQA,
  packed documents, with three options of ``zero3_actrc``; and every pair recomputed around its kept
  attention core (``+rc+keepcore``).

Megatron's own layer under the same scripts: ``tests/megatron/test_megatron_layer_memory.py``. The cells and
their measurement: ``tests/helpers/memory_cells.py``.
"""

from __future__ import annotations

import functools

import pytest

from megatron_paradyse.core.multiprocess import run_on_ranks

from helpers.memory_cells import assert_every_rank_allocates_what_the_scripts_say, measure_all, strategy_cells


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"p{p}")
def measured(request):
    p = request.param
    return p, run_on_ranks(functools.partial(measure_all, cells_of=strategy_cells), p, timeout_s=900)


def test_every_rank_allocates_what_the_scripts_say(measured):
    assert_every_rank_allocates_what_the_scripts_say(*measured)
