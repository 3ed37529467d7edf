"""Measuring on the machine: kernels, collectives and whole layers timed into a cost profile
(:mod:`~megatron_paradyse.calibration.calibrate`; at a job's start-up,
:mod:`~megatron_paradyse.calibration.startup`), one layer's measured time and memory
(:mod:`~megatron_paradyse.calibration.measure`), and the memory trace of a layer at any shape on one
process standing in for one rank (:mod:`~megatron_paradyse.mcore.trace`).

Above the Megatron adapter: a whole layer runs ``tp_sp`` through Megatron's own linears.
"""
