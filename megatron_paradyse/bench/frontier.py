"""The long-context frontier, simulated: Llama-3-8B on one 8-GPU node, the whole model.

    python -m megatron_paradyse.bench frontier [--gpus a100,h100,h200]

**Nothing here is measured.** ``bench simulate`` also runs it, beside the paper's experiment: the planner and
the analytic cost model on published-figure profiles (:mod:`megatron_paradyse.cost.hardware`), for
``configs/llama3-8b.yaml`` (32 layers, h=4096, GQA 8, SwiGLU 14336, RMSNorm, RoPE, no biases, untied)
at TP=8 with Llama 3's vocabulary (128,256 tokens, padded as Megatron pads it at TP=8), the embedding,
output layer and loss on the node, every strategy pair and per-layer recompute, one sequence per step.

Per GPU kind it prints the longest sequence each way of running the stage fits, on device memory alone:
the transformer layers alone (no vocabulary), the whole model with Megatron's own loss, and the whole
model with the planner free to chunk the loss (:mod:`megatron_paradyse.mcore.chunked_loss`); then with
host memory too, the planner free to offload recomputed layers' inputs (:mod:`megatron_paradyse.core.offload`,
the config's ``planner.host_memory_gib`` per rank, over PCIe at the published rate); then the plan,
predicted step time and the model FLOP utilisation it implies at 1M tokens, every lever allowed, and the
utilisation at 128K tokens. Every
column lets the planner run MLPs over sequence tiles (the config's ``planner.mlp_tile_tokens``,
:mod:`megatron_paradyse.strategies.tiling`).

Assumptions: as the paper's setting (:mod:`megatron_paradyse.bench.simulate`): bf16 weights, fp32 main
gradients, fp32 master weights and Adam moments on the GPUs, not sharded (18 bytes per parameter, no data
parallelism); the budget as a job on such a node sizes it, by the config's ``memory.margin`` (3%) of what
each GPU's caching allocator can hold, with the node's assumed memory in use outside it; host copies as
:mod:`megatron_paradyse.cost.hardware` states them.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from megatron_paradyse.config import load_config
from megatron_paradyse.core.layout import SequenceLayout
from megatron_paradyse.cost.hardware import HARDWARE, NodeSpec
from megatron_paradyse.planner import Planner
from megatron_paradyse.run.config_cli import model_shape_from_args
from megatron_paradyse.run.megatron_flags import parse_megatron_args
from megatron_paradyse.simulation.node import NodeModel
from megatron_paradyse.strategies import ModelShape

__all__ = ["FrontierResult", "frontier", "llama3_node", "main", "print_frontier", "training_flops"]

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

LLAMA3_VOCAB = 128_256
"""Llama 3's tokenizer (Llama Team 2024)."""
REPORT_TOKENS = 1_048_576
LONG_TOKENS = 131_072
"""A second length the utilisation is reported at (128K: where long-context training starts)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontierResult:
    gpu: str
    layers_only_max_len: int
    """The transformer layers alone on the node (no embedding, output layer or loss)."""
    megatron_loss_max_len: int
    """The whole model, the output layer and loss as Megatron computes them."""
    chunked_loss_max_len: int
    """The whole model, the planner free to chunk the loss, on device memory alone."""
    max_len: int
    """The whole model, the planner free to chunk the loss and to offload layer inputs to host memory."""
    host_gib_per_rank: float
    node_host_bytes: int
    """The node's system memory (published)."""
    plan_at_1m: str
    step_s_at_1m: float
    """Predicted forward and backward time of the layers (and a chunked loss's recompute) at 1M tokens."""
    mfu_at_1m: float
    """:func:`training_flops` over that time and the node's peak."""
    mfu_at_128k: float
    """The same at :data:`LONG_TOKENS`, under the plan the planner chooses there."""


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary (``--make-vocab-size-divisible-by`` times the TP size)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def training_flops(shape: ModelShape, num_layers: int, tokens: int) -> float:
    """Model FLOPs of the transformer layers in one training step on one causal sequence (forward and
    backward, no recompute): three times the forward's GEMMs and its attention (``2 s^2 h`` per layer,
    halved by the causal mask, for scores and values). The embedding and output layer are left out, as
    the plan's predicted time leaves their time out (at 1M tokens the output layer's GEMMs are under 0.5%
    of the layers' FLOPs)."""
    h = shape.hidden_size
    q = shape.num_attention_heads * shape.kv_channels
    kv = 2 * shape.num_query_groups * shape.kv_channels
    fc1 = (2 if shape.gated_mlp else 1) * shape.ffn_hidden_size
    per_token = num_layers * 2 * h * (q + kv + q + fc1 + shape.ffn_hidden_size)
    attention = num_layers * 2 * tokens * tokens * q  # QK^T and PV, 2 FLOPs each, causal half
    return 3 * (per_token * tokens + attention)


