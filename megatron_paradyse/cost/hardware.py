"""Published figures of GPU nodes, as data, and the cost profile they imply: **simulated, not measured**.

``paradyse calibrate`` measures a profile on the machine it runs on. To project the planner and the
cost model onto hardware we do not have (the paper's node of 8 x A100-SXM4-80GB, and H100/H200 nodes),
:func:`hardware_profile` builds a profile of the same schema from the figures below instead. Every number
carries its source; a number marked *assumption* is ours (an order of magnitude we believe, not a
citation). Sources:

- [A100] NVIDIA A100 Tensor Core GPU datasheet (A100 SXM4 80GB column): 312 TFLOP/s dense BF16,
  2,039 GB/s HBM2e, 80 GB, NVLink 600 GB/s.
- [H100] NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): 1,979 TFLOP/s BF16 *with sparsity*,
  i.e. 989 dense; 3.35 TB/s HBM3; 80 GB; NVLink 900 GB/s.
- [H200] NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): same tensor cores as H100 (989 TFLOP/s
  dense BF16); 4.8 TB/s HBM3e; 141 GB; NVLink 900 GB/s.
- [FA2] T. Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
  arXiv 2307.08691 (ICLR 2024), section 4.1: on A100-SXM4-80GB the forward pass reaches up to 73% and
  the backward pass up to 63% of the 312 TFLOP/s peak (head dim 128, long sequences); the same code on
  H100 SXM5 reaches up to 335 TFLOP/s forward + backward; end-to-end GPT training reaches 225 TFLOP/s
  per A100 (72% model FLOPs utilisation). FLOPs counted as there: forward ``4 s^2 d`` per head (halved
  causal), backward 2.5 times the forward.
- [NCCL-A100] NVIDIA/nccl-tests issue #149 (S. Jeaugey, 2023-07-05): 12 NVLinks x ~20 GB/s effective,
  "~230 GB/s" bus bandwidth on A100 (all-gather, reduce-scatter, ring all-reduce).
- [NCCL-H100] NVIDIA/nccl-tests issue #212 (S. Jeaugey, 2024-05-06): "effective NVLink bandwidth of
  370 GB/s" bus bandwidth for non-all-reduce collectives on H100; issue #326 (2025-06-24): all-gather
  at "360 GB/s is exactly what we'd expect on H100".
- [P2P-H100] NVIDIA/nccl-tests issue #268 (2024-11-19): ``sendrecv_perf`` between two NVLink-connected
  H100s plateaus at ~180 GB/s.
- [CUDNN-H200] Measured here: ``benchmarks/results/attention-kernels_h200_20261126_a36467b.md``, a
  Llama-3-8B attention core (32 query heads, 8 key heads, head dim 128, causal, bf16) forward + backward
  on one H200 at 4K, 16K and 64K tokens, with cuDNN's fused attention (PyTorch's kernel from Hopper on,
  the one the layers run there on square causal blocks) and with FlashAttention-2: cuDNN 1.8x faster,
  FlashAttention-2 at 330 TFLOP/s at 64K tokens ([FA2]'s published H100 figure: 335).
- [GEMM-H200] Measured here: ``benchmarks/results/calibrate_h200_20261127_d44f729.md``, Llama-3-8B's own
  GEMM shapes of 1,024 rows and more on one H200 at 645 to 801 TFLOP/s forward and 627 to 746 backward.
- [SMI] ``nvidia-smi`` memory.total as commonly reported: 81,920 MiB (A100-SXM4-80GB), 81,559 MiB
  (H100 80GB HBM3), 143,771 MiB (H200).

- [PCIE] The datasheets' host interface: PCIe Gen4 x16, 64 GB/s both directions together (A100), PCIe
  Gen5 x16, 128 GB/s (H100, H200): 32 and 64 GB/s each way.
- [DGX] NVIDIA DGX A100 and DGX H100/H200 user guides: 2 TB of system memory per node (DGX A100 80GB
  configuration; DGX H100 and H200 as shipped).

- [BUSBW] NVIDIA/nccl-tests ``doc/PERFORMANCE.md``: bus bandwidth is ``algbw (p-1)/p`` for all-gather,
  reduce-scatter and all-to-all, ``algbw`` itself for broadcast and reduce.

Collective figures are NCCL bus bandwidths (nccl-tests ``busbw``), which [BUSBW] turns into seconds per
byte of what the cost terms count: an all-gather of ``N`` output bytes on ``p`` ranks takes
``N (p-1)/p / busbw``, a reduce-scatter of ``N`` input bytes and an all-to-all of ``N`` bytes per rank
likewise, a broadcast or reduce of an ``N``-byte message ``N / busbw``; a ring hop of ``N`` bytes
``N / bw`` (all ranks send at once, each to its own neighbour). Figures are for ``p = 8`` GPUs of one
node behind NVSwitch; a group of 1, 2 or 4 of them (:func:`node_group`) has the same bus bandwidth
(*assumption*: every GPU reaches the NVSwitches over all its NVLinks, whatever the group's size).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_paradyse.cost.profile import PROFILE_SCHEMA, PROFILE_VERSION
from megatron_paradyse.strategies import ModelShape
from megatron_paradyse.strategies.terms import COLLECTIVE_KINDS

__all__ = [
    "BYTES_PER_PARAM",
    "GROUP_SIZES",
    "HARDWARE",
    "AttentionFigures",
    "Link",
    "NodeSpec",
    "OPTIMIZER_BYTES_PER_PARAM",
    "hardware_profile",
    "node_group",
    "stage_params_per_rank",
    "stage_static_bytes",
]

_MIB = 2**20

# FlashAttention-2's throughput grows with the block length and saturates after a few thousand tokens
# ([FA2], Figures 4-6: 512 ... 16K). Fraction of the long-sequence rate at each block length,
# read approximately off those figures (an *assumption* in its detail); causal blocks ramp up later.
_FLASH_RAMP = {
    "causal": ((512, 0.50), (1024, 0.65), (2048, 0.80), (4096, 0.90), (8192, 1.00)),
    "full": ((512, 0.70), (1024, 0.80), (2048, 0.90), (4096, 0.95), (8192, 1.00)),
}
# [FA2] plots head dims 64 and 128; 64 runs below 128. *Assumption*: 85% of the head-dim-128 rate.
_HEAD_DIM_64_FACTOR = 0.85


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class AttentionFigures:
    """One attention kernel's rates on blocks of one mask, at head dim 128."""

    kernel: str
    forward_flops: float
    """FLOP/s of the forward on long blocks ([FA2]'s count: ``4`` per visible pair and head dim)."""
    backward_flops: float
    """FLOP/s of the backward on long blocks (``10`` per visible pair and head dim)."""
    ramp: tuple[tuple[int, float], ...]
    """``(block length, fraction of the long-block rates)``, rising to 1."""
    source: str


