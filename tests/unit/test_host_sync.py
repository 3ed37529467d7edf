"""No layer copies host data or waits for the device during its forward or backward.

Every strategy pair, with and without recompute, runs Megatron's layer built from the Paradyse spec
(norms, RoPE, bias-dropout-add, the strategies' collectives and attention) on one rank of a fake
process group, with ``meta`` tensors standing in for a GPU's: the host is the CPU, the device is not.
:class:`~megatron_paradyse.core.host_sync.HostSyncs` watches the layer's operators only; the layout's index
tensors reach the device before the layer runs, as the entry point puts them there. The same check on
a GPU, under ``torch.cuda.set_sync_debug_mode("error")``, is in ``tests/gpu/test_gpu_layers.py``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_paradyse.core.host_sync import HostSyncs, watch_host_syncs
from megatron_paradyse.core.layout import LayoutIndices, SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore import compat
from megatron_paradyse.mcore.trace import LayerModel, RankTracer, fake_world
from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.registry import strategy_names

DEVICE = torch.device("meta")
# RMSNorm, GQA, SwiGLU, RoPE: the Llama layer
MODEL = LayerModel(
    shape=ModelShape(
        hidden_size=64, num_attention_heads=8, num_query_groups=4, kv_channels=8, ffn_hidden_size=96, gated_mlp=True
    ),
    normalization="RMSNorm",
)
OPTIONS = [
    LayerOption(attention, mlp, recompute)
    for attention in strategy_names("attention")
    for mlp in strategy_names("mlp")
    for recompute in (False, True)
]
DOCUMENTS = (100, 37, 91)  # packed documents: one attention call per document, padding its own


@pytest.fixture(autouse=True)
def megatron_buffers_on_the_device(monkeypatch):
    """Megatron allocates its communication buffers on ``torch.cuda.current_device()``, which is the
    GPU on a GPU machine: here, the stand-in device (after the CPU patches, which point it at the CPU)."""
    compat.install()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: DEVICE)


def _host_syncs(rank: int, p: int, options: list[LayerOption]) -> dict[str, list[str]]:
    layout = SequenceLayout.build(DOCUMENTS, p, causal=True)
    found = {}
    with fake_world(rank, p), RankTracer(MODEL, layer="megatron", device=DEVICE, fake=False, kernel="math") as tracer:
        for option in options:
            watch = HostSyncs(DEVICE)
            tracer.trace(option, layout, watch=watch)
            found[str(option)] = [str(s) for s in watch.found]
    return found


@pytest.mark.parametrize(("rank", "p"), [(0, 1), (1, 2), (2, 4)])
def test_no_strategy_copies_host_data_or_reads_device_data_on_the_host(rank, p):
    # recompute reruns the same forward: once is enough; the ranks' shares of heads and shards change with p
    options = OPTIONS if p == 2 else [o for o in OPTIONS if not o.recompute]
    found = _host_syncs(rank, p, options)
    assert found.keys() == {str(o) for o in options}
    assert not any(found.values()), {option: syncs for option, syncs in found.items() if syncs}


def test_a_layer_that_copies_its_indices_in_forward_is_caught(monkeypatch):
    """The check above fails when a layer copies the layout's host indices itself, as layers did before
    the entry point put them on the device once per micro-batch."""

    def copy_every_time(layout: SequenceLayout, device) -> LayoutIndices:
        host = (layout.natural_positions, layout.canonical_index, layout.position_ids, layout.cu_seqlens)
        return LayoutIndices(*(t.to(device) for t in host))

    monkeypatch.setattr(SequenceLayout, "indices", copy_every_time)
    found = _host_syncs(1, 2, [LayerOption("ulysses", "zero3")])["ulysses/zero3"]
    assert found, "a host-to-device copy inside the layer went unseen"
    assert all(s.startswith("aten._to_copy.default: copies from cpu to meta") for s in found), found


def test_the_checker_names_reads_of_device_data_and_host_tensors():
    x = torch.empty(4, 3, device=DEVICE)
    with HostSyncs(DEVICE) as watch:
        x.index_select(0, torch.empty(2, dtype=torch.long, device=DEVICE))  # device only: nothing
        x * torch.tensor(2.0)  # a 0-dim host tensor is a number to the kernel: nothing
        with pytest.raises(NotImplementedError):
            x.cpu()  # meta tensors have no data to copy; a GPU would wait for it
        with pytest.raises(NotImplementedError):
            x.nonzero()  # nor can they say how many; a GPU would wait to find out
    assert [s.op for s in watch.found] == ["aten._to_copy.default", "aten.nonzero.default"]
    assert watch.found[0].reason == "copies from meta to cpu"
    assert watch.found[1].reason == "the host reads its result from the device"
    assert watch.found[0].where.startswith(__file__)


def test_watching_on_the_cpu_lists_what_would_wait_for_a_gpu():
    """Without a GPU, :func:`watch_host_syncs` lists the operators whose result the host reads, each with
    where it ran; the device being the host, its copies and reads of host tensors are none."""
    x = torch.arange(6.0)
    with watch_host_syncs(torch.device("cpu")) as syncs:
        y = x * 2 + x.to("cpu", copy=True)
        y[torch.tensor([0, 2])]  # integer indices: the result's shape is theirs, whatever they hold
        y.nonzero()
        y[y > 1]  # a boolean mask: its count sets the shape
        y.sum().item()
        assert syncs == []  # filled when the block ends
    ops = ["aten.nonzero.default", "aten.index.Tensor", "aten._local_scalar_dense.default"]
    assert [s.split(":")[0] for s in syncs] == ops
    assert all(f"the host reads its result from the device (at {__file__}:" in s for s in syncs), syncs
