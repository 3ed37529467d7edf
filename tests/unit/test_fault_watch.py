"""What a rank's death rests on (megatron_paradyse.run.fault): rank 0 hearing a rank fall silent, and the
processes a rank forks dying with it. tests/e2e/test_dead_rank.py kills ranks of the entry point."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from megatron_paradyse.run.fault import _LEFT, _SILENT_S, _Silence

from helpers.paths import ROOT
from helpers.processes import running


def test_rank_0_takes_a_rank_for_dead_once_its_beat_stood_still_for_the_silence_by_its_own_clock():
    silence = _Silence(range(1, 4), now=100.0)
    assert silence.gone([b"1", b"1", b"1"], now=101.0) == []  # the first beats
    assert silence.gone([b"1", b"1", b"1"], now=101.0 + _SILENT_S - 0.1) == []
    assert silence.gone([b"1", b"1", b"1"], now=101.0 + _SILENT_S) == [1, 2, 3]
    # Rank 0 itself held up for 15 s: every beat moved meanwhile, and none is gone.
    assert silence.gone([b"9", b"9", b"9"], now=120.0) == []
    # Rank 2 left (its watch closed at the end of training): its silence is no death; rank 3's is.
    assert silence.gone([b"10", _LEFT, b"9"], now=120.0 + _SILENT_S) == [3]


def test_children_forked_from_the_main_thread_die_with_the_process_and_others_outlive_their_thread(tmp_path):
    """A child forked by another thread is left alone: the kernel would kill it when that thread ends."""
    script = textwrap.dedent("""
        import multiprocessing, os, signal, threading, time
        from megatron_paradyse.run.fault import children_die_with_this_process

        children_die_with_this_process()
        fork = multiprocessing.get_context("fork")
        by_main = fork.Process(target=time.sleep, args=(60,))
        by_main.start()
        by_thread = fork.Process(target=time.sleep, args=(60,))
        thread = threading.Thread(target=by_thread.start)
        thread.start()
        thread.join()
        time.sleep(0.5)
        print(by_main.pid, by_thread.pid, by_thread.is_alive(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    out = tmp_path / "out"  # a file, not a pipe: the children hold it open
    with out.open("w") as file:
        result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, stdout=file, stderr=file, timeout=120)
    assert result.returncode == -signal.SIGKILL, out.read_text()[-3000:]
    by_main, by_thread, thread_child_alive = out.read_text().split()
    try:
        assert thread_child_alive == "True"
        deadline = time.monotonic() + 5
        while running(int(by_main)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not running(int(by_main))
    finally:
        for pid in (int(by_main), int(by_thread)):
            if running(pid):
                os.kill(pid, signal.SIGKILL)
