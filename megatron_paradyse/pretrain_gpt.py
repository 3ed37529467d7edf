"""Train a GPT with Megatron's own ``pretrain()``, the Paradyse layers and a plan for every micro-batch.

    torchrun --nproc-per-node 8 -m megatron_paradyse.pretrain_gpt --paradyse-config cfg.yaml \\
        --tensor-model-parallel-size 4 --num-layers 24 --hidden-size 2048 ...   # any Megatron flag

(also ``paradyse-pretrain-gpt``, and Megatron-LM's ``pretrain_gpt.py --paradyse-config`` with the patch
in ``patches/``). Megatron's flags come from three places, later ones winning: the defaults this entry
point needs (:func:`~megatron_paradyse.run.job.entry_defaults`), the config's ``megatron_args``, the command line.

Around ``pretrain()``:

- the model is Megatron's GPT with :func:`megatron_paradyse.spec.get_paradyse_layer_spec`, causal or
  bidirectional as the config's ``attention_mask`` says (the data's canonical order follows it);
- the data is an external iterator (:class:`~megatron_paradyse.run.planned_loader.PlannedMicroBatches`):
  every rank builds its micro-batches itself (one document, or a packing, per micro-batch:
  ``--micro-batch-size 1``), in the canonical order, without an attention mask; lengths vary from one
  micro-batch to the next (``variable_seq_lengths``), the loss is normalised by the tokens of the
  global batch (``--calculate-per-token-loss``), and ``--seq-length`` is the longest micro-batch;
- each pipeline stage has a planner, priced by the cost profile (``cost.profile``, or a quick
  calibration at start-up by the tensor-parallel groups on themselves, rank 0's shared) within the
  memory budget; all ranks check at start-up that they plan from the same inputs;
- before the first optimizer step (``memory.preflight``; on by default on GPUs), every rank runs forward and
  backward of the micro-batches the data will put at the highest predicted peak, measures their peaks and
  keeps the budget, or shrinks it by what they exceed their predictions by, with one line
  (:mod:`~megatron_paradyse.run.preflight`);
- ``--eval-iters N`` (with ``--eval-interval``, and ``--split`` for the shares) holds documents out
  for validation (and test): Megatron evaluates on them, forward only, under plans priced for
  forward-only passes; each evaluation runs the same micro-batches, and the last rank prints one line
  on them after Megatron's loss line;
- the data loader's position is saved with every Megatron checkpoint and restored on ``--load``; a
  checkpoint of Megatron's own ``pretrain_gpt`` (same model and layout) loads too, without
  ``--finetune``: its model, optimizer state and iteration count continue, the data starts from its
  beginning (one line says so);
- after each iteration, the last rank (which holds the loss) prints one row per micro-batch: its
  length, plan, predicted and measured time and peak (every ``--log-interval`` iterations, as
  Megatron's own line), and writes the iteration's figures and plans to Megatron's TensorBoard and
  W&B writers (``--tensorboard-dir``, ``--wandb-project``; tags under ``paradyse/``), with JSONL and a
  plot on request (``log`` section). Megatron's own logging is unchanged: its train loop has no
  callback, so the entry point wraps ``training_log`` (called once per iteration on every rank),
  calls it unchanged, then logs;
- an out-of-memory error in a training step, on any rank (any forward, backward or the optimizer
  step: the entry point wraps Megatron's ``train_step``), stops every rank at once with exit code 3
  and the memory budget shrunk (``memory.oom_shrink``) and saved in the ``--save`` directory; a
  relaunch with ``--load`` (``torchrun --max-restarts`` does it) re-plans under it and re-runs the
  step from the last checkpoint, up to ``memory.oom_retries`` times per iteration
  (:mod:`megatron_paradyse.run.fault`);
- a rank that dies without a word (killed, crashed) during training stops every other rank within
  seconds, with exit code 4 and one line naming it (rank 0 hears every other rank's heartbeat; the
  others hear rank 0 go through the store it hosts); the processes a rank forks die with it.

Configuration errors print ``paradyse: error: ...`` and return 2 before Megatron starts, a flag
Megatron's parser refuses included (one line, not its usage: :mod:`~megatron_paradyse.run.megatron_flags`).
A rank of several that fails at start-up (its config, its flags, cost profile or dataset) stops every
rank within seconds: the ranks join the default process group first and agree
(:mod:`megatron_paradyse.run.startup`); rank 0 prints the one message, naming the rank and the cause.
Errors every rank meets alike later are printed by rank 0 alone too.

The modules that import ``megatron.training`` (:mod:`~megatron_paradyse.run.job`, the training run and
hooks) are imported inside the functions, after :func:`main` has made the CUDA allocator's settings
(:mod:`megatron_paradyse.core.allocator`): importing them imports Transformer Engine where it is
installed, which may initialise CUDA.
"""

from __future__ import annotations

import datetime
import re
import sys
from typing import TYPE_CHECKING

import torch

from megatron_paradyse.config import ParadyseConfig, load_config
from megatron_paradyse.core import allocator
from megatron_paradyse.cost import ProfileError
from megatron_paradyse.mcore import compat
from megatron_paradyse.planner import InfeasibleSequenceError
from megatron_paradyse.run.agreement import RankDisagreement
from megatron_paradyse.run.fault import children_die_with_this_process, end_process
from megatron_paradyse.run.megatron_flags import RaisingParser, megatron_parser
from megatron_paradyse.run.startup import (
    StartupError,
    agree,
    distributed_launch,
    distributed_settings,
    init_distributed,
    leaving_process_groups,
)

