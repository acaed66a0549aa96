"""Rotary embedding of the `qk_rope_head_dim` slice of q and k, with DeepSeek's YaRN.

Frequencies and the cos/sin attention factor follow HF `_compute_yarn_parameters` exactly (fp32).
DeepSeek rotates *interleaved* pairs `(x0, x1), (x2, x3), ...` by one frequency each (V2's complex
form and V3's `rope_interleave=True` are the same rotation). We write the result de-interleaved
(evens then odds, as HF V3 does); the layout of k_pe in the cache and of q_pe only has to agree,
and q·k is invariant under the same permutation of both. `rope_interleave=False` (a V3 switch)
rotates halves instead (`rotate_half`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from deepseek_pd.model.config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """Inverse frequencies `[dim // 2]` in fp32, HF's default or YaRN formula."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


class RotaryEmbedding(nn.Module):
    """Applies rope to q_pe `[T, heads, d]` and k_pe `[T, d]` at `positions` `[T]`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dim = config.qk_rope_head_dim
        self.interleaved = config.rope_interleave
        self.attention_factor = config.rope.attention_factor
        self.register_buffer("inv_freq", rope_inv_freq(config.rope, self.dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 `[T, d/2]` cos and sin, already multiplied by the YaRN attention factor."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x `[T, ..., d]`; cos/sin `[T, d/2]` broadcast over the middle dims. Math in fp32."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
        cos, sin = cos.view(shape), sin.view(shape)
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
        else:
            half = self.dim // 2
            x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor,
                k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions)
        return self.rotate(q_pe, cos, sin), self.rotate(k_pe, cos, sin)
