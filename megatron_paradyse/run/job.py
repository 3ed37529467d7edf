"""One rank's job, checked before Megatron starts: the flags (the entry point's defaults, the config's
``megatron_args``, the command line), the model config with the Paradyse layer spec, the memory budget
(the configured one, or the one saved after an out-of-memory error), the cost profile and what the
plans need of them. Everything here runs without a process group: a bad input is refused before any
rank joins one."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import io
import logging
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_paradyse.config import ParadyseConfig
from megatron_paradyse.core.comm import warm_communicators
from megatron_paradyse.core.memory import allocator_capacity_bytes, device_memory_bytes
from megatron_paradyse.cost import load_profile
from megatron_paradyse.data import ByteTokenizer, KmerTokenizer
from megatron_paradyse.data.indexed import missing_files
from megatron_paradyse.data.prepare import read_manifest
from megatron_paradyse.data.subset import split_fractions
from megatron_paradyse.mcore import compat
from megatron_paradyse.mcore.model_shape import model_shape
from megatron_paradyse.mcore.modules import config_problems
from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
from megatron_paradyse.mcore.static_memory import optimizer_problem
from megatron_paradyse.mcore.step_groups import step_groups
from megatron_paradyse.planner import layer_options
from megatron_paradyse.planner.decision import byte_sizes
from megatron_paradyse.run.documents import BUILT_IN
from megatron_paradyse.run.fault import STATE_FILE, BudgetState, read_state
from megatron_paradyse.run.megatron_flags import parse_megatron_args
from megatron_paradyse.run.stage_planning import (
    cross_entropy_problem,
    kept_between_micro_batches_bytes,
    recompute_only,
    stage_cost_models,
    stage_footprints,
    step_stage_budgets,
)
from megatron_paradyse.strategies import get_strategy

from megatron.core.datasets import utils as dataset_utils
from megatron.core.transformer.enums import AttnMaskType
from megatron.training import get_tokenizer
from megatron.training.argument_utils import gpt_config_from_args
from megatron.training.arguments import parse_and_validate_args, parse_args, validate_args
from megatron.training.global_vars import unset_global_variables

__all__ = ["Job", "add_paradyse_args", "job_arguments", "dataset_tokenizer", "entry_defaults", "quiet_megatron"]


def add_paradyse_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("paradyse", "megatron-paradyse (see docs/configs.md)")
    group.add_argument("--paradyse-config", metavar="FILE", help="paradyse YAML config (planner, memory, cost, data)")
    return parser


def entry_defaults(config: ParadyseConfig, *, cuda: bool) -> list[str]:
    """The Megatron flags this entry point needs, before the config's and the command line's."""
    longest = config.data.token_budget or config.data.max_len
    # the layers' linear modules: Transformer Engine's where it is installed, as in a stock job
    te = cuda and importlib.util.find_spec("transformer_engine") is not None
    impl = "transformer_engine" if te else "local"
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
    if not te:
        # Megatron turns RoPE fusion on by default, and its fused RoPE is Transformer Engine's kernel:
        # without TE, building the model's config fails ("apply_rope_fusion is not available")
        flags.append("--no-rope-fusion")
    vocab_size = dataset_tokenizer(config)[0]
    if vocab_size is not None:
        # megatron-core 0.19's NullTokenizer(n) has ids 0..n-1: the dataset's whole vocabulary.
        flags += ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab_size)]
    if not cuda:
        # Megatron's bias fusions are torch.compile'd: on a CPU, C++ built at every new length
        flags += [
            "--distributed-backend", "gloo",
            "--use-cpu-initialization",
            "--no-gradient-accumulation-fusion",
            "--no-bias-dropout-fusion",
            "--no-bias-gelu-fusion",
            "--no-bias-swiglu-fusion",
        ]  # fmt: skip
    return flags


def dataset_tokenizer(config: ParadyseConfig) -> tuple[int | None, int | None]:
    """(vocabulary size, padding id) of the dataset's tokenizer, when the dataset says which it is."""
    if config.data.dataset == "code":
        tokenizer = ByteTokenizer()
        return tokenizer.vocab_size, tokenizer.pad_id
    if config.data.dataset == "dna":
        tokenizer = KmerTokenizer(3)
        return tokenizer.vocab_size, tokenizer.pad_id
    missing = missing_files(config.data.dataset)
    if missing:
        built_in = ", ".join(BUILT_IN)
        raise ValueError(f"data.dataset: {missing}; nor is {config.data.dataset!r} a built-in corpus ({built_in})")
    manifest = read_manifest(config.data.dataset)
    if manifest is None:
        return None, None
    return manifest["vocab_size"], manifest["pad_id"]


