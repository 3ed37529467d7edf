"""``paradyse <command>``: the command-line entry point (``python -m megatron_paradyse.cli``).

Commands: ``calibrate`` (measure this machine and write a cost profile), ``check-config`` (validate a
paradyse config and print it resolved), ``plan`` (will it fit: the plans per length before launching),
``demo`` (the CPU demo; ``paradyse demo --help``). Each command is a
``_cmd_<name>(args) -> int`` registered in :func:`_parser`; user errors print ``paradyse: error: ...``
and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_paradyse.calibration.calibrate import calibrate, calibrate_on_group
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile, node_group
from megatron_paradyse.cost.profile import load_profile, save_profile
from megatron_paradyse.run import config_cli, plan_cli
from megatron_paradyse.run.demo import main as demo_main
from megatron_paradyse.strategies import get_strategy, strategy_names

__all__ = ["main"]


def _cmd_calibrate(args: argparse.Namespace) -> int:
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.access(folder, os.W_OK):  # before minutes of measuring, not after
        raise ValueError(f"cannot write the profile to {args.output}: {folder} is not a writable directory")
    p, dtype, model = args.p or [4], args.dtype or "float32", {}
    if args.config is not None:
        job = config_cli.calibration_target(args.config, args.megatron_flags)
        p, dtype = args.p or [job.p], args.dtype or job.dtype
        model = {"shape": job.shape, "longest": job.longest}
    elif args.megatron_flags:
        raise ValueError(f"Megatron flags ({' '.join(args.megatron_flags)}) go with --config, which they override")
    start = time.perf_counter()
    settings = dict(grid=args.grid, dtype=getattr(torch, dtype), fit_correction=args.fit_correction, **model)
    if args.fake_group:
        profile = _calibrate_one_rank_of(p, args.links, args.device, settings, show_progress=not args.quiet)
        how = f"one GPU as rank 0 of {profile['concurrency']} on a fake group, links from {args.links}"
    else:
        if args.links is not None:
            raise ValueError("--links gives the collectives of a fake group, which measures none: add --fake-group")
        profile = calibrate(p, device=args.device, show_progress=not args.quiet, **settings)
        how = f"p in {sorted(profile['collectives'], key=int) or [1]}, {profile['concurrency']} ranks at once"
    save_profile(profile, args.output)
    measured = "" if not model else f", the model's own work up to {model['longest']} tokens"
    print(
        f"wrote {args.output}: {args.grid} grid{measured}, {how}, {time.perf_counter() - start:.0f} s",
        file=sys.stderr,
    )
    return 0


def _calibrate_one_rank_of(p: list[int], links: str | None, device: str, settings: dict, *, show_progress: bool):
    """``--fake-group``: this process alone as rank 0 of a fake group of ``p`` ranks, on its GPU: one
    rank's compute at ``p`` ranks' shapes, the collectives and ring overlap from ``links``."""
    from megatron_paradyse.mcore.trace import fake_world  # megatron-core: not for the other commands

    if len(p) != 1:
        raise ValueError(f"--fake-group stands for one group size, got --p {','.join(map(str, p))}")
    if device != "cuda":
        raise ValueError(
            "--fake-group measures one GPU standing for each rank; on the CPU the ranks share the cores, so "
            "calibrate them together: leave out --fake-group"
        )
    if links is None:
        raise ValueError(
            "--fake-group measures no collective (a fake group's move nothing): give --links, a profile "
            f"calibrated on the cluster (`paradyse calibrate --p {p[0]}`) or a node's published figures "
            f"({', '.join(HARDWARE)})"
        )
    if links in HARDWARE:
        try:
            link_profile = hardware_profile(node_group(links, p[0]))
        except ValueError as e:
            raise ValueError(f"--links {links}: {e}") from None
    else:  # measured on the cluster, where this machine need not be
        link_profile = load_profile(links, p=p[0], check_machine=False)
    if not torch.cuda.is_available():
        raise ValueError(
            "--fake-group measures this machine's GPU, and it has none (torch.cuda.is_available() is False)"
        )
    with fake_world(0, p[0]):
        gpu = torch.device("cuda", torch.cuda.current_device())
        return calibrate_on_group(
            dist.group.WORLD, device=gpu, links=link_profile, show_progress=show_progress, **settings
        )


def _p_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--p takes group sizes like 2,4, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--p takes positive group sizes, got {text!r}")
    return values


def _cmd_strategies(args: argparse.Namespace) -> int:
    for sublayer in ("attention", "mlp"):
        for name in strategy_names(sublayer):
            print(f"{sublayer:<9} {name:<8} {get_strategy(sublayer, name).summary}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paradyse", description="megatron-paradyse tools")
    commands = parser.add_subparsers(dest="command", required=True)
    cal = commands.add_parser("calibrate", help="measure kernels and collectives; write a cost profile (JSON)")
    cal.add_argument("--output", "-o", required=True, help="profile file to write")
    cal.add_argument(
        "--p", type=_p_list, help="group sizes to calibrate collectives for (default: --config's TP size, else 4)"
    )
    cal.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    cal.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="default: --config's precision, else float32"
    )
    cal.add_argument(
        "--config",
        help="a paradyse config: also measure its model's own GEMMs and attention, up to its longest micro-batch",
    )
    cal.add_argument(
        "megatron_flags",
        nargs="*",
        metavar="-- MEGATRON_FLAGS",
        help="after --config and a '--': Megatron flags that override its megatron_args, as in the job",
    )
    cal.add_argument("--grid", choices=("quick", "full"), default="full", help="measurement grid (default full)")
    cal.add_argument(
        "--fit-correction",
        action="store_true",
        help="also time a few whole layers and fit the correction of DESIGN section 4",
    )
    cal.add_argument(
        "--fake-group",
        action="store_true",
        help="this GPU alone as one rank of --p on a fake process group: one rank's compute at p ranks' shapes, "
        "the collectives from --links (CUDA; a single --p)",
    )
    cal.add_argument(
        "--links",
        metavar="PROFILE|GPU",
        help="with --fake-group: the collectives and ring overlap, from a profile calibrated on the cluster or a "
        "node's published figures (a100, h100, h200)",
    )
    cal.add_argument("--quiet", action="store_true", help="no progress bar")
    cal.set_defaults(run=_cmd_calibrate)
    check = commands.add_parser("check-config", help="validate a paradyse config and its megatron_args")
    config_cli.add_check_config_arguments(check)
    check.set_defaults(run=config_cli.run_check_config)
    plan = commands.add_parser("plan", help="will it fit? the plans, time and peak per length, before launching")
    plan_cli.add_plan_arguments(plan)
    plan.set_defaults(run=plan_cli.run_plan)
    listing = commands.add_parser("strategies", help="the strategy library: each strategy and what it does")
    listing.set_defaults(run=_cmd_strategies)
    # Listed for --help; main() hands "demo ..." to the demo, which parses its own options.
    commands.add_parser("demo", help="the CPU demo: train a small GPT on 4 gloo ranks, switching plans")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["demo"]:
        return demo_main(argv[1:])
    parser = _parser()
    # Megatron flags after "--" (every command takes them) are split off here: argparse gives a positional
    # that follows options nothing ("check-config FILE --world-size 8 -- --bf16" would refuse "--bf16")
    head, flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(head)
    args.megatron_flags = flags
    try:
        return args.run(args)
    except ValueError as e:  # bad input: a message, not a traceback
        parser.exit(2, f"paradyse: error: {e}\n")


if __name__ == "__main__":
    sys.exit(main())
