"""Peak memory of each strategy, with and without per-layer recompute, per rank.

    python -m megatron_paradyse.bench memory                      # p=4 gloo ranks on CPU
    python -m megatron_paradyse.bench memory --p 2 --lengths 512,2048
    python -m megatron_paradyse.bench memory --device cuda        # one rank's share on one GPU
    python -m megatron_paradyse.bench memory --trace              # production layers, traced, vs the model

A stack of ``--layers`` pre-LN GPT layers (MHA, GELU MLP, biases, causal; no RoPE) runs forward and
backward on every rank under one layer option at a time; the peak bytes allocated in that window
are measured per rank with :class:`~megatron_paradyse.core.memory.PeakMemory`. What was held before the
window is not counted: the weight shards, their gradients (allocated beforehand, as Megatron's
gradient buffers are) and the input. A stack, not one layer: saved activations accumulate over
layers, which is what recompute trades away.

``--device cuda`` measures *one rank's share* of a ``p``-rank run on a single GPU: the process joins
a fake process group (PyTorch's ``fake`` backend, as torchtitan's dry runs use) as rank ``--rank``
of ``p``, so every tensor has the size rank ``--rank`` would allocate, but collectives move no data
(received buffers hold garbage, which changes no allocation) and NCCL's own buffers are absent.
``--simulate`` does the same on CPU, where its figures match rank ``--rank``'s in the real gloo run
(most to the byte; tested within 15%: gloo's threads may drop a sent buffer a moment late).
Python's cyclic garbage collector is paused inside the window, so figures do not depend on when it
happens to run.

``--trace`` checks the memory model at production shapes instead: one layer of Llama 3 8B and of the
ParaDySe paper's GPT (:data:`TRACE_MODELS`), bf16, b=1, one causal document of each ``--lengths``,
on ``p=8`` ranks, under every layer option the planner has, traced with
:func:`megatron_paradyse.mcore.trace.trace_rank` (a fake process group and fake tensors: no memory,
no peers) and laid beside :func:`~megatron_paradyse.cost.terms.layer_terms`. The traced layer is
Megatron's ``TransformerLayer`` from the Paradyse spec (``--layer run_layer``: the cost models' own
test layer). ``ring`` and ``lean`` attention allocate differently per rank: the rank traced is the one
whose predicted peak is the largest (``--all-ranks``: every rank, every option). The last line is
``traced_mem_err_max=<percent> traced_cases=<n>``: the largest ``|predicted - traced| / traced`` of
the peak over all cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel, kernel_names
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.memory import PeakMemory, freeze_what_lives_now
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.mcore.bare_layer import LayerParams, make_layer_params, run_layer
from megatron_paradyse.mcore.trace import LAYER_KINDS, LayerKind, LayerModel, LayerTrace, fake_world, trace_rank
from megatron_paradyse.planner.config import PlannerConfig, layer_options
from megatron_paradyse.strategies import AttentionContext, MLPContext, ModelShape, get_strategy, unsupported_reason

PAIRINGS = ("tp_sp/tp_sp", "ulysses/zero3", "ring/zero3", "lean/lean")
"""Each attention strategy with its natural MLP partner; the first is the baseline of the ratios."""

MIB = 2**20
GIB = 2**30

TRACE_MODELS = {
    # configs/llama3-8b.yaml: GQA, SwiGLU, RMSNorm, RoPE base 500000, no biases
    "llama3-8b": LayerModel(
        shape=ModelShape(
            hidden_size=4096,
            num_attention_heads=32,
            num_query_groups=8,
            kv_channels=128,
            ffn_hidden_size=14336,
            gated_mlp=True,
        ),
        normalization="RMSNorm",
        rotary_base=500000,
    ),
    # configs/paper-gpt.yaml: GPT-3 175B's layer, MHA, GELU, LayerNorm, no linear biases, RoPE (Megatron's base)
    "gpt": LayerModel(
        shape=ModelShape(
            hidden_size=12288,
            num_attention_heads=96,
            num_query_groups=96,
            kv_channels=128,
            ffn_hidden_size=49152,
        ),
        normalization="LayerNorm",
        rotary_base=10000,
    ),
}
"""The production layers ``--trace`` runs, by name."""
TRACE_LENGTHS = (8192, 65536, 262144, 1048576)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _option(pairing: str, recompute: bool) -> LayerOption:
    return dataclasses.replace(LayerOption.parse(pairing), recompute=recompute)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    shape: ModelShape
    p: int
    lengths: tuple[int, ...]
    layers: int
    batch: int
    pairings: tuple[str, ...]
    device: str
    dtype: torch.dtype
    kernel: str


def _stack_forward_backward(x_local, layers: list[LayerParams], option: LayerOption, actx, mctx) -> None:
    y_local = x_local
    for params in layers:
        y_local = run_layer(y_local, params, option, actx, mctx)
    y_local.float().square().sum().backward()


def measure(rank: int, p: int, cfg: BenchConfig) -> dict[str, int]:
    """Peak bytes of forward+backward on this rank, keyed ``"<option>@<length>"``."""
    group = dist.group.WORLD
    device = torch.device(cfg.device)
    gen = torch.Generator().manual_seed(1234 + rank)
    layers = [make_layer_params(cfg.shape, p, rank, dtype=cfg.dtype, device=device, seed=i) for i in range(cfg.layers)]
    params = [t for layer in layers for t in layer.tensors()]
    kernel = get_kernel(cfg.kernel, device, cfg.dtype)
    mctx = MLPContext(group=group, shape=cfg.shape, activation=F.gelu)

    def run(option: LayerOption, length: int) -> int:
        layout = SequenceLayout.build(length, p, causal=True)
        actx = AttentionContext(
            group=group, layout=layout, shape=cfg.shape, kernel=kernel, softmax_scale=cfg.shape.kv_channels**-0.5
        )
        for t in params:  # gradient buffers exist before the window, as in Megatron
            t.grad = torch.zeros_like(t)
        x_local = torch.randn(layout.local_len, cfg.batch, cfg.shape.hidden_size, generator=gen)
        x_local = x_local.to(device, cfg.dtype).requires_grad_()
        dist.barrier(group=group)
        # Paused collector: tensors freed only with a reference cycle count until the window ends.
        gc.collect()
        gc.disable()
        try:
            with PeakMemory(device) as peak:
                _stack_forward_backward(x_local, layers, option, actx, mctx)
        finally:
            gc.enable()
        return peak.peak_bytes

    if device.type == "cuda":  # library workspaces (cuBLAS, flash-attn) are allocated on first use
        run(LayerOption.parse(cfg.pairings[0]), min(cfg.lengths))
    peaks = {}
    for length in cfg.lengths:
        for pairing in cfg.pairings:
            for rc in (False, True):
                option = _option(pairing, rc)
                peaks[f"{option}@{length}"] = run(option, length)
                if rank == 0:
                    print(
                        f"bench memory: {option} s={length}: {peaks[f'{option}@{length}'] / MIB:.1f} MiB",
                        file=sys.stderr,
                    )
    return peaks


def simulate_rank(rank: int, cfg: BenchConfig) -> dict[str, int]:
    """:func:`measure` for rank ``rank`` of ``cfg.p`` alone, in this process, on a fake process group."""
    freeze_what_lives_now()  # as a rank of run_on_ranks does: the imports out of each window's collection
    with fake_world(rank, cfg.p):
        return measure(rank, cfg.p, cfg)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench memory",
        description="Per-rank peak memory of forward+backward for each strategy, with and without recompute.",
    )
    parser.add_argument("--p", type=int, default=None, help="group size (gloo ranks on CPU); default 4, --trace 8")
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma-separated sequence lengths; default 1024,4096,8192, --trace " + ",".join(map(str, TRACE_LENGTHS)),
    )
    parser.add_argument("--layers", type=int, default=4, help="layers in the measured stack")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=None, help="MLP hidden size (default 4 * hidden)")
    parser.add_argument("--batch", type=int, default=1, help="micro-batch size")
    parser.add_argument("--pairings", default=",".join(PAIRINGS), help="comma-separated attention/mlp pairs")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: one rank's share of a p-rank run on this GPU, over a fake process group (no data moves; "
        "NCCL buffers not counted); see the module docstring",
    )
    parser.add_argument(
        "--kernel",
        choices=("auto", *kernel_names()),
        default="auto",
        help="attention kernel (auto: torch on CPU, flash_attn on CUDA; math is O(s^2) memory)",
    )
    parser.add_argument("--simulate", action="store_true", help="on CPU too, one rank's share over a fake group")
    parser.add_argument("--rank", type=int, default=0, help="the rank whose share --device cuda/--simulate runs")
    parser.add_argument("--json", metavar="FILE", help="also write every measurement to FILE")
    trace = parser.add_argument_group("--trace: production layers traced on a fake group, against the memory model")
    trace.add_argument("--trace", action="store_true", help="trace production layers (see the module docstring)")
    trace.add_argument("--models", default=",".join(TRACE_MODELS), help="comma-separated: " + ", ".join(TRACE_MODELS))
    trace.add_argument(
        "--options",
        default=None,
        help="comma-separated layer options, e.g. tp_sp/tp_sp,lean/lean+rc (default: every option the planner has)",
    )
    trace.add_argument("--layer", choices=LAYER_KINDS, default="megatron", help="the layer traced")
    trace.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    trace.add_argument(
        "--all-ranks", action="store_true", help="trace every rank (default: the rank of the largest predicted peak)"
    )
    trace.add_argument(
        "--events",
        action="store_true",
        help="with --json: every case's allocations and frees, and what was alive at its peak (large: restrict the "
        "cases with --models, --lengths, --options)",
    )
    return parser


def parse_lengths(text: str, flag: str = "--lengths") -> tuple[int, ...]:
    """``"1024,4096"`` -> ``(1024, 4096)``; a ValueError naming ``flag`` otherwise."""
    try:
        lengths = tuple(int(n) for n in text.split(","))
    except ValueError as e:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from e
    if min(lengths) < 1:
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return lengths


def parse_options(text: str, models: dict[str, LayerModel], p: int) -> tuple[LayerOption, ...]:
    """``"tp_sp/tp_sp,lean/lean+rc"`` -> layer options every model can run on ``p`` ranks; a
    ValueError naming what cannot run otherwise."""
    options = tuple(LayerOption.parse(option) for option in text.split(","))
    for name, model in models.items():
        for option in options:
            for sublayer, strategy in (("attention", option.attention), ("mlp", option.mlp)):
                reason = unsupported_reason(sublayer, strategy, model.shape, p)
                if reason:
                    raise ValueError(
                        f"--options: {sublayer} strategy {strategy!r} cannot run {name} on p={p}: {reason}"
                    )
    return options


def _config(args: argparse.Namespace) -> BenchConfig:
    hidden, heads, p = args.hidden, args.heads, 4 if args.p is None else args.p
    if heads < 1 or hidden % heads:
        raise ValueError(f"--hidden={hidden} must be a positive multiple of --heads={heads}")
    shape = ModelShape(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hidden // heads,
        ffn_hidden_size=args.ffn or 4 * hidden,
    )
    lengths = parse_lengths(args.lengths or "1024,4096,8192")
    pairings = tuple(args.pairings.split(","))
    if pairings[0] != PAIRINGS[0]:
        raise ValueError(f"--pairings must start with the baseline {PAIRINGS[0]}, got {args.pairings!r}")
    if not 0 <= args.rank < p:
        raise ValueError(f"--rank must be in [0, {p}), got {args.rank}")
    for pairing in pairings:
        option = LayerOption.parse(pairing)
        for sublayer, name in (("attention", option.attention), ("mlp", option.mlp)):
            reason = unsupported_reason(sublayer, name, shape, p)
            if reason:
                raise ValueError(f"{sublayer} strategy {name!r} cannot run this model on p={p}: {reason}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    dtype = torch.bfloat16 if cuda else torch.float32
    return BenchConfig(
        shape=shape,
        p=p,
        lengths=lengths,
        layers=args.layers,
        batch=args.batch,
        pairings=pairings,
        device=args.device,
        dtype=dtype,
        kernel=get_kernel(args.kernel, torch.device(args.device), dtype).name,
    )


def _report(cfg: BenchConfig, ranks: list[int], per_rank: list[dict[str, int]]) -> tuple[list[dict], dict[str, str]]:
    """Table rows and headline figures. A row's figure is the worst rank's peak."""
    rows = []
    worst = {key: max(peaks[key] for peaks in per_rank) for key in per_rank[0]}
    for length in cfg.lengths:
        baseline = worst[f"{PAIRINGS[0]}@{length}"]
        for pairing in cfg.pairings:
            for rc in (False, True):
                key = f"{_option(pairing, rc)}@{length}"
                rows.append(
                    {
                        "strategy": pairing,
                        "recompute": rc,
                        "length": length,
                        "peak_bytes": {r: peaks[key] for r, peaks in zip(ranks, per_rank)},
                        "ratio_to_tp_sp": worst[key] / baseline,
                    }
                )
    longest = max(cfg.lengths)

    def peak(pairing: str, rc: bool, length: int) -> int:
        return worst[f"{_option(pairing, rc)}@{length}"]

    figures = {
        "recompute_lowers_all": str(
            int(all(peak(s, True, n) < peak(s, False, n) for s in cfg.pairings for n in cfg.lengths))
        )
    }
    if "lean/lean" in cfg.pairings:
        lean_lowest = all(
            peak("lean/lean", rc, longest) <= min(peak(s, rc, longest) for s in cfg.pairings) for rc in (False, True)
        )
        figures["lean_lowest_at_longest"] = str(int(lean_lowest))
        figures["lean_vs_tp_sp_at_longest"] = (
            f"{peak('lean/lean', False, longest) / peak(PAIRINGS[0], False, longest):.3f}"
        )
        figures["lean_rc_vs_tp_sp_at_longest"] = (
            f"{peak('lean/lean', True, longest) / peak(PAIRINGS[0], False, longest):.3f}"
        )
    figures["longest"] = str(longest)
    figures["p"] = str(cfg.p)
    return rows, figures


# -- --trace: production layers traced on a fake group, against the memory model -----------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceConfig:
    models: dict[str, LayerModel]
    p: int
    lengths: tuple[int, ...]
    options: tuple[LayerOption, ...] | None
    """None: every option the planner has for the model."""
    layer: LayerKind
    dtype: torch.dtype
    all_ranks: bool
    batch: int
    events: bool = False
    """Keep every case's events (:class:`~megatron_paradyse.core.memory.MemoryEvent`) in its row."""


