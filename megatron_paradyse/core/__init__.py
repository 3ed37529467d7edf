"""What every strategy shares: the token layout, the collectives, the plan and the micro-batch it runs on,
the dtype sums are kept in, the measuring of memory and host syncs, and megatron-core on a machine
without CUDA."""
