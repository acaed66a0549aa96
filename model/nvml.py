"""A GPU's total memory and compute capability read through NVML, without creating a CUDA context.

`serve` decides its GPU defaults before any rank process exists; the supervisor of a multi-rank
group must not hold a CUDA context (it would take memory on the GPU rank 0 sizes its KV pool
from). NVML (`libnvidia-ml.so.1`, shipped with the driver) answers without one, as torch's own
NVML-based device count does. `CUDA_VISIBLE_DEVICES` renumbers CUDA devices but not NVML's, so
`cuda:N` is mapped through it (indices or `GPU-` UUIDs); anything else (MIG instances, no driver
library, an NVML error) gives None, and the caller keeps its device-independent default.

    total_memory_bytes("cuda:0")   # 150754820096 on an H200; None on a machine without NVML

NVML's total is not what CUDA can allocate. It counts the whole framebuffer; `cudaMemGetInfo`
(torch's `mem_get_info` and `get_device_properties().total_memory`) leaves out what the driver
reserves for itself: 85,520,809,984 against 85,017,493,504 bytes on an H100 80GB (0.59%), so NVML
reads more, by at most `DRIVER_RESERVED_MAX_FRACTION`. Which reading serves which rule:

- the chunk tiers (`worker_config.gpu_chunked_prefill_size`) read NVML: they are SGLang's, which
  reads `nvidia-smi --query-gpu=memory.total` (NVML's figure), and `serve` picks them before any
  CUDA context exists; the tiers are tens of GiB apart, so no card sits near a boundary;
- the KV pool's budget (`mem_fraction_static` x total, `model/kv/pool_sizing.py`) reads CUDA's
  total after loading, in the worker: a fraction of memory nobody can allocate would oversize the
  pool by the reservation.
"""
from __future__ import annotations

import ctypes

from deepseek_pd import env


# NVML's total over CUDA's is the driver's reservation: 0.59% on an H100 80GB, about 0.4% on the H200
# (150,754,820,096 bytes against the ~139.8 GiB CUDA reports, operator/gpu_types.py).
DRIVER_RESERVED_MAX_FRACTION = 0.02


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


def _query(device: str, read) -> object | None:
    """`read(nvml, handle)` for the CUDA `device` ("cuda" or "cuda:N") through NVML, or None (no
    driver library, an unmappable device, an NVML error: `read` returns None for its own errors)."""
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
        handle = ctypes.c_void_p()
        if isinstance(target, int):
            found = nvml.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(target), ctypes.byref(handle))
        else:
            found = nvml.nvmlDeviceGetHandleByUUID(ctypes.c_char_p(target.encode()), ctypes.byref(handle))
        return None if found != 0 else read(nvml, handle)
    finally:
        nvml.nvmlShutdown()


def total_memory_bytes(device: str) -> int | None:
    """NVML's total memory of the CUDA `device` ("cuda" or "cuda:N"), or None (see the module
    docstring: this is nvidia-smi's figure, above what CUDA can allocate)."""
    def read(nvml, handle) -> int | None:
        memory = _Memory()
        return int(memory.total) if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0 else None

    return _query(device, read)


def compute_capability(device: str) -> tuple[int, int] | None:
    """The CUDA `device`'s compute capability (major, minor), (9, 0) on Hopper, or None when NVML
    cannot tell; asked without a CUDA context, as `torch.cuda.get_device_capability` would make one."""
    def read(nvml, handle) -> tuple[int, int] | None:
        major, minor = ctypes.c_int(), ctypes.c_int()
        if nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
            return None
        return major.value, minor.value

    return _query(device, read)
