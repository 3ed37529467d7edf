"""What the tests' rank processes import before they are forked (``tests/conftest.py`` preloads it into
multiprocessing's fork server): megatron-core on the CPU, torch, the package's layers, and the entry point
with Megatron's training loop (``helpers.job_ranks`` forks whole jobs' ranks).

The fork server swallows an import error here and forks ranks that import everything again, so
``tests/ranks/test_rank_launch.py`` checks that a rank starts with this module loaded.
"""

from megatron_paradyse.mcore import compat

compat.install()  # before anything below imports megatron.core

from megatron_paradyse import cost, planner, pretrain_gpt, strategies  # noqa: E402, F401
from megatron_paradyse.mcore import modules  # noqa: E402, F401
from megatron_paradyse.run import job, training  # noqa: E402, F401

from megatron.training import training as megatron_training  # noqa: E402, F401

from helpers import megatron_harness  # noqa: E402, F401