if TYPE_CHECKING:
    from megatron_paradyse.run.job import Job

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run this rank of a job, as ``torchrun ... -m megatron_paradyse.pretrain_gpt <flags>`` would
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from the environment)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        return _print_help()
    allocator.prefer_expandable_segments()  # before anything initialises CUDA
    children_die_with_this_process()  # before Megatron starts any: a rank killed cannot end them itself
    try:
        config = _paradyse_config(argv)
    except ValueError as e:
        with leaving_process_groups():
            return _failed_to_start(e, argv)
    from megatron_paradyse.run.job import Job  # after the allocator's settings (the module's docstring)

    with compat.megatron_training_on_cpu(), leaving_process_groups():
        try:
            job = Job.from_argv(config, argv)
        except ValueError as e:
            return _failed_to_start(e, [*(config.megatron_args if config else ()), *argv])
        try:
            run(job)
        except (StartupError, InfeasibleSequenceError, RankDisagreement, ProfileError) as e:
            # Raised on every rank at the same point, from what every rank knows alike: start-up's agreement,
            # the planners of every stage checking the whole global batch (or the data's shortest sample)
            # before any forward, the inputs' digests and the calibration gathered from every rank. Rank 0
            # says it once (of the digests' problems, a rank that could not read its profile adds why).
            return _error(e) if torch.distributed.get_rank() == 0 else 2
    return 0


def _error(e: Exception) -> int:
    print(f"paradyse: error: {e}", file=sys.stderr, flush=True)
    return 2


def _failed_to_start(e: ValueError, flags: list[str]) -> int:
    """This rank cannot start (``flags``: its Megatron flags, as far as it knows them). One rank of
    several still joins the others (:mod:`megatron_paradyse.run.startup`), so that every rank stops now;
    rank 0 prints the one message."""
    if not distributed_launch():
        return _error(e)
    try:
        init_distributed(*distributed_settings(flags))
    except (ValueError, RuntimeError) as join:  # no rendezvous to reach: say what stopped this rank
        return _error(ValueError(f"{e} (and the other ranks could not be told: {join})"))
    try:
        agree(str(e))
    except StartupError as every:
        return _error(every) if torch.distributed.get_rank() == 0 else 2
    raise AssertionError("agree() raises when this rank reports a problem")


def _paradyse_config(argv: list[str]) -> ParadyseConfig:
    """The ``--paradyse-config`` of ``argv``, loaded."""
    from megatron_paradyse.run.job import add_paradyse_args  # after the allocator's settings

    parser = RaisingParser(add_help=False, allow_abbrev=False)  # "--paradyse-config" without a file: one line
    add_paradyse_args(parser)
    known, _ = parser.parse_known_args(argv)
    if known.paradyse_config is None:
        raise ValueError("--paradyse-config FILE is required (see docs/configs.md)")
    return load_config(known.paradyse_config)


def _print_help() -> int:
    """Megatron's flags and ours, as Megatron's parser describes them."""
    from megatron_paradyse.run.job import add_paradyse_args

    parser = megatron_parser(
        add_paradyse_args, prog="pretrain_gpt", description="Megatron-LM arguments, and megatron-paradyse's"
    )
    for action in parser._actions:
        if action.help:
            # megatron-core 0.19 writes a bare "%" in a help text (10%), which argparse reads as a format
            # directive: its own --help fails. Escape what is not "%%" or "%(name)s".
            action.help = re.sub(r"%%|%\(|%", lambda m: m[0] if len(m[0]) == 2 else "%%", action.help)
    parser.print_help()
    return 0


def run(job: Job) -> None:
    """Join the ranks, then Megatron's ``pretrain()`` on the job's planned data, with this project's hooks
    in Megatron's training loop."""
    from megatron_paradyse.mcore import training_hooks  # imports megatron.training: after the allocator's settings
    from megatron_paradyse.run.training import TrainingRun

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    init_distributed(job.args.distributed_backend, datetime.timedelta(minutes=job.args.distributed_timeout_minutes))
    agree(None)  # where a rank that could not read its config or profile reports it (main)
    training_run = TrainingRun(job)
    training_run.start_up()
    with (
        training_hooks.after_each_iteration(training_run.end_iteration),
        training_hooks.around_each_evaluation(training_run.begin_evaluation, training_run.end_evaluation),
        training_hooks.around_each_step(training_run.begin_step, training_run.out_of_memory),
        training_hooks.each_schedule_leaving_nothing(),
        training_run.fault_watch,
    ):
        pretrain(
            pretrain_cfg_container_from_args(job.args, job.model_config),
            training_run.dataset_provider(),
            ModelType.encoder_or_decoder,
            training_run.forward_step,
        )
    training_run.finish()


if __name__ == "__main__":
    code = main()
    if code and torch.distributed.is_initialized():
        # a rank that stops with an error leaves its process group's threads running, which the
        # interpreter's shutdown may abort on ("terminate called without an active exception", exit -6)
        end_process(code)
    sys.exit(code)