def _forward_backward_split(forward_backward_flops: float) -> tuple[float, float]:
    """Forward and backward FLOP/s whose forward + backward rate (3.5 units over ``1/f + 2.5/b``) is
    ``forward_backward_flops``, in the ratio [FA2] measured on A100 (73% : 63% of the peak): the measured
    figures time the two together."""
    ratio = 0.73 / 0.63
    forward = forward_backward_flops * (1 + 2.5 * ratio) / 3.5
    return forward, forward / ratio


def _flash_attention_2(forward_backward_flops: float, mask: str, source: str) -> AttentionFigures:
    forward, backward = _forward_backward_split(forward_backward_flops)
    return AttentionFigures(
        kernel="flash_attn", forward_flops=forward, backward_flops=backward, ramp=_FLASH_RAMP[mask], source=source
    )


# [CUDNN-H200]: milliseconds of the Llama-3-8B core's forward + backward at each length, (cuDNN, FlashAttention-2)
_H200_CORE_MS = {4096: (1.08, 2.00), 16384: (13.45, 24.32), 65536: (211.2, 373.6)}


def _core_flops(tokens: int, milliseconds: float) -> float:
    """FLOP/s of the measured core (32 heads, head dim 128, causal): ``14`` per visible pair and head dim."""
    return 14 * tokens * (tokens + 1) / 2 * 32 * 128 / (milliseconds / 1e3)


