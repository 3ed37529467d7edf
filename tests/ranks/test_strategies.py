"""Every strategy, and random per-layer mixes with and without recompute (and offload, and MLPs in tiles),
equal a single-rank fp32 reference on p gloo ranks. A recompute that keeps the attention core runs no
attention kernel forward in backward, and in bf16 gives the gradients of the layer not recomputed, bit
for bit; an MLP recomputing its activation (``zero3_actrc``) gives ``zero3``'s output and gradients, bit
for bit, in fp32, bf16 and fp16.

One launch per p runs every case; each case is its own test. Every rank computes the reference
itself and compares its own shards: loss, input gradient and every weight gradient, within 1e-5
relative (max abs difference over max abs reference; the strategies only reorder fp32 sums, observed
errors are ~1e-6).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_paradyse.attention import get_kernel
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.core.plan import LayerOption
from megatron_paradyse.mcore.bare_layer import make_layer_params, run_layer
from megatron_paradyse.strategies import (
    AttentionContext,
    MLPContext,
    available_strategies,
    run_attention,
    run_mlp,
    strategy_names,
)

from helpers.numerics import rel_err
from helpers.reference_model import StackConfig, make_params, reference_forward, shard_layer
from helpers.strategy_stack import fields, gradient_errors, held_by_megatron_linears, model_shape, run_stack

TOLERANCE = 1e-5
REPLICATED = ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "q_scale", "k_scale")
NUM_LAYERS = 4
BATCH = 2


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    gqa: bool
    causal: bool
    docs: tuple[int, ...]
    plan: tuple[LayerOption, ...]
    seed: int
    qk_scale: bool = False


def build_cases(p: int) -> list[Case]:
    rng = random.Random(1000 + p)
    kept_seeds = random.Random(2000 + p)

    def random_plan(attn: list[str], mlp: list[str], offload: int = 0) -> tuple[LayerOption, ...]:
        """Random strategies, recompute on random layers; with ``offload``, every attention strategy in
        turn and every ``offload``-th layer recomputed from host memory (2: an offloaded layer feeds and
        is fed by others)."""
        plan = []
        for i in range(NUM_LAYERS):
            off = bool(offload) and (i + 1) % offload == 0
            attention = attn[i % len(attn)] if offload else rng.choice(attn)
            plan.append(LayerOption(attention, rng.choice(mlp), off or rng.random() < 0.5, off))
        return tuple(plan)

    cases = []
    for config, (gqa, causal) in enumerate(itertools.product((False, True), (True, False))):
        attn, skipped_a = available_strategies("attention", model_shape(p, gqa), p)
        mlp, skipped_m = available_strategies("mlp", model_shape(p, gqa), p)
        assert not skipped_a and not skipped_m, (skipped_a, skipped_m)
        tag = f"p{p}-{'gqa_swiglu' if gqa else 'mha_gelu'}-{'causal' if causal else 'bidir'}"
        docs = (8 * p - 3,)  # needs padding to 8p
        # Every strategy alone; the MLP partner rotates with the model config, so across the four
        # configs every attention strategy meets every MLP strategy.
        for i, a in enumerate(attn):
            m = mlp[(i + config) % len(mlp)]
            plan = (LayerOption(a, m),) * NUM_LAYERS
            cases.append(Case(f"{tag}-{a}+{m}", gqa, causal, docs, plan, rng.randrange(10**6)))
        # Recompute on alternate layers, so a recomputed layer feeds and is fed by plain ones.
        # With a parameter inside qk_transform: lean differentiates it inside its own backward.
        plan = tuple(LayerOption("lean", "lean", i % 2 == 1) for i in range(NUM_LAYERS))
        cases.append(Case(f"{tag}-lean+lean-rc", gqa, causal, docs, plan, rng.randrange(10**6), qk_scale=True))
        for i in range(3):
            cases.append(Case(f"{tag}-mix{i}", gqa, causal, docs, random_plan(attn, mlp), rng.randrange(10**6)))
        # every layer offloaded, each with its own attention strategy
        cases.append(Case(f"{tag}-offload", gqa, causal, docs, random_plan(attn, mlp, offload=1), rng.randrange(10**6)))
        # MLPs in tiles of 6 rows (the last one 2) and of 2, every MLP strategy, alternate layers offloaded
        tiled = [
            dataclasses.replace(option, mlp=mlp[i % len(mlp)], mlp_tile_tokens=(6 if i % 2 else 2) * p)
            for i, option in enumerate(random_plan(attn, mlp, offload=2))
        ]
        cases.append(Case(f"{tag}-tiled", gqa, causal, docs, tuple(tiled), rng.randrange(10**6)))
        cases.append(
            Case(
                f"{tag}-packed",
                gqa,
                causal,
                (5, 4 * p + 1, 2 * p),
                random_plan(attn, mlp),
                rng.randrange(10**6),
                qk_scale=True,
            )
        )
        # every attention strategy in turn, its core kept through the recompute: one document padded (alternate
        # layers' inputs offloaded), and packed (drawn apart, so the cases above stay as they were)
        for name, kept_docs, offload in (("keepcore", docs, True), ("keepcore_packed", (5, 4 * p + 1, 2 * p), False)):
            kept = tuple(
                LayerOption(attn[i % len(attn)], mlp[(i + config) % len(mlp)], True, offload and i % 2 == 1, 0, True)
                for i in range(NUM_LAYERS)
            )
            cases.append(Case(f"{tag}-{name}", gqa, causal, kept_docs, kept, kept_seeds.randrange(10**6), True))
    return cases


def run_case(case: Case, rank: int, p: int) -> dict:
    group = dist.group.WORLD
    cfg = StackConfig(model_shape(p, case.gqa), NUM_LAYERS, case.causal, qk_scale=case.qk_scale)
    layers = make_params(cfg, case.seed)
    layout = SequenceLayout.build(case.docs, p, causal=case.causal)
    gen = torch.Generator().manual_seed(case.seed + 1)
    x = torch.randn(layout.valid_len, BATCH, cfg.shape.hidden_size, generator=gen)
    # A positive weighting of y^2: a loss without cancellation, so its relative error is meaningful.
    g = torch.rand(x.shape, generator=gen)

    # Reference: one rank, full weights, natural order, no padding.
    x_ref = x.clone().requires_grad_()
    ref_layers = [{k: None if v is None else v.clone().requires_grad_() for k, v in layer.items()} for layer in layers]
    loss_ref = (reference_forward(x_ref, ref_layers, cfg, case.docs).square() * g).sum()
    loss_ref.backward()

    # Distributed: this rank's canonical shard of the padded sequence, Megatron TP shards.
    local = layout.local_slice(rank)
    x_local = layout.to_canonical(x)[local].clone().requires_grad_()
    g_local = layout.to_canonical(g)[local]
    shards = [held_by_megatron_linears(shard_layer(layer, cfg.shape, p, rank), cfg.shape, group) for layer in layers]
    norms = [{k: layer[k].clone().requires_grad_() for k in REPLICATED if k in layer} for layer in layers]
    params = [t for aw, mw in shards for t in (*fields(aw), *fields(mw)) if t is not None]
    for t in params:
        t.requires_grad_()
    before = [t.detach().clone() for t in params]

    y_local = run_stack(x_local, *zip(*shards), norms, case.plan, layout, cfg, group)
    loss_local = (y_local.square() * g_local).sum()
    with _Operators() as backward:
        loss_local.backward()

    loss = loss_local.detach().clone()
    dist.all_reduce(loss, group=group)
    # Replicated parameters see only local tokens: Megatron all-reduces them over TP; so do we.
    replicated = [t.grad for n in norms for t in n.values()] + [
        t.grad for aw, mw in shards for t in (aw.proj_bias, mw.fc2_bias) if t is not None
    ]
    for grad in replicated:
        dist.all_reduce(grad, group=group)

    errors = {
        "loss": rel_err(loss, loss_ref.detach()),
        "dx": rel_err(x_local.grad, layout.to_canonical(x_ref.grad)[local]),
        **gradient_errors(ref_layers, shards, norms, cfg.shape, p, rank),
    }
    worst = max(errors, key=errors.get)
    return {
        "max_err": errors[worst],
        "worst": worst,
        "weights_unchanged": all(torch.equal(a, b.detach()) for a, b in zip(before, params)),
        "kernel_forwards_in_backward": backward.names.count(KERNEL_FORWARD),
    }


KERNEL_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
"""The CPU attention kernel's forward operator (``attention.kernels.TorchCpuKernel``)."""


