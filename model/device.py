"""Which torch device a process runs on: `--device auto|cpu|cuda|cuda:N`, decided once.

`auto` means CUDA when `torch.cuda.is_available()`, else the CPU. It is resolved by the command
(`serve`, `up`, `generate`) before any config is frozen, so no config ever holds "auto" and
every worker of `up` gets the device its parent chose.

    resolve_device("auto")   # "cuda" on a GPU machine, "cpu" elsewhere
    resolve_device("cuda:1") # "cuda:1", or a UserError when CUDA is not available
"""
from __future__ import annotations

import torch

from deepseek_pd.errors import UserError

AUTO = "auto"


def resolve_device(device: str) -> str:
    """A concrete torch device string; a UserError for names torch rejects or CUDA that is absent."""
    if device == AUTO:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UserError(f"device {device!r} is not a torch device (auto, cpu, cuda, cuda:1, ...)") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {device!r} requested but CUDA is not available on this machine")
    return device


def is_cuda(device: str) -> bool:
    """Whether a (resolved) device string names a CUDA device: "cuda" or "cuda:N"."""
    return device.split(":", 1)[0] == "cuda"
