"""RMSNorm exactly as HF DeepSeek computes it (normalise in fp32, scale in the input dtype).

The math is `rms_norm_ref` (the oracle); the module runs it, or the fused Triton kernel, through
the norm/rope backend chosen when it is built (`model/norm_rope.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from deepseek_pd.model.norm_rope import NORM_ROPE_BACKENDS, NormRopeOps, rms_norm_ref

__all__ = ["RMSNorm", "rms_norm_ref"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, backend: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps
        self.ops: NormRopeOps = NORM_ROPE_BACKENDS.build(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps, None)[0]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual += x; return norm(residual), residual` (first layer: residual is x itself)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
