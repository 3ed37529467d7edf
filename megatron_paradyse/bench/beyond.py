"""A sequence no plan fits without one of the long-context levers, trained on CPU under the same budget,
peaks measured.

    python -m megatron_paradyse.bench beyond [--lever loss|offload|tile] [--tp 2] [--tokens 4096]
                                             [--vocab 32768] [--loss-chunk-tokens 512]

On ``--tp`` gloo ranks, Megatron's GPTModel of the CPU demo (``configs/tiny-cpu.yaml``'s layers, tied
output layer) and the Paradyse layer spec. ``--lever loss`` (the default, with a large vocabulary, so
that the output layer's logits outweigh the layers): plans with Megatron's own loss against plans free to
chunk it (:mod:`megatron_paradyse.mcore.chunked_loss`). ``--lever offload`` (give a small ``--vocab``,
so that the layers weigh most): plans free to chunk the loss on device memory alone, against plans also
free to keep recomputed layers' inputs in host memory (:mod:`megatron_paradyse.core.offload`); ``--lever
tile`` likewise, against plans also free to run MLPs over tiles of :data:`TILE_TOKENS` tokens
(:mod:`megatron_paradyse.strategies.tiling`). The budget
per rank is set midway between the least predicted peak of any plan without the lever and that of any
plan with it, for one sequence of ``--tokens`` tokens: the first planner cannot run it (the training entry
point would refuse it before any work), the second can. It then runs one training step (forward, loss,
backward; Megatron's step buffers released before it, as the training entry point does) of that sequence
under the second planner's plan and measures every rank's device peak (parameters and gradients, the
step's inputs and everything the step allocates; host copies apart), beside the prediction, and from its
gradients on trains on the sequence with a few plain SGD steps under the same plan (the loss printed before
and after each). The time figures only rank the plans (published A100 figures; this run is about memory).
Last line: the longest sequence each planner fits (``unchunked_max_len chunked_max_len``, or
``device_max_len offload_max_len``), ``trained_len predicted_peak_mib measured_peak_mib budget_mib`` (and,
offloading, ``host_mib``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_paradyse.bench._e2e_arms import DEMO, DEMO_LAYERS, model_config
from megatron_paradyse.core.memory import peak_bytes_of, storage_bytes
from megatron_paradyse.core.micro_batch import MicroBatch
from megatron_paradyse.core.multiprocess import run_on_ranks
from megatron_paradyse.cost import AnalyticCostModel
from megatron_paradyse.cost.hardware import HARDWARE, hardware_profile
from megatron_paradyse.data import make_micro_batch
from megatron_paradyse.mcore.chunked_loss import micro_batch_loss
from megatron_paradyse.mcore.model_shape import model_shape, rotary_dim
from megatron_paradyse.mcore.spec import get_paradyse_layer_spec
from megatron_paradyse.mcore.step_buffers import release_step_buffers
from megatron_paradyse.planner import Planner, PlannerConfig

from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

__all__ = ["main"]

MIB = 2**20
SEED = 1234


@dataclasses.dataclass(frozen=True)
class _Settings:
    lever: str
    tp: int
    tokens: int
    vocab: int
    loss_chunk_tokens: int


HOST_GIB = 1.0
"""Host memory per rank the offloading planner may use (far more than these layers' inputs)."""
TRAIN_STEPS = 3
LEARNING_RATE = 0.05
"""Plain SGD steps on the sequence under the plan, the first from the measured step's gradients (the loss
printed before the first and after each)."""
TILE_TOKENS = 512
"""Gathered tokens per MLP tile of the tiling planner."""
LEVERS = {
    "loss": ("unchunked", "chunked", "Megatron's loss", "chunked loss"),
    "offload": ("device", "offload", "device memory only", "with offload"),
    "tile": ("untiled", "tiled", "whole MLPs", "MLPs in tiles"),
}
"""Each lever's keys and labels for the planners without and with it."""


def _on_rank(rank: int, world_size: int, settings: _Settings) -> dict | None:
    p = settings.tp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=p)
    model_parallel_cuda_manual_seed(SEED)
    config = model_config(DEMO, DEMO_LAYERS, p)
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

    def planner(lever: bool, budget: float) -> Planner:
        planner_config = PlannerConfig(
            loss_chunk_tokens=settings.loss_chunk_tokens if lever or settings.lever != "loss" else 0,
            host_memory_gib=HOST_GIB if lever and settings.lever == "offload" else 0.0,
            mlp_tile_tokens=TILE_TOKENS if lever and settings.lever == "tile" else 0,
            bucket_tokens=2 * p,
        )
        return Planner.for_model(
            planner_config, cost, shape=cost.shape, p=p, num_layers=config.num_layers, budget_bytes=budget
        )

    without_least = planner(False, 1.0).leanest_peak_bytes(layout)
    with_least = planner(True, 1.0).leanest_peak_bytes(layout)
    if with_least >= without_least:
        raise SystemExit(
            f"at {settings.tokens} tokens --lever {settings.lever} saves nothing (leanest peaks "
            f"{with_least / MIB:.1f} and {without_least / MIB:.1f} MiB): raise --tokens, or adjust --vocab"
        )
    budget = (without_least + with_least) / 2
    without, with_lever = planner(False, budget), planner(True, budget)
    plan = with_lever.decide(layout).plan

    def step(*, backward: bool = True) -> tuple[float, int]:
        """One step of the plan: its loss, and the host bytes its offloaded layer inputs peaked at."""
        micro_batch = MicroBatch(layout=layout, plan=plan)
        loss = micro_batch_loss(model, batch, micro_batch)
        if backward:
            loss.backward()
        return loss.item(), micro_batch.offload.host_peak_bytes

    release_step_buffers()  # as the training entry point does before each micro-batch
    inputs = [batch[k] for k in ("tokens", "labels", "loss_mask", "position_ids")] + list(layout.indices("cpu"))
    first = []
    device_peak = peak_bytes_of(lambda: first.append(step()))
    ((loss, host_measured),) = first
    measured = [None] * p
    dist.all_gather_object(measured, static + storage_bytes(inputs) + device_peak)
    losses = [loss]
    for k in range(TRAIN_STEPS):  # then it trains: SGD on the sequence, the loss going down
        _sgd_step(model)
        losses.append(step(backward=k < TRAIN_STEPS - 1)[0])  # the last: its loss (its gradients move nothing)
    parallel_state.destroy_model_parallel()
    if rank != 0:  # rank 0 reports; the planners' figures below are every rank's alike (a few seconds each)
        return None
    return {
        "budget": budget,
        "without_least": without_least,
        "without_fits": without.fits(layout),
        "without_max_len": without.max_feasible_length(p, causal=True),
        "with_max_len": with_lever.max_feasible_length(p, causal=True),
        "plan": plan.compact(),
        "predicted": plan.predicted_peak_bytes,
        "predicted_here": cost.plan_peak_bytes(plan, layout, 1),
        "measured": measured,
        "host_predicted": sum(cost.layer_cost(option, layout, 1).host_bytes for option in plan),
        "host_measured": host_measured,
        "padded": layout.padded_len,
        "losses": losses,
    }


