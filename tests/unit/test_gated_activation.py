"""The gated MLP activation (``strategies.common.activate``): autograd's gradients to the bit, one tensor kept,
only the input's gradient allocated in backward; another activation refused.

Its memory against the storage tracker, every MLP strategy on gloo ranks: tests/ranks/test_memory_scripts.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_paradyse.core.memory import PeakMemory
from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.common import activate, gated_activation_problem

from helpers.numerics import assert_same_output_and_gradient

SHAPE = ModelShape(
    hidden_size=16, num_attention_heads=2, num_query_groups=2, kv_channels=8, ffn_hidden_size=24, gated_mlp=True
)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu-tanh": functools.partial(F.gelu, approximate="tanh")}


def _autograds(h: torch.Tensor, activation, blocks: int) -> torch.Tensor:
    """What autograd makes of ``activation(gate) * up`` over ``blocks`` ``[gate | up]`` shards."""
    gate, up = h.unflatten(-1, (blocks, 2, -1)).unbind(-2)
    return (activation(gate) * up).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("blocks", [1, 3])
def test_the_gated_activation_gives_autograds_output_and_gradient_to_the_bit(dtype, activation, blocks):
    gen = torch.Generator().manual_seed(blocks)
    h = torch.randn(5, 2, blocks * 2 * 8, generator=gen).to(dtype)
    dy = torch.randn(5, 2, blocks * 8, generator=gen).to(dtype)
    fn, reference = (
        functools.partial(f, activation=ACTIVATIONS[activation], blocks=blocks)
        for f in (functools.partial(activate, shape=SHAPE), _autograds)
    )
    assert_same_output_and_gradient(fn, reference, h, dy)


def test_the_gated_activation_keeps_only_its_input_for_backward():
    kept = []
    h = torch.randn(4, 1, 2 * 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        activate(h * 1, SHAPE, F.silu, blocks=1)  # h * 1: the input is a tensor of the graph, as fc1's output
    assert [t.shape for t in kept] == [h.shape]  # autograd alone would keep activation(gate), up and gate too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_activations_backward_allocates_only_the_inputs_gradient(dtype):
    h = torch.randn(64, 1, 2 * 32).to(dtype).requires_grad_()
    fc1_out = h * 1
    y = activate(fc1_out, SHAPE, F.silu, blocks=2)
    dy = torch.ones_like(y)
    with PeakMemory() as memory:
        (dh,) = torch.autograd.grad(y, fc1_out, dy)
    assert memory.peak_bytes == dh.numel() * dh.element_size()


def test_another_gated_activation_is_refused():
    problem = (
        "a gated MLP with activation 'relu': the gated MLPs run torch's silu (SwiGLU) or gelu, exact or tanh "
        "(GEGLU), whose gradient they compute in place"
    )
    assert gated_activation_problem(F.relu) == problem
    assert gated_activation_problem(functools.partial(F.gelu, approximate="tanh")) is None
    with pytest.raises(ValueError, match=r"^a gated MLP with activation 'relu'"):
        activate(torch.randn(2, 1, 16), SHAPE, F.relu, blocks=1)
