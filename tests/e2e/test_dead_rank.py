"""A rank that dies without a word (SIGKILL) stops every other rank within seconds, with one line naming it,
and takes the processes it started along (megatron_paradyse.run.fault).

Two gloo ranks (TP=2) run the entry point, started by :mod:`helpers.job_ranks`: as ``srun`` without
``--kill-on-bad-exit``, nothing there ends a rank when another exits. In iteration 2 each rank starts
a child process, as Megatron starts a checkpoint writer, then one rank kills itself: rank 1, whose silence
rank 0 hears, or rank 0, whose store goes with it (torch's store client logs the lost connection first, a
C++ warning no setting of the running process silences: the rank's line comes last).
"""

from __future__ import annotations

import pytest

from megatron_paradyse.run.fault import PEER_EXIT_CODE

from helpers.entry_point import SMALL_GPT, small_job_config
from helpers.injections import Injection
from helpers.job_ranks import launch

FLAGS = [*SMALL_GPT, "--tensor-model-parallel-size", "2", "--global-batch-size", "1", "--train-iters", "4"]
STOP_S = 15.0
"""How long after the death the other rank may take to exit: rank 0 waits for 10 s of silence."""
LINES = {
    1: "paradyse: error: rank 1 stopped without a word (no heartbeat for 10 s); every rank stops",
    0: "paradyse: error: rank 0 stopped without a word (the store it hosted closed); every rank stops",
}


@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_that_dies_without_a_word_stops_the_others_and_its_children(tmp_path, cache_p2, dead):
    config = small_job_config(tmp_path / "cfg.yaml", cache_p2)
    out, marker = tmp_path / "ranks", tmp_path / "killed-at"
    program = ["-m", "megatron_paradyse.pretrain_gpt", "--paradyse-config", str(config), *FLAGS]
    job = launch(2, program, out, before=Injection("death", dead, 2, marker, out))
    children = [int(path.read_text()) for path in out.glob("child*.pid")]
    assert len(children) == 2, children
    assert not job.left, f"processes the ranks started still run after them: {job.left} (children: {children})"
    survivor = 1 - dead
    err = job.ranks[survivor].err
    assert job.codes[dead] == -9, job.output()
    assert job.codes[survivor] == PEER_EXIT_CODE, err[-3000:]
    delay = job.ranks[survivor].at - float(marker.read_text())
    assert delay < STOP_S, f"rank {survivor} exited {delay:.1f} s after rank {dead} died"
    assert [line for line in err.splitlines() if line.startswith("paradyse:")] == [LINES[dead]], err[-3000:]
    assert err.endswith(LINES[dead] + "\n"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
