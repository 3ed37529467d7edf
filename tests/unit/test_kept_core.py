"""A recompute that keeps the attention core (``+rc+keepcore``): the option's text, and the mechanism
(``attention.kept``) on one process: the core runs once, its backward reads the forward's results, the
gradients are those of the function not recomputed. Every strategy on gloo ranks:
``tests/ranks/test_strategies.py``; the memory: ``tests/ranks/test_memory_scripts.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_paradyse.attention import get_kernel, segment_attention
from megatron_paradyse.attention.kept import KeptCores
from megatron_paradyse.core.layout import Segment
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.strategies.recompute import recompute


def test_the_option_is_written_after_recompute_and_needs_it():
    option = LayerOption("ulysses", "zero3", True, keep_core=True)
    assert str(option) == "ulysses/zero3+rc+keepcore"
    assert LayerOption.parse("ring/lean+tile512+rc+keepcore") == LayerOption("ring", "lean", True, False, 512, True)
    with pytest.raises(ValueError, match=r"^a layer option reads .* got 'ring/zero3\+keepcore'$"):
        LayerOption.parse("ring/zero3+keepcore")
    with pytest.raises(
        ValueError,
        match=r"^ring/zero3: keeping the attention core spares its rerun in a recomputed layer; it needs recompute "
        r"\(write 'ring/zero3\+rc\+keepcore'\)$",
    ):
        LayerOption("ring", "zero3", keep_core=True)
    offloaded = LayerOption.parse("ring/zero3+rc+keepcore+off")  # the input in host memory, the core not
    assert offloaded == LayerOption("ring", "zero3", True, True, keep_core=True)
    assert str(offloaded) == "ring/zero3+rc+keepcore+off"


class _Counted:
    """The CPU kernel, counting its forward calls."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.kernel = get_kernel("torch", torch.device("cpu"), dtype)
        self.forwards = 0

    def forward(self, *args):
        self.forwards += 1
        return self.kernel.forward(*args)

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _attention(x: torch.Tensor, w: torch.Tensor, kernel: _Counted) -> torch.Tensor:
    """``x [b, n, s, d]`` projected to q, k, v, causal attention over two documents, then squared."""
    q, k, v = ((x @ w[i]).contiguous() for i in range(3))
    segments = (Segment(0, 5, 0, 5, True), Segment(5, 12, 5, 12, True))
    return segment_attention(q, k, v, segments, 0.5, kernel).square()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_kept_core_runs_once_and_gives_the_gradients_of_the_function_not_recomputed(dtype):
    x0 = torch.randn(2, 3, 12, 8).to(dtype)
    w0 = torch.randn(3, 8, 8).to(dtype)
    results = {}
    for run in ("plain", "rc", "keepcore"):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        kernel = _Counted(dtype)
        if run == "plain":
            y = _attention(x, w, kernel)
        else:
            y = recompute(_attention, x, w, kernel, keep_core=run == "keepcore")
        y.sum().backward()
        results[run] = (kernel.forwards, y.detach(), x.grad, w.grad)
    assert [results[run][0] for run in ("plain", "rc", "keepcore")] == [2, 4, 2]  # a call per document
    for run in ("rc", "keepcore"):
        assert all(map(torch.equal, results[run][1:], results["plain"][1:])), run


def test_a_rerun_that_calls_other_cores_than_its_forward_is_an_error():
    kernel = _Counted(torch.float32)
    calls = []

    def once(x: torch.Tensor) -> torch.Tensor:  # the attention on the first run only
        calls.append(x)
        return _attention(x, torch.eye(8).expand(3, 8, 8), kernel) if len(calls) == 1 else x.square()

    kept = KeptCores()
    kept.run(once, torch.randn(2, 3, 12, 8))
    with pytest.raises(RuntimeError, match=r"^a layer's rerun called 1 attention core\(s\) fewer than its forward"):
        kept.run(once, torch.randn(2, 3, 12, 8))
