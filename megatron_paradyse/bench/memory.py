"""Peak memory of each strategy, with and without per-layer recompute, per rank.

    python -m megatron_paradyse.bench memory                      # p=4 gloo ranks on CPU
    python -m megatron_paradyse.bench memory --p 2 --lengths 512,2048
    python -m megatron_paradyse.bench memory --device cuda        # one rank's share on one GPU

A stack of ``--layers`` pre-LN GPT layers (MHA, GELU MLP, biases, causal; no RoPE) runs forward and
backward on every rank under one layer option at a time; the peak bytes allocated in that window
are measured per rank with :class:`~megatron_paradyse.memory.PeakMemory`. What was held before the
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
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_paradyse.attention import get_kernel, kernel_names
from megatron_paradyse.cost.measure import LayerParams, make_layer_params, run_layer
from megatron_paradyse.layout import SequenceLayout
from megatron_paradyse.memory import PeakMemory
from megatron_paradyse.multiprocess import run_on_ranks
from megatron_paradyse.plan import LayerOption
from megatron_paradyse.strategies import AttentionContext, MLPContext, ModelShape, unsupported_reason

PAIRINGS = ("tp_sp/tp_sp", "ulysses/zero3", "ring/zero3", "lean/lean")
"""Each attention strategy with its natural MLP partner; the first is the baseline of the ratios."""

MIB = 2**20


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
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cfg.p)
    try:
        return measure(rank, cfg.p, cfg)
    finally:
        dist.destroy_process_group()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench memory",
        description="Per-rank peak memory of forward+backward for each strategy, with and without recompute.",
    )
    parser.add_argument("--p", type=int, default=4, help="group size (gloo ranks on CPU)")
    parser.add_argument("--lengths", default="1024,4096,8192", help="comma-separated sequence lengths")
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
    return parser


def _config(args: argparse.Namespace) -> BenchConfig:
    hidden, heads = args.hidden, args.heads
    if heads < 1 or hidden % heads:
        raise ValueError(f"--hidden={hidden} must be a positive multiple of --heads={heads}")
    shape = ModelShape(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=heads,
        kv_channels=hidden // heads,
        ffn_hidden_size=args.ffn or 4 * hidden,
    )
    try:
        lengths = tuple(int(n) for n in args.lengths.split(","))
    except ValueError as e:
        raise ValueError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from e
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths must be positive, got {args.lengths!r}")
    pairings = tuple(args.pairings.split(","))
    if pairings[0] != PAIRINGS[0]:
        raise ValueError(f"--pairings must start with the baseline {PAIRINGS[0]}, got {args.pairings!r}")
    if not 0 <= args.rank < args.p:
        raise ValueError(f"--rank must be in [0, {args.p}), got {args.rank}")
    for pairing in pairings:
        option = LayerOption.parse(pairing)
        for sublayer, name in (("attention", option.attention), ("mlp", option.mlp)):
            reason = unsupported_reason(sublayer, name, shape, args.p)
            if reason:
                raise ValueError(f"{sublayer} strategy {name!r} cannot run this model on p={args.p}: {reason}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    dtype = torch.bfloat16 if cuda else torch.float32
    return BenchConfig(
        shape=shape,
        p=args.p,
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
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
            "megatron_paradyse.memory.PeakMemory), including tensors autograd saves; gloo's internal buffers "
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
