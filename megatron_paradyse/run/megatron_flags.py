"""Megatron's command-line flags, read by Megatron-LM's own parser, with a flag it refuses said in one line.

Megatron's parser is argparse's: a misspelt flag or a bad value prints its whole usage (some 700
lines), then argparse's one-line reason, and exits; in a job, on every rank. :func:`parse_megatron_args`
parses the flags as Megatron's ``parse_args`` does and raises ``ValueError`` with one line instead:
argparse's reason for a bad value, the closest of Megatron's flags for an unknown one. The entry point
calls it before Megatron parses, so a job's ranks agree on that line and rank 0 prints it; ``paradyse
check-config``, ``plan`` and ``calibrate`` print the same.

Megatron-LM's parser is imported inside the functions that use it: ``paradyse``'s parser and the
entry point import this module before anything may import megatron-core.
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Callable, Sequence
from typing import NoReturn

__all__ = ["RaisingParser", "megatron_parser", "parse_megatron_args"]

_FLAG = re.compile(r"--?[A-Za-z]")
"""What starts a flag (a negative number, the value of the flag before it, does not)."""


class RaisingParser(argparse.ArgumentParser):
    """argparse's parser, raising its one-line reason as a ``ValueError`` rather than printing its usage
    and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def megatron_parser(
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None, **kwargs
) -> RaisingParser:
    """Megatron-LM's argument parser as its ``parse_args`` builds it, with ``extra_args_provider``'s flags
    (``kwargs``: the parser's, a ``prog`` or ``description``)."""
    from megatron_paradyse import mcore  # noqa: F401 - the CPU shim, before megatron

    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(RaisingParser(allow_abbrev=False, **kwargs))
    return parser if extra_args_provider is None else extra_args_provider(parser)


def parse_megatron_args(
    flags: Sequence[str],
    extra_args_provider: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
    *,
    config_flags: Sequence[str] = (),
) -> argparse.Namespace:
    """``config_flags`` (a config's ``megatron_args``) then ``flags`` parsed by Megatron-LM's own parser,
    with ``extra_args_provider``'s flags; ``ValueError`` in one line for a bad value (argparse's reason:
    "argument --lr: invalid float value: 'abc'") or unknown flags (each with the closest of Megatron's,
    and where it came from if from ``config_flags``: "--num-layer: not a Megatron flag; did you mean
    --num-layers?").

    Only parsing: Megatron's cross-checks (``validate_args``) need the job's world size and run when
    the job starts. Where a flag repeats, the last one wins, as on a command line.
    """
    parser = megatron_parser(extra_args_provider)
    args, unknown = parser.parse_known_args([*config_flags, *flags])  # a bad value raises here
    if unknown:
        raise ValueError(_unknown_flags(unknown, parser, config_flags=config_flags, command_line=flags))
    return args


def _unknown_flags(
    unknown: list[str], parser: argparse.ArgumentParser, *, config_flags: Sequence[str], command_line: Sequence[str]
) -> str:
    """One line on the arguments ``parser`` does not know: each unknown flag, with its closest known one."""
    names = [token.split("=", 1)[0] for token in unknown if _FLAG.match(token)]
    if not names:  # values alone: Megatron takes no positional argument
        return f"unrecognized arguments: {' '.join(unknown)}"
    from_config = _names(config_flags) - _names(command_line)
    known = list(parser._option_string_actions)  # every flag, each spelling (argparse has no public list)
    problems = []
    for name in dict.fromkeys(names):
        where = " (in the config's megatron_args)" if name in from_config else ""
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"did you mean {close[0]}?" if close else "`python -m megatron_paradyse.pretrain_gpt --help` lists them"
        problems.append(f"{name}{where}: not a Megatron flag; {hint}")
    return "; ".join(problems)


def _names(flags: Sequence[str]) -> set[str]:
    return {flag.split("=", 1)[0] for flag in flags if _FLAG.match(flag)}