def llama3_node(gpu: NodeSpec, configs: Path) -> NodeModel:
    """``llama3-8b.yaml``'s whole model on a node of ``gpu``, planned as its config plans it, every lever
    allowed (length buckets geometric)."""
    config = load_config(configs / "llama3-8b.yaml")
    args = parse_megatron_args(config.megatron_args)
    shape = model_shape_from_args(args)
    p = args.tensor_model_parallel_size
    if p != gpu.p:
        raise ValueError(f"llama3-8b.yaml runs TP={p}, the {gpu.name} node has {gpu.p} GPUs")
    host_gib = config.planner.space.host_memory_gib
    if host_gib * 2**30 * p > gpu.host_memory_bytes:
        raise ValueError(
            f"llama3-8b.yaml gives each of {p} ranks {host_gib} GiB of host memory; the {gpu.name} node has "
            f"{gpu.host_memory_bytes / 2**30:.0f} GiB in all"
        )
    return NodeModel(
        gpu=gpu.name,
        shape=shape,
        num_layers=args.num_layers,
        causal=True,
        budget_bytes=config.memory.budget_bytes(gpu.allocator_bytes),
        planner=dataclasses.replace(config.planner, bucket="geometric", on_infeasible="stop"),
        vocab_size=padded_vocab(LLAMA3_VOCAB, p),
        rotary_dim=shape.kv_channels,
        normalization="RMSNorm",
    )


def frontier(gpu: NodeSpec, configs: Path) -> FrontierResult:
    node = llama3_node(gpu, configs)
    shape, p, layers, vocab = node.shape, gpu.p, node.num_layers, node.vocab_size
    host_gib = node.planner.space.host_memory_gib

    def planner(vocab_size: int, loss_chunk_tokens: int, host_memory_gib: float = 0.0) -> Planner:
        planner_config = dataclasses.replace(
            node.planner, loss_chunk_tokens=loss_chunk_tokens, host_memory_gib=host_memory_gib
        )
        return Planner.for_model(
            planner_config,
            dataclasses.replace(node, vocab_size=vocab_size).cost_model(p),
            shape=shape,
            p=p,
            num_layers=layers,
            budget_bytes=node.budget_bytes,
        )

    chunking = node.planner.space.loss_chunk_tokens
    adaptive = planner(vocab, chunking, host_gib)

    def utilisation(tokens: int) -> tuple[str, float, float]:
        """(plan, predicted seconds, model FLOP utilisation) of one sequence of ``tokens``."""
        plan = adaptive.decide(SequenceLayout.build(tokens, p, causal=True)).plan
        seconds = plan.predicted_time_s
        return plan.compact(), seconds, training_flops(shape, layers, tokens) / (seconds * p * gpu.peak_bf16_flops)

    plan_at_1m, step_s, mfu_at_1m = utilisation(REPORT_TOKENS)
    return FrontierResult(
        gpu=gpu.name,
        layers_only_max_len=planner(0, 0).max_feasible_length(p, causal=True),
        megatron_loss_max_len=planner(vocab, 0).max_feasible_length(p, causal=True),
        chunked_loss_max_len=planner(vocab, chunking).max_feasible_length(p, causal=True),
        max_len=adaptive.max_feasible_length(p, causal=True),
        host_gib_per_rank=host_gib,
        node_host_bytes=gpu.host_memory_bytes,
        plan_at_1m=plan_at_1m,
        step_s_at_1m=step_s,
        mfu_at_1m=mfu_at_1m,
        mfu_at_128k=utilisation(LONG_TOKENS)[2],
    )


def print_frontier(results: list[FrontierResult]) -> None:
    print(
        f"\nLlama-3-8B on one node, the whole model (configs/llama3-8b.yaml, TP=8, vocabulary "
        f"{padded_vocab(LLAMA3_VOCAB, 8):,} padded), SIMULATED; longest sequence on device memory alone, "
        f"then with {results[0].host_gib_per_rank:g} GiB of host memory per rank for offloaded layer inputs "
        f"(of {results[0].node_host_bytes / 1e12:g} TB per node)"
    )
    head = ["gpu", "layers only", "Megatron's loss", "chunked loss", "+ offload", "plan at 1M tokens", "step s", "MFU"]
    head += ["MFU at 128K"]
    rows = [
        [
            f.gpu,
            f"{f.layers_only_max_len:,}",
            f"{f.megatron_loss_max_len:,}",
            f"{f.chunked_loss_max_len:,}",
            f"{f.max_len:,}",
            f.plan_at_1m,
            f"{f.step_s_at_1m:.1f}",
            f"{f.mfu_at_1m:.1%}",
            f"{f.mfu_at_128k:.1%}",
        ]
        for f in results
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  " + "  ".join(v.ljust(w) if i in (0, 5) else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_paradyse.bench frontier", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--gpus", default="a100,h100,h200", help=f"of {','.join(HARDWARE)}")
    parser.add_argument("--configs", type=Path, default=CONFIGS, help="folder of llama3-8b.yaml")
    args = parser.parse_args(argv)
    gpus = [g for g in args.gpus.split(",") if g]
    unknown = [g for g in gpus if g not in HARDWARE]
    if unknown or not gpus:
        raise SystemExit(f"--gpus: unknown {', '.join(unknown) or '(empty)'}; known: {', '.join(HARDWARE)}")
    results = [frontier(HARDWARE[g], args.configs) for g in gpus]
    print_frontier(results)
    print(" ".join(f"llama3_8b_{r.gpu}_max_len={r.max_len}" for r in results))
    return 0
