"""What a micro-batch on a sub-group of the ranks holding the weights may not be, refused before any work
with a message that says why (the runs themselves: ``tests/ranks/test_subgroups.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.cost.layer_memory import sublayer_memory
from megatron_paradyse.cost.terms import sublayer_terms
from megatron_paradyse.strategies import MLPContext, MLPWeights, ModelShape, Strategy, register, run_mlp
from megatron_paradyse.strategies.dims import Dims

SHAPE = ModelShape(hidden_size=32, num_attention_heads=4, num_query_groups=4, kv_channels=8, ffn_hidden_size=48)


class _Ranks:
    """A stand-in process group: its size is all the checks read."""

    def __init__(self, size: int):
        self._size = size

    def size(self) -> int:
        return self._size


def test_a_group_that_does_not_divide_the_shards_ranks_is_refused():
    ctx = MLPContext(group=_Ranks(3), shape=SHAPE, activation=F.gelu, weight_group=_Ranks(4))
    weights = MLPWeights(fc1=torch.zeros(12, 32), fc2=torch.zeros(32, 12))
    with pytest.raises(ValueError) as refused:
        run_mlp("zero3", torch.zeros(6, 1, 32), weights, ctx)
    assert str(refused.value) == (
        "a micro-batch on 3 ranks cannot be a sub-group of the 4 holding the weights' TP shards: its size must divide 4"
    )


def test_time_and_scripted_memory_on_a_subgroup_are_refused_not_guessed():
    layout = SequenceLayout.build(64, 2, causal=True)
    d = Dims(SHAPE, 2, layout.padded_len, 1, 2, shards=4)
    with pytest.raises(ValueError) as terms:
        sublayer_terms("mlp", "zero3", d, layout)
    assert str(terms.value) == (
        "the time of mlp strategy 'zero3' on a sub-group of 2 of the 4 ranks holding its shards is not modelled: "
        "its collectives' prices need the sub-group's rates"
    )
    with pytest.raises(ValueError) as memory:
        sublayer_memory("attention", "ulysses", d, layout)
    assert str(memory.value) == (
        "the memory of attention strategy 'ulysses' on a sub-group of the shards' ranks is not modelled: only a "
        "strategy recorded from its code (every MLP strategy) is priced there"
    )
    with pytest.raises(ValueError, match=r"^Dims\(shards=6\): a sub-group of p=4 ranks must divide it$"):
        Dims(SHAPE, 4, 64, 1, 2, shards=6)


def test_an_attention_strategy_without_a_memory_script_is_not_registered():
    with pytest.raises(ValueError) as refused:
        register(Strategy(name="mine", sublayer="attention", forward=None, terms=None, summary=""))
    assert str(refused.value) == (
        "attention strategy 'mine' gives no memory script: only an MLP strategy's memory is recorded from its "
        "code (strategies/recorded.py); write one from attention_allocations.py"
    )
