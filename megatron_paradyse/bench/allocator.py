"""The CUDA caching allocator against the memory model: one rank's share of a Llama 3 8B layer, for real.

    python -m megatron_paradyse.bench allocator                 # on a machine with one GPU
    python -m megatron_paradyse.bench allocator --lengths 8192,16384 --options tp_sp/tp_sp,lean/lean+rc

The process plays one rank of ``p=8`` on a fake process group (:mod:`megatron_paradyse.mcore.trace`:
collectives move nothing, every tensor has the size that rank allocates, NCCL's own buffers are
absent) and runs the Megatron layer of Llama 3 8B (``--model``: any of ``bench memory``'s
``TRACE_MODELS``), bf16, b=1, one causal document, with real CUDA tensors; the rank is the one
``bench memory --trace`` traces (the largest predicted peak for ``ring`` and ``lean`` attention).

- **Sweep**: every option at every ``--lengths`` in increasing order, the allocator's cache emptied
  before each; ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` above what the
  window started with (weights, their gradient buffers, the input, the rotary table; the peak
  statistics reset per case), beside the storage tracker's count of the same window and
  :func:`~megatron_paradyse.cost.terms.layer_terms`. An option that runs out of memory is recorded
  and not run at longer lengths.
- **Sequence**: the lengths of ``--sequence`` one after the other, cycling through the options, the
  cache never emptied, as a planner switches: the reserved-over-allocated slack it accumulates
  (the largest reserved over the largest allocated, both absolute).

Both run twice, each in a child process: with the allocator's defaults and with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (read once, when CUDA initialises).

Attention kernel (``--kernel``, default ``auto``): ``flash_attn`` where it is installed, ``math``
otherwise; ``math`` keeps ``O(s^2)`` score matrices the model does not have, so its lengths stop early
and its errors say nothing about the model. Last line::

    alloc_err_max=<%> reserved_err_max=<%> expandable_alloc_err_max=<%> expandable_reserved_err_max=<%>
    slack=<ratio> expandable_slack=<ratio> longest=<tokens> cases=<n> oom=<n>

(errors: the largest ``|predicted - measured| / measured`` of the peak over the cases that fit;
``longest``: the longest length at which some option fit; ``cases``: those that fit; ``oom``: those
that ran out of memory, with the allocator's defaults.) ``--device cpu`` runs the same with real
CPU tensors and the tracker's figures only (allocator figures ``nan``): the command's own test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import torch

from megatron_paradyse.attention import get_kernel, kernel_names
from megatron_paradyse.bench.memory import (
    DTYPES,
    GIB,
    TRACE_MODELS,
    TraceCase,
    TraceConfig,
    parse_lengths,
    parse_options,
    trace_cases,
)
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.mcore.trace import LayerModel, LayerTrace, RankTracer, fake_world
from megatron_paradyse.planner.config import PlannerConfig, layer_options
from megatron_paradyse.strategies import ModelShape

__all__ = ["main"]

MODELS = {
    **TRACE_MODELS,
    # a Llama-like layer 64 wide: for a smoke run on any machine and the command's own test
    "tiny": LayerModel(
        shape=ModelShape(
            hidden_size=64, num_attention_heads=8, num_query_groups=8, kv_channels=8, ffn_hidden_size=96, gated_mlp=True
        ),
        normalization="RMSNorm",
        rotary_base=500000,
    ),
}
SETTINGS = {"default": None, "expandable": "expandable_segments:True"}
"""Allocator settings, each run in a child process: the value of ``PYTORCH_CUDA_ALLOC_CONF`` (None: unset)."""
LENGTHS = (8192, 16384, 32768, 65536, 131072)
SEQUENCE = (65536, 8192, 32768, 16384, 131072, 4096, 98304, 24576, 49152, 12288)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    model: str
    p: int
    lengths: tuple[int, ...]
    options: tuple[LayerOption, ...]
    sequence: tuple[int, ...]
    device: str
    kernel: str
    dtype: torch.dtype


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench allocator",
        description="CUDA allocator peaks of one rank's Llama 3 8B layer against the memory model, with and "
        "without expandable segments.",
    )
    parser.add_argument("--model", choices=tuple(MODELS), default="llama3-8b", help="the layer (tiny: a smoke run)")
    parser.add_argument("--p", type=int, default=8, help="the group size the traced rank belongs to")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="the sweep's sequence lengths")
    parser.add_argument(
        "--options", default=None, help="comma-separated layer options (default: every option the planner has)"
    )
    parser.add_argument("--sequence", default=",".join(map(str, SEQUENCE)), help="the varying-length sequence")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: tracker only (tests)")
    parser.add_argument(
        "--kernel",
        choices=("auto", *kernel_names()),
        default="auto",
        help="attention kernel (auto: flash_attn on CUDA where installed, else math: O(s^2) memory)",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    parser.add_argument("--child", choices=tuple(SETTINGS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser


def _config(args: argparse.Namespace) -> AllocatorConfig:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible (--device cpu runs the tracker only)")
    model = {args.model: MODELS[args.model]}
    if args.options is None:
        options = layer_options(PlannerConfig(), model[args.model].shape, args.p)[0]
    else:
        options = parse_options(args.options, model, args.p)
    return AllocatorConfig(
        model=args.model,
        p=args.p,
        lengths=tuple(sorted(parse_lengths(args.lengths))),
        options=tuple(options),
        sequence=parse_lengths(args.sequence, "--sequence"),
        device=args.device,
        kernel=args.kernel,
        dtype=DTYPES[args.dtype],
    )


# -- one allocator setting, in a child process ---------------------------------------------------------
def run_setting(cfg: AllocatorConfig) -> dict:
    """The sweep and the sequence under this process's allocator settings."""
    device = torch.device(cfg.device)
    cases = trace_cases(
        TraceConfig(
            models={cfg.model: MODELS[cfg.model]},
            p=cfg.p,
            lengths=cfg.lengths,
            options=cfg.options,
            layer="megatron",
            dtype=cfg.dtype,
            all_ranks=False,
            batch=1,
        )
    )
    layouts = {n: SequenceLayout.build(n, cfg.p, causal=True) for n in {*cfg.lengths, *cfg.sequence}}
    traces: dict[TraceCase, LayerTrace | None] = {}
    out_of_memory_at: dict[LayerOption, int] = {}  # the shortest length an option ran out of memory at
    for rank in sorted({c.rank for c in cases}):
        with _tracer(cfg, rank) as tracer:
            for case in (c for c in cases if c.rank == rank):  # lengths in increasing order
                if case.length >= out_of_memory_at.get(case.option, math.inf):
                    continue
                _release(device)
                traces[case] = _trace_or_none(tracer, case.option, layouts[case.length])
                if traces[case] is None:
                    out_of_memory_at[case.option] = case.length
                _progress(f"s={case.length} {case.option} rank {case.rank}: " + _outcome(traces[case]))
    sweep = [
        {"length": c.length, "option": str(c.option), "rank": c.rank, "ran": c in traces, **_figures(traces.get(c))}
        for c in cases
    ]
    sequence = []
    _release(device)
    with _tracer(cfg, 0) as tracer:
        for i, length in enumerate(cfg.sequence):
            option = cfg.options[i % len(cfg.options)]
            trace = _trace_or_none(tracer, option, layouts[length])
            sequence.append({"length": length, "option": str(option), **_figures(trace)})
            _progress(f"sequence step {i + 1}/{len(cfg.sequence)}: s={length} {option}: " + _outcome(trace))
    return {
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "kernel": _kernel_name(cfg),
        "sweep": sweep,
        "sequence": sequence,
    }


