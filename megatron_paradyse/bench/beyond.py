"""A sequence no plan fits without a chunked loss, trained on CPU under the same budget, peaks measured.

    python -m megatron_paradyse.bench beyond [--tp 2] [--tokens 4096] [--vocab 32768] [--loss-chunk-tokens 512]

On ``--tp`` gloo ranks, Megatron's GPTModel of the CPU demo (``configs/tiny-cpu.yaml``'s layers, tied
output layer) with a large vocabulary, so that the output layer's logits outweigh the layers, and the
Paradyse layer spec. The budget per rank is set midway between the least predicted peak of any plan with
Megatron's own loss and that of any plan free to chunk it, for one sequence of ``--tokens`` tokens: the
first planner cannot run it (the training entry point would refuse it before any work), the second
can. It then runs one training step (forward, loss, backward; after a first one, so that nothing
created once is counted) of that sequence under the second planner's plan and measures every rank's
peak (parameters and gradients, the step's inputs and everything the step allocates), beside the
prediction. The time figures only rank the plans (published A100 figures; this run is about memory).
Last line: ``unchunked_max_len chunked_max_len trained_len predicted_peak_mib measured_peak_mib
budget_mib``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
import torch

from megatron_paradyse.core.multiprocess import run_on_ranks

__all__ = ["main"]

MIB = 2**20
SEED = 1234


@dataclasses.dataclass(frozen=True)
class _Settings:
    tp: int
    tokens: int
    vocab: int
    loss_chunk_tokens: int


def _on_rank(rank: int, world_size: int, settings: _Settings) -> dict:
    from megatron_paradyse.core import compat

    compat.install()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_paradyse.bench.e2e import demo_config
    from megatron_paradyse.core.memory import peak_bytes_of, storage_bytes
    from megatron_paradyse.core.micro_batch import MicroBatch, micro_batch_scope
    from megatron_paradyse.cost import AnalyticCostModel
    from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
    from megatron_paradyse.data import make_micro_batch
    from megatron_paradyse.mcore.chunked_loss import output_processor
    from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim
    from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
    from megatron_paradyse.mcore.step_buffers import release_step_buffers
    from megatron_paradyse.planner import Planner, PlannerConfig

    p = settings.tp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=p)
    model_parallel_cuda_manual_seed(SEED)
    config = demo_config(p)
    torch.manual_seed(SEED)
    model = GPTModel(
        config,
        get_paradyse_layer_spec(config),
        vocab_size=settings.vocab,
        max_sequence_length=settings.tokens + 2 * p,
        position_embedding_type="rope",
    )
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # Megatron's gradient buffer: there before any step
    static = storage_bytes(t for param in model.parameters() for t in (param, param.grad))
    profile = hardware_profile(dataclasses.replace(HARDWARE["a100"], p=p))
    profile["fingerprint"]["device"] = "cpu"  # memory as tensors take it on this machine
    profile["allocator_slack"] = 0.0  # no caching allocator on the CPU
    profile["dtype"] = "float32"  # the model's (the rates stay bf16's: they only rank the plans)
    cost = AnalyticCostModel(
        profile,
        model_shape(config),
        p,
        static_bytes=static,
        vocab_size=settings.vocab,
        rotary_dim=rotary_dim(config, "rope"),
        bias=config.add_bias_linear,
        normalization=config.normalization,
        tied_unfused_output=not config.gradient_accumulation_fusion,
    )
    tokens = np.random.default_rng(SEED).integers(0, settings.vocab, settings.tokens)
    batch = make_micro_batch([tokens], [False], p=p, causal=True, pad_id=0)
    layout = batch["layout"]

    def planner(loss_chunk_tokens: int, budget: float) -> Planner:
        planner_config = PlannerConfig(loss_chunk_tokens=loss_chunk_tokens, bucket_tokens=2 * p)
        return Planner.for_model(
            planner_config, cost, shape=cost.shape, p=p, num_layers=config.num_layers, budget_bytes=budget
        )

    whole_least = planner(0, 1.0).leanest_peak_bytes(layout)
    chunked_least = planner(settings.loss_chunk_tokens, 1.0).leanest_peak_bytes(layout)
    if chunked_least >= whole_least:
        raise SystemExit(
            f"at {settings.tokens} tokens a chunked loss saves nothing (leanest peaks {chunked_least / MIB:.1f} "
            f"and {whole_least / MIB:.1f} MiB): raise --vocab or --tokens, or lower --loss-chunk-tokens"
        )
    budget = (whole_least + chunked_least) / 2
    whole, chunked = planner(0, budget), planner(settings.loss_chunk_tokens, budget)
    plan = chunked.decide(layout).plan

    def step() -> None:
        with micro_batch_scope(MicroBatch(layout=layout, plan=plan)):
            per_token = model(
                batch["tokens"],
                batch["position_ids"],
                None,
                labels=batch["labels"],
                output_processor=output_processor(plan),
            )
        ((per_token * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()

    step()
    release_step_buffers()  # as the training entry point does before each micro-batch
    inputs = [batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")] + list(layout.indices("cpu"))
    measured = [None] * p
    dist.all_gather_object(measured, static + storage_bytes(inputs) + peak_bytes_of(step))
    parallel_state.destroy_model_parallel()
    return {
        "budget": budget,
        "whole_least": whole_least,
        "whole_fits": whole.fits(layout),
        "unchunked_max_len": whole.max_feasible_length(p, causal=True),
        "chunked_max_len": chunked.max_feasible_length(p, causal=True),
        "plan": plan.compact(),
        "predicted": plan.predicted_peak_bytes,
        "predicted_here": cost.plan_peak_bytes(plan, layout, 1),
        "measured": measured,
        "padded": layout.padded_len,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench beyond", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--tp", type=int, default=2, help="gloo ranks of the tensor-parallel group (default 2)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the sequence (default 4096)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary, a multiple of 128 x tp (default 32768)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=512, help="gathered tokens per loss chunk")
    args = parser.parse_args(argv)
    problems = [
        f"--{name} must be a positive int, got {value}"
        for name, value in (("tp", args.tp), ("tokens", args.tokens), ("loss-chunk-tokens", args.loss_chunk_tokens))
        if value < 1
    ]
    if args.vocab < 1 or args.vocab % (128 * max(args.tp, 1)):
        problems.append(f"--vocab must be a positive multiple of 128 x tp = {128 * max(args.tp, 1)}, got {args.vocab}")
    if problems:
        parser.error("; ".join(problems))
    settings = _Settings(args.tp, args.tokens, args.vocab, args.loss_chunk_tokens)
    result = run_on_ranks(_on_rank, args.tp, args=(settings,), timeout_s=1800)[0]
    measured = max(result["measured"])
    print(
        f"GPT of the CPU demo (4 layers, h=128), vocabulary {args.vocab:,}, on {args.tp} gloo ranks (TP with "
        f"sequence parallelism), fp32, one sequence of {args.tokens:,} tokens (padded {result['padded']:,})"
    )
    print(f"budget per rank: {result['budget'] / MIB:.2f} MiB (midway between the leanest plans with and without)")
    print(
        f"  Megatron's loss: the leanest plan peaks at {result['whole_least'] / MIB:.2f} MiB: "
        f"{'fits' if result['whole_fits'] else 'does not fit'}; "
        f"longest that fits {result['unchunked_max_len']:,} tokens"
    )
    print(f"  chunked loss:    plan {result['plan']}; longest that fits {result['chunked_max_len']:,} tokens")
    print(
        f"    predicted peak {result['predicted_here'] / MIB:.2f} MiB (the planner's, at its bucket's edge: "
        f"{result['predicted'] / MIB:.2f}); measured, per rank: "
        + ", ".join(f"{m / MIB:.2f}" for m in result["measured"])
        + f" MiB ({result['predicted_here'] / measured - 1:+.2%})"
    )
    print(
        f"unchunked_max_len={result['unchunked_max_len']} chunked_max_len={result['chunked_max_len']} "
        f"trained_len={args.tokens} predicted_peak_mib={result['predicted_here'] / MIB:.2f} "
        f"measured_peak_mib={measured / MIB:.2f} budget_mib={result['budget'] / MIB:.2f}"
    )
    return 0 if measured <= result["budget"] and not result["whole_fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
