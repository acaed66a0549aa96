"""A GPU's total memory read through NVML, without creating a CUDA context.

`serve` decides its GPU defaults before any rank process exists; the supervisor of a multi-rank
group must not hold a CUDA context (it would take memory on the GPU rank 0 sizes its KV pool
from). NVML (`libnvidia-ml.so.1`, shipped with the driver) answers without one, as torch's own
NVML-based device count does. `CUDA_VISIBLE_DEVICES` renumbers CUDA devices but not NVML's, so
`cuda:N` is mapped through it (indices or `GPU-` UUIDs); anything else (MIG instances, no driver
library, an NVML error) gives None, and the caller keeps its device-independent default.

    total_memory_bytes("cuda:0")   # 150754820096 on an H200; None on a machine without NVML
"""
from __future__ import annotations

import ctypes

from deepseek_pd import env


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def visible_device(cuda_index: int, visible: str | None) -> int | str | None:
    """The NVML index (int) or UUID (str) of CUDA device `cuda_index` under CUDA_VISIBLE_DEVICES
    `visible` (None: unset); None when it cannot be told (MIG, out of range, unparsable)."""
    if visible is None:
        return cuda_index
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if cuda_index >= len(entries):
        return None
    entry = entries[cuda_index]
    if entry.isdigit():
        return int(entry)
    return entry if entry.startswith("GPU-") else None


def total_memory_bytes(device: str) -> int | None:
    """Total memory of the CUDA `device` ("cuda" or "cuda:N"), or None (see the module docstring)."""
    _, _, index = device.partition(":")
    target = visible_device(int(index or 0), env.cuda_visible_devices())
    if target is None:
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        handle, memory = ctypes.c_void_p(), _Memory()
        if isinstance(target, int):
            found = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(target), ctypes.byref(handle))
        else:
            found = nvml.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(target.encode()), ctypes.byref(handle))
        if found != 0 or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.total)
    finally:
        nvml.nvmlShutdown()