def _cudnn_causal_hopper() -> AttentionFigures:
    """cuDNN's fused attention on causal square blocks, as measured on an H200 [CUDNN-H200]; under 4K tokens
    (not measured) *assumption*: FlashAttention-2's causal ramp, scaled to the measured 4K point."""
    rates = {n: _core_flops(n, cudnn) for n, (cudnn, _) in _H200_CORE_MS.items()}
    longest = rates[max(rates)]
    measured = [(n, rate / longest) for n, rate in sorted(rates.items())]
    first, first_fraction = measured[0]
    flash_at_first = dict(_FLASH_RAMP["causal"])[first]
    below = [(n, f * first_fraction / flash_at_first) for n, f in _FLASH_RAMP["causal"] if n < first]
    forward, backward = _forward_backward_split(longest)
    return AttentionFigures(
        kernel="cudnn",
        forward_flops=forward,
        backward_flops=backward,
        ramp=(*below, *measured),
        source="benchmarks/results/attention-kernels_h200_20261126_a36467b.md",
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    """One collective on the node's NVSwitch fabric at ``p = 8``."""

    bytes_per_s: float
    """NCCL bus bandwidth (``send_recv``: bytes per second one rank sends to its neighbour)."""
    latency_s: float
    """Fixed cost per call (small-message time)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """One kind of 8-GPU node: each GPU's published figures and the links between them."""

    name: str
    device_name: str
    """What ``torch.cuda.get_device_name()`` reports on such a GPU."""
    memory_bytes: int
    peak_bf16_flops: float
    """Dense BF16 tensor-core peak."""
    gemm_efficiency: float
    """Fraction of the peak large BF16 GEMMs reach."""
    attention: dict[str, AttentionFigures]
    """The kernel that runs each mask's blocks (``causal``, ``full``) and its rates."""
    hbm_bytes_per_s: float
    hbm_efficiency: float
    """Fraction of the HBM peak that memory-bound kernels (copies, norms, adds) reach."""
    links: dict[str, Link]
    """Per collective kind of :data:`~megatron_paradyse.cost.terms.COLLECTIVE_KINDS`."""
    host_link: Link
    """One GPU's copies to and from pinned host memory, each way (offloaded activations)."""
    host_memory_bytes: int
    """The node's system memory [DGX]."""
    p: int = 8
    gemm_launch_s: float = 5e-6
    """*Assumption*: per GEMM call (launch and framework overhead)."""
    attention_call_s: float = 10e-6
    """*Assumption*: per attention kernel call."""
    elementwise_op_s: float = 4e-6
    """*Assumption*: per memory-bound op."""
    ring_overlap: float = 0.9
    """*Assumption*: fraction of a ring hop hidden behind the attention kernel it runs beside (NCCL on its
    own stream takes a few SMs)."""
    host_overlap: float = 0.9
    """*Assumption*: fraction of a host copy hidden behind the compute beside it (copy engines run
    beside the kernels, sharing HBM with them)."""
    allocator_slack: float = 0.05
    """Fraction of the transient working set the CUDA caching allocator adds (rounding,
    fragmentation): the value ``paradyse calibrate`` writes on CUDA."""
    outside_allocator_bytes: int = 3 * 2**30
    """*Assumption*: each GPU's memory in use outside PyTorch's caching allocator while training (the CUDA
    context, cuBLAS and cuDNN, NCCL's communicators), which a job measures at start-up: 2.82 GiB at the
    end of a one-GPU run on an H200 (benchmarks/results/train-peaks_h200_20261126_a63fbdb-2.md), rounded
    up; several GPUs' communicators not measured."""
    sources: tuple[str, ...] = ()

    @property
    def allocator_bytes(self) -> int:
        """What the caching allocator can hold on each GPU: what plans are budgeted from."""
        return self.memory_bytes - self.outside_allocator_bytes


def _nvswitch_links(collective_bytes_per_s: float, p2p_bytes_per_s: float, latency_s: float, p2p_latency_s: float):
    # all-to-all, broadcast and reduce over NVSwitch: *assumption*, the all-gather's bus bandwidth
    collective = Link(bytes_per_s=collective_bytes_per_s, latency_s=latency_s)
    return {
        "all_gather": collective,
        "reduce_scatter": collective,
        "all_to_all": collective,
        "broadcast": collective,
        "reduce": collective,
        "send_recv": Link(bytes_per_s=p2p_bytes_per_s, latency_s=p2p_latency_s),
    }


def _bus_fraction(kind: str, p: int) -> float:
    """Bytes each rank's busiest link carries per byte the cost terms count for ``kind`` [BUSBW]."""
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (p - 1) / p
    if kind in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"no bus-bandwidth rule for collective {kind!r}; add it to cost/hardware.py")


