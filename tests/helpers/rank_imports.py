"""What the tests' rank processes import before they are forked (``tests/conftest.py`` preloads it into
multiprocessing's fork server): torch, megatron-core on the CPU, and the package's layers."""

from megatron_paradyse import cost, planner, strategies  # noqa: F401
from megatron_paradyse.mcore import modules  # noqa: F401

from helpers import megatron_harness  # noqa: F401 - compat.install(), then megatron-core
