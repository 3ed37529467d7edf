"""Train a GPT with Megatron's own ``pretrain()``, the Paradyse layers and a plan for every micro-batch.

    torchrun --nproc-per-node 8 -m megatron_paradyse.pretrain_gpt --paradyse-config cfg.yaml \\
        --tensor-model-parallel-size 4 --num-layers 24 --hidden-size 2048 ...   # any Megatron flag

(also ``paradyse-pretrain-gpt``, and Megatron-LM's ``pretrain_gpt.py --paradyse-config`` with the patch
in ``patches/``). Megatron's flags come from three places, later ones winning: the defaults this entry
point needs (:func:`entry_defaults`), the config's ``megatron_args``, the command line.

Around ``pretrain()``:

- the model is Megatron's GPT with :func:`megatron_paradyse.spec.get_paradyse_layer_spec`, causal or
  bidirectional as the config's ``attention_mask`` says (the data's canonical order follows it);
- the data is an external iterator (:class:`~megatron_paradyse.planned_loader.PlannedMicroBatches`):
  every rank builds its micro-batches itself (one document, or a packing, per micro-batch:
  ``--micro-batch-size 1``), in the canonical order, without an attention mask; lengths vary from one
  micro-batch to the next (``variable_seq_lengths``), the loss is normalised by the tokens of the
  global batch (``--calculate-per-token-loss``), and ``--seq-length`` is the longest micro-batch;
- each pipeline stage has a planner, priced by the cost profile (``cost.profile``, or a quick
  calibration at start-up shared by rank 0) within the memory budget; all ranks check at start-up
  that they plan from the same inputs;
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
  (:mod:`megatron_paradyse.fault`).

Configuration errors print ``paradyse: error: ...`` and return 2 before Megatron starts. A rank of
several that fails at start-up (its config, cost profile or dataset) stops every rank within seconds:
the ranks join the default process group first and agree (:mod:`megatron_paradyse.startup`); rank 0
prints the one message, naming the rank and the cause.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.util
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import torch

from megatron_paradyse import compat
from megatron_paradyse.config import ParadyseConfig, load_config
from megatron_paradyse.fault import STATE_FILE, BudgetState, read_state

__all__ = ["Job", "entry_defaults", "main"]

_GIB = 2**30


def main(argv: list[str] | None = None) -> int:
    """Run this rank of a job, as ``torchrun ... -m megatron_paradyse.pretrain_gpt <flags>`` would
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` from the environment)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if {"-h", "--help"} & set(argv):
        return _print_help()
    try:
        config = _paradyse_config(argv)
    except ValueError as e:
        return _failed_to_start(e, argv)
    compat.install()
    from megatron_paradyse.agreement import RankDisagreement
    from megatron_paradyse.cost import ProfileError
    from megatron_paradyse.planner import InfeasibleSequenceError
    from megatron_paradyse.startup import StartupError

    with compat.megatron_training_on_cpu():
        try:
            job = Job.from_argv(config, argv)
        except ValueError as e:
            return _failed_to_start(e, [*(config.megatron_args if config else ()), *argv])
        try:
            job.run()
        except StartupError as e:  # the same message on every rank: one is enough
            return _error(e) if torch.distributed.get_rank() == 0 else 2
        except (InfeasibleSequenceError, RankDisagreement, ProfileError) as e:
            # Raised on every rank at the same point (before any forward of the step, at start-up):
            # a message, not a traceback.
            return _error(e)
    return 0


def _error(e: Exception) -> int:
    print(f"paradyse: error: {e}", file=sys.stderr, flush=True)
    return 2


def _failed_to_start(e: ValueError, flags: list[str]) -> int:
    """This rank cannot start (``flags``: its Megatron flags, as far as it knows them). One rank of
    several still joins the others (:mod:`megatron_paradyse.startup`), so that every rank stops now;
    rank 0 prints the one message."""
    from megatron_paradyse.startup import (
        StartupError,
        agree,
        distributed_launch,
        distributed_settings,
        init_distributed,
    )

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
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    _add_paradyse_args(parser)
    known, _ = parser.parse_known_args(argv)
    if known.paradyse_config is None:
        raise ValueError("--paradyse-config FILE is required (see configs/README.md)")
    return load_config(known.paradyse_config)


def _print_help() -> int:
    """Megatron's flags and ours, as Megatron's parser describes them."""
    import warnings

    compat.install()
    with warnings.catch_warnings():  # Megatron's "TE/apex not installed": nothing to do with its flags
        warnings.simplefilter("ignore")
        from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(
        prog="pretrain_gpt", description="Megatron-LM arguments, and megatron-paradyse's", allow_abbrev=False
    )
    _add_paradyse_args(add_megatron_arguments(parser))
    for action in parser._actions:
        if action.help:
            # megatron-core 0.19 writes a bare "%" in a help text (10%), which argparse reads as a format
            # directive: its own --help fails. Escape what is not "%%" or "%(name)s".
            action.help = re.sub(r"%%|%\(|%", lambda m: m[0] if len(m[0]) == 2 else "%%", action.help)
    parser.print_help()
    return 0


def _add_paradyse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("paradyse", "megatron-paradyse (see configs/README.md)")
    group.add_argument("--paradyse-config", metavar="FILE", help="paradyse YAML config (planner, memory, cost, data)")
    return parser


def entry_defaults(config: ParadyseConfig, *, cuda: bool) -> list[str]:
    """The Megatron flags this entry point needs, before the config's and the command line's."""
    longest = config.data.token_budget or config.data.max_len
    # the layers' linear modules: Transformer Engine's where it is installed, as in a stock job
    impl = "transformer_engine" if cuda and importlib.util.find_spec("transformer_engine") else "local"
    flags = [
        "--dataloader-type", "external",
        "--no-create-attention-mask-in-dataloader",
        "--calculate-per-token-loss",
        "--micro-batch-size", "1",
        "--seq-length", str(longest),
        "--max-position-embeddings", str(longest),
        "--sequence-parallel",
        "--transformer-impl", impl,
        "--eval-iters", "0",
        "--eval-interval", "1000",
    ]  # fmt: skip
    vocab_size = _dataset_tokenizer(config)[0]
    if vocab_size is not None:
        # megatron-core 0.19's NullTokenizer(n) has ids 0..n-1: the dataset's whole vocabulary.
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size)]
    if not cuda:
        flags += [
            "--distributed-backend", "gloo",
            "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion",
            "--no-rope-fusion",
        ]  # fmt: skip
    return flags


def _dataset_tokenizer(config: ParadyseConfig) -> tuple[int | None, int | None]:
    """(vocabulary size, padding id) of the dataset's tokenizer, when the dataset says which it is."""
    from megatron_paradyse.data import ByteTokenizer, KmerTokenizer
    from megatron_paradyse.data.prepare import read_manifest

    if config.data.dataset == "code":
        tokenizer = ByteTokenizer()
        return tokenizer.vocab_size, tokenizer.pad_id
    if config.data.dataset == "dna":
        tokenizer = KmerTokenizer(3)
        return tokenizer.vocab_size, tokenizer.pad_id
    manifest = read_manifest(config.data.dataset)
    if manifest is None:
        return None, None
    return manifest["vocab_size"], manifest["pad_id"]


# -- the job ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Job:
    """One rank's run: validated arguments, the model config, and what the hooks share."""

    config: ParadyseConfig
    args: argparse.Namespace
    model_config: object
    """Megatron's ``GPTModelConfig`` (``.transformer`` is the ``TransformerConfig``)."""
    profile: dict | None
    """The cost profile read from ``cost.profile``; None: calibrated at start-up."""
    budget_bytes: float
    """The budget plans must fit: the configured one, or the smaller one saved after an out-of-memory error."""
    device: torch.device
    pad_id: int
    """Token id of padding (never attended to, never in the loss)."""
    budget_state: BudgetState | None = None
    """What ``paradyse_state.json`` in the ``--load`` directory holds (None: there is none)."""

    @classmethod
    def from_argv(cls, config: ParadyseConfig, argv: list[str]) -> Job:
        """Parse and check everything that can be checked without a process group."""
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.training.argument_utils import gpt_config_from_args
        from megatron.training.arguments import parse_and_validate_args

        from megatron_paradyse.modules import config_problems
        from megatron_paradyse.spec import get_paradyse_layer_spec

        cuda = torch.cuda.is_available()
        defaults = [*entry_defaults(config, cuda=cuda), *config.megatron_args]
        _use_prebuilt_dataset_helpers()
        with _command_line([*defaults, *argv]):
            try:
                args = parse_and_validate_args(extra_args_provider=_add_paradyse_args)
            except AssertionError as e:  # Megatron checks its arguments with asserts
                raise ValueError(f"Megatron's argument check failed: {_assertion(e)}") from e
            except (ValueError, TypeError, KeyError) as e:  # a failure inside Megatron's own argument code
                raise ValueError(f"Megatron's argument handling failed: {type(e).__name__}: {e}") from e
        problems = _argument_problems(args, config, [*config.megatron_args, *argv])
        if problems:
            raise ValueError("the Megatron arguments do not fit this entry point:\n  - " + "\n  - ".join(problems))
        # Lengths change between micro-batches: pipeline stages exchange shapes first. (Megatron's
        # allgather token dispatcher refuses variable lengths even without experts.)
        args.variable_seq_lengths = True
        args.moe_token_dispatcher_type = "alltoall"
        args.dataloader_save = args.save  # Megatron then saves the loader's position with each checkpoint
        model_config = gpt_config_from_args(args)
        problems = config_problems(model_config.transformer) + _overlap_problems(args, config, model_config.transformer)
        if problems:
            raise ValueError("the Paradyse layers cannot run this model:\n  - " + "\n  - ".join(problems))
        mask = AttnMaskType.causal if config.attention_mask == "causal" else AttnMaskType.no_mask
        model_config.transformer_layer_spec = functools.partial(get_paradyse_layer_spec, attn_mask_type=mask)
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        pad_id = _dataset_tokenizer(config)[1]
        budget_bytes = _budget_bytes(config, device)
        budget_state = read_state(args.load)
        if budget_state is not None:
            budget_state.check_retries(config.memory.oom_retries, Path(args.load) / STATE_FILE)
            budget_bytes = min(budget_bytes, budget_state.budget_bytes)
        job = cls(
            config=config,
            args=args,
            model_config=model_config,
            profile=_read_profile(config, args),
            budget_bytes=budget_bytes,
            device=device,
            pad_id=_megatron_pad_id() if pad_id is None else pad_id,
            budget_state=budget_state,
        )
        job.cost_models()  # the profile fits the model (group size, dtype): fail here, not after start-up
        return job

    @property
    def tp(self) -> int:
        return self.args.tensor_model_parallel_size

    @property
    def planner_config(self):
        """The config's planner section; at TP=1, plans choose recompute per layer only: one rank holds the
        whole sequence, and every strategy runs the same computation there."""
        if self.tp > 1:
            return self.config.planner
        return dataclasses.replace(self.config.planner, pairs=("tp_sp/tp_sp",), attention=None, mlp=None)

    @property
    def causal(self) -> bool:
        return self.config.attention_mask == "causal"

    def run(self) -> None:
        from megatron.core.enums import ModelType
        from megatron.training import pretrain
        from megatron.training.argument_utils import pretrain_cfg_container_from_args

        from megatron_paradyse.startup import agree, init_distributed
        from megatron_paradyse.training import TrainingRun

        timeout = datetime.timedelta(minutes=self.args.distributed_timeout_minutes)
        init_distributed(self.args.distributed_backend, timeout)
        agree(None)  # where a rank that could not read its config or profile reports it (main)
        run = TrainingRun(self)
        run.start_up()
        with (
            _after_each_iteration(run.end_iteration),
            _around_each_evaluation(run.begin_evaluation, run.end_evaluation),
            _on_out_of_memory(run.out_of_memory),
            run.fault_watch,
        ):
            pretrain(
                pretrain_cfg_container_from_args(self.args, self.model_config),
                run.dataset_provider(),
                ModelType.encoder_or_decoder,
                run.forward_step,
            )
        run.finish()

    # -- planning ---------------------------------------------------------------------------------
    def footprints(self):
        from megatron_paradyse.drop_in import stage_footprints

        return stage_footprints(self.args, self.model_config.transformer)

    def cost_models(self, profile: dict | None = None):
        """One cost model per pipeline stage (``profile``: instead of the configured one)."""
        from megatron_paradyse.drop_in import stage_cost_models

        profile = profile or self.profile
        return None if profile is None else stage_cost_models(self.args, self.model_config.transformer, profile)


def _argument_problems(args: argparse.Namespace, config: ParadyseConfig, flags: list[str]) -> list[str]:
    """What of Megatron's arguments this entry point cannot run (``flags``: the ones the user gave, the
    config's ``megatron_args`` and the command line's)."""
    problems = []
    longest = config.data.token_budget or config.data.max_len
    wanted = {
        "dataloader_type": ("external", "--dataloader-type: the entry point feeds Megatron its own iterator"),
        "micro_batch_size": (1, "--micro-batch-size: a micro-batch is one row (one document or a packing)"),
        "context_parallel_size": (1, "--context-parallel-size: the strategies parallelise the sequence over TP"),
        "full_validation": (False, "--full-validation: validation runs --eval-iters steps"),
        "multiple_validation_sets": (False, "--multiple-validation-sets: validation holds out one split"),
        "spec": (None, "--spec: the entry point uses megatron_paradyse.spec"),
    }
    for name, (value, why) in wanted.items():
        if getattr(args, name) != value:
            problems.append(f"{why}; got {getattr(args, name)!r}, leave it out or set {value!r}")
    given = {flag.split("=", 1)[0] for flag in flags}
    if "--eval-micro-batch-size" in given and args.eval_micro_batch_size != 1:  # else it follows the above
        problems.append(
            f"--eval-micro-batch-size: a micro-batch is one row; got {args.eval_micro_batch_size}, leave it out "
            f"or set 1"
        )
    if "--eval-interval" in given and not args.eval_iters:
        problems.append(
            f"--eval-interval {args.eval_interval} without --eval-iters: no validation would run; add --eval-iters N "
            f"(validation steps per evaluation, N > 0), or leave --eval-interval out"
        )
    if args.split is not None:
        from megatron_paradyse.data.subset import split_fractions

        try:
            split_fractions(args.split)
        except ValueError as e:
            problems.append(str(e))
    if args.seq_length < longest:
        problems.append(
            f"--seq-length {args.seq_length} is shorter than the longest micro-batch, {longest} tokens "
            f"(data.token_budget or data.max_len); leave it out"
        )
    if args.tokenizer_type is None:
        problems.append(
            f"the dataset {config.data.dataset} has no manifest naming its tokenizer: pass --tokenizer-type "
            f"and its flags"
        )
    if args.inprocess_restart:
        problems.append(
            "--inprocess-restart: Megatron's in-process restart is not wired into this entry point; an out-of-memory "
            "error stops every rank with the shrunk budget saved, and torchrun --max-restarts with --load restarts "
            "the run from the last checkpoint (configs/README.md); leave it out"
        )
    if not torch.cuda.is_available() and config.memory.budget_gib is None:
        problems.append("memory.budget_gib is required on a machine without CUDA (the config's memory section)")
    return problems


def _overlap_problems(args: argparse.Namespace, config: ParadyseConfig, transformer) -> list[str]:
    """What of Megatron's overlapped gradient reduction the plans would break."""
    from megatron_paradyse.modules import model_shape
    from megatron_paradyse.planner import layer_options

    if not (args.overlap_grad_reduce and transformer.qk_layernorm) or args.tensor_model_parallel_size == 1:
        return []
    options, _ = layer_options(config.planner, model_shape(transformer), args.tensor_model_parallel_size)
    if not any(option.attention == "lean" for option in options):
        return []
    return [
        "--overlap-grad-reduce with --qk-layernorm and the lean attention strategy in the plans: lean's backward "
        "adds the q/k norm weights' gradients once per head group, and Megatron's overlapped reduction counts each "
        "as the weight's gradient being ready; leave out --overlap-grad-reduce (and --overlap-param-gather), or "
        "keep lean out of the plans (planner.attention or planner.pairs)"
    ]


def _megatron_pad_id() -> int:
    from megatron.training import get_tokenizer

    tokenizer = get_tokenizer()
    pad = getattr(tokenizer, "pad", None)
    return tokenizer.eod if pad is None or pad < 0 else pad


def _assertion(e: AssertionError) -> str:
    """The assertion's message, or the failing line and where it is when it has none."""
    if str(e):
        return str(e)
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{frame.line} ({Path(frame.filename).name}:{frame.lineno})"


def _read_profile(config: ParadyseConfig, args: argparse.Namespace) -> dict | None:
    from megatron_paradyse.cost import load_profile

    if config.cost.profile is None:
        return None
    return load_profile(config.cost.profile, p=args.tensor_model_parallel_size, check_machine=config.cost.check_machine)


def _budget_bytes(config: ParadyseConfig, device: torch.device) -> float:
    if config.memory.budget_gib is not None:
        return config.memory.budget_gib * _GIB
    return torch.cuda.get_device_properties(device).total_memory * (1.0 - config.memory.margin)


@contextlib.contextmanager
def _command_line(argv: list[str]) -> Iterator[None]:
    """Megatron's parser reads ``sys.argv``."""
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pretrain_gpt", *argv]
    try:
        yield
    finally:
        sys.argv = saved


def _use_prebuilt_dataset_helpers() -> None:
    """``initialize_megatron`` compiles Megatron's dataset helpers with ``make`` in the package folder;
    the megatron-core wheel ships them compiled and without the Makefile, so rank 0 would exit. Keep
    the compiled module when it imports (CUDA or not); a source checkout compiles as before."""
    from megatron.core.datasets import utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    if not (Path(utils.__file__).parent / "Makefile").exists():
        utils.compile_helpers = lambda: None


@contextlib.contextmanager
def _after_each_iteration(callback: Callable[[int, dict], None]) -> Iterator[None]:
    """Call ``callback(iteration, loss_dict)`` after Megatron's ``training_log`` of each iteration."""
    from megatron.training import training

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
def _around_each_evaluation(begin: Callable[[], None], end: Callable[[str], None]) -> Iterator[None]:
    """Call ``begin()`` before each of Megatron's evaluations (validation during and after training, test
    at the end) and ``end(prefix)`` after it has printed its loss (``prefix``: ``iteration N ...``)."""
    from megatron.training import training

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
def _on_out_of_memory(handler: Callable[[torch.OutOfMemoryError], NoReturn]) -> Iterator[None]:
    """Hand an out-of-memory error raised in a training step on this rank (any forward, backward, the
    optimizer step) to ``handler``, which ends the process: unwound, it would leave the other ranks
    blocked in the step's collectives. ``train()`` looks ``train_step`` up in its module."""
    from megatron.training import training

    original = training.train_step

    def train_step(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except torch.OutOfMemoryError as e:
            handler(e)

    training.train_step = train_step
    try:
        yield
    finally:
        training.train_step = original


if __name__ == "__main__":
    sys.exit(main())
