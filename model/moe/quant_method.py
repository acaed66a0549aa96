"""How routed experts are stored: the quantisation method of `FusedExperts` (SGLang's
`FusedMoEMethodBase` idea). It makes the parameters and says what a kernel needs besides them.

    UnquantisedMethod(dtype, device)  `w13 [E, 2I, H]`, `w2 [E, H, I]` in the model dtype.
    Fp8BlockMethod(spec, I, device)   the same in e4m3, plus fp32 `w13_scale_inv`/`w2_scale_inv`
                                      per block (DeepSeek-V3's format, kept in FP8 on the device).

FP8 blocks follow `Fp8Spec.block_for`: w13's rows join gate and up at `I` (and fused shared
slices at multiples of `I`), w2's columns join shared slices at multiples of `I`.
"""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.quant.fp8_linear import Fp8Spec, fp8_parameter, scale_parameter
from deepseek_pd.model.quant.moe_scales import Fp8ExpertScales


class MoEQuantMethod(Protocol):
    is_fp8: bool

    def create_weights(self, module: nn.Module, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        """Registers the expert parameters on `module`."""

    def param_blocks(self) -> dict[str, Fp8BlockQuantConfig]:
        """The FP8 parameters' names and scale blocks (empty without FP8)."""

    def scales(self, module: nn.Module) -> Fp8ExpertScales | None:
        """What the kernel gets besides `w13`/`w2` (read at each call: loading may replace parameters)."""


class UnquantisedMethod:
    is_fp8 = False

    def __init__(self, dtype: torch.dtype, device: torch.device | str) -> None:
        self.dtype, self.device = dtype, device

    def create_weights(self, module, num_experts, hidden_size, intermediate_size):
        kw = dict(dtype=self.dtype, device=self.device)
        module.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        module.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))

    def param_blocks(self):
        return {}

    def scales(self, module):
        return None


class Fp8BlockMethod:
    is_fp8 = True

    def __init__(self, spec: Fp8Spec, intermediate_size: int, device: torch.device | str) -> None:
        self.device = device
        self.block13 = spec.block_for(row_splits=(intermediate_size,))
        self.block2 = spec.block_for(col_splits=(intermediate_size,))

    def create_weights(self, module, num_experts, hidden_size, intermediate_size):
        module.w13 = fp8_parameter((num_experts, 2 * intermediate_size, hidden_size), self.device)
        module.w13_scale_inv = scale_parameter(tuple(module.w13.shape), self.block13, self.device)
        module.w2 = fp8_parameter((num_experts, hidden_size, intermediate_size), self.device)
        module.w2_scale_inv = scale_parameter(tuple(module.w2.shape), self.block2, self.device)

    def param_blocks(self):
        return {"w13": self.block13, "w2": self.block2}

    def scales(self, module):
        return Fp8ExpertScales(module.w13_scale_inv, self.block13, module.w2_scale_inv, self.block2)


def moe_quant_method(fp8: Fp8Spec | None, intermediate_size: int, dtype: torch.dtype,
                     device: torch.device | str) -> MoEQuantMethod:
    """The one place that picks the method: FP8 when weights stay FP8 (`fp8_linear.fp8_spec`)."""
    return UnquantisedMethod(dtype, device) if fp8 is None else Fp8BlockMethod(fp8, intermediate_size, device)