_A100_PEAK = 312e12  # [A100]
_H100_PEAK = 989e12  # [H100], [H200]: 1,979 with sparsity, halved
_A100_FLASH = {  # [FA2] on A100: 73% (forward) and 63% (backward) of the peak
    mask: AttentionFigures(
        kernel="flash_attn",
        forward_flops=0.73 * _A100_PEAK,
        backward_flops=0.63 * _A100_PEAK,
        ramp=ramp,
        source="FlashAttention-2 (arXiv 2307.08691) 4.1",
    )
    for mask, ramp in _FLASH_RAMP.items()
}
# From Hopper on, square causal blocks run cuDNN's attention [CUDNN-H200]; full blocks and the ring's
# rectangles FlashAttention-2 at [FA2]'s H100 forward + backward 335 TFLOP/s (330 measured on an H200).
# *Assumption* for the H100: the H200's measured rates (the same tensor cores; attention is compute-bound).
_HOPPER_ATTENTION = {
    "causal": _cudnn_causal_hopper(),
    "full": _flash_attention_2(335e12, "full", "FlashAttention-2 (arXiv 2307.08691) 4.1"),
}

# [PCIE] each way, *assumption*: 80% of it reached by pinned copies, on every GPU of the node at once,
# 10 us per copy
_PCIE4 = Link(bytes_per_s=0.8 * 32e9, latency_s=10e-6)
_PCIE5 = Link(bytes_per_s=0.8 * 64e9, latency_s=10e-6)
_DGX_MEMORY = 2 * 10**12  # [DGX]

