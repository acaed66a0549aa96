"""An RMSNorm whose output only FP8 linears read, fused with their activation quantisation.

Where every linear that reads the norm's output keeps FP8 weights with a GEMM backend that multiplies
quantised activations (`Fp8Linear.takes_quantised`: "triton", "deep_gemm") in groups of one width,
and the norm runs the Triton kernels (its ops have `rms_norm_quant`), the norm hands on
`QuantisedRows` (`kernels/rmsnorm_quant.py`: norm + quantisation in one launch) and each linear runs
its GEMM alone (`apply`): one launch less per norm and per reader, and the normed rows are never
written to memory in the model dtype and read back. The bytes are those of the unfused kernels
(tests/model/quant/test_norm_fp8_linear.py), so the choice changes no output. Chosen once, when the
layer is built (`norm_quant_group`); used by

    MLA's q_a_layernorm -> q_b_proj         NormThenLinear(self.q_a_layernorm, self.q_b_proj)(q_a)
    the input norm -> q_a + kv_a (or q, kv_a)  LayerCommunicator(..., attn_quant_group=...)
    the post-attention norm -> a dense layer's gate_up_proj  LayerCommunicator(..., mlp_quant_group=...)
                                            (a MoE layer's router reads the normed rows in the model dtype)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import torch
from torch import nn

from deepseek_pd.model.norm import RMSNorm
from deepseek_pd.model.quant.fp8_linear import Fp8Linear
from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE, num_groups


@dataclass(frozen=True)
class QuantisedRows:
    """Normed rows `[T, D]` as e4m3 `fp8` and fp32 `scale` `[T, ceil(D / group)]`; `dtype` is the
    normed rows' dtype, which the linears that read them return."""

    fp8: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


Rows = Union[torch.Tensor, QuantisedRows]


def norm_quant_group(norm: RMSNorm, linears: Sequence[nn.Module]) -> int | None:
    """The activation group when `norm`'s output can go to `linears` quantised; None otherwise."""
    if not linears or not callable(getattr(norm.ops, "rms_norm_quant", None)):
        return None
    groups = {linear.block.block_in if isinstance(linear, Fp8Linear) and linear.takes_quantised else None
              for linear in linears}
    return groups.pop() if len(groups) == 1 and None not in groups else None


def add_norm_quant(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None, group: int,
                   packed: torch.Tensor | None = None) -> tuple[QuantisedRows, torch.Tensor]:
    """`norm.add_and_norm(x, residual)` with the normed rows quantised in the same launch; written
    into `packed` (`packed_rows`) when given."""
    lead, dim = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, dim)
    out = None if packed is None else unpacked(packed, dim, group)
    x_fp8, x_scale, new_residual = norm.ops.rms_norm_quant(
        flat, norm.weight, norm.eps, group, None if residual is None else residual.reshape(flat.shape), out=out)
    new_residual = flat if new_residual is None else new_residual
    rows = QuantisedRows(x_fp8, x_scale, torch.promote_types(norm.weight.dtype, x.dtype))
    return rows, new_residual.view(*lead, dim)


# Quantised rows that a collective moves (attention TP's all-gather of the input norm's rows) travel
# as one uint8 buffer `[T, D + 4 * ceil(D / group)]`: each row's e4m3 bytes, then its fp32 scales.
# One collective of about half the bytes of the model-dtype rows, and the same bits as gathering
# those and quantising after (the quantisation is per row).

def packs(dim: int) -> bool:
    """Whether rows of width `dim` can travel packed (the scales must start 4-byte aligned)."""
    return dim % 4 == 0


def packed_rows(tokens: int, dim: int, group: int, device: torch.device | str) -> torch.Tensor:
    """An empty packed buffer for `tokens` quantised rows."""
    return torch.empty(tokens, dim + 4 * num_groups(dim, group), dtype=torch.uint8, device=device)


def unpacked(packed: torch.Tensor, dim: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 `[T, D]`, x_scale `[T, groups]`): views into `packed`, row stride its width."""
    if not packs(dim) or packed.dtype != torch.uint8 or packed.shape[-1] != dim + 4 * num_groups(dim, group):
        raise ValueError(f"not a packed buffer of rows of {dim} in groups of {group}: "
                         f"{packed.dtype} {tuple(packed.shape)}")
    return packed[:, :dim].view(FP8_DTYPE), packed[:, dim:].view(torch.float32)


def apply(linear: nn.Module, rows: Rows) -> torch.Tensor:
    """`linear(rows)` for model-dtype rows, its GEMM alone for `QuantisedRows`."""
    if isinstance(rows, QuantisedRows):
        return linear.forward_quantised(rows.fp8, rows.scale, rows.dtype)
    return linear(rows)


class NormThenLinear:
    """`linear(norm(x))`, fused where `norm_quant_group` allows. Not a module: `norm` and `linear`
    stay the owning layer's (their weights and names)."""

    def __init__(self, norm: RMSNorm, linear: nn.Module) -> None:
        self.norm, self.linear = norm, linear
        self.group = norm_quant_group(norm, (linear,))

    @property
    def fused(self) -> bool:
        return self.group is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.linear(self.norm(x))
        rows, _ = add_norm_quant(self.norm, x, None, self.group)
        return apply(self.linear, rows).view(*x.shape[:-1], -1)