def _sgd_step(model: torch.nn.Module) -> None:
    """The weights moved against their gradients (summed over the TP group where every rank holds the
    parameter whole, as Megatron sums them), the gradients zeroed."""
    with torch.no_grad():
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())
            param -= LEARNING_RATE * param.grad
            param.grad.zero_()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench beyond", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--lever", choices=tuple(LEVERS), default="loss", help="what the second planner may use")
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
    settings = _Settings(args.lever, args.tp, args.tokens, args.vocab, args.loss_chunk_tokens)
    result = run_on_ranks(_on_rank, args.tp, args=(settings,), timeout_s=1800)[0]
    measured = max(result["measured"])
    before, after, without_label, with_label = LEVERS[args.lever]
    print(
        f"GPT of the CPU demo (4 layers, h=128), vocabulary {args.vocab:,}, on {args.tp} gloo ranks (TP with "
        f"sequence parallelism), fp32, one sequence of {args.tokens:,} tokens (padded {result['padded']:,})"
    )
    print(f"budget per rank: {result['budget'] / MIB:.2f} MiB (midway between the leanest plans with and without)")
    print(
        f"  {without_label}: the leanest plan peaks at {result['without_least'] / MIB:.2f} MiB: "
        f"{'fits' if result['without_fits'] else 'does not fit'}; "
        f"longest that fits {result['without_max_len']:,} tokens"
    )
    print(f"  {with_label}: plan {result['plan']}; longest that fits {result['with_max_len']:,} tokens")
    print(
        f"    predicted device peak {result['predicted_here'] / MIB:.2f} MiB (the planner's, at its bucket's edge: "
        f"{result['predicted'] / MIB:.2f}); measured, per rank: "
        + ", ".join(f"{m / MIB:.2f}" for m in result["measured"])
        + f" MiB ({result['predicted_here'] / measured - 1:+.2%})"
    )
    print(
        f"    trained under the plan, {TRAIN_STEPS} SGD steps (lr {LEARNING_RATE}): loss "
        + " -> ".join(f"{loss:.3f}" for loss in result["losses"])
    )
    host = ""
    if args.lever == "offload":
        print(
            f"    host memory (offloaded layer inputs): predicted {result['host_predicted'] / MIB:.2f} MiB, "
            f"measured {result['host_measured'] / MIB:.2f} MiB on rank 0"
        )
        host = f" host_mib={result['host_measured'] / MIB:.2f}"
    print(
        f"{before}_max_len={result['without_max_len']} {after}_max_len={result['with_max_len']} "
        f"trained_len={args.tokens} predicted_peak_mib={result['predicted_here'] / MIB:.2f} "
        f"measured_peak_mib={measured / MIB:.2f} budget_mib={result['budget'] / MIB:.2f}{host}"
    )
    return 0 if measured <= result["budget"] and not result["without_fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