HARDWARE: dict[str, NodeSpec] = {
    "a100": NodeSpec(
        name="a100",
        device_name="NVIDIA A100-SXM4-80GB",
        memory_bytes=81920 * _MIB,  # [SMI]
        peak_bf16_flops=_A100_PEAK,
        # *assumption*: 75%; [FA2]'s 72% MFU end to end, attention and memory-bound work included,
        # bounds large GEMMs from below
        gemm_efficiency=0.75,
        attention=_A100_FLASH,
        hbm_bytes_per_s=2039e9,  # [A100]
        hbm_efficiency=0.85,  # *assumption*: a streaming copy's share of the HBM peak
        # [NCCL-A100] 230 GB/s; ring hop *assumption*: [P2P-H100]'s 180 GB/s scaled by 230/370;
        # latencies *assumption* (small-message times of nccl-tests on NVSwitch nodes)
        links=_nvswitch_links(230e9, 180e9 * 230 / 370, 20e-6, 12e-6),
        host_link=_PCIE4,
        host_memory_bytes=_DGX_MEMORY,
        sources=("A100 datasheet", "FlashAttention-2 (arXiv 2307.08691) 4.1", "nccl-tests #149"),
    ),
    "h100": NodeSpec(
        name="h100",
        device_name="NVIDIA H100 80GB HBM3",
        memory_bytes=81559 * _MIB,  # [SMI]
        peak_bf16_flops=_H100_PEAK,
        gemm_efficiency=0.70,  # 692 TFLOP/s: within [GEMM-H200]'s 627 to 801 (the same tensor cores)
        attention=_HOPPER_ATTENTION,
        hbm_bytes_per_s=3.35e12,  # [H100]
        hbm_efficiency=0.85,
        links=_nvswitch_links(360e9, 180e9, 15e-6, 10e-6),  # [NCCL-H100], [P2P-H100]
        host_link=_PCIE5,
        host_memory_bytes=_DGX_MEMORY,
        sources=(
            "H100 datasheet",
            "FlashAttention-2 (arXiv 2307.08691) 4.1",
            "nccl-tests #212, #326, #268",
            "benchmarks/results/attention-kernels_h200_20261126_a36467b.md",
            "benchmarks/results/calibrate_h200_20261127_d44f729.md",
        ),
    ),
    "h200": NodeSpec(
        name="h200",
        device_name="NVIDIA H200",
        memory_bytes=143771 * _MIB,  # [SMI]
        peak_bf16_flops=_H100_PEAK,  # [H200]
        gemm_efficiency=0.70,  # [GEMM-H200]: 627 to 801 TFLOP/s measured
        attention=_HOPPER_ATTENTION,
        hbm_bytes_per_s=4.8e12,  # [H200]
        hbm_efficiency=0.85,
        links=_nvswitch_links(360e9, 180e9, 15e-6, 10e-6),  # NVLink 4 as H100 [H200]
        host_link=_PCIE5,
        host_memory_bytes=_DGX_MEMORY,
        sources=(
            "H200 datasheet",
            "FlashAttention-2 (arXiv 2307.08691) 4.1",
            "nccl-tests #212, #326, #268",
            "benchmarks/results/attention-kernels_h200_20261126_a36467b.md",
            "benchmarks/results/calibrate_h200_20261127_d44f729.md",
        ),
    ),
}
"""The GPU kinds the simulation covers, by short name."""


GROUP_SIZES = (1, 2, 4, 8)
"""The groups of one node's GPUs the figures cover."""


def node_group(name: str, p: int) -> NodeSpec:
    """``p`` GPUs of one node of kind ``name`` (:data:`HARDWARE`), ``p`` in :data:`GROUP_SIZES`."""
    if p not in GROUP_SIZES:
        raise ValueError(
            f"the published figures are for groups of {', '.join(map(str, GROUP_SIZES))} GPUs of one node, not p={p}"
        )
    return dataclasses.replace(HARDWARE[name], p=p)


