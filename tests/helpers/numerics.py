"""How far a result is from its reference."""

from __future__ import annotations

import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def assert_same_output_and_gradient(fn, reference, x: torch.Tensor, dy: torch.Tensor) -> None:
    """``fn`` and ``reference`` give ``x`` the same output and, from ``dy``, the same input gradient, bit for bit."""
    results = []
    for f in (fn, reference):
        leaf = x.clone().requires_grad_()
        y = f(leaf)
        y.backward(dy)
        results.append((y.detach(), leaf.grad))
    (y, dx), (y_ref, dx_ref) = results
    assert torch.equal(y, y_ref)
    assert torch.equal(dx, dx_ref)