@dataclasses.dataclass(frozen=True)
class TraceCase:
    model: str
    length: int
    option: LayerOption
    rank: int


def _trace_config(args: argparse.Namespace) -> TraceConfig:
    if args.device != "cpu" or args.simulate:
        raise ValueError(
            "--trace runs fake tensors on the CPU; for the CUDA allocator run `python -m megatron_paradyse.bench "
            "allocator`"
        )
    if args.events and not args.json:
        raise ValueError("--events goes into the --json file; give one")
    p = 8 if args.p is None else args.p
    models = tuple(args.models.split(","))
    unknown = [m for m in models if m not in TRACE_MODELS]
    if unknown:
        raise ValueError(f"--models: unknown {', '.join(map(repr, unknown))}; known: {', '.join(TRACE_MODELS)}")
    chosen = {name: TRACE_MODELS[name] for name in models}
    return TraceConfig(
        models=chosen,
        p=p,
        lengths=parse_lengths(args.lengths or ",".join(map(str, TRACE_LENGTHS))),
        options=None if args.options is None else parse_options(args.options, chosen, p),
        layer=args.layer,
        dtype=DTYPES[args.dtype],
        all_ranks=args.all_ranks,
        batch=args.batch,
        events=args.events,
    )


def _predicted(cfg: TraceConfig, case: TraceCase, rank: int | None = None):
    model, layout = cfg.models[case.model], SequenceLayout.build(case.length, cfg.p, causal=True)
    dims = model.dims(cfg.layer, cfg.p, layout, cfg.batch, cfg.dtype)
    return layer_terms(case.option, dims, layout, case.rank if rank is None else rank)


