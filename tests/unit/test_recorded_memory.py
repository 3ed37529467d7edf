"""A strategy's memory recorded from its code (``strategies/recorded.py``, ``mcore/memory_record.py``): the fit
in the tokens holds beyond the lengths it was made from, code that is not linear is refused, and recording
leaves the process as it was. That the recordings equal every rank's real allocations, to the byte, is
``tests/ranks/test_memory_scripts.py``'s."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.distributed_c10d as c10d

from megatron_paradyse.mcore import memory_record
from megatron_paradyse.strategies import ModelShape, Strategy, registry, strategy_names
from megatron_paradyse.strategies.dims import Dims
from megatron_paradyse.strategies.recorded import RecordingKey, replay

from megatron.core import parallel_state

SHAPE = ModelShape(
    hidden_size=32, num_attention_heads=4, num_query_groups=2, kv_channels=8, ffn_hidden_size=48, gated_mlp=True
)


def _key(name: str, p: int = 2, e: int = 2, bias: bool = True, ahead: bool = False) -> RecordingKey:
    return RecordingKey("mlp", name, SHAPE, p, p, e, 1, bias, ahead, 0)


@pytest.mark.parametrize("name", strategy_names("mlp"))
def test_a_recording_fitted_on_other_lengths_replays_alike(name, monkeypatch):
    """Fitted from 16, 24 and 40 tokens a rank, or from 8, 56 and 96: the same memory at 1000 tokens, also
    with the gradients of a tiled MLP's other tiles held."""
    first = memory_record.record(_key(name, ahead=name.startswith("zero3")))
    monkeypatch.setattr(memory_record, "LENGTHS", (8, 56, 96))
    second = memory_record.record(_key(name, ahead=name.startswith("zero3")))
    for held in ((), (100.0,) * 4):
        d = Dims(SHAPE, 2, 2000, 1, 2, bias=True, mlp_weight_ahead=name.startswith("zero3"), grads_held=bool(held))
        d = dataclasses.replace(d, grads_before=held)
        assert replay(first, d) == replay(second, d)
    if name == "zero3":  # what it keeps at 1000 tokens a rank: x_local, fc1's output, the activation's, in bf16
        assert replay(first, d).saved_bytes == 1000 * (32 + 2 * 48 + 48) * 2


def test_code_whose_memory_is_not_linear_in_the_tokens_is_refused(monkeypatch):
    """An MLP that makes a ``[t, t]`` tensor: a recording cannot serve every length, and says so."""

    def quadratic(x_local, w, ctx):
        scores = x_local.flatten(1) @ x_local.flatten(1).t()  # [t, t], for a moment
        return x_local * scores.sum(1).view(-1, 1, 1)

    monkeypatch.setitem(
        registry._LIBRARY,
        ("mlp", "quadratic"),
        Strategy(name="quadratic", sublayer="mlp", forward=quadratic, terms=None, summary=""),
    )
    with pytest.raises(AssertionError) as refused:
        memory_record.record(_key("quadratic"))
    assert "memory of mlp strategy 'quadratic' at p=2: storage" in str(refused.value)
    assert str(refused.value).endswith("is not linear in the tokens")


def test_recording_leaves_the_process_as_it_was():
    """Megatron's gather buffer (the process's own, a real tensor) and torch.distributed's groups are what
    they were: the recording's fake group and fake buffer were its own."""
    parallel_state._set_global_memory_buffer()
    try:
        buffer = parallel_state.get_global_memory_buffer()
        held = buffer.get_tensor((4, 32), torch.bfloat16, "mpu")
        groups = dict(c10d._world.pg_group_ranks)
        memory_record.record(_key("tp_sp", p=2))
        assert parallel_state.get_global_memory_buffer() is buffer
        assert buffer.get_tensor((4, 32), torch.bfloat16, "mpu").data_ptr() == held.data_ptr()
        assert not isinstance(held, torch._subclasses.fake_tensor.FakeTensor)
        assert dict(c10d._world.pg_group_ranks) == groups
    finally:
        parallel_state.destroy_global_memory_buffer()


def test_a_recording_is_kept_on_disk_and_read_back_alike(tmp_path, monkeypatch):
    """Recorded once per key and code: the second ask reads the file (recording again would fail here)."""
    monkeypatch.setenv("PARADYSE_RECORDINGS", str(tmp_path))
    recorded = memory_record.cached_record(_key("zero3_actrc", e=4))
    monkeypatch.setattr(memory_record, "record", lambda key: pytest.fail("recorded again"))
    assert memory_record.cached_record(_key("zero3_actrc", e=4)) == recorded
    assert len(list(tmp_path.glob("*.json"))) == 1
    other = _key("zero3_actrc", e=2)
    with pytest.raises(pytest.fail.Exception, match="recorded again"):
        memory_record.cached_record(other)
