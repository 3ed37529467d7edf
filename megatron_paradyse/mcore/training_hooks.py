"""Hooks into Megatron's training loop, for the training entry point (:mod:`megatron_paradyse.pretrain_gpt`):
each rebinds one function of ``megatron.training.training`` for the length of its ``with`` block, and with
the CPU shim (:mod:`~megatron_paradyse.mcore.compat`) they are all that the project changes of Megatron.

``train()`` and ``evaluate()`` look these functions up in their module at each call, so a rebinding
takes effect for the next call and is undone on leaving the block, whatever raised.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import NoReturn

import torch

from megatron_paradyse.mcore.step_buffers import leaving_nothing

from megatron.training import training

__all__ = ["after_each_iteration", "around_each_evaluation", "around_each_step", "each_schedule_leaving_nothing"]


@contextlib.contextmanager
def after_each_iteration(callback: Callable[[int, dict], None]) -> Iterator[None]:
    """Call ``callback(iteration, loss_dict)`` after Megatron's ``training_log`` of each iteration."""
    original = training.training_log

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        result = original(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)
        callback(iteration, loss_dict)
        return result

    training.training_log = training_log
    try:
        yield
    finally:
        training.training_log = original


@contextlib.contextmanager
def around_each_evaluation(begin: Callable[[], None], end: Callable[[str], None]) -> Iterator[None]:
    """Call ``begin()`` before each of Megatron's evaluations (validation during and after training, test
    at the end) and ``end(prefix)`` after it has printed its loss (``prefix``: ``iteration N ...``)."""
    original = training.evaluate_and_print_results

    def evaluate_and_print_results(prefix, *args, **kwargs):
        begin()
        result = original(prefix, *args, **kwargs)
        end(prefix)
        return result

    training.evaluate_and_print_results = evaluate_and_print_results
    try:
        yield
    finally:
        training.evaluate_and_print_results = original


@contextlib.contextmanager
def each_schedule_leaving_nothing() -> Iterator[None]:
    """Every pipeline schedule Megatron's training and evaluation run releases what its model chunks keep of
    the step's last micro-batch when it returns (:func:`~megatron_paradyse.mcore.step_buffers.leaving_nothing`):
    the planners budget each step for its own micro-batches. Both look ``get_forward_backward_func`` up in
    their module."""
    original = training.get_forward_backward_func

    def get_forward_backward_func(*args, **kwargs):
        return leaving_nothing(original(*args, **kwargs))

    training.get_forward_backward_func = get_forward_backward_func
    try:
        yield
    finally:
        training.get_forward_backward_func = original


@contextlib.contextmanager
def around_each_step(
    begin: Callable[[dict], None], on_out_of_memory: Callable[[torch.OutOfMemoryError], NoReturn]
) -> Iterator[None]:
    """Call ``begin(arguments)`` (``train_step``'s, by name: the model, the schedule it runs...) before each
    training step, and hand an out-of-memory error raised in it or in the step on this rank (any forward,
    backward, the optimizer step) to ``on_out_of_memory``, which ends the process: unwound, it would leave the
    other ranks blocked in the step's collectives. ``train()`` looks ``train_step`` up in its module."""
    original = training.train_step
    signature = inspect.signature(original)

    def train_step(*args, **kwargs):
        try:
            begin(signature.bind(*args, **kwargs).arguments)
            return original(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            on_out_of_memory(e)

    training.train_step = train_step
    try:
        yield
    finally:
        training.train_step = original
