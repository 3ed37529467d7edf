"""A single-rank fp32 transformer stack in Megatron's TP=1 weight layout: the oracle for strategy tests.

Written independently of the package's attention code: dense masks and PyTorch SDPA, natural token
order, no padding. Also cuts the full weights into Megatron's TP=p shards for the distributed side.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_paradyse.strategies import AttentionWeights, MLPWeights, ModelShape


@dataclasses.dataclass(frozen=True)
class StackConfig:
    shape: ModelShape
    num_layers: int
    causal: bool
    bias: bool = True
    qk_scale: bool = False
    """Learned per-channel scales of q and k before RoPE (``q_scale``/``k_scale`` ``[hn]``, replicated):
    a parameter inside ``qk_transform``, standing in for Megatron's q/k layernorm weights."""

    @property
    def activation(self):
        return F.silu if self.shape.gated_mlp else F.gelu


def rope(t: Tensor, positions: Tensor) -> Tensor:
    """Rotary embedding (rotate-half) of ``t [s, b, n, d]`` at ``positions [s]``, computed in fp32 and
    returned in ``t``'s dtype."""
    d = t.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float()[:, None] * inv_freq[None, :]  # [s, d/2]
    cos, sin = angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]
    x1, x2 = t[..., : d // 2], t[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(t.dtype)


def rope_transform(q: Tensor, k: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    return rope(q, position_ids), rope(k, position_ids)


def make_params(cfg: StackConfig, seed: int) -> list[dict[str, Tensor]]:
    """Full (TP=1) weights of every layer, the same on every rank for the same seed."""
    s = cfg.shape
    gen = torch.Generator().manual_seed(seed)
    qkv_rows = s.num_query_groups * (s.heads_per_group + 2) * s.kv_channels

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    layers = []
    for _ in range(cfg.num_layers):
        h = s.hidden_size
        layers.append(
            {
                "ln1_w": 1 + rand(h, scale=0.1),
                "ln1_b": rand(h, scale=0.1),
                "qkv_w": rand(qkv_rows, h, scale=h**-0.5),
                "qkv_b": rand(qkv_rows, scale=0.1) if cfg.bias else None,
                "proj_w": rand(
                    h, s.num_attention_heads * s.kv_channels, scale=(s.num_attention_heads * s.kv_channels) ** -0.5
                ),
                "proj_b": rand(h, scale=0.1) if cfg.bias else None,
                "ln2_w": 1 + rand(h, scale=0.1),
                "ln2_b": rand(h, scale=0.1),
                "fc1_w": rand(s.fc1_rows(1), h, scale=h**-0.5),
                "fc1_b": rand(s.fc1_rows(1), scale=0.1) if cfg.bias else None,
                "fc2_w": rand(h, s.ffn_hidden_size, scale=s.ffn_hidden_size**-0.5),
                "fc2_b": rand(h, scale=0.1) if cfg.bias else None,
            }
        )
        if cfg.qk_scale:
            layers[-1].update(q_scale=1 + rand(s.kv_channels, scale=0.1), k_scale=1 + rand(s.kv_channels, scale=0.1))
    return layers


def _doc_ids_and_positions(doc_lengths: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lengths)])
    positions = torch.cat([torch.arange(n) for n in doc_lengths])
    return ids, positions


def reference_forward(
    x: Tensor, layers: list[dict[str, Tensor]], cfg: StackConfig, doc_lengths: tuple[int, ...]
) -> Tensor:
    """``x [s, b, h]`` in natural order, unpadded -> ``[s, b, h]``."""
    s = cfg.shape
    hn, per_group = s.kv_channels, s.heads_per_group
    doc_ids, positions = _doc_ids_and_positions(doc_lengths)
    allowed = doc_ids[:, None] == doc_ids[None, :]
    if cfg.causal:
        allowed &= torch.ones_like(allowed).tril()
    seq, b, h = x.shape
    for p in layers:
        a = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
        qkv = F.linear(a, p["qkv_w"], p["qkv_b"]).view(seq, b, s.num_query_groups, (per_group + 2) * hn)
        q, k, v = torch.split(qkv, [per_group * hn, hn, hn], dim=3)
        q = q.reshape(seq, b, s.num_attention_heads, hn)
        if "q_scale" in p:
            q, k = q * p["q_scale"], k * p["k_scale"]
        q, k = rope(q, positions), rope(k, positions)
        k, v = (t.repeat_interleave(per_group, dim=2) for t in (k, v))
        core = F.scaled_dot_product_attention(
            q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=allowed
        )  # [b, n, s, d]
        core = core.permute(2, 0, 1, 3).reshape(seq, b, -1)
        x = x + F.linear(core, p["proj_w"], p["proj_b"])
        m = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"])
        hid = F.linear(m, p["fc1_w"], p["fc1_b"])
        if s.gated_mlp:
            gate, up = torch.chunk(hid, 2, dim=-1)
            hid = cfg.activation(gate) * up
        else:
            hid = cfg.activation(hid)
        x = x + F.linear(hid, p["fc2_w"], p["fc2_b"])
    return x


def _rows(t: Tensor | None, p: int, rank: int) -> Tensor | None:
    return None if t is None else t.chunk(p, dim=0)[rank]


def shard_layer(layer: dict[str, Tensor], shape: ModelShape, p: int, rank: int) -> tuple[AttentionWeights, MLPWeights]:
    """Megatron's TP=p shards of one layer (fresh tensors, never views of the full weights)."""
    if shape.gated_mlp:
        # Megatron's gated fc1 shard is [gate rows of this rank | up rows of this rank].
        gate, up = layer["fc1_w"].chunk(2, dim=0)
        fc1 = torch.cat([_rows(gate, p, rank), _rows(up, p, rank)])
        fc1_b = None
        if layer["fc1_b"] is not None:
            gate_b, up_b = layer["fc1_b"].chunk(2)
            fc1_b = torch.cat([_rows(gate_b, p, rank), _rows(up_b, p, rank)])
    else:
        fc1, fc1_b = _rows(layer["fc1_w"], p, rank), _rows(layer["fc1_b"], p, rank)

    def clone(t):
        return None if t is None else t.clone()

    attn = AttentionWeights(
        qkv=clone(_rows(layer["qkv_w"], p, rank)),
        proj=clone(layer["proj_w"].chunk(p, dim=1)[rank]),
        qkv_bias=clone(_rows(layer["qkv_b"], p, rank)),
        proj_bias=clone(layer["proj_b"]),
    )
    mlp = MLPWeights(
        fc1=clone(fc1),
        fc2=clone(layer["fc2_w"].chunk(p, dim=1)[rank]),
        fc1_bias=clone(fc1_b),
        fc2_bias=clone(layer["fc2_b"]),
    )
    return attn, mlp