@contextlib.contextmanager
def _tracer(cfg: AllocatorConfig, rank: int) -> Iterator[RankTracer]:
    """Rank ``rank``'s layer, warmed up: libraries' workspaces (cuBLAS) are allocated on first use and
    belong to what every window starts with."""
    kwargs = dict(layer="megatron", dtype=cfg.dtype, device=cfg.device, fake=False, kernel=cfg.kernel)
    with fake_world(rank, cfg.p), RankTracer(MODELS[cfg.model], **kwargs) as tracer:
        tracer.trace(cfg.options[0], SequenceLayout.build(2 * cfg.p, cfg.p, causal=True))
        yield tracer


def _trace_or_none(tracer: RankTracer, option: LayerOption, layout: SequenceLayout) -> LayerTrace | None:
    """The trace, or None if the device ran out of memory (then its tensors are released)."""
    try:
        return tracer.trace(option, layout)
    except torch.OutOfMemoryError:
        pass  # the traceback holds the failed step's tensors: released once out of the handler
    _release(tracer.device)
    return None


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _figures(trace: LayerTrace | None) -> dict:
    if trace is None:
        return {"oom": True}
    alloc = trace.allocator
    return {
        "oom": False,
        "traced_saved_bytes": trace.saved_bytes,
        "traced_peak_bytes": trace.peak_bytes,
        "allocated_peak_bytes": alloc.allocated_bytes if alloc else None,
        "reserved_peak_bytes": alloc.reserved_bytes if alloc else None,
        "allocated_saved_bytes": alloc.saved_allocated_bytes if alloc else None,
        "held_allocated_bytes": alloc.held_allocated_bytes if alloc else None,
        "held_reserved_bytes": alloc.held_reserved_bytes if alloc else None,
    }