def hardware_profile(spec: NodeSpec) -> dict[str, Any]:
    """The cost profile (schema of :mod:`~megatron_paradyse.cost.profile`) that ``spec``'s figures imply.

    bf16, CUDA, ``p = spec.p``, no correction; load it with ``check_machine=False`` (its fingerprint
    names the GPU, not this machine). GEMM time is ``launch + FLOPs / (efficiency x peak) + bytes /
    achieved HBM bandwidth`` (an additive roofline: above the true time near the ridge point);
    backward does twice the FLOPs and bytes. Attention per (visible pair x head dim) is ``4 / rate``
    forward and ``10 / rate`` backward, per mask the rates of the kernel that runs it
    (:class:`AttentionFigures`), ramped over block length.
    """
    missing = [kind for kind in COLLECTIVE_KINDS if kind not in spec.links]
    if missing:
        raise ValueError(f"hardware {spec.name!r} has no link figures for {', '.join(missing)}; add them to its links")
    gemm_s_per_flop = 1.0 / (spec.gemm_efficiency * spec.peak_bf16_flops)
    s_per_byte = 1.0 / (spec.hbm_efficiency * spec.hbm_bytes_per_s)
    gemm = {
        "forward": {"coef": [spec.gemm_launch_s, gemm_s_per_flop, s_per_byte]},
        # the model prices backward with the forward's FLOPs and bytes: dgrad + wgrad do each twice
        "backward": {"coef": [2 * spec.gemm_launch_s, 2 * gemm_s_per_flop, 2 * s_per_byte]},
    }
    flops_per_unit = {"forward": 4.0, "backward": 10.0}  # per (visible pair x head dim) [FA2]
    kernels = sorted({figures.kernel for figures in spec.attention.values()})
    attention: dict[str, Any] = {"kernel": "+".join(kernels)}
    for direction, flops in flops_per_unit.items():
        attention[direction] = {}
        for mask, figures in spec.attention.items():
            long_rate = figures.forward_flops if direction == "forward" else figures.backward_flops
            by_head_dim = {}
            for hn, factor in ((64, _HEAD_DIM_64_FACTOR), (128, 1.0)):
                by_head_dim[str(hn)] = {
                    "lengths": [float(n) for n, _ in figures.ramp],
                    "per_unit_s": [flops / (factor * long_rate * fraction) for _, fraction in figures.ramp],
                }
            attention[direction][mask] = {"per_call_s": spec.attention_call_s, "by_head_dim": by_head_dim}
    collectives = {}
    for kind in COLLECTIVE_KINDS:
        link = spec.links[kind]
        collectives[kind] = {"latency_s": link.latency_s, "per_byte_s": _bus_fraction(kind, spec.p) / link.bytes_per_s}
    return {
        "schema": PROFILE_SCHEMA,
        "version": PROFILE_VERSION,
        "grid": "published",
        "simulated": True,
        "fingerprint": {
            "device": "cuda",
            "device_name": spec.device_name,
            "cpu_count": None,
            "torch": "n/a (simulated from published figures)",
            "megatron_core": "n/a (simulated from published figures)",
            "python": None,
            "hostname": "simulated",
        },
        "dtype": "bfloat16",
        "concurrency": spec.p,
        "gemm": gemm,
        "attention": attention,
        "elementwise": {"per_byte_s": s_per_byte, "per_op_s": spec.elementwise_op_s},
        "collectives": {str(spec.p): collectives},
        "ring_overlap": spec.ring_overlap,
        "host_link": {
            "latency_s": spec.host_link.latency_s,
            "per_byte_s": 1.0 / spec.host_link.bytes_per_s,
            "overlap": spec.host_overlap,
        },
        "allocator_slack": spec.allocator_slack,
        "correction": None,
        "samples": {"sources": list(spec.sources), "see": "megatron_paradyse/cost/hardware.py"},
    }


BYTES_PER_PARAM = 18
"""bf16 weight (2) + fp32 main gradient (4) + fp32 master weight (4) + Adam's two fp32 moments (8):
Megatron's default bf16 recipe, without a distributed optimizer (the paper's node has no data parallelism)."""
OPTIMIZER_BYTES_PER_PARAM = 12
"""Of :data:`BYTES_PER_PARAM`, the fp32 master weight and Adam's moments: what Megatron's distributed
optimizer shards over the data-parallel ranks."""


def stage_params_per_rank(shape: ModelShape, num_layers: int, p: int, *, vocab_size: int = 0) -> float:
    """Parameters one of ``p`` tensor-parallel ranks holds of the node's layers: TP-sharded linear
    weights, replicated LayerNorm weights and biases (no linear biases, as the presets); with
    ``vocab_size``, a vocab-parallel embedding and output layer (untied)."""
    h = shape.hidden_size
    qkv = (shape.num_attention_heads + 2 * shape.num_query_groups) * shape.kv_channels
    fc1 = (2 if shape.gated_mlp else 1) * shape.ffn_hidden_size
    sharded = h * (qkv + shape.num_attention_heads * shape.kv_channels + fc1 + shape.ffn_hidden_size)
    return num_layers * (sharded / p + 4 * h) + 2 * vocab_size * h / p


def stage_static_bytes(shape: ModelShape, num_layers: int, p: int, *, vocab_size: int = 0, dp: int = 1) -> float:
    """Weights, gradients and optimizer state of :func:`stage_params_per_rank` (:data:`BYTES_PER_PARAM`
    per parameter), the optimizer state sharded over ``dp`` data-parallel replicas as Megatron's
    distributed optimizer shards it (``dp = 1``: not sharded)."""
    per_param = BYTES_PER_PARAM - OPTIMIZER_BYTES_PER_PARAM + OPTIMIZER_BYTES_PER_PARAM / dp
    return stage_params_per_rank(shape, num_layers, p, vocab_size=vocab_size) * per_param
