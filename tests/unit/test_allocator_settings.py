"""The CUDA caching allocator's expandable segments: the entry point turns them on unless the job configures
the allocator, and a job whose settings leave them off is told why its budget may not hold
(``megatron_paradyse.core.allocator``; on an H200 the defaults reserved 1.38x what a run switching lengths
allocated, expandable segments 1.03x)."""

from __future__ import annotations

import os

import pytest

from megatron_paradyse import pretrain_gpt
from megatron_paradyse.core.allocator import expandable_segments_off, prefer_expandable_segments

ON = "expandable_segments:True"


def test_turned_on_unless_the_job_configures_the_allocator():
    environ = {}
    prefer_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": ON}
    for own in ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, {"PYTORCH_ALLOC_CONF": "backend:native"}):
        environ = dict(own)
        prefer_expandable_segments(environ)
        assert environ == own


@pytest.mark.parametrize(
    "environ",
    [
        {"PYTORCH_CUDA_ALLOC_CONF": ON},
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:true"},
        {"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:[256:1,512:2],expandable_segments:True"},
    ],
)
def test_on_is_read_wherever_torch_reads_it(environ):
    assert expandable_segments_off(environ) is None


def test_off_says_which_setting_and_what_to_set():
    tail = (
        " the CUDA caching allocator's expandable segments off: a run switching plans across lengths can then "
        "reserve well over what it allocates (1.38x on an H200, bench allocator), more than memory.margin keeps "
        "free; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or add it to the settings) before the job starts"
    )
    assert expandable_segments_off({}) == "the defaults leave" + tail
    own = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    assert expandable_segments_off(own) == "PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512 leaves" + tail
    both = {"PYTORCH_ALLOC_CONF": ON, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    assert expandable_segments_off(both) == (
        "PYTORCH_ALLOC_CONF=expandable_segments:True and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False leave" + tail
    )


def test_the_entry_point_turns_them_on_before_anything_else(monkeypatch, capsys):
    """Even a run that stops at its config has them set: nothing before that line can initialise CUDA."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # restored after the test, whatever the entry point sets
        monkeypatch.delenv(name)
    assert pretrain_gpt.main(["--num-layers", "2"]) == 2
    assert "--paradyse-config FILE is required" in capsys.readouterr().err
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ON
