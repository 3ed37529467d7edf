"""The Megatron-Core adapter: Megatron modules that run the plan's strategies, the norms and the layer
specs, Megatron's linears around bare shards, its indexed datasets, the static memory of a stage, the
drop-in planner for jobs that do not know the plans, the CPU shim and the hooks into Megatron's
training loop.

The only package (with the training entry points and the benchmarks) that imports megatron-core: it
installs the CPU shim (:mod:`~megatron_paradyse.mcore.compat`) on import, before any of its modules
imports megatron-core, so they import it at module level. A module outside it that imports
megatron-core imports this package (or one of its modules) first, at module level too
(docs/architecture.md, "Which package may import which").
"""

from megatron_paradyse.mcore import compat

compat.install()

from megatron_paradyse.mcore import memory_record  # noqa: E402, F401  (installs the strategies' memory recorder)
