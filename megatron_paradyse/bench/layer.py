"""One transformer layer's forward + backward on one device: the Paradyse layer under ``tp_sp/tp_sp``
against Megatron's stock layer, and the attention kernel against PyTorch's SDPA.

``python -m megatron_paradyse.bench layer`` (a single GPU: ``scripts/gpu_check.sh`` runs it after the
GPU tests). For each length, one document of that many tokens, micro-batch 1, TP=1:

- **layer**: Megatron's ``TransformerLayer`` from :func:`megatron_paradyse.spec.get_paradyse_layer_spec`
  under ``tp_sp/tp_sp`` against the layer of Megatron's stock GPT spec of the same transformer
  implementation (Transformer Engine's where it is installed, else the local one of
  :mod:`megatron_paradyse.mcore.stock_spec`); the same weights, RoPE table and input. The local stock layer
  attends with Megatron's unfused ``DotProductAttention`` (``[s, s]`` scores): where it runs out of
  memory its row says so and the ratio leaves that length out.
- **attention**: the Paradyse attention core (:func:`~megatron_paradyse.attention.segment_attention`
  with the config's ``auto`` kernel) against ``F.scaled_dot_product_attention(is_causal=True)`` under
  each SDPA backend that takes the shape, the fastest of them.
- **host syncs**: one more forward + backward of the Paradyse layer at the first length (after one
  that sets up what a process sets up once), counted under ``torch.cuda.set_sync_debug_mode("warn")``
  on CUDA, each printed with where it happened (elsewhere by
  :class:`~megatron_paradyse.core.host_sync.HostSyncs`).

- **predicted** (``--profile FILE``, a profile calibrated on this machine): the cost model's time for
  the Paradyse layer under ``tp_sp/tp_sp`` at TP=1, beside the measured one.
- **a new length**: what the first call at a length the process has not run adds to the steady time,
  for the Paradyse layer, its attention core, and SDPA's cuDNN and flash backends (flash builds nothing
  per shape), each at its own new length just below a measured one (``n - 2`` to ``n - 8``: the
  allocator already holds what ``n`` took, so the difference is per-shape set-up, not memory), its
  steady time from at most 3 runs after 1. PyTorch builds a cuDNN attention graph for each new shape
  (its cache is keyed by the sequence length); a training run meets a new length with most
  micro-batches, and the cost model prices none of it.

Times are medians over ``--repeats`` runs after ``--warmup`` (CUDA events on a GPU). The last line:
``tp_sp_vs_stock_max`` (the largest Paradyse/stock time ratio over the lengths both ran),
``attention_vs_sdpa_best`` (the largest ratio of the Paradyse core to SDPA's fastest backend) and
``host_syncs``, then with ``--profile`` the least and the largest predicted/measured ratio of the
Paradyse layer (``predicted_over_measured_min``, ``predicted_over_measured_max``), then the largest
extra of the Paradyse layer's first call at a new length (``new_length_extra_ms_max``). Targets on an
H100: <= 1.03, <= 1.10 and 0.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_paradyse.attention import get_kernel, segment_attention
from megatron_paradyse.bench.memory import TRACE_MODELS
from megatron_paradyse.core.host_sync import wait_for_device, watch_host_syncs
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.analytic import AnalyticCostModel
from megatron_paradyse.cost.profile import ProfileError
from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
from megatron_paradyse.mcore.stock_spec import stock_block_spec
from megatron_paradyse.mcore.trace import LayerModel, fake_world
from megatron_paradyse.strategies import ModelShape

from megatron.core import parallel_state
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module

MODELS = {
    "llama3-8b": TRACE_MODELS["llama3-8b"],
    # the same layer, small enough for a CPU test
    "tiny": LayerModel(
        shape=ModelShape(
            hidden_size=64, num_attention_heads=8, num_query_groups=2, kv_channels=8, ffn_hidden_size=96, gated_mlp=True
        ),
        normalization="RMSNorm",
        rotary_base=500000,
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(v) for v in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from e
    if not lengths or min(lengths) < 2 or any(n % 2 for n in lengths):
        raise argparse.ArgumentTypeError(f"token counts must be even and >= 2, got {text!r}")
    return lengths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_paradyse.bench layer", description=__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--lengths", type=_lengths, default=[4096, 16384, 65536], help="tokens, comma-separated")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", help="a cost profile of this machine: the predicted time beside the measured")
    args = parser.parse_args(argv)
    device, dtype, model = torch.device(args.device), DTYPES[args.dtype], MODELS[args.model]
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    predict = None if args.profile is None else _predictor(args.profile, model, dtype, parser)

    with fake_world(0, 1), _LayerPair(model, dtype, device) as pair:
        print(f"layer: {args.model}, {args.dtype}, {device}, transformer implementation: {pair.impl}")
        predicted_head = "" if predict is None else f" {'pred ms':>9} pred/meas"
        print(
            f"{'tokens':>7} {'paradyse ms':>12} {'stock ms':>10} {'ratio':>6} {'attn ms':>9} {'sdpa ms':>9} ratio"
            + predicted_head
        )
        layer_ratios, attention_ratios, predicted_ratios = [], [], []
        timer = _Timer(device, args.warmup, args.repeats)
        for n in args.lengths:
            print(f"[bench layer] {n} tokens", file=sys.stderr, flush=True)
            ours = timer(pair.step("paradyse", n))
            stock = _or_oom(lambda n=n: timer(pair.step("stock", n)))
            attention = timer(_paradyse_attention(model, n, dtype, device))
            backend, sdpa = _sdpa_best(timer, model, n, dtype, device)
            if stock is not None:
                layer_ratios.append(ours / stock)
            attention_ratios.append(attention / sdpa)
            stock_text = "OOM" if stock is None else f"{stock * 1e3:.2f}"
            ratio_text = "-" if stock is None else f"{ours / stock:.3f}"
            predicted_text = ""
            if predict is not None:
                predicted = predict(n)
                predicted_ratios.append(predicted / ours)
                predicted_text = f" {predicted * 1e3:>9.2f} {predicted / ours:.3f}"
            print(
                f"{n:>7} {ours * 1e3:>12.2f} {stock_text:>10} {ratio_text:>6} {attention * 1e3:>9.2f} "
                f"{sdpa * 1e3:>9.2f} {attention / sdpa:.3f} ({backend})" + predicted_text,
                flush=True,
            )
        # a per-shape build (tens of milliseconds and more, by public reports) stands out of a short one
        probe_timer = _Timer(device, min(args.warmup, 1), min(args.repeats, 3))
        new_length_extras = _print_new_length_extras(pair, model, args.lengths, dtype, device, probe_timer)
        syncs = _host_syncs(pair.step("paradyse", args.lengths[0]), device)
    worst_layer = max(layer_ratios) if layer_ratios else math.nan
    last = f"tp_sp_vs_stock_max={worst_layer:.3f} attention_vs_sdpa_best={max(attention_ratios):.3f} host_syncs={syncs}"
    if predicted_ratios:
        low, high = min(predicted_ratios), max(predicted_ratios)
        last += f" predicted_over_measured_min={low:.3f} predicted_over_measured_max={high:.3f}"
    print(last + f" new_length_extra_ms_max={max(new_length_extras, default=math.nan) * 1e3:.2f}")
    return 0


def _print_new_length_extras(
    pair: _LayerPair, model: LayerModel, lengths: list[int], dtype: torch.dtype, device: torch.device, timer: _Timer
) -> list[float]:
    """Print, per measured length ``n``, the seconds the first call at a length not run before adds to
    the steady time: the Paradyse layer at ``n - 2``, its attention core at ``n - 4``, SDPA's cuDNN and
    flash backends at ``n - 6`` and ``n - 8`` ("-" where the backend does not take the shape; lengths
    under 10 are left out). Returns the layer's extras."""
    probes = (
        ("paradyse layer", lambda m: pair.step("paradyse", m)),
        ("attention core", lambda m: _paradyse_attention(model, m, dtype, device)),
        ("sdpa cudnn", lambda m: _sdpa(model, m, dtype, device, SDPBackend.CUDNN_ATTENTION)),
        ("sdpa flash", lambda m: _sdpa(model, m, dtype, device, SDPBackend.FLASH_ATTENTION)),
    )
    print("first call at a new length, minus its steady time (ms)")
    print(f"{'tokens':>7} " + " ".join(f"{name:>15}" for name, _ in probes))
    layer_extras = []
    for n in (n for n in lengths if n >= 10):
        extras = [
            _or_oom(lambda make=make, m=n - 2 * (i + 1): _first_call_extra(make(m), device, timer), RuntimeError)
            for i, (_, make) in enumerate(probes)
        ]
        layer_extras += extras[:1] if extras[0] is not None else []
        texts = ["-" if extra is None else f"{extra * 1e3:.2f}" for extra in extras]
        print(f"{n:>7} " + " ".join(f"{text:>15}" for text in texts), flush=True)
    return layer_extras