def _kept_core_in_bf16(rank: int, p: int) -> dict[str, bool]:
    """Each attention strategy's layer (GQA, packed documents, causal) in bf16 under ``+rc+keepcore`` and
    without recompute: whether the output and every gradient are equal, bit for bit (a kept core's
    backward reads the forward's own output and log-sum-exp beside the same rebuilt q, k, v)."""
    shape = model_shape(p, gqa=True)
    layout = SequenceLayout.build((5, 4 * p + 1, 2 * p), p, causal=True)
    group = dist.group.WORLD
    params = make_layer_params(shape, p, rank, bias=True, dtype=torch.bfloat16, seed=7)
    actx = AttentionContext(
        group=group,
        layout=layout,
        shape=shape,
        kernel=get_kernel("torch", torch.device("cpu"), torch.bfloat16),
        softmax_scale=shape.kv_channels**-0.5,
    )
    mctx = MLPContext(group=group, shape=shape, activation=F.silu)
    x = torch.randn(layout.local_len, 1, shape.hidden_size, generator=torch.Generator().manual_seed(rank))
    equal = {}
    for name in available_strategies("attention", shape, p)[0]:
        results = []
        for option in (LayerOption(name, "zero3"), LayerOption(name, "zero3", True, keep_core=True)):
            x_local = x.to(torch.bfloat16).requires_grad_()
            for t in params.tensors():
                t.grad.zero_()
            y = run_layer(x_local, params, option, actx, mctx)
            y.float().square().sum().backward()
            results.append([y.detach(), x_local.grad, *(t.grad.clone() for t in params.tensors())])
        equal[name] = all(map(torch.equal, *results))
    return equal


