"""FP8 weights kept in FP8: the linear layer, its GEMM backends, and the one rule for block sizes.

With `BuildOptions.fp8_backend` set (a name in `FP8_GEMM_BACKENDS`) and an FP8 checkpoint, every
linear weight DeepSeek-V3 ships in FP8 (`fp8.is_block_quantised_weight`) stays e4m3 on the
device next to its fp32 `weight_scale_inv`; activations are quantised per token group at run time
(`fp8_ops.py`). Without it the loader dequantises to the model dtype, as before.

Block sizes: the checkpoint's blocks are `(block_out, block_in)` (128×128 for V3). A parameter
that fuses several HF tensors along its rows (fused q_a + kv_a, gate + up) keeps one scale per
`gcd(block_out, part offsets)` rows, so every part's scales copy in exactly (for V3 all offsets
are multiples of 128 and nothing changes; a tiny model with q_lora_rank 32 gets 32-row blocks).
Columns are never fused except for fused shared experts' `w2` slices: `gcd(block_in, offsets)`.

    spec = fp8_spec(config, options)                   # None: weights are dequantised at load
    layer = make_linear(hidden, 2112, spec, options, row_splits=(1536,))   # Fp8Linear or nn.Linear
"""
from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from deepseek_pd.errors import UserError
from deepseek_pd.model.config import ModelConfig
from deepseek_pd.model.quant.fp8 import Fp8BlockQuantConfig
from deepseek_pd.model.quant.fp8_ops import FP8_DTYPE, fp8_linear_ref, num_groups
from deepseek_pd.model.registry import Registry


class Fp8Gemm(Protocol):
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                 block_k: int) -> torch.Tensor:
        """x `[M, K]` (model dtype) · FP8 `weight [N, K]`^T with per-block `scale` → `[M, N]` in x's dtype."""


FP8_GEMM_BACKENDS: Registry[Fp8Gemm] = Registry("FP8 GEMM backend")


@FP8_GEMM_BACKENDS.register("torch")
class TorchFp8Gemm:
    """Reference: per-token-group quantisation, dequantise both operands, fp32 matmul."""

    cuda_graph_safe = True  # no host sync

    def __call__(self, x, weight, scale, block_n, block_k):
        return fp8_linear_ref(x, weight, scale, block_n, block_k)


# From this many rows the cuBLAS blockwise GEMM beats the Triton one (H200, V3 shapes: 1.34-1.74x
# bf16 at M >= 4096 against Triton's 0.86-1.06x; at M <= 128 Triton was as fast or faster).
CUBLAS_MIN_ROWS = 257


@FP8_GEMM_BACKENDS.register("triton")
class TritonFp8Gemm:
    """`kernels/fp8_quant.py`, then `kernels/fp8_gemm.py` for decode-sized M, or torch's cuBLAS
    blockwise `scaled_mm` (`kernels/fp8_scaled_mm.py`) from `CUBLAS_MIN_ROWS` rows where it exists:
    two launches per linear layer either way. The choice is by shape, so CUDA graphs capture it."""

    cuda_graph_safe = True

    def __init__(self) -> None:
        from deepseek_pd.model.kernels.checks import require_triton

        require_triton("FP8 GEMM backend 'triton'")
        from deepseek_pd.model.kernels.fp8_gemm import block_fp8_matmul
        from deepseek_pd.model.kernels.fp8_quant import per_token_group_quant
        from deepseek_pd.model.kernels import fp8_scaled_mm

        self._quant, self._matmul, self._cublas = per_token_group_quant, block_fp8_matmul, fp8_scaled_mm

    def __call__(self, x, weight, scale, block_n, block_k):
        x_fp8, x_scale = self._quant(x if x.stride(-1) == 1 else x.contiguous(), block_k)
        return self.matmul_quantised(x_fp8, x_scale, weight, scale, block_n, block_k, x.dtype)

    def matmul_quantised(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         block_n: int, block_k: int, out_dtype: torch.dtype) -> torch.Tensor:
        """The GEMM alone, of activations quantised already (1 x `block_k` groups): `__call__`'s second
        launch, and what `quant/norm_fp8_linear.py` runs after its fused norm + quantisation."""
        if x_fp8.shape[0] >= CUBLAS_MIN_ROWS and x_fp8.is_cuda \
                and self._cublas.fits_blockwise(*weight.shape, block_n, block_k) \
                and self._cublas.blockwise_scaled_mm_available(x_fp8.device.index or 0):
            # Rows gathered packed under attention TP (quant/norm_fp8_linear.py) have a row stride
            # past their width, which the Triton kernel takes; cuBLAS is given them dense.
            return self._cublas.scaled_mm_block_fp8(x_fp8.contiguous(), x_scale, weight, scale, out_dtype)
        return self._matmul(x_fp8, x_scale, weight, scale, block_n, block_k, out_dtype)


