"""Per-layer recompute (offloaded, or keeping the attention core) leaves nothing behind in a Megatron GPT
model: after backward, the bytes still alive are those the same model leaves without recompute (the
gradients), on p=2 gloo ranks. With hidden dropout its rerun draws the forward's masks again: the loss and
every gradient are those of the model without recompute, to the bit.

PyTorch's checkpoint stops a rerun early by default, at the last tensor autograd saved; in a Megatron
layer (custom autograd functions, RoPE) the tensors a stopped rerun had built then outlived the
layer's backward and the step: one layer's activations more for every recomputed layer.
``megatron_paradyse.strategies.recompute`` runs every rerun to its end.
"""

from __future__ import annotations

import time

import pytest

from megatron_paradyse.core.multiprocess import run_on_ranks

P = 2
PAIRINGS = ("tp_sp/tp_sp", "ulysses/zero3", "ring/zero3", "lean/lean")


def _bytes_left_after_backward(rank: int, p: int) -> dict[str, int]:
    from megatron_paradyse.core.memory import PeakMemory, collective_buffers_freed_promptly
    from megatron_paradyse.core.plan import LayerOption, Plan
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from helpers import megatron_harness as H

    H.init_parallel(p)
    config = H.make_config("gpt", p)
    model = H.build_gpt(config, get_paradyse_layer_spec(config))
    batch = H.Batch.make(512, p, seed=0)

    def step(option: LayerOption) -> int:
        with PeakMemory() as memory:
            H.paradyse_loss(model, batch, Plan.uniform(option, H.NUM_LAYERS)).backward()
            time.sleep(0.001)  # the GIL for gloo's worker thread to release the last collective's buffers
            return memory.current_bytes()

    options = [LayerOption.parse(pairing + rc) for pairing in PAIRINGS for rc in ("", "+rc", "+rc+off", "+rc+keepcore")]
    for option in options:  # gradients and the layout's cached tensors exist before the measured runs
        step(option)
    with collective_buffers_freed_promptly():  # as calibration.measure.measure_layer
        return {str(option): min(step(option) for _ in range(2)) for option in options}


def _dropout_gradients(rank: int, p: int) -> dict[str, tuple[float, float]]:
    """(loss, largest gradient difference from the plain option's) of every option, hidden dropout on, the
    random states set alike before each run."""
    import torch

    from megatron_paradyse.core.plan import LayerOption, Plan
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from helpers import megatron_harness as H

    H.init_parallel(p)
    config = H.make_config("gpt", p, hidden_dropout=0.1)
    model = H.build_gpt(config, get_paradyse_layer_spec(config))
    batch = H.Batch.make((37, 60), p, seed=3)
    out = {}
    for pairing in PAIRINGS:
        runs = {}
        for rc in ("", "+rc", "+rc+off", "+rc+keepcore"):
            torch.manual_seed(5)
            model_parallel_cuda_manual_seed(7)
            option = LayerOption.parse(pairing + rc)
            runs[str(option)] = H.backward(model, H.paradyse_loss(model, batch, Plan.uniform(option, H.NUM_LAYERS)))
        plain = runs[pairing]
        for name, run in runs.items():
            worst = max(float((g - plain.grads[k]).abs().max()) for k, g in run.grads.items())
            out[name] = (float(run.loss), worst)
    return out


def _on_rank(rank: int, p: int) -> tuple[dict[str, int], dict[str, tuple[float, float]]]:
    return _bytes_left_after_backward(rank, p), _dropout_gradients(rank, p)


@pytest.fixture(scope="module")
def per_rank():
    return run_on_ranks(_on_rank, P, timeout_s=600)


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_recompute_leaves_what_the_plain_model_leaves(per_rank, pairing):
    for rank, (left, _) in enumerate(per_rank):
        assert left[pairing + "+rc"] == left[pairing], f"rank {rank}"
        assert left[pairing + "+rc+off"] == left[pairing], f"rank {rank}"
        assert left[pairing + "+rc+keepcore"] == left[pairing], f"rank {rank}"  # the kept core freed too


@pytest.mark.parametrize("pairing", PAIRINGS)
def test_recompute_with_hidden_dropout_gives_the_plain_gradients(per_rank, pairing):
    for rank, (_, runs) in enumerate(per_rank):
        plain_loss, _ = runs[pairing]
        for rc in ("+rc", "+rc+off", "+rc+keepcore"):
            assert runs[pairing + rc] == (plain_loss, 0.0), f"rank {rank}, {pairing + rc}"