def trace_cases(cfg: TraceConfig) -> list[TraceCase]:
    """Every (model, length, option) with the ranks traced: all, or the one the model predicts the
    largest peak for (the lowest of equals; rank 0 where the option's memory does not depend on it)."""
    cases = []
    for name in cfg.models:
        options = cfg.options or layer_options(PlannerConfig(), cfg.models[name].shape, cfg.p)[0]
        for length in cfg.lengths:
            for option in options:
                if cfg.all_ranks:
                    cases += [TraceCase(name, length, option, rank) for rank in range(cfg.p)]
                    continue
                case = TraceCase(name, length, option, 0)
                if get_strategy("attention", option.attention).depends_on_rank:
                    peaks = [_predicted(cfg, case, rank).peak_bytes for rank in range(cfg.p)]
                    case = dataclasses.replace(case, rank=peaks.index(max(peaks)))
                cases.append(case)
    return cases


def run_traces(cfg: TraceConfig) -> list[dict]:
    """Trace every case (one fake world per model and rank) and lay it beside its prediction."""
    cases = trace_cases(cfg)
    traced: dict[TraceCase, LayerTrace] = {}
    for name in cfg.models:
        for rank in range(cfg.p):
            mine = [c for c in cases if c.model == name and c.rank == rank]
            if not mine:
                continue

            def progress(i: int, trace: LayerTrace, mine=mine) -> None:
                case = mine[i]
                traced[case] = trace
                print(
                    f"bench memory --trace [{len(traced)}/{len(cases)}]: {case.model} s={case.length} {case.option} "
                    f"rank {case.rank}: peak {trace.peak_bytes / GIB:.3f} GiB ({trace.seconds:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )

            layouts = {n: SequenceLayout.build(n, cfg.p, causal=True) for n in cfg.lengths}
            trace_rank(
                cfg.models[name],
                rank,
                cfg.p,
                [(c.option, layouts[c.length]) for c in mine],
                layer=cfg.layer,
                dtype=cfg.dtype,
                record=cfg.events,
                progress=progress,
            )
    rows = []
    for case in cases:
        trace, terms = traced[case], _predicted(cfg, case)
        rows.append(
            {
                "model": case.model,
                "length": case.length,
                "option": str(case.option),
                "rank": case.rank,
                "traced_saved_bytes": trace.saved_bytes,
                "predicted_saved_bytes": terms.saved_bytes,
                "traced_peak_bytes": trace.peak_bytes,
                "predicted_peak_bytes": terms.peak_bytes,
                "saved_err_pct": _error_pct(terms.saved_bytes, trace.saved_bytes),
                "peak_err_pct": _error_pct(terms.peak_bytes, trace.peak_bytes),
                "seconds": trace.seconds,
            }
        )
        if cfg.events:
            rows[-1]["forward_events"] = trace.forward_events
            rows[-1]["events"] = [dataclasses.asdict(e) for e in trace.events]
            rows[-1]["alive_at_peak"] = [dataclasses.asdict(e) for e in trace.alive_at_peak()]
    return rows


def _error_pct(predicted: float, traced: int) -> float:
    return 100.0 * (predicted - traced) / traced


def _print_traces(cfg: TraceConfig, rows: list[dict], seconds: float) -> dict[str, str]:
    ranks = "every rank" if cfg.all_ranks else "the rank of the largest predicted peak (ring, lean attention)"
    print(
        f"# One transformer layer ({cfg.layer}), forward + backward, p={cfg.p}, b={cfg.batch}, "
        f"{str(cfg.dtype)[6:]}, one causal document, traced on a fake process group under FakeTensorMode "
        f"(megatron_paradyse.mcore.trace), {ranks}.\n"
        "# saved: alive when the forward returns (output included); peak: high-water mark over forward and "
        "backward (the output's gradient in the output's place, freed once used); both above the layer's "
        "input, weights, gradient buffers and rotary table.\n"
        "# predicted: megatron_paradyse.cost.terms.layer_terms; err = (predicted - traced) / traced."
    )
    print(
        f"{'model':<10}{'length':>9}  {'option':<20}{'rank':>5}{'saved GiB':>11}{'pred':>9}{'err %':>8}"
        f"{'peak GiB':>10}{'pred':>9}{'err %':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<10}{r['length']:>9}  {r['option']:<20}{r['rank']:>5}"
            f"{r['traced_saved_bytes'] / GIB:>11.3f}{r['predicted_saved_bytes'] / GIB:>9.3f}{r['saved_err_pct']:>8.1f}"
            f"{r['traced_peak_bytes'] / GIB:>10.3f}{r['predicted_peak_bytes'] / GIB:>9.3f}{r['peak_err_pct']:>8.1f}"
        )
    saved_worst = max(rows, key=lambda r: abs(r["saved_err_pct"]))
    print(
        f"# saved-bytes error: max |err| {abs(saved_worst['saved_err_pct']):.2f}% ({saved_worst['model']} "
        f"s={saved_worst['length']} {saved_worst['option']} rank {saved_worst['rank']}); "
        f"{len(rows)} cases traced in {seconds:.0f} s"
    )
    return {
        "traced_mem_err_max": f"{max(abs(r['peak_err_pct']) for r in rows):.2f}",
        "traced_cases": str(len(rows)),
    }


def _main_trace(args: argparse.Namespace) -> int:
    try:
        cfg = _trace_config(args)
    except ValueError as e:
        print(f"bench memory: error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows = run_traces(cfg)
    figures = _print_traces(cfg, rows, time.perf_counter() - start)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows, "figures": figures}, f, indent=1)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.trace:
        return _main_trace(args)
    try:
        cfg = _config(args)
    except ValueError as e:
        print(f"bench memory: error: {e}", file=sys.stderr)
        return 2
    if cfg.device == "cuda" or args.simulate:
        ranks, per_rank = [args.rank], [simulate_rank(args.rank, cfg)]
        how = f"rank {args.rank}'s share of a p={cfg.p} run, simulated on a fake process group"
    else:
        ranks, per_rank = list(range(cfg.p)), run_on_ranks(measure, cfg.p, args=(cfg,), timeout_s=3600)
        how = f"p={cfg.p} gloo ranks"
    rows, figures = _report(cfg, ranks, per_rank)

    s = cfg.shape
    print(
        f"# Peak bytes allocated during forward+backward of a {cfg.layers}-layer stack (h={s.hidden_size}, "
        f"{s.num_attention_heads} heads, ffn={s.ffn_hidden_size}, b={cfg.batch}, causal, {str(cfg.dtype)[6:]}, "
        f"{cfg.kernel} attention kernel), "
        f"{how}, on {cfg.device}.\n"
        "# Counted: memory allocated inside the window, above what was held before it (weights, their gradient "
        "buffers, the input).\n"
        + (
            "# CUDA: torch.cuda.max_memory_allocated (caching allocator), communication library buffers excluded."
            if cfg.device == "cuda"
            else "# CPU: bytes of every storage an operator creates until it is freed (a dispatch-mode tracker, "
            "megatron_paradyse.core.memory.PeakMemory), including tensors autograd saves; gloo's internal buffers "
            "are not seen."
        )
        + "\n# ratio: worst rank's peak over tp_sp/tp_sp's (no recompute) at the same length."
    )
    rank_cols = "".join(f"{f'rank{r} MiB':>12}" for r in ranks)
    print(f"{'strategy':<14}{'recompute':>10}{'length':>9}{rank_cols}{'ratio':>8}")
    for row in rows:
        cols = "".join(f"{row['peak_bytes'][r] / MIB:>12.2f}" for r in ranks)
        rc = "yes" if row["recompute"] else "no"
        print(f"{row['strategy']:<14}{rc:>10}{row['length']:>9}{cols}{row['ratio_to_tp_sp']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows, "figures": figures}, f, indent=1)
    print(" ".join(f"{k}={v}" for k, v in figures.items()))
    return 0
