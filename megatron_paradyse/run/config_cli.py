"""``paradyse check-config FILE [--world-size N] [--print-config] [-- MEGATRON_FLAGS]``: validate a paradyse
config before a job starts.

Checks everything :func:`~megatron_paradyse.config.load_config` checks (keys, types, ranges, strategy
names), then parses the config's ``megatron_args`` (and the job's command-line flags, after ``--``) with
Megatron-LM's own argument parser, so a misspelt Megatron flag fails here rather than on every rank of a
job; where the flags name a model, it runs what the job's ranks check before their first step, with the
job's code, on a machine of this one's kind or of ``--device``'s: the arguments
(:func:`~megatron_paradyse.run.job.job_arguments`), the tokenizer, the budget, cost profile and static
memory (:meth:`~megatron_paradyse.run.job.Job.checked`), the dataset
(:func:`~megatron_paradyse.run.documents.training_documents`). ``--print-config`` prints the resolved
config (paths made absolute) as YAML; loading that output gives the same config.

A bad config prints ``paradyse: error: ...`` (every problem, one per line) and exits with status 2;
``paradyse``'s parser (``megatron_paradyse/cli.py``) wires :func:`add_check_config_arguments` and
:func:`run_check_config`.
:func:`calibration_argv` gives the ``paradyse calibrate`` arguments a config's job needs (used by
``scripts/slurm/calibrate.sbatch``), :func:`calibration_target` what that job computes.

Megatron-LM's parser and the job's checks (megatron-core) are imported inside the functions that use
them: ``paradyse``'s parser imports this module for every command.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import yaml

from megatron_paradyse.config import ConfigError, ParadyseConfig, load_config, section_keys
from megatron_paradyse.run.megatron_flags import parse_megatron_args
from megatron_paradyse.strategies import ModelShape

__all__ = [
    "CalibrationTarget",
    "add_check_config_arguments",
    "calibration_argv",
    "calibration_target",
    "format_config",
    "model_shape_from_args",
    "run_check_config",
    "world_size",
]


def add_check_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="paradyse YAML config")
    parser.add_argument(
        "--world-size",
        type=world_size,
        help="the job's ranks, for Megatron's checks that depend on it (default: one data-parallel replica)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="check the job as it starts on machines of this kind (default: this machine's kind)",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML")
    parser.add_argument(
        "megatron_flags",
        nargs="*",
        metavar="-- MEGATRON_FLAGS",
        help="after a '--': the job's command-line Megatron flags, which override the config's megatron_args",
    )


def world_size(text: str) -> int:
    """``--world-size``'s value: a job's ranks, a positive number."""
    try:
        ranks = int(text)
    except ValueError:
        ranks = 0
    if ranks < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of ranks, got {text!r}")
    return ranks


def run_check_config(args: argparse.Namespace) -> int:
    """The command, for ``paradyse``'s parser: raises :class:`ConfigError` for a bad config, or for one
    whose job would stop before it starts, ``ValueError`` for a Megatron flag its parser refuses (the job's
    own line). Flags that name no model (a config completed by the job's command line) are parsed, not
    checked as a job's."""
    config = load_config(args.config)
    parsed = parse_megatron_args(args.megatron_flags, config_flags=config.megatron_args)
    if None in (parsed.num_layers, parsed.hidden_size, parsed.num_attention_heads):
        checked = (
            "Megatron's parser takes its flags; they name no model (--num-layers, --hidden-size, "
            "--num-attention-heads), so the job's start-up checks did not run: give the job's flags after '--'"
        )
    else:
        from megatron_paradyse.run.job import quiet_megatron

        with quiet_megatron():
            checked = _check_job(config, args)
    print(format_config(config) if args.print_config else f"{args.config}: valid ({checked})\n", end="")
    return 0


def _check_job(config: ParadyseConfig, args: argparse.Namespace) -> str:
    """What the job's ranks check before their first step, on a machine of ``args.device``'s kind: its
    arguments, then its budget, cost profile and static memory, and its dataset (opened, token ids against
    the tokenizer's vocabulary, the splits); :class:`ConfigError` with every problem a rank would stop on,
    in the job's own words. Returns what was checked."""
    import torch

    from megatron_paradyse import mcore  # noqa: F401 - the CPU shim, before megatron
    from megatron_paradyse.core.memory import device_memory_bytes
    from megatron_paradyse.data.corpora import NotBuilt
    from megatron_paradyse.run.documents import training_documents
    from megatron_paradyse.run.job import Job, job_arguments
    from megatron_paradyse.run.startup import attempt

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    here = "cuda" if torch.cuda.is_available() else "cpu"
    kind = args.device or here
    machine = "on a GPU" if kind == "cuda" else "on a machine without CUDA"
    stopped = f"{args.config}: its job would stop at start-up ({machine})"
    try:
        job_args, model_config = job_arguments(
            config, args.megatron_flags, world_size=args.world_size, cuda=kind == "cuda"
        )
    except ValueError as e:
        raise ConfigError(f"{stopped}: {e}") from e
    # Megatron's start-up builds the tokenizer, which pads the vocabulary (args.padded_vocab_size) too
    tokenizer, problem = attempt(lambda: build_tokenizer(job_args))
    if problem:
        raise ConfigError(f"{stopped}: its tokenizer: {problem}")
    device = torch.device("cuda", torch.cuda.current_device()) if kind == here == "cuda" else torch.device(kind)
    device_bytes = device_memory_bytes(device) if kind == here else None
    job, problem = attempt(
        lambda: Job.checked(
            config, job_args, model_config, device=device, device_bytes=device_bytes, check_machine=kind == here
        )
    )
    problems = [problem] if problem else []
    unchecked = []
    if job is not None and job.budget_bytes is None:
        unchecked.append("static memory not checked: the budget is the GPU's memory, measured at start-up")
    try:
        _, problem = attempt(lambda: training_documents(config, job_args, tokenizer.vocab_size, build=False))
        problems += [problem] if problem else []
    except NotBuilt as e:
        unchecked.append(f"dataset not checked: its job builds the {config.data.dataset} corpus into {e} at start-up")
    if problems:  # each as the job says it; the job stops at the first
        raise ConfigError(f"{stopped}: " + (problems[0] if len(problems) == 1 else "\n  - ".join(["", *problems])))
    checked = f"checked as its job's ranks check it {machine}, at {job_args.world_size} ranks"
    return "; ".join([checked, *unchecked])


def model_shape_from_args(args: argparse.Namespace) -> ModelShape:
    """The transformer layer of parsed Megatron flags, with Megatron's defaults (``kv_channels = h / n``,
    ``ffn_hidden_size = 4h``, MHA unless ``--group-query-attention``)."""
    heads = args.num_attention_heads
    return ModelShape(
        hidden_size=args.hidden_size,
        num_attention_heads=heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else heads,
        kv_channels=args.kv_channels or args.hidden_size // heads,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size,
        gated_mlp=args.swiglu,
        qk_norm=args.qk_layernorm,
    )


@dataclasses.dataclass(frozen=True)
class CalibrationTarget:
    """What a job run with a config (and Megatron flags after its ``megatron_args``) computes: its
    tensor-parallel size, dtype, layer and longest micro-batch (``--seq-length``, else the config's)."""

    p: int
    dtype: str
    shape: ModelShape
    longest: int


def calibration_target(config_path: str | Path, megatron_flags: Sequence[str] = ()) -> CalibrationTarget:
    config = load_config(config_path)
    args = parse_megatron_args(megatron_flags, config_flags=config.megatron_args)
    if args.hidden_size is None or args.num_attention_heads is None:
        raise ConfigError(
            f"{config_path}: calibration measures the model's own work, and the config's megatron_args (with the "
            f"flags given) name no model: add --hidden-size and --num-attention-heads (--ffn-hidden-size, "
            f"--num-query-groups, --kv-channels where they differ from Megatron's defaults)"
        )
    return CalibrationTarget(
        p=args.tensor_model_parallel_size,
        dtype="bfloat16" if args.bf16 else "float16" if args.fp16 else "float32",
        shape=model_shape_from_args(args),
        longest=args.seq_length or config.data.token_budget or config.data.max_len,
    )


def calibration_argv(config_path: str | Path, megatron_flags: Sequence[str] = (), *, p: str | None = None) -> list[str]:
    """``paradyse calibrate`` arguments for a job run with the config at ``config_path`` and
    ``megatron_flags`` (given after the config's ``megatron_args``): its tensor-parallel size (or the
    group sizes ``p``, e.g. ``"4,8"``), its dtype, its model's own work, on CUDA, the full grid, written
    where ``cost.profile`` points."""
    config = load_config(config_path)
    if config.cost.profile is None:
        raise ConfigError(
            "cost.profile is not set: name the file that calibration writes and training reads, "
            "e.g. cost: {profile: profiles/p8-bf16.json}"
        )
    target = calibration_target(config_path, megatron_flags)
    measured = ["--p", p or str(target.p), "--dtype", target.dtype, "--device", "cuda", "--grid", "full"]
    flags = ["--", *megatron_flags] if megatron_flags else []
    return ["calibrate", "--output", config.cost.profile, *measured, "--config", str(config_path), *flags]


def format_config(config: ParadyseConfig) -> str:
    """The resolved config as YAML that :func:`load_config` reads back to an equal config."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    return yaml.safe_dump(plain(section_keys(config)), sort_keys=False)
