"""Rank processes start from the fork server's preloaded imports (``helpers.rank_imports``).

The fork server ignores an import error in its preload and then forks ranks that import torch and
megatron-core each on their own: every launch slower, and a rank that imports ``megatron.core`` before
the CPU patches fails far from the cause. This test names the cause.
"""

from __future__ import annotations

import sys

from megatron_paradyse.core.multiprocess import run_on_ranks


def _preloaded(rank: int, world_size: int) -> bool:
    return "helpers.rank_imports" in sys.modules


def test_ranks_start_with_the_preloaded_imports():
    assert run_on_ranks(_preloaded, 2, timeout_s=120) == [True, True]