def _outcome(trace: LayerTrace | None) -> str:
    if trace is None:
        return "out of memory"
    alloc = trace.allocator
    measured = f", allocated {alloc.allocated_bytes / GIB:.3f} GiB" if alloc else ""
    return f"tracker {trace.peak_bytes / GIB:.3f} GiB{measured} ({trace.seconds:.1f} s)"


def _kernel_name(cfg: AllocatorConfig) -> str:
    return get_kernel(cfg.kernel, torch.device(cfg.device), cfg.dtype).name


def _progress(text: str) -> None:
    print(f"bench allocator [{os.environ.get('PYTORCH_CUDA_ALLOC_CONF') or 'default'}]: {text}", file=sys.stderr)


# -- the parent: both settings, the table, the figures -------------------------------------------------
def _run_children(argv: list[str]) -> dict[str, dict]:
    results = {}
    with tempfile.TemporaryDirectory(prefix="paradyse-allocator-") as tmp:
        for setting, conf in SETTINGS.items():
            out = os.path.join(tmp, f"{setting}.json")
            env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
            if conf is not None:
                env["PYTORCH_CUDA_ALLOC_CONF"] = conf
            command = [sys.executable, "-m", "megatron_paradyse.bench", "allocator", *argv, "--child", setting]
            subprocess.run([*command, "--out", out], env=env, check=True)
            with open(out) as f:
                results[setting] = json.load(f)
    return results


def _predicted_peak(cfg: AllocatorConfig, row: dict) -> float:
    model, layout = MODELS[cfg.model], SequenceLayout.build(row["length"], cfg.p, causal=True)
    dims = model.dims("megatron", cfg.p, layout, 1, cfg.dtype, device=torch.device(cfg.device).type)
    return layer_terms(LayerOption.parse(row["option"]), dims, layout, row["rank"]).peak_bytes


def _err(predicted: float, measured: int | None) -> float:
    return math.nan if measured is None else 100.0 * (predicted - measured) / measured