def _first_call_extra(run: Callable[[], None], device: torch.device, timer: _Timer) -> float:
    """The first ``run()``'s wall time (the device synchronised before and after) less ``timer(run)``."""
    wait_for_device(device)
    start = time.perf_counter()
    run()
    wait_for_device(device)
    first = time.perf_counter() - start
    return first - timer(run)


def _predictor(path: str, model: LayerModel, dtype: torch.dtype, parser: argparse.ArgumentParser):
    """The cost model's time of the Paradyse layer under ``tp_sp/tp_sp`` at TP=1, for a token count."""
    try:
        cost = AnalyticCostModel.from_file(path, model.shape, 1, dtype=dtype)
    except (OSError, ProfileError, ValueError) as e:
        parser.error(f"--profile {path}: {e}")
    option = LayerOption("tp_sp", "tp_sp")
    return lambda n: cost.layer_cost(option, SequenceLayout.build(n, 1, causal=True), 1).time_s


class _LayerPair:
    """The Paradyse and the stock layer of ``model`` with the same weights, on TP=1 of the fake group."""

    def __init__(self, model: LayerModel, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.impl = "transformer_engine" if HAVE_TE and device.type == "cuda" else "local"
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        model_parallel_cuda_manual_seed(0)  # the stock attention's dropout forks Megatron's RNG state
        config = model.transformer_config(1, dtype)
        config.transformer_impl = self.impl
        if self.impl == "transformer_engine":
            stock_spec = get_gpt_layer_with_transformer_engine_spec(normalization=model.normalization)
        else:
            stock_spec = stock_block_spec(config).layer_specs[0]
        self.layers = {
            "paradyse": build_module(get_paradyse_layer_spec(config).layer_specs[0], config=config, layer_number=1),
            "stock": build_module(stock_spec, config=config, layer_number=1),
        }
        names = [[name for name, _ in layer.named_parameters()] for layer in self.layers.values()]
        if names[0] != names[1]:  # the same model, so the same weights: the checkpoint contract
            raise RuntimeError(f"the Paradyse and stock layers hold different parameters: {names[0]} vs {names[1]}")
        generator = torch.Generator().manual_seed(0)
        for layer in self.layers.values():
            layer.to(device)
        with torch.no_grad():
            for ours, theirs in zip(self.layers["paradyse"].parameters(), self.layers["stock"].parameters()):
                ours.copy_(torch.randn(ours.shape, generator=generator) / ours.shape[-1] ** 0.5)
                theirs.copy_(ours)

    def step(self, which: str, n: int) -> Callable[[], None]:
        """One forward + backward of layer ``which`` on ``n`` tokens (inputs made once)."""
        hidden = self.model.shape.hidden_size
        x = torch.randn(n, 1, hidden, device=self.device, dtype=self.dtype).requires_grad_()
        dy = torch.randn_like(x)
        rope = RotaryEmbedding(self.model.shape.kv_channels, 1.0, rotary_base=self.model.rotary_base)
        rotary = rope(n).to(self.device)
        layer = self.layers[which]
        layout = SequenceLayout.build(n, 1, causal=True)
        layout.indices(self.device)  # as the entry point does, before the model runs
        scope = MicroBatch(layout=layout, plan=Plan((LayerOption("tp_sp", "tp_sp"),)), attention_kernel="auto")

        def run() -> None:
            with micro_batch_scope(scope) if which == "paradyse" else contextlib.nullcontext():
                y, _ = layer(x, attention_mask=None, rotary_pos_emb=rotary)
            y.backward(dy)
            x.grad = None

        return run

    def __enter__(self) -> _LayerPair:
        return self

    def __exit__(self, *exc) -> None:
        parallel_state.destroy_model_parallel()


def _qkv(shape: ModelShape, n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``q [1, nq, n, d]``, ``k``/``v`` ``[1, nkv, n, d]``, needing gradients, laid out sequence-major as
    the strategies hand them to the kernel (on CUDA with ``attention.kernels.CUDNN_LENGTH_BUCKETS`` set,
    cuDNN's graphs by length bucket then apply, as in the job)."""
    heads = (shape.num_attention_heads, shape.num_query_groups, shape.num_query_groups)
    return tuple(
        torch.randn(1, n, h, shape.kv_channels, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
        for h in heads
    )


def _paradyse_attention(model: LayerModel, n: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    q, k, v = _qkv(model.shape, n, dtype, device)
    layout = SequenceLayout.build(n, 1, causal=True)
    cu_seqlens = layout.indices(device).cu_seqlens
    kernel, scale = get_kernel("auto", device, dtype), model.shape.kv_channels**-0.5
    dout = torch.randn_like(q)

    def run() -> None:
        segment_attention(q, k, v, layout.full_segments(), scale, kernel, cu_seqlens).backward(dout)

    return run


def _sdpa(model: LayerModel, n: int, dtype: torch.dtype, device: torch.device, backend) -> Callable[[], None]:
    """Forward + backward of causal ``F.scaled_dot_product_attention`` on ``n`` tokens under ``backend``."""
    q, k, v = _qkv(model.shape, n, dtype, device)
    dout = torch.randn_like(q)

    def run() -> None:
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    return run


def _sdpa_best(timer: _Timer, model: LayerModel, n: int, dtype: torch.dtype, device: torch.device) -> tuple[str, float]:
    """(backend, seconds) of the fastest SDPA backend that takes the shape."""
    times = {}
    backends = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
    for backend in backends:
        run = _sdpa(model, n, dtype, device, backend)
        seconds = _or_oom(lambda run=run: timer(run), RuntimeError)  # "No available kernel" for shapes it does not take
        if seconds is not None:
            times[backend.name.lower()] = seconds
    if not times:
        raise RuntimeError(f"no SDPA backend ran {n} tokens in {dtype} on {device}")
    best = min(times, key=times.get)
    return best, times[best]


class _Timer:
    """Median seconds of ``run()`` over ``repeats`` runs after ``warmup`` (CUDA events on a GPU)."""

    def __init__(self, device: torch.device, warmup: int, repeats: int) -> None:
        self.device, self.warmup, self.repeats = device, warmup, repeats

    def __call__(self, run: Callable[[], None]) -> float:
        for _ in range(self.warmup):
            run()
        times = []
        for _ in range(self.repeats):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                run()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
        return statistics.median(times)


def _or_oom(measure: Callable[[], float], *errors: type[BaseException]) -> float | None:
    """``measure()``, or None where it runs out of memory (or raises one of ``errors``)."""
    try:
        return measure()
    except (torch.OutOfMemoryError, *errors):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def _host_syncs(run: Callable[[], None], device: torch.device) -> int:
    """Host synchronisations in one ``run()`` after a first one (which sets up what a process sets up
    once: library handles, workspaces) (:func:`~megatron_paradyse.core.host_sync.watch_host_syncs`), on
    CUDA each printed with where it was raised."""
    run()
    with watch_host_syncs(device) as syncs:
        run()
    for sync in syncs if device.type == "cuda" else ():
        print(f"[bench layer] host sync: {sync}", file=sys.stderr)
    return len(syncs)
