"""What a rank's death rests on (megatron_paradyse.run.fault): the processes a rank forks die with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from helpers.paths import ROOT
from helpers.processes import running


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
