"""Input checks shared by the kernel wrappers: clear errors instead of a fault inside a kernel."""
from __future__ import annotations

import torch

from deepseek_pd import env
from deepseek_pd.errors import UserError


def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def require_triton(what: str) -> None:
    """Raises UserError unless Triton can run here: a CUDA device, or Triton's CPU interpreter."""
    if not triton_importable():
        raise UserError(f"{what} needs the 'triton' package; use the 'torch' backend instead")
    if not (torch.cuda.is_available() or env.triton_interpret()):
        raise UserError(f"{what} needs a CUDA device (or TRITON_INTERPRET=1 for Triton's CPU interpreter)")


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...],
                 device: torch.device) -> None:
    """Rank, dtype, device and a unit stride on the last axis (kernels index rows by stride)."""
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {t.dtype} not in {dtypes}")
    if t.device != device:
        raise ValueError(f"{name}: on {t.device}, expected {device}")
    if t.device.type != "cuda" and not env.triton_interpret():
        raise ValueError(f"{name}: Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last axis must be contiguous (stride 1), got strides {t.stride()}")


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
