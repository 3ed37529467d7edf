"""megatron-paradyse: per-micro-batch, per-layer parallel-strategy switching for Megatron-Core.

Importing the package touches no device, file, environment variable or logger configuration.
"""

__version__ = "0.1.0"
