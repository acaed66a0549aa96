"""How many KV pages a worker gets: a fixed count, or what a GPU memory budget leaves (SGLang's
`--mem-fraction-static`).

The budget is `mem_fraction_static x the GPU's TOTAL memory`; it must hold everything this process
keeps resident: the weights (measured after loading, `torch.cuda.memory_allocated`), the KV pool,
and an explicit headroom for activations and CUDA graphs. The pool gets the rest, in whole pages:

    pages = floor((fraction * total - weights - headroom) / bytes_per_page)

Worked example, DeepSeek-V2-Lite in bf16 on an H200 (139.8 GiB), fraction 0.88, headroom 2 GiB:
budget 123.0 GiB - weights 29.3 GiB - 2 GiB = 91.8 GiB; one 64-token page of 27 layers x 576 x 2 B
is 1.90 MiB, so 49,495 pages = 3.17M tokens. Two workers on one GPU (`up`) get fractions that sum
to the single-worker one, so their budgets cannot overlap whatever order they start in.

The fraction of *total* memory (not of what is free) makes the size independent of what other
processes hold at that moment; what is free is only checked, so that a GPU already taken by
someone else fails with a clear error instead of a CUDA out-of-memory later. On the CPU the pool
has a fixed size (`RunnerConfig.num_pages`, 1024 pages by default): there is no budget to read.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.units import gib, mib

log = logging.getLogger(__name__)

# The budget of one worker alone on a GPU (`serve` on CUDA), and what `up` splits between the
# workers sharing one; the rest of the GPU is the CUDA context, NCCL/transfer buffers, other tenants.
DEFAULT_MEM_FRACTION_STATIC = 0.88


def pages_for_budget(budget_bytes: int, bytes_per_page: int, weights_bytes: int, headroom_bytes: int,
                     min_pages: int = 1) -> int:
    """Whole pages in `budget - weights - headroom`; a UserError when fewer than `min_pages` fit."""
    if bytes_per_page < 1 or min_pages < 1:
        raise ValueError(f"bytes_per_page and min_pages must be >= 1, got {bytes_per_page}, {min_pages}")
    left = budget_bytes - weights_bytes - headroom_bytes
    pages = left // bytes_per_page if left > 0 else 0
    if pages < min_pages:
        raise UserError(
            f"no room for the KV pool: the memory budget of {gib(budget_bytes)} minus the weights "
            f"({gib(weights_bytes)}) and the activation headroom ({gib(headroom_bytes)}) leaves "
            f"{gib(max(left, 0))}, less than {min_pages} page(s) of {mib(bytes_per_page)}; "
            f"raise --mem-fraction-static, lower mem_headroom_gib or --page-size, or use a smaller model")
    return pages


@dataclass(frozen=True)
class GpuMemory:
    """One reading of a GPU's memory, taken right after the weights were loaded."""

    total_bytes: int  # the device's whole memory
    free_bytes: int  # free now, all processes counted
    resident_bytes: int  # what this process holds already: the weights and model buffers

    @classmethod
    def measure(cls, device: str) -> "GpuMemory":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # cached-but-unused blocks (loading temporaries) are free memory
        free, total = torch.cuda.mem_get_info(device)
        return cls(total_bytes=total, free_bytes=free, resident_bytes=torch.cuda.memory_allocated(device))


def pages_for_gpu(memory: GpuMemory, mem_fraction_static: float, headroom_bytes: int, bytes_per_page: int,
                  min_pages: int = 1) -> int:
    """The pool for a budget of `mem_fraction_static` of the GPU, checked against what is free."""
    budget = int(mem_fraction_static * memory.total_bytes)
    try:
        pages = pages_for_budget(budget, bytes_per_page, memory.resident_bytes, headroom_bytes, min_pages)
    except UserError as exc:
        raise UserError(f"{exc} (budget = mem_fraction_static {mem_fraction_static} x "
                        f"{gib(memory.total_bytes)} of GPU memory)") from None
    needed = pages * bytes_per_page + headroom_bytes
    if needed > memory.free_bytes:
        raise UserError(
            f"the KV pool ({pages} pages, {gib(pages * bytes_per_page)}) plus the headroom "
            f"({gib(headroom_bytes)}) needs {gib(needed)}, but only {gib(memory.free_bytes)} of the "
            f"GPU's {gib(memory.total_bytes)} is free: another process holds the rest. Lower "
            f"--mem-fraction-static (workers sharing a GPU need fractions that sum below 1) or pass --num-pages")
    log.info("KV pool sized from mem_fraction_static %.3g x %s: weights %s, headroom %s, pool %s",
             mem_fraction_static, gib(memory.total_bytes), gib(memory.resident_bytes), gib(headroom_bytes),
             gib(pages * bytes_per_page))
    return pages
