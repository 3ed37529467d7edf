"""The GPU checks of the layers (``pytest -m gpu``, skipped without CUDA; ``scripts/gpu_check.sh`` runs
them; docs/gpu.md).

- every strategy pair on one GPU (TP=1), bf16 with the ``auto`` attention kernel, against the same
  layer in fp32 with the ``math`` kernel: output, input gradient and every weight gradient;
- one rank of TP=8 on the fake process group (collectives move nothing, so the numbers are not
  compared): every strategy pair runs its CUDA kernels at that rank's shard shapes under
  ``torch.cuda.set_sync_debug_mode("error")`` (a host synchronisation raises), and allocates what the
  memory model (:mod:`megatron_paradyse.cost.layer_memory`) predicts, MLPs in tiles included;
- offloaded and tiled layers equal to the plain recomputed one, and the offload's copies on pinned memory;
- a step of a small GPT model with the Paradyse spec (embedding, layers, loss) under the same mode;
- the memory budget sized by what the caching allocator can hold, which its own tensors leave alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from megatron_paradyse.core.host_sync import cuda_sync_debug
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
from megatron_paradyse.core.offload import ActivationOffload
from megatron_paradyse.core.plan import LayerOption, Plan
from megatron_paradyse.cost.terms import layer_terms
from megatron_paradyse.mcore import compat
from megatron_paradyse.mcore.trace import LayerModel, RankTracer, fake_world
from megatron_paradyse.run.log import MicroBatchMeter
from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.registry import strategy_names

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Llama-shaped (RMSNorm, GQA, SwiGLU, RoPE), heads of 128 channels as Llama 3's, 8 key/value groups
MODEL = LayerModel(
    shape=ModelShape(
        hidden_size=1024,
        num_attention_heads=16,
        num_query_groups=8,
        kv_channels=128,
        ffn_hidden_size=2048,
        gated_mlp=True,
    ),
    normalization="RMSNorm",
    rotary_base=500000,
)
OPTIONS = [LayerOption(a, m) for a in strategy_names("attention") for m in strategy_names("mlp")]
DOCUMENTS = (1000, 3000, 96)  # packed: the variable-length kernel call, and padding


@contextlib.contextmanager
def _tp1() -> Iterator[None]:
    """Megatron's parallel state at TP=1 of a fake one-rank group, for the block."""
    compat.install()
    from megatron.core import parallel_state

    with fake_world(0, 1):
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


def _layer(dtype: torch.dtype):
    """Megatron's layer from the Paradyse spec on this GPU (inside :func:`_tp1`), with its rotary table;
    random weights drawn in fp32 (the same values, rounded, in every dtype)."""
    from megatron_paradyse.spec import get_paradyse_layer_spec

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.spec_utils import build_module

    config = MODEL.transformer_config(1, dtype)
    config.transformer_impl = "local"
    layer = build_module(get_paradyse_layer_spec(config).layer_specs[0], config=config, layer_number=1).cuda()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    rope = RotaryEmbedding(MODEL.shape.kv_channels, 1.0, rotary_base=MODEL.rotary_base)
    return layer, rope


def _forward_backward(layer, rope, option: LayerOption, layout: SequenceLayout, x, dy, kernel: str):
    layout.indices(x.device)
    x = x.detach().requires_grad_()
    for param in layer.parameters():
        param.grad = None
    with micro_batch_scope(MicroBatch(layout=layout, plan=Plan((option,)), attention_kernel=kernel)):
        y, _ = layer(x, attention_mask=None, rotary_pos_emb=rope(layout.padded_len).cuda())
    y.backward(dy)
    return [y, x.grad, *(p.grad for p in layer.parameters())]


def test_every_strategy_on_one_gpu_in_bf16_matches_fp32():
    layout = SequenceLayout.build(DOCUMENTS, 1, causal=True)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(layout.padded_len, 1, MODEL.shape.hidden_size, generator=generator).cuda()
    dy = torch.randn(x.shape, generator=generator).cuda()
    errors = {}
    with _tp1():
        layer, rope = _layer(torch.float32)
        reference = _forward_backward(layer, rope, OPTIONS[0], layout, x, dy, "math")
        half, _ = _layer(torch.bfloat16)
        for option in OPTIONS:
            got = _forward_backward(half, rope, option, layout, x.bfloat16(), dy.bfloat16(), "auto")
            # bf16 keeps 8 bits of mantissa; sums of a few thousand terms in fp32 accumulators
            errors[str(option)] = _largest_error(got, reference)
    assert all(e < 2e-2 for e in errors.values()), errors


