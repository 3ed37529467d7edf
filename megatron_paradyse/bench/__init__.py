"""Benchmarks: ``python -m megatron_paradyse.bench <name> [options]`` runs ``bench/<name>.py``'s ``main``.

Each prints a table to stdout and, as its last line, its headline figures as ``key=value`` pairs.
"""