def _recomputed_activation_changes_nothing(rank: int, p: int) -> dict[str, bool]:
    """``zero3_actrc`` against ``zero3`` (GELU and SwiGLU, fp32, bf16 and fp16): whether the output and
    every gradient are equal, bit for bit (fc2's input recomputed by the same operators from the same fc1
    output)."""
    layout = SequenceLayout.build(4 * p, p, causal=True)
    equal = {}
    for gqa, dtype in itertools.product((False, True), (torch.float32, torch.bfloat16, torch.float16)):
        shape = model_shape(p, gqa=gqa)
        params = make_layer_params(shape, p, rank, bias=not gqa, dtype=dtype, seed=11)
        ctx = MLPContext(group=dist.group.WORLD, shape=shape, activation=F.silu if gqa else F.gelu)
        x = torch.randn(layout.local_len, 1, shape.hidden_size, generator=torch.Generator().manual_seed(rank))
        weights = [
            t for t in (params.mlp.fc1, params.mlp.fc2, params.mlp.fc1_bias, params.mlp.fc2_bias) if t is not None
        ]
        results = []
        for name in ("zero3", "zero3_actrc"):
            x_local = x.to(dtype).requires_grad_()
            for t in weights:
                t.grad = None
            y = run_mlp(name, x_local, params.mlp, ctx)
            y.float().square().sum().backward()
            results.append([y.detach(), x_local.grad, *(t.grad for t in weights)])
        equal[f"{'swiglu' if gqa else 'gelu'} {dtype}"] = all(map(torch.equal, *results))
    return equal


def _all_cases(rank: int, p: int) -> dict:
    return {
        **{case.id: run_case(case, rank, p) for case in build_cases(p)},
        "bf16": _kept_core_in_bf16(rank, p),
        "actrc": _recomputed_activation_changes_nothing(rank, p),
    }


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda p: f"p{p}")
def launch(request):
    p = request.param
    per_rank = run_on_ranks(_all_cases, p, timeout_s=600)
    return p, per_rank


CASE_IDS = sorted({c.id.split("-", 1)[1] for p in (1, 2, 3, 4) for c in build_cases(p)})


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_strategy_matches_single_rank_reference(launch, case_id):
    p, per_rank = launch
    for rank, results in enumerate(per_rank):
        result = results[f"p{p}-{case_id}"]
        assert result["max_err"] <= TOLERANCE, f"rank {rank}: {result['worst']} off by {result['max_err']:.2e}"
        assert result["weights_unchanged"], f"rank {rank}: a weight changed during forward+backward"
        if "keepcore" in case_id:  # every layer keeps its core: no kernel forward is rerun
            assert result["kernel_forwards_in_backward"] == 0, f"rank {rank}: {result}"
        if case_id.endswith("lean+lean-rc"):  # recomputed layers rerun theirs (what the count would show)
            assert result["kernel_forwards_in_backward"] > 0, f"rank {rank}: {result}"