@dataclasses.dataclass
class Job:
    """One rank's run: validated arguments, the model config, and what the hooks share."""

    config: ParadyseConfig
    args: argparse.Namespace
    model_config: object
    """Megatron's ``GPTModelConfig`` (``.transformer`` is the ``TransformerConfig``)."""
    profile: dict | None
    """The cost profile read from ``cost.profile``; None: calibrated at start-up."""
    budget_bytes: float | None
    """The budget plans must fit: the configured one, or the smaller one saved after an out-of-memory error
    (shrunk again where the pre-flight measures a peak over its prediction: :mod:`~megatron_paradyse.run.preflight`).
    On CUDA, sized by the device's whole memory until start-up measures what the caching allocator can
    hold (:meth:`measure_budget`): an upper bound, enough to refuse at once what could never fit. None
    only where a job is checked away from its GPU (``paradyse check-config --device cuda``)."""
    device: torch.device
    budget_state: BudgetState | None = None
    """What ``paradyse_state.json`` in the ``--load`` directory holds (None: there is none)."""

    @classmethod
    def from_argv(cls, config: ParadyseConfig, argv: list[str]) -> Job:
        """Parse and check everything that can be checked without a process group."""
        cuda = torch.cuda.is_available()
        flags = [*config.megatron_args, *argv]
        parse_megatron_args(argv, add_paradyse_args, config_flags=config.megatron_args)  # one line, not its usage
        _use_prebuilt_dataset_helpers()
        with _command_line([*entry_defaults(config, cuda=cuda), *flags]):
            args = _megatron_checked(lambda: parse_and_validate_args(extra_args_provider=add_paradyse_args))
        try:
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            model_config = _model_config(args, config, flags, cuda=cuda)
            return cls.checked(config, args, model_config, device=device, device_bytes=device_memory_bytes(device))
        except Exception:  # refused: Megatron's globals (its parsed arguments first) as they were before
            unset_global_variables()
            raise

    @classmethod
    def checked(
        cls,
        config: ParadyseConfig,
        args: argparse.Namespace,
        model_config,
        *,
        device: torch.device,
        device_bytes: int | None,
        check_machine: bool = True,
    ) -> Job:
        """The job of validated ``args`` and their ``model_config`` on ``device`` (``device_bytes``: its
        memory, None where it is not known): its budget, profile and static memory checked, as a rank checks
        them before joining a process group (``check_machine``: hold the profile to this machine, as
        ``cost.check_machine`` says; False where the job runs on another kind of machine)."""
        mask = AttnMaskType.causal if config.attention_mask == "causal" else AttnMaskType.no_mask
        model_config.transformer_layer_spec = functools.partial(get_paradyse_layer_spec, attn_mask_type=mask)
        budget_state = read_state(args.load)
        if budget_state is not None:
            budget_state.check_retries(config.memory.oom_retries, Path(args.load) / STATE_FILE)
        job = cls(
            config=config,
            args=args,
            model_config=model_config,
            profile=_read_profile(config, args, check_machine=check_machine),
            budget_bytes=_budget_bytes(config, budget_state, device_bytes),
            device=device,
            budget_state=budget_state,
        )
        if job.budget_bytes is not None:  # None: a GPU's, measured at start-up
            job.check_static_memory()  # fail here, on every rank, not after start-up
        job.cost_models()  # the profile fits the model (group size, dtype): fail here, not after start-up
        return job

    @functools.cached_property
    def pad_id(self) -> int:
        """Token id of padding (never attended to, never in the loss): the dataset's, else Megatron's
        tokenizer's."""
        pad_id = dataset_tokenizer(self.config)[1]
        return _megatron_pad_id() if pad_id is None else pad_id

    @property
    def tp(self) -> int:
        return self.args.tensor_model_parallel_size

    @property
    def planner_config(self):
        """The config's planner section; at TP=1, plans choose recompute per layer only: one rank holds the
        whole sequence, and every strategy runs the same computation there."""
        return self.config.planner if self.tp > 1 else recompute_only(self.config.planner)

    @property
    def causal(self) -> bool:
        return self.config.attention_mask == "causal"

    # -- planning ---------------------------------------------------------------------------------
    def footprints(self):
        return stage_footprints(self.args, self.model_config.transformer, self.device.type)

    def check_static_memory(self) -> None:
        """Every pipeline stage's weights, gradients and optimizer state fit the budget with the optimizer
        step's working set, and with what the pipeline schedule keeps of one micro-batch into the next
        (:func:`~megatron_paradyse.run.stage_planning.step_stage_budgets`): else no micro-batch could train."""
        footprints = self.footprints()
        transformer = self.model_config.transformer
        budgets = step_stage_budgets(self.budget_bytes, footprints, self.args, transformer)
        kept = kept_between_micro_batches_bytes(transformer, self.args.seq_length, self.args.micro_batch_size)
        over = []  # (stage, static bytes, bytes beside them, what those are)
        for f, budget in zip(footprints, budgets):
            if f.static_bytes + f.optimizer_step_bytes > self.budget_bytes:
                over.append((f.stage, f.static_bytes, f.optimizer_step_bytes, "more while the optimizer steps"))
            elif budget.holding(self.args.seq_length) <= f.static_bytes:
                over.append(
                    (
                        f.stage,
                        f.static_bytes,
                        kept,
                        f"for a micro-batch's input and its gradient, of --seq-length {self.args.seq_length} tokens, "
                        f"that the pipeline schedule keeps into the next one (a shorter data.max_len or more "
                        f"tensor-parallel ranks make it smaller)",
                    )
                )
        if over:
            sizes = iter(byte_sizes(self.budget_bytes, *(n for _, static, more, _ in over for n in (static, more))))
            budget_size = next(sizes)
            stages = "\n  - ".join(
                f"pipeline stage {stage}: {next(sizes)} of weights, gradients and optimizer state, and {next(sizes)} "
                f"{what}"
                for stage, _, _, what in over
            )
            raise ValueError(
                f"the memory budget ({budget_size} per rank) cannot hold what every plan "
                f"holds:\n  - {stages}\nwhat would fit: more tensor- or pipeline-parallel ranks, the distributed "
                f"optimizer over data-parallel ranks (--use-distributed-optimizer), Transformer Engine or apex "
                f"installed (a fused optimizer step needs no working set), or a larger memory.budget_gib"
            )

    def measure_budget(self) -> float | None:
        """Size the budget by what the CUDA caching allocator can hold now, the least over every rank (so
        every rank plans with one budget), and check the static memory against it again; returns that
        capacity (None on the CPU, where ``memory.budget_gib`` is the budget). At start-up, on every rank,
        once the model, its optimizer and the start-up calibration hold what they hold, and the step's
        communicators theirs (warmed here: else the first step's collectives would take it, at its peak)."""
        warm_communicators(step_groups(self.args), self.device)
        capacity = allocator_capacity_bytes(self.device, torch.distributed.group.WORLD)
        if capacity is not None:
            self.budget_bytes = _budget_bytes(self.config, self.budget_state, capacity)
            self.check_static_memory()
        return capacity

    def cost_models(self, profile: dict | None = None):
        """One cost model per pipeline stage (``profile``: instead of the configured one)."""
        profile = profile or self.profile
        if profile is None:
            return None
        return stage_cost_models(self.args, self.model_config.transformer, profile, self.footprints())


