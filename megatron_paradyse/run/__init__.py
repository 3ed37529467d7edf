"""A training job: its arguments, Megatron's ``pretrain()`` around the planned data, start-up agreement,
out-of-memory recovery, logging, and the ``paradyse`` sub-commands."""
