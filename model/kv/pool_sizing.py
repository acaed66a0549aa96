"""How many KV pages a worker gets: a fixed count, or what a GPU memory budget leaves (SGLang's
`--mem-fraction-static`).

The budget is `mem_fraction_static x the GPU's TOTAL memory`; it must hold everything this process
keeps resident: the weights (measured after loading, `torch.cuda.memory_allocated`), the KV pool,
an explicit headroom for activations and CUDA graphs, and what the caller reserves beside the pool
(`reserve`: a decode worker's Mooncake staging area, model/kv/staging_size.py, allocated after the
pool). The pool gets the rest, in whole pages:

    pages = floor((fraction * total - weights - headroom - reserve) / bytes_per_page)

On a GPU shared by several workers (`up`), the pool gets this worker's share of what the budget
leaves after every worker's weights and headroom (model/kv/memory_budget.py, `GpuShare`).

Worked example, DeepSeek-V2-Lite in bf16 on an H200 (139.8 GiB), fraction 0.88, headroom 2 GiB:
budget 123.0 GiB - weights 29.3 GiB - 2 GiB = 91.8 GiB; one 64-token page of 27 layers x 576 x 2 B
is 1.90 MiB, so 49,495 pages = 3.17M tokens.

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
from deepseek_pd.model.kv.memory_budget import DEFAULT_MEM_FRACTION_STATIC, GpuShare, budget_bytes as gpu_budget
from deepseek_pd.units import gib, mib

log = logging.getLogger(__name__)
__all__ = ["DEFAULT_MEM_FRACTION_STATIC", "GpuMemory", "pages_for_budget", "pages_for_gpu"]


def pages_for_budget(budget_bytes: int, bytes_per_page: int, weights_bytes: int, headroom_bytes: int,
                     min_pages: int = 1, share: GpuShare = GpuShare(), reserve_bytes: int = 0) -> int:
    """Whole pages in this worker's KV bytes (`share.kv_bytes`: alone, `budget - weights -
    headroom - reserve`); a UserError when fewer than `min_pages` fit."""
    if bytes_per_page < 1 or min_pages < 1 or reserve_bytes < 0:
        raise ValueError(f"bytes_per_page and min_pages must be >= 1 and reserve_bytes >= 0, got "
                         f"{bytes_per_page}, {min_pages}, {reserve_bytes}")
    left = share.kv_bytes(budget_bytes, weights_bytes + headroom_bytes + reserve_bytes)
    pages = left // bytes_per_page
    if pages < min_pages:
        each = f" ({share.workers} workers' copies)" if share.workers > 1 else ""
        raise UserError(
            f"no room for the KV pool: the memory budget of {gib(budget_bytes)} minus the weights "
            f"({gib(weights_bytes)}), the activation headroom ({gib(headroom_bytes)}) and the reserve beside "
            f"the pool ({gib(reserve_bytes)}, a KV staging area){each} leaves "
            f"{gib(left)} for this worker's KV ({share.describe()}), less than {min_pages} page(s) of "
            f"{mib(bytes_per_page)}; raise --mem-fraction-static, lower mem_headroom_gib or --page-size, "
            f"or use a smaller model")
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
                  min_pages: int = 1, share: GpuShare = GpuShare(), reserve_bytes: int = 0) -> int:
    """The pool for a budget of `mem_fraction_static` of the GPU (this worker's `share` of it),
    checked against what is free; `reserve_bytes` (allocated after the pool) is kept out of it."""
    budget = gpu_budget(mem_fraction_static, memory.total_bytes)
    try:
        pages = pages_for_budget(budget, bytes_per_page, memory.resident_bytes, headroom_bytes, min_pages, share,
                                 reserve_bytes)
    except UserError as exc:
        raise UserError(f"{exc} (budget = mem_fraction_static {mem_fraction_static} x "
                        f"{gib(memory.total_bytes)} of GPU memory)") from None
    needed = pages * bytes_per_page + headroom_bytes + reserve_bytes
    if needed > memory.free_bytes:
        raise UserError(
            f"the KV pool ({pages} pages, {gib(pages * bytes_per_page)}) plus the headroom "
            f"({gib(headroom_bytes)}) and the reserve ({gib(reserve_bytes)}) needs {gib(needed)}, but only "
            f"{gib(memory.free_bytes)} of the "
            f"GPU's {gib(memory.total_bytes)} is free: another process holds the rest. Lower "
            f"--mem-fraction-static or pass --num-pages")
    log.info("KV pool sized from mem_fraction_static %.3g x %s (%s): weights %s, headroom %s, reserve %s, pool %s",
             mem_fraction_static, gib(memory.total_bytes), share.describe(), gib(memory.resident_bytes),
             gib(headroom_bytes), gib(reserve_bytes), gib(pages * bytes_per_page))
    return pages
