"""Streaming FP8 weights and their scales into our parameters (the FP8 half of `weight_mapping`).

The loader (`iter_checkpoint_tensors(keep_fp8=True)`) yields each FP8 weight `X.weight` followed by
`X.weight_scale_inv`. For every target of `X.weight`:
  - a view of one of our FP8 parameters (e.g. rows 0..1535 of `fused_qkv_a_proj.weight`): the e4m3
    bytes are copied at once, and when the scale arrives the matching block scales are copied
    into that parameter's `<name>_scale_inv`, re-gridded to the parameter's own block size
    (`Fp8Spec.block_for`), e.g. 128-row source blocks into 32-row blocks of a fused parameter;
  - a view of a parameter in the model dtype (`w_kc`/`w_vc` from `kv_b_proj`, which the absorbed
    MLA multiplies in bf16): the weight is held until its scale arrives, then dequantised and copied.

Re-gridding needs no arithmetic: a destination block of `g` rows starting at source row `r`
takes the scale of source block `r // block_out`; `g` divides both `block_out` and `r` by
construction, so no destination block straddles two source blocks.

Example: V3's `q_a_proj` (1536 rows, 12 row blocks) and `kv_a_proj_with_mqa` (576 rows, 5 blocks,
the last of 64 rows) fill `fused_qkv_a_proj` (2112 rows) and its 17 scale rows exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from deepseek_pd.errors import CheckpointError, UserError
from deepseek_pd.model.quant.fp8 import FP8_DTYPES, SCALE_SUFFIX, Fp8BlockQuantConfig, dequantize_block_fp8
from deepseek_pd.model.quant.fp8_ops import num_groups


@dataclass(frozen=True)
class RowSlice:
    """A transform taking rows [start, stop) of the source (introspectable, unlike a lambda)."""

    start: int
    stop: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.start:self.stop]


@dataclass(frozen=True)
class ColSlice:
    start: int
    stop: int

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[:, self.start:self.stop]


def _source_origin(transform: Callable | None, name: str) -> tuple[int, int]:
    if transform is None:
        return 0, 0
    if isinstance(transform, RowSlice):
        return transform.start, 0
    if isinstance(transform, ColSlice):
        return 0, transform.start
    raise UserError(f"{name}: FP8 weights cannot be kept in FP8 through this mapping ({transform!r})")


@dataclass(frozen=True)
class _ScaleJob:
    scale_dest: torch.Tensor  # the destination parameter's scale rows/cols for this target
    src_origin: tuple[int, int]
    block: Fp8BlockQuantConfig  # the destination parameter's blocks


class Fp8Streams:
    """Pairs FP8 weights with their scales while `load_hf_weights` streams the checkpoint."""

    def __init__(self, params: Mapping[str, torch.Tensor], fp8_blocks: Mapping[str, Fp8BlockQuantConfig],
                 source_block: Fp8BlockQuantConfig | None) -> None:
        self.source_block = source_block
        self._fp8 = {}  # storage pointer → (parameter, its scale, block)
        for name, block in fp8_blocks.items():
            param = params[name].data
            self._fp8[param.untyped_storage().data_ptr()] = (param, params[name + SCALE_SUFFIX].data, block)
        self._scale_jobs: dict[str, list[_ScaleJob]] = {}
        self._dequant: dict[str, tuple[torch.Tensor, list]] = {}

    def is_fp8_param(self, dest: torch.Tensor) -> bool:
        return dest.untyped_storage().data_ptr() in self._fp8

    def weight(self, name: str, tensor: torch.Tensor, targets: list, copy: Callable) -> None:
        """An FP8 checkpoint weight: copy its bytes into FP8 parameters now, hold it for the others."""
        if self.source_block is None:
            raise UserError(f"{name} is FP8 but config.json has no quantization_config")
        jobs, held = [], []
        for target in targets:
            if self.is_fp8_param(target.dest):
                copy(name, target, tensor)
                jobs.append(self._scale_job(name, target, tensor))
            else:
                held.append(target)
        self._scale_jobs[name] = jobs
        if held:
            self._dequant[name] = (tensor, held)

    def expects(self, scale_name: str) -> bool:
        return scale_name.endswith(SCALE_SUFFIX) and scale_name[:-len(SCALE_SUFFIX)] in self._scale_jobs

    def scale(self, scale_name: str, scale: torch.Tensor, copy: Callable) -> str:
        """The scale of a weight seen before; returns the weight's name (now complete)."""
        name = scale_name[:-len(SCALE_SUFFIX)]
        block = self.source_block
        for job in self._scale_jobs.pop(name):
            job.scale_dest.copy_(_regrid(scale, block, job.src_origin, job.block, tuple(job.scale_dest.shape)))
        if name in self._dequant:
            tensor, held = self._dequant.pop(name)
            value = dequantize_block_fp8(tensor, scale, block, dtype=torch.float32, name=name)
            for target in held:
                copy(name, target, value)
        return name

    def check_complete(self) -> None:
        if self._scale_jobs:
            raise CheckpointError(sorted(n + SCALE_SUFFIX for n in self._scale_jobs), [],
                                  where="FP8 weights without their scales")

    def _scale_job(self, name: str, target, tensor: torch.Tensor) -> _ScaleJob:
        param, scale_param, block = self._fp8[target.dest.untyped_storage().data_ptr()]
        dest = target.dest
        rows, cols = param.shape[-2:]
        if dest.dim() != 2 or dest.stride() != param.stride()[-2:]:
            raise UserError(f"{name}: an FP8 target must be a 2-D slice of its parameter")
        offset = dest.storage_offset() - param.storage_offset()
        lead, within = divmod(offset, rows * cols)
        row0, col0 = divmod(within, cols)
        if row0 % block.block_out or col0 % block.block_in:
            raise UserError(f"{name}: lands at row {row0}, column {col0}, not on a "
                            f"{block.block_out}x{block.block_in} block of its FP8 parameter")
        r0, c0 = row0 // block.block_out, col0 // block.block_in
        scales = scale_param.view(-1, *scale_param.shape[-2:])[lead]
        view = scales[r0:r0 + num_groups(dest.shape[0], block.block_out),
                      c0:c0 + num_groups(dest.shape[1], block.block_in)]
        return _ScaleJob(view, _source_origin(target.transform, name), block)


def _regrid(scale: torch.Tensor, src: Fp8BlockQuantConfig, origin: tuple[int, int], dst: Fp8BlockQuantConfig,
            shape: tuple[int, int]) -> torch.Tensor:
    """Destination block (i, j) of `dst` size, at source element (origin + (i, j) * dst size), takes the
    scale of the source block holding that element."""
    if src.block_out % dst.block_out or src.block_in % dst.block_in or origin[0] % dst.block_out \
            or origin[1] % dst.block_in:
        raise UserError(f"FP8 blocks {dst.block_out}x{dst.block_in} do not tile the checkpoint's "
                        f"{src.block_out}x{src.block_in} blocks at offset {origin}")
    rows = (origin[0] + torch.arange(shape[0]) * dst.block_out) // src.block_out
    cols = (origin[1] + torch.arange(shape[1]) * dst.block_in) // src.block_in
    return scale.float()[rows][:, cols]


def is_fp8_tensor(tensor: torch.Tensor) -> bool:
    return tensor.dtype in FP8_DTYPES
