"""The plan context: scoping, nesting, threads, and its checks (single process, no Megatron)."""

from __future__ import annotations

import threading

import pytest

from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.micro_batch import MicroBatch, current_micro_batch, micro_batch_scope
from megatron_paradyse.core.plan import Plan


def micro_batch(doc_length: int, options: list[str]) -> MicroBatch:
    return MicroBatch(layout=SequenceLayout.build(doc_length, 2, causal=True), plan=Plan.from_options(options))


def test_scope_makes_a_micro_batch_current_and_nested_scopes_restore_the_outer_one():
    outer, inner = micro_batch(10, ["tp_sp/tp_sp"]), micro_batch(20, ["ring/zero3+rc"])
    with micro_batch_scope(outer):
        assert current_micro_batch() is outer
        with micro_batch_scope(inner):
            assert current_micro_batch() is inner
        assert current_micro_batch() is outer
    with pytest.raises(RuntimeError, match="a Paradyse layer ran outside micro_batch_scope"):
        current_micro_batch()


def test_scope_is_restored_when_the_model_raises():
    with pytest.raises(KeyError), micro_batch_scope(micro_batch(10, ["tp_sp/tp_sp"])):
        raise KeyError("the model failed")
    with pytest.raises(RuntimeError):
        current_micro_batch()


def test_other_threads_do_not_see_the_scope():
    seen = []

    def look():
        try:
            seen.append(current_micro_batch())
        except RuntimeError:
            seen.append(None)

    with micro_batch_scope(micro_batch(10, ["tp_sp/tp_sp"])):
        thread = threading.Thread(target=look)
        thread.start()
        thread.join()
    assert seen == [None]


def test_option_checks_the_plan_covers_the_stage():
    step = micro_batch(10, ["tp_sp/tp_sp", "ring/zero3+rc"])
    assert str(step.option(1, stage_layers=2)) == "ring/zero3+rc"
    with pytest.raises(ValueError, match=r"the plan has 2 layer options, but this pipeline stage has 3"):
        step.option(0, stage_layers=3)


def test_micro_batch_rejects_what_is_not_a_layout_or_plan():
    layout = SequenceLayout.build(10, 2, causal=True)
    with pytest.raises(ValueError, match="MicroBatch.plan must be a Plan, got list"):
        MicroBatch(layout=layout, plan=["tp_sp/tp_sp"])
    with pytest.raises(ValueError, match="MicroBatch.layout must be a SequenceLayout, got int"):
        MicroBatch(layout=10, plan=Plan.from_options(["tp_sp/tp_sp"]))
    with pytest.raises(ValueError, match="micro_batch_scope takes a MicroBatch, got Plan"):
        with micro_batch_scope(Plan.from_options(["tp_sp/tp_sp"])):
            pass