class DeepGemmFp8Gemm(TritonFp8Gemm):
    """`kernels/fp8_quant.py`, then DeepGEMM's `fp8_gemm_nt` (`kernels/fp8_deep_gemm.py`) for the
    weights its recipe takes, the "triton" backend's path for the rest. Registered only where
    `deep_gemm` is installed; a UserError where it does not import on a Hopper GPU."""

    cuda_graph_safe = False  # DeepGEMM compiles each new shape on first use; not yet run in graphs

    def __init__(self) -> None:
        from deepseek_pd.model.kernels import fp8_deep_gemm

        if not fp8_deep_gemm.deep_gemm_available():
            raise UserError("FP8 GEMM backend 'deep_gemm' needs the deep_gemm package built for this torch and a "
                            "Hopper (sm90) GPU; use 'triton'")
        super().__init__()
        self._deep_gemm = fp8_deep_gemm

    def matmul_quantised(self, x_fp8, x_scale, weight, scale, block_n, block_k, out_dtype):
        if not self._deep_gemm.fits(*weight.shape, block_n, block_k):
            return super().matmul_quantised(x_fp8, x_scale, weight, scale, block_n, block_k, out_dtype)
        return self._deep_gemm.dense(x_fp8.contiguous(), x_scale.contiguous(), weight, scale, out_dtype)


if importlib.util.find_spec("deep_gemm") is not None:
    FP8_GEMM_BACKENDS.register("deep_gemm")(DeepGemmFp8Gemm)


@dataclass(frozen=True)
class Fp8Spec:
    """How this model keeps FP8 weights: the checkpoint's blocks and the GEMM backend's name."""

    block: Fp8BlockQuantConfig
    backend: str

    def block_for(self, row_splits: tuple[int, ...] = (), col_splits: tuple[int, ...] = ()) -> Fp8BlockQuantConfig:
        """The scale blocks of a parameter whose rows (cols) join HF tensors at these offsets."""
        return Fp8BlockQuantConfig(math.gcd(self.block.block_out, *row_splits),
                                   math.gcd(self.block.block_in, *col_splits))


def fp8_spec(config: ModelConfig, backend: str | None) -> Fp8Spec | None:
    """The one place that decides whether weights stay FP8 (a backend name was given)."""
    if backend is None:
        return None
    if not config.is_fp8:
        raise UserError(f"fp8_backend={backend!r} keeps FP8 weights, but the checkpoint is not FP8 "
                        "(no quantization_config); leave it unset")
    FP8_GEMM_BACKENDS.get(backend)  # unknown names fail here, listing the known ones
    bo, bi = config.quantization["weight_block_size"]
    return Fp8Spec(Fp8BlockQuantConfig(int(bo), int(bi)), backend)


def fp8_parameter(shape: tuple[int, ...], device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False)


def scale_parameter(weight_shape: tuple[int, ...], block: Fp8BlockQuantConfig,
                    device: torch.device | str) -> nn.Parameter:
    """fp32 `[..., ceil(N/block_out), ceil(K/block_in)]`, filled with NaN until loaded (a missed
    copy poisons the output instead of passing silently)."""
    *lead, n, k = weight_shape
    shape = (*lead, num_groups(n, block.block_out), num_groups(k, block.block_in))
    return nn.Parameter(torch.full(shape, float("nan"), dtype=torch.float32, device=device), requires_grad=False)


class Fp8Linear(nn.Module):
    """`y = x · W^T` with `weight` e4m3 `[out, in]` and `weight_scale_inv` fp32 per `block`."""

    def __init__(self, in_features: int, out_features: int, block: Fp8BlockQuantConfig, backend: str,
                 device: torch.device | str) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = block
        self.weight = fp8_parameter((out_features, in_features), device)
        self.weight_scale_inv = scale_parameter((out_features, in_features), block, device)
        self.gemm: Fp8Gemm = FP8_GEMM_BACKENDS.build(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = self.gemm(x.reshape(-1, self.in_features), self.weight, self.weight_scale_inv,
                      self.block.block_out, self.block.block_in)
        return y.view(*lead, self.out_features)

    @property
    def takes_quantised(self) -> bool:
        """Whether its GEMM backend multiplies activations quantised already (`forward_quantised`)."""
        return callable(getattr(self.gemm, "matmul_quantised", None))

    def forward_quantised(self, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """`forward` of x quantised already: x_fp8 `[M, in]` e4m3, x_scale fp32 `[M, ceil(in / block_in)]`."""
        return self.gemm.matmul_quantised(x_fp8, x_scale, self.weight, self.weight_scale_inv, self.block.block_out,
                                          self.block.block_in, out_dtype)

    def fp8_param_blocks(self) -> dict[str, Fp8BlockQuantConfig]:
        """Its FP8 parameters by name and their scale blocks (see `fp8_blocks`)."""
        return {"weight": self.block}

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block={self.block.block_out}x{self.block.block_in}")


def make_linear(in_features: int, out_features: int, spec: Fp8Spec | None, dtype: torch.dtype,
                device: torch.device | str, row_splits: tuple[int, ...] = (),
                col_splits: tuple[int, ...] = ()) -> nn.Module:
    """An `Fp8Linear` when weights stay FP8, else a bias-free `nn.Linear` in `dtype`.

    `row_splits`/`col_splits`: offsets at which HF tensors (or a TP rank's slice of one) start."""
    if spec is None:
        return nn.Linear(in_features, out_features, bias=False, dtype=dtype, device=device)
    return Fp8Linear(in_features, out_features, spec.block_for(row_splits, col_splits), spec.backend, device)


def fp8_blocks(model: nn.Module) -> dict[str, Fp8BlockQuantConfig]:
    """Our FP8 parameter names (`layers.0.self_attn.o_proj.weight`, `...experts.w13`) → their blocks;
    what the weight mapping needs to copy scales in."""
    blocks: dict[str, Fp8BlockQuantConfig] = {}
    for name, module in model.named_modules():
        for param_name, block in getattr(module, "fp8_param_blocks", lambda: {})().items():
            blocks[f"{name}.{param_name}" if name else param_name] = block
    return blocks