def test_a_kept_core_gives_the_gradients_of_the_layer_not_recomputed_in_bf16(launch):
    p, per_rank = launch
    for rank, results in enumerate(per_rank):
        assert results["bf16"] and all(results["bf16"].values()), f"rank {rank}: {results['bf16']}"


def test_an_mlp_recomputing_its_activation_gives_the_output_and_gradients_of_one_keeping_it(launch):
    p, per_rank = launch
    for rank, results in enumerate(per_rank):
        assert len(results["actrc"]) == 6 and all(results["actrc"].values()), f"rank {rank}: {results['actrc']}"


EMBEDDING_TOKENS = 64


class _Operators(TorchDispatchMode):
    """Records the name of every operator run inside."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _on_the_embeddings_strides(rank: int, p: int) -> dict[str, dict]:
    """Every strategy, in bf16, fp16 and fp32, forward and backward on an input laid out as Megatron's
    embedding output at b=1 and on the same values laid out afresh: whether the outputs and gradients are
    equal, and the operators each ran. The embedding output is ``[s, 1, h]``, transposed from ``[1, s, h]``:
    contiguous to ``is_contiguous``, but its size-1 dimension's stride is ``s * h``."""
    shape = model_shape(p, gqa=True)
    layout = SequenceLayout.build(EMBEDDING_TOKENS * p, p, causal=True)
    group = dist.group.WORLD
    mctx = MLPContext(group=group, shape=shape, activation=F.silu)
    results = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        params = make_layer_params(shape, p, rank, bias=False, dtype=dtype, seed=5)
        embedding = torch.randn(1, EMBEDDING_TOKENS, shape.hidden_size).to(dtype).transpose(0, 1)
        fresh = embedding.clone(memory_format=torch.contiguous_format)
        assert embedding.stride(1) == EMBEDDING_TOKENS * shape.hidden_size and fresh.stride(1) == shape.hidden_size
        actx = AttentionContext(
            group=group,
            layout=layout,
            shape=shape,
            kernel=get_kernel("torch", torch.device("cpu"), dtype),
            softmax_scale=shape.kv_channels**-0.5,
        )
        for sublayer, run, weights, ctx in (
            ("attention", run_attention, params.attention, actx),
            ("mlp", run_mlp, params.mlp, mctx),
        ):
            for name in available_strategies(sublayer, shape, p)[0]:
                outputs, operators = [], []
                for x in (fresh, embedding, fresh):  # the first run makes what is made once (the layout's indices)
                    x = x.detach().requires_grad_()
                    with _Operators() as ran:
                        y = run(name, x, weights, ctx)
                        y.backward(torch.ones_like(y))
                    outputs.append((y.detach(), x.grad))
                    operators.append(ran.names)
                results[f"{str(dtype).removeprefix('torch.')} {sublayer} {name}"] = {
                    "equal": all(map(torch.equal, *outputs[1:])),
                    "embedding only": sorted(set(operators[1]) - set(operators[2])),
                    "same operators": operators[1] == operators[2],
                }
    return results


def test_a_strategys_work_does_not_depend_on_its_inputs_strides():
    """``torch.matmul`` folds a 3-D input into one GEMM only where its strides allow a view or the weight
    needs a gradient; a strategy multiplying by a gathered or received shard must not hand it the
    embedding's layout. ``lean`` attention and ZeRO-3's linear did: a batched GEMM per token against the
    weight expanded to every token (in bf16 on the CPU, a copy of ``[s, h, out]`` inside the kernel:
    ``scripts/dispatch_mode_peaks.py`` measured 500 MiB at 2,000 tokens of h=256)."""
    per_rank = run_on_ranks(_on_the_embeddings_strides, 2, timeout_s=300)
    strategies = len(strategy_names("attention")) + len(strategy_names("mlp"))
    assert all(len(results) == 3 * strategies for results in per_rank), per_rank  # 3 dtypes x every strategy
    off = [
        (rank, case, result)
        for rank, results in enumerate(per_rank)
        for case, result in results.items()
        if not (result["equal"] and result["same operators"])
    ]
    assert not off, off