def job_arguments(
    config: ParadyseConfig, argv: list[str], *, world_size: int | None = None, cuda: bool = True
) -> tuple[argparse.Namespace, object]:
    """Megatron's arguments and model config (``GPTModelConfig``) of a job started with ``config`` and the
    command-line flags ``argv`` on CUDA machines (``cuda=False``: on machines without CUDA), checked as its
    ranks check them before joining a process group (Megatron's own validation, what this entry point and
    the Paradyse layers can run), here, whatever this machine has: what ``paradyse check-config`` checks and
    ``paradyse plan`` plans. Nothing global is set (no tokenizer, no TensorBoard or W&B writer).
    ``world_size``: the job's ranks (None: one data-parallel replica, every model-parallel rank once;
    ``args.world_size`` says which). Raises ``ValueError`` with the job's own message."""
    flags = [*config.megatron_args, *argv]
    parse_megatron_args(argv, add_paradyse_args, config_flags=config.megatron_args)  # one line, not its usage
    with quiet_megatron():
        with compat.megatron_training_on_cpu(), _command_line([*entry_defaults(config, cuda=cuda), *flags]):
            args = parse_args(add_paradyse_args)
            model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
            args.world_size = world_size or model_parallel * args.context_parallel_size
            _megatron_checked(lambda: validate_args(args))
            model_config = _model_config(args, config, flags, cuda=cuda)
    return args, model_config


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Megatron's start-up code in a command that prints only its answer: no argument listing (stdout),
    warnings or INFO logs (the tokenizer's padding, the dataset's index)."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        disabled = logging.root.manager.disable
        logging.disable(max(disabled, logging.INFO))
        try:
            yield
        finally:
            logging.disable(disabled)


def _megatron_checked(validate: Callable[[], argparse.Namespace]) -> argparse.Namespace:
    """``validate()``, Megatron's argument validation, with its failures as a ``ValueError`` that says what
    failed (Megatron checks its arguments with asserts, often without a message)."""
    try:
        return validate()
    except AssertionError as e:
        raise ValueError(f"Megatron's argument check failed: {_assertion(e)}") from e
    except (ValueError, TypeError, KeyError) as e:  # a failure inside Megatron's own argument code
        raise ValueError(f"Megatron's argument handling failed: {type(e).__name__}: {e}") from e


