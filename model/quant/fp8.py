"""FP8 block-scaled weights as DeepSeek-V3 ships them, and their dequantisation.

A quantised linear weight `W [out, in]` is stored as `float8_e4m3fn` next to
`weight_scale_inv [ceil(out/bo), ceil(in/bi)]` (fp32), with `(bo, bi)` from
`quantization_config.weight_block_size` (128×128 for V3). The real value is
`W[i, j] = fp8[i, j] * scale_inv[i // bo, j // bi]`; edge blocks are partial when a dimension is
not a multiple of the block, e.g. out=300, bo=128 gives 3 row blocks of 128, 128 and 44 rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deepseek_pd.errors import UserError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"  # "...weight" -> "...weight_scale_inv"


@dataclass(frozen=True)
class Fp8BlockQuantConfig:
    """`quantization_config` of an FP8 block-scaled checkpoint (DeepSeek-V3 style)."""

    block_out: int = 128
    block_in: int = 128

    @classmethod
    def from_hf(cls, quantization_config: dict | None) -> "Fp8BlockQuantConfig | None":
        """None for an unquantised checkpoint; UserError for a scheme we cannot load."""
        if not quantization_config:
            return None
        method = quantization_config.get("quant_method")
        if method != "fp8":
            raise UserError(f"quantization_config.quant_method={method!r} is not supported (only 'fp8')")
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise UserError(f"quantization_config.fmt={fmt!r} is not supported (only 'e4m3')")
        block = quantization_config.get("weight_block_size")
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)):
            raise UserError(
                f"quantization_config.weight_block_size={block!r} must be two positive integers "
                "(per-tensor FP8 without blocks is not supported)")
        return cls(block_out=block[0], block_in=block[1])


def expected_scale_shape(weight_shape: torch.Size | tuple[int, int], block: Fp8BlockQuantConfig) -> tuple[int, int]:
    out_features, in_features = weight_shape
    return (-(-out_features // block.block_out), -(-in_features // block.block_in))


def check_scale_shape(weight: torch.Tensor, scale_inv: torch.Tensor, block: Fp8BlockQuantConfig,
                      name: str = "weight") -> None:
    """UserError unless `weight` is 2-D and `scale_inv` has one entry per (partial) block."""
    if weight.dim() != 2:
        raise UserError(f"{name}: FP8 block-scaled weight must be 2-D, got shape {tuple(weight.shape)}")
    want = expected_scale_shape(weight.shape, block)
    if tuple(scale_inv.shape) != want:
        raise UserError(f"{name}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} "
                        f"for weight {tuple(weight.shape)} with {block.block_out}x{block.block_in} blocks")


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Fp8BlockQuantConfig,
                         dtype: torch.dtype = torch.bfloat16, name: str = "weight") -> torch.Tensor:
    """Vectorised block dequantisation: pads to whole blocks, scales each block, crops back.

    The product is formed in fp32 and cast to `dtype` once, so bf16 output rounds only once.
    """
    check_scale_shape(weight, scale_inv, block, name)
    want = expected_scale_shape(weight.shape, block)
    out_features, in_features = weight.shape
    rows, cols = want
    padded = torch.zeros(rows * block.block_out, cols * block.block_in, dtype=torch.float32,
                         device=weight.device)
    padded[:out_features, :in_features] = weight.to(torch.float32)
    blocks = padded.view(rows, block.block_out, cols, block.block_in)
    blocks.mul_(scale_inv.to(torch.float32).view(rows, 1, cols, 1))
    return padded[:out_features, :in_features].to(dtype).contiguous()


def quantize_block_fp8(weight: torch.Tensor, block: Fp8BlockQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, as DeepSeek's converter does it: per-block amax / 448 is the scale.

    Used to build FP8 checkpoints in tests and by `make_tiny_model(..., fp8=True)`.
    """
    out_features, in_features = weight.shape
    rows, cols = expected_scale_shape(weight.shape, block)
    padded = torch.zeros(rows * block.block_out, cols * block.block_in, dtype=torch.float32)
    padded[:out_features, :in_features] = weight.to(torch.float32)
    blocks = padded.view(rows, block.block_out, cols, block.block_in)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    quantised = (blocks / scale_inv.view(rows, 1, cols, 1)).view_as(padded)
    fp8 = quantised[:out_features, :in_features].to(torch.float8_e4m3fn)
    return fp8.contiguous(), scale_inv


def is_block_quantised_weight(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek-V3's FP8 release stores as FP8: 2-D linear weights, except the
    embeddings, lm_head and the router gate (which stay in bf16/fp32), and the MTP layer's
    eh_proj and its copy of the head (bf16 in the release)."""
    return (tensor.dim() == 2 and name.endswith(".weight") and "embed_tokens" not in name
            and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight")
            and not name.endswith((".eh_proj.weight", ".shared_head.head.weight")))


def quantize_checkpoint(tensors: dict[str, torch.Tensor], block: Fp8BlockQuantConfig) -> dict[str, torch.Tensor]:
    """An FP8 block-scaled copy of HF-named tensors: each quantisable `X.weight` becomes FP8 plus
    `X.weight_scale_inv`; everything else is kept as is."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_block_quantised_weight(name, tensor):
            out[name], out[name + SCALE_SUFFIX] = quantize_block_fp8(tensor, block)
        else:
            out[name] = tensor
    return out


def hf_quantization_config(block: Fp8BlockQuantConfig) -> dict:
    """The `quantization_config` entry of config.json, as DeepSeek-V3 writes it."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [block.block_out, block.block_in]}