def _largest_error(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """The largest error over the tensors, each relative to its reference's largest magnitude."""
    return max(
        ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
        for g, r in zip(got, reference, strict=True)
    )


def test_one_rank_of_eight_runs_every_strategy_without_host_syncs_in_the_memory_predicted():
    layout = SequenceLayout.build(DOCUMENTS, 8, causal=True)
    rank = 3
    found = {}
    with fake_world(rank, 8), RankTracer(MODEL, layer="megatron", device="cuda", fake=False, kernel="auto") as tracer:
        tiled = [LayerOption("lean", "lean", mlp_tile_tokens=2048), LayerOption("ulysses", "zero3", True, False, 4096)]
        for option in OPTIONS + [LayerOption("ring", "zero3", True), LayerOption("lean", "lean", True), *tiled]:
            tracer.trace(option, layout)  # warm-up: kernels chosen, allocator and buffers filled
            traced = tracer.trace(option, layout, watch=cuda_sync_debug("error"))  # the layer's run only
            dims = MODEL.dims("megatron", 8, layout, 1, torch.bfloat16, device="cuda")
            predicted = layer_terms(option, dims, layout, rank)
            found[str(option)] = (traced.saved_bytes, traced.peak_bytes, predicted.saved_bytes, predicted.peak_bytes)
    wrong = {o: v for o, v in found.items() if v[:2] != v[2:]}
    assert not wrong, f"(saved, peak) traced vs predicted: {wrong}"


def test_offload_and_tiles_on_a_gpu_compute_what_the_layer_does_without_them():
    """bf16, TP=1: a layer recomputed from its input in pinned host memory gives the plain recomputed
    layer's output and gradients to the bit (the same kernels on the same data: ``math`` attention, as
    FlashAttention-2's backward adds its query gradients up in no fixed order, and on an H200 two
    identical calls differed). With its MLP in tiles, the same to bf16's round-off: other GEMM shapes,
    and weight gradients summed tile by tile."""
    layout = SequenceLayout.build(DOCUMENTS, 1, causal=True)
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(layout.padded_len, 1, MODEL.shape.hidden_size, generator=generator).cuda().bfloat16()
    dy = torch.randn(x.shape, generator=generator).cuda().bfloat16()
    with _tp1():
        layer, rope = _layer(torch.bfloat16)
        runs = {
            text: _forward_backward(layer, rope, LayerOption.parse(text), layout, x, dy, "math")
            for text in ("ulysses/lean+rc", "ulysses/lean+rc+off", "ulysses/lean+tile1024+rc")
        }
    plain = runs["ulysses/lean+rc"]
    assert all(torch.equal(g, r) for g, r in zip(runs["ulysses/lean+rc+off"], plain, strict=True))
    assert _largest_error(runs["ulysses/lean+tile1024+rc"], plain) < 2e-2


def test_offloaded_activations_go_to_pinned_memory_and_come_back_prefetched():
    offload = ActivationOffload()
    xs = [torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    handles = [offload.store(x) for x in xs]
    assert offload.host_bytes == 3 * xs[0].nbytes
    assert all(entry.host.is_pinned() for entry in offload._saved.values())
    back = offload.restore(handles[2])
    assert offload._saved[1].fetched is not None  # the next one on its way
    assert torch.equal(back, xs[2])
    assert all(torch.equal(offload.restore(h), x) for h, x in zip(handles[1::-1], xs[1::-1]))
    assert offload.host_bytes == 0


def test_a_gpt_step_makes_no_host_synchronisation():
    """Embedding, two Paradyse layers, output layer and loss, forward and backward: after a warm-up
    step, one under the sync-debug mode; the layout's indices go to the device first, as the entry
    point puts them there. The time-only meter that ``planner.learn_time`` uses times both steps
    (CUDA events, read after the step)."""
    compat.install()
    from helpers import megatron_harness as harness

    layout = SequenceLayout.build((300, 212), 1, causal=True)
    tokens = torch.randint(0, harness.VOCAB, (1, layout.padded_len)).cuda()
    with _tp1():
        harness.model_parallel_cuda_manual_seed(0)
        config = harness.make_config("llama", tp=1, num_layers=2, params_dtype=torch.bfloat16, bf16=True)
        from megatron_paradyse.spec import get_paradyse_layer_spec

        model = harness.build_gpt(config, get_paradyse_layer_spec(config)).cuda()
        position_ids = layout.indices("cuda").position_ids[None]
        plan = Plan((LayerOption("tp_sp", "tp_sp"), LayerOption("ring", "zero3", True)))
        meter = MicroBatchMeter(torch.device("cuda"), static_bytes=0.0, memory=False)
        meter.attach(model)
        for watch in (contextlib.nullcontext(), cuda_sync_debug("error")):  # a warm-up step, then the check
            with watch:
                meter.begin()
                with micro_batch_scope(MicroBatch(layout=layout, plan=plan, attention_kernel="auto")):
                    loss = model(tokens, position_ids, None, labels=tokens)
                loss.sum().backward()
        times = [measured.time_s for measured in meter.collect()]
        assert len(times) == 2 and min(times) > 0, times


def test_the_budget_counts_what_the_caching_allocator_can_hold_not_what_it_holds():
    """The budget is sized by the device's memory less what is in use outside the caching allocator (the
    CUDA context, cuBLAS, cuDNN): tensors the allocator holds, or has cached and released, leave it alone."""
    from megatron_paradyse.core.memory import allocator_capacity_bytes, device_memory_bytes

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    capacity = allocator_capacity_bytes(device)
    free, total = torch.cuda.mem_get_info(device)
    assert total == device_memory_bytes(device) and free <= capacity < total
    held = torch.ones(2**30, dtype=torch.uint8, device=device)  # 1 GiB through the allocator
    assert abs(allocator_capacity_bytes(device) - capacity) < 2**24
    del held
    torch.cuda.empty_cache()
    assert abs(allocator_capacity_bytes(device) - capacity) < 2**24