def _model_config(args: argparse.Namespace, config: ParadyseConfig, flags: list[str], *, cuda: bool):
    """Megatron's ``GPTModelConfig`` of validated ``args``, as this entry point runs it (``flags``: the
    config's ``megatron_args`` and the command line's; ``cuda``: on CUDA machines); ``ValueError`` with
    every problem the entry point or the Paradyse layers have with them."""
    problems = _argument_problems(args, config, flags, cuda=cuda)
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
    return model_config


def _argument_problems(args: argparse.Namespace, config: ParadyseConfig, flags: list[str], *, cuda: bool) -> list[str]:
    """What of Megatron's arguments this entry point cannot run (``flags``: the ones the user gave, the
    config's ``megatron_args`` and the command line's; ``cuda``: on CUDA machines)."""
    problems = []
    longest = config.data.token_budget or config.data.max_len
    wanted = {
        "dataloader_type": ("external", "--dataloader-type: the entry point feeds Megatron its own iterator"),
        "micro_batch_size": (1, "--micro-batch-size: a micro-batch is one row (one document or a packing)"),
        "context_parallel_size": (1, "--context-parallel-size: the strategies parallelise the sequence over TP"),
        "full_validation": (False, "--full-validation: validation runs --eval-iters steps"),
        "multiple_validation_sets": (False, "--multiple-validation-sets: validation holds out one split"),
        "spec": (None, "--spec: the entry point uses megatron_paradyse.spec"),
        "qk_l2_norm": (
            False,
            "--qk-l2-norm: the planner counts the memory of q/k norms of --normalization's kind (--qk-layernorm), "
            "not Megatron's L2 norm",
        ),
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
    for problem in (optimizer_problem(args.optimizer), cross_entropy_problem(args.cross_entropy_loss_fusion)):
        if problem:
            problems.append(problem)
    if "--eval-interval" in given and not args.eval_iters:
        problems.append(
            f"--eval-interval {args.eval_interval} without --eval-iters: no validation would run; add --eval-iters N "
            f"(validation steps per evaluation, N > 0), or leave --eval-interval out"
        )
    if args.split is not None:
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
            "the run from the last checkpoint (docs/configs.md); leave it out"
        )
    if not cuda and config.memory.budget_gib is None:
        problems.append("memory.budget_gib is required on a machine without CUDA (the config's memory section)")
    return problems


def _overlap_problems(args: argparse.Namespace, config: ParadyseConfig, transformer) -> list[str]:
    """What of Megatron's overlapped gradient reduction the plans would break."""
    if not (args.overlap_grad_reduce and transformer.qk_layernorm) or args.tensor_model_parallel_size == 1:
        return []
    options, _ = layer_options(config.planner, model_shape(transformer), args.tensor_model_parallel_size)
    in_parts = {name: get_strategy("attention", name).qk_norm_grads_in_parts for name in {o.attention for o in options}}
    return [
        f"--overlap-grad-reduce with --qk-layernorm and the {name} attention strategy in the plans: {name}'s backward "
        f"adds the q/k norm weights' gradients {how}, and Megatron's overlapped reduction counts each as the "
        "weight's gradient being ready; leave out --overlap-grad-reduce (and --overlap-param-gather), or keep "
        f"{name} out of the plans (planner.attention or planner.pairs)"
        for name, how in sorted(in_parts.items())
        if how
    ]


def _megatron_pad_id() -> int:
    tokenizer = get_tokenizer()
    pad = getattr(tokenizer, "pad", None)
    return tokenizer.eod if pad is None or pad < 0 else pad


def _assertion(e: AssertionError) -> str:
    """The assertion's message, or the failing line and where it is when it has none."""
    if str(e):
        return str(e)
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{frame.line} ({Path(frame.filename).name}:{frame.lineno})"


def _budget_bytes(config: ParadyseConfig, state: BudgetState | None, allocator_bytes: float | None) -> float:
    """The configured budget (``memory.budget_gib``, else ``allocator_bytes`` less ``memory.margin``; one of
    them is set where there is no CUDA: ``config_problems``), or the smaller one a run shrank to."""
    budget = config.memory.budget_bytes(allocator_bytes)
    return budget if state is None else min(budget, state.budget_bytes)


def _read_profile(config: ParadyseConfig, args: argparse.Namespace, *, check_machine: bool) -> dict | None:
    if config.cost.profile is None:
        return None
    return load_profile(
        config.cost.profile,
        p=args.tensor_model_parallel_size,
        check_machine=config.cost.check_machine and check_machine,
        host_link=config.planner.space.host_memory_gib > 0,
    )


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
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    if not (Path(dataset_utils.__file__).parent / "Makefile").exists():
        dataset_utils.compile_helpers = lambda: None
