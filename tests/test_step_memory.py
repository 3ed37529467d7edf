"""The whole step's memory against the cost model, measured on gloo ranks in fp32, bf16 and fp16.

One micro-batch of a Megatron GPTModel built with the Paradyse layer spec (RoPE; GPT-style LayerNorm
with biases, or LLaMA-style RMSNorm, GQA and SwiGLU without; each tied to its embedding at one TP size
and untied at the other) runs forward, Megatron's vocab-parallel loss and backward under
:class:`PeakMemory`, after a first step (so nothing lazily created is counted) and after
:func:`release_step_buffers` (Megatron's all-gather buffer and rotary tables are the step's own, as in
the training entry point), twice: the smaller peak counts (gloo's worker thread may free a buffer
late). The step's inputs and the layout's index tensors exist before the window and are added to what
it measures. The largest rank's measured peak must be the cost model's ``peak_bytes``
for the plan (static bytes 0: the gradients exist before, as Megatron's buffer) within
:data:`TOLERANCE`: embedding, every layer, the final norm, the output layer, the cross-entropy and the
backward's weight gradients included (host copies of offloaded layers' inputs are not device memory:
left out; where every layer is offloaded the model may count one activation more, the stage's input,
which it keeps beside the loss but the loss's backward no longer has). Plans: every strategy family
with and without recompute at TP=2, and the recompute choices TP=1 plans from; every layer offloaded,
and one offloaded after one recomputed; MLPs in tiles (uneven: 256 gathered tokens of 500 and 1000 rows);
the output layer and loss in chunks
(:mod:`megatron_paradyse.mcore.chunked_loss`) beside Megatron's whole-sequence buffer (``tp_sp``) and
without it; one document and three packed. At TP=1 the two ranks are data-parallel replicas, and the
plans run again under Megatron's DDP (the distributed optimizer's gradient buffer in fp32, reduce-scatters
of several buckets overlapped with backward, finished inside the window): the gradients then go to DDP's
buffer, and the peak must still be the model's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest

from megatron_paradyse.core.multiprocess import run_on_ranks

TOLERANCE = 0.01
"""Relative; the runs agree within 0.5% (the remainder: a few bytes per token the model leaves out)."""
DTYPES = ("float32", "bfloat16", "float16")
VARIANTS = ("gpt", "llama")
CHUNKED = "; loss in 64-token chunks"
PLANS = {
    2: (
        "tp_sp/tp_sp",
        "ulysses/zero3+rc",
        "ring/zero3",
        "lean/lean+rc",
        "tp_sp/tp_sp" + CHUNKED,
        "ring/zero3" + CHUNKED,
        "ulysses/lean+rc+off",
        "tp_sp/zero3+rc, ring/lean+rc+off" + CHUNKED,
        "tp_sp/tp_sp+tile256",
        "ring/zero3+tile256",
        "ulysses/lean+tile256+rc, lean/lean+tile256+rc+off",
    ),
    1: ("tp_sp/tp_sp", "tp_sp/tp_sp+rc", "tp_sp/tp_sp+rc" + CHUNKED, "tp_sp/tp_sp+rc+off", "tp_sp/tp_sp+tile256"),
}
DOCUMENTS = {"one": (1000,), "packed": (300, 500, 196)}


def _steps_on_rank(rank: int, world_size: int) -> list[tuple]:
    import numpy as np
    import torch
    import torch.nn.functional as F

    from megatron_paradyse.core import compat

    compat.install()
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_paradyse.core.compat import cuda_to_cpu
    from megatron_paradyse.core.memory import peak_bytes_of, storage_bytes
    from megatron_paradyse.core.micro_batch import MicroBatch
    from megatron_paradyse.core.plan import Plan
    from megatron_paradyse.cost import AnalyticCostModel
    from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
    from megatron_paradyse.data import make_micro_batch
    from megatron_paradyse.mcore.chunked_loss import micro_batch_loss
    from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim
    from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
    from megatron_paradyse.mcore.step_buffers import release_step_buffers

    variants = {
        "gpt": dict(normalization="LayerNorm"),
        "llama": dict(
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            num_query_groups=2,
        ),
    }
    # the distributed optimizer's reduce-scatters, overlapped with backward, over buckets of about 20K
    # elements (4 buckets of these models)
    DDP_CONFIG = DistributedDataParallelConfig(
        overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=20_000, grad_reduce_in_fp32=True
    )
    results = []
    for tp in sorted(PLANS, reverse=True):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        model_parallel_cuda_manual_seed(1)
        profile = hardware_profile(dataclasses.replace(HARDWARE["a100"], p=2))
        profile["fingerprint"]["device"] = "cpu"
        profile["allocator_slack"] = 0.0
        for dtype_name, variant in itertools.product(DTYPES, VARIANTS):
            tied = (variant == "gpt") == (tp > 1)  # both ways at each TP size
            dtype = getattr(torch, dtype_name)
            config = TransformerConfig(
                num_layers=2,
                hidden_size=64,
                num_attention_heads=4,
                ffn_hidden_size=128,
                use_cpu_initialization=True,
                params_dtype=dtype,
                pipeline_dtype=dtype,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                tensor_model_parallel_size=tp,
                sequence_parallel=tp > 1,
                **variants[variant],
            )
            vocab = 512 * tp
            torch.manual_seed(0)
            model = GPTModel(
                config,
                get_paradyse_layer_spec(config),
                vocab_size=vocab,
                max_sequence_length=1024,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=tied,
            )
            for param in model.parameters():
                param.grad = torch.zeros_like(param)  # Megatron's gradient buffer: there before the step
            profile["dtype"] = dtype_name
            cost_model = AnalyticCostModel(
                profile,
                model_shape(config),
                tp,
                dtype=dtype,
                vocab_size=vocab,
                rotary_dim=rotary_dim(config, "rope"),
                bias=config.add_bias_linear,
                normalization=config.normalization,
                tied_unfused_output=tied and not config.gradient_accumulation_fusion,
            )
            # at TP=1 the two ranks are data-parallel replicas: the plans run again under Megatron's DDP
            for data_parallel in (False, True) if tp == 1 else (False,):
                runner = model
                if data_parallel:
                    for param in model.parameters():
                        param.grad = None  # DDP's buffer holds the gradients
                    runner = DistributedDataParallel(config, DDP_CONFIG, model)
                rng = np.random.default_rng(0)
                for documents, plan_name in itertools.product(DOCUMENTS, PLANS[tp]):
                    pieces = [rng.integers(0, vocab, n) for n in DOCUMENTS[documents]]
                    batch = make_micro_batch(pieces, [False] * len(pieces), p=tp, causal=True, pad_id=0)
                    layout = batch["layout"]
                    options, chunked, _ = plan_name.partition(CHUNKED)
                    options = options.split(", ")
                    plan = Plan.from_options(options * (config.num_layers // len(options)))
                    plan = dataclasses.replace(plan, loss_chunk_tokens=64 if chunked else 0)

                    def step(runner=runner, batch=batch, plan=plan, data_parallel=data_parallel):
                        # DDP's gradient sync waits on CUDA streams: none on CPU
                        with cuda_to_cpu() if data_parallel else contextlib.nullcontext():
                            micro_batch_loss(runner, batch, MicroBatch(layout=batch["layout"], plan=plan)).backward()
                            if data_parallel:
                                runner.finish_grad_sync()  # the buckets' reduce-scatters, started in backward

                    def measured_step(step=step) -> int:
                        release_step_buffers()  # the step's own, made inside the window
                        return peak_bytes_of(step)

                    step()
                    if data_parallel:  # the gradients went to DDP's buffer, not to the parameters
                        assert all(p.grad is None and p.main_grad.count_nonzero() for p in model.parameters())
                    inputs = [batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")]
                    inputs += list(layout.indices("cpu"))
                    # the smaller of two runs: gloo's worker thread now and then frees a finished collective's
                    # buffer after the code has dropped it, which only ever adds to a run's peak
                    measured = storage_bytes(inputs) + min(measured_step(), measured_step())
                    predicted = cost_model.plan_peak_bytes(plan, layout, 1)
                    case = f"p={tp} {dtype_name} {variant} {'tied' if tied else 'untied'} {documents} {plan_name}"
                    case += " DDP" if data_parallel else ""
                    # every layer offloaded: the model keeps the stage's input beside the loss, which its
                    # backward no longer has (stage_layer_bytes): up to one activation over
                    everything_offloaded = all(option.offload for option in plan)
                    headroom = (
                        layout.padded_len // tp * config.hidden_size * dtype.itemsize if everything_offloaded else 0
                    )
                    results.append((case, measured, predicted, headroom))
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def steps() -> list[list[tuple]]:
    return run_on_ranks(_steps_on_rank, 2, timeout_s=1800)


def test_whole_step_peak_is_the_cost_models(steps):
    """The model's peak is the largest of any rank's (ring steps differ between ranks): it is compared with
    the largest measured."""
    cases = len(DTYPES) * len(VARIANTS) * len(DOCUMENTS) * (sum(map(len, PLANS.values())) + len(PLANS[1]))  # + DDP
    assert all(len(results) == cases for results in steps)
    off = []
    for per_rank in zip(*steps):
        (case, _, predicted, headroom), measured = per_rank[0], max(m for _, m, _, _ in per_rank)
        assert all(c == case and p == predicted for c, _, p, _ in per_rank), per_rank
        if not (predicted / measured - 1 >= -TOLERANCE and (predicted - headroom) / measured - 1 <= TOLERANCE):
            off.append(
                f"{case}: largest measured {measured} B, model {predicted:.0f} B ({predicted / measured - 1:+.2%})"
            )
    assert not off, "\n".join(off)
