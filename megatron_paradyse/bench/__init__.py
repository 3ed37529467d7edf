"""Benchmarks: ``python -m megatron_paradyse.bench <name> [options]`` runs ``bench/<name>.py``'s ``main``.

Each prints a table to stdout and, as its last line, its headline figures as ``key=value`` pairs.
"""

import megatron_paradyse.mcore  # noqa: F401  (records the strategies' memory from their code)