def _report(cfg: AllocatorConfig, results: dict[str, dict]) -> dict[str, str]:
    default, expandable = results["default"], results["expandable"]
    print(
        f"# One rank's share (p={cfg.p}, fake process group) of a {cfg.model} Megatron layer, {str(cfg.dtype)[6:]}, "
        f"b=1, one causal document, real tensors on {cfg.device}, '{default['kernel']}' attention kernel; forward + "
        "backward.\n"
        "# Peaks above the window's start (weights, gradient buffers, input, rotary table), cache emptied per case: "
        "tracker = storages' bytes (megatron_paradyse.core.memory), alloc/resv = torch.cuda.max_memory_allocated/"
        "reserved; default and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (expd).\n"
        "# predicted: layer_terms; err = (predicted - measured) / measured."
    )
    print(
        f"{'length':>8}  {'option':<20}{'rank':>5}{'pred GiB':>10}{'tracker':>9}{'alloc':>9}{'resv':>9}"
        f"{'expd alloc':>11}{'expd resv':>10}{'alloc err%':>11}{'resv err%':>10}"
    )
    errors = {"alloc": [], "reserved": [], "expandable_alloc": [], "expandable_reserved": []}
    for row, expd in zip(default["sweep"], expandable["sweep"]):
        predicted = _predicted_peak(cfg, row)
        head = f"{row['length']:>8}  {row['option']:<20}{row['rank']:>5}{predicted / GIB:>10.3f}"
        if row["oom"]:
            what = "out of memory" if row["ran"] else "not run (out of memory at a shorter length)"
            print(f"{head}  {what}" + ("" if expd["oom"] else " (default settings only)"))
            continue
        errs = {
            "alloc": _err(predicted, row["allocated_peak_bytes"]),
            "reserved": _err(predicted, row["reserved_peak_bytes"]),
            "expandable_alloc": math.nan if expd["oom"] else _err(predicted, expd["allocated_peak_bytes"]),
            "expandable_reserved": math.nan if expd["oom"] else _err(predicted, expd["reserved_peak_bytes"]),
        }
        for key, value in errs.items():
            errors[key].append(value)
        cols = [row["traced_peak_bytes"], row["allocated_peak_bytes"], row["reserved_peak_bytes"]]
        cols += [None, None] if expd["oom"] else [expd["allocated_peak_bytes"], expd["reserved_peak_bytes"]]
        print(
            head
            + "".join(f"{_gib(v):>{w}}" for v, w in zip(cols, (9, 9, 9, 11, 10)))
            + f"{errs['alloc']:>11.1f}{errs['reserved']:>10.1f}"
        )
    print("# sequence (cache kept): length option -> allocated / reserved GiB (absolute peaks), default | expd")
    for row, expd in zip(default["sequence"], expandable["sequence"]):
        print(f"#   {row['length']:>8} {row['option']:<20} {_absolute(row)} | {_absolute(expd)}")
    fitted = [r for r in default["sweep"] if not r["oom"]]
    figures = {f"{key}_err_max": _max_abs(values) for key, values in errors.items()}
    figures.update(
        slack=_slack(default["sequence"]),
        expandable_slack=_slack(expandable["sequence"]),
        longest=str(max((r["length"] for r in fitted), default=0)),
        cases=str(len(fitted)),
        oom=str(sum(r["oom"] and r["ran"] for r in default["sweep"])),
    )
    return figures


def _gib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GIB:.3f}"


def _absolute(row: dict) -> str:
    if row["oom"]:
        return "out of memory"
    if row["held_allocated_bytes"] is None:
        return "- / -"
    allocated = row["held_allocated_bytes"] + row["allocated_peak_bytes"]
    reserved = row["held_reserved_bytes"] + row["reserved_peak_bytes"]
    return f"{allocated / GIB:.3f} / {reserved / GIB:.3f}"


def _slack(sequence: list[dict]) -> str:
    """The largest reserved over the largest allocated, both absolute, over the sequence's steps."""
    steps = [r for r in sequence if not r["oom"] and r["held_allocated_bytes"] is not None]
    if not steps:
        return "nan"
    allocated = max(r["held_allocated_bytes"] + r["allocated_peak_bytes"] for r in steps)
    reserved = max(r["held_reserved_bytes"] + r["reserved_peak_bytes"] for r in steps)
    return f"{reserved / allocated:.3f}"


def _max_abs(values: list[float]) -> str:
    finite = [abs(v) for v in values if not math.isnan(v)]
    return f"{max(finite):.2f}" if finite else "nan"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        cfg = _config(args)
    except ValueError as e:
        print(f"bench allocator: error: {e}", file=sys.stderr)
        return 2
    if args.child:
        with open(args.out, "w") as f:
            json.dump(run_setting(cfg), f)
        return 0
    try:
        results = _run_children(argv)
    except subprocess.CalledProcessError as e:
        print(f"bench allocator: error: a child run failed ({e})", file=sys.stderr)
        return 1
    figures = _report(cfg, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "results": results, "figures": figures}, f, indent=1)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0
