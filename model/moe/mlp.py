"""The SwiGLU MLP used by dense layers and by (unfused) shared experts: gate and up fused."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepseek_pd.model.quant.fp8_linear import Fp8Spec, make_linear
from deepseek_pd.model.quant.norm_fp8_linear import Rows, apply


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))` with `gate_up_proj` = [gate_proj ; up_proj] `[2I, H]`."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str, fp8: Fp8Spec | None = None) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, fp8, dtype, device,
                                        row_splits=(intermediate_size,))
        self.down_proj = make_linear(intermediate_size, hidden_size, fp8, dtype, device)

    def forward(self, x: Rows) -> torch.Tensor:
        """x `[T, H]`, or its `QuantisedRows` where the post-attention norm quantised them."""
        gate, up = apply(self.gate_up_proj, x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
