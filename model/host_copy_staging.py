"""A thread's own page-locked buffers for what it copies to the device (a transport thread's page
ids and landed KV), which `host_copy.upload` copies through once the thread reserved them.

Why. A copy from pageable host memory goes through the CUDA driver's own staging buffers, which
all threads of the process share, and a staging buffer is held until its copy has run on the GPU.
On an H100 the first per-chunk send's host calls returned exactly when the next forward's spin
kernel ended (tests/workers/prefill/test_chunk_send_order_cuda.py, 422a203), while the model
thread's own pageable copies of that forward were queued behind the spin; the page ids' pageable
copy was the one CUDA copy both send paths share. That diagnosis is not yet confirmed on the GPU:
test_cuda_first_use_cuda.py's rows "... beside a pageable copy" time it. From page-locked memory a
copy is a plain DMA on the caller's own stream, with no driver staging.

Making page-locked memory waits for the whole device, so a transport's warm-up reserves each
thread's buffers (`reserve`, workers/transport/warm_up.py) before any forward runs; which memory
an upload reads, in which thread, is `host_copy.upload`'s rule.
"""
from __future__ import annotations

import threading

import torch


class HostStaging:
    """One thread's page-locked buffer of `dtype` for one device, handed out front to back.

    A region is written again only after the copies that read it have run: `_copied`, recorded
    after each copy, covers all earlier ones, since they are on one stream and a change of stream
    first waits for the last copy of the old one. Those waits are for the caller's own stream,
    never for the default stream's next forward (the callers synchronise their stream anyway
    before they return, so the wait is usually already over)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, capacity: int) -> None:
        self.device = device
        self.host = torch.empty(capacity, dtype=dtype, pin_memory=True)
        self._next = 0
        self._copied = torch.cuda.Event()
        self._stream: "torch.cuda.Stream | None" = None

    def upload(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (a flat CPU tensor of this buffer's dtype, at most its size) on the device,
        queued on the current stream."""
        count = values.numel()
        stream = torch.cuda.current_stream(self.device)
        if self._stream is not None and (stream != self._stream or self._next + count > self.host.numel()):
            self._copied.synchronize()
            self._next = 0
        region = self.host[self._next:self._next + count]
        region.copy_(values)
        self._next += count
        on_device = region.to(self.device, non_blocking=True)
        self._copied.record(stream)
        self._stream = stream
        return on_device

    def release(self) -> None:
        """Waits until no queued copy reads the buffer (before it is let go)."""
        self._copied.synchronize()


_local = threading.local()


def _key(device: torch.device, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    return str(device), dtype


def reserve(device: torch.device | str, dtype: torch.dtype, count: int) -> None:
    """Makes this thread's buffer of `dtype` for `device` hold at least `count` values (nothing on
    the CPU). Waits for the whole device when it allocates: call it before serving."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    buffers = _local.__dict__.setdefault("buffers", {})
    staging = buffers.get(_key(device, dtype))
    if staging is None or staging.host.numel() < count:
        if staging is not None:
            staging.release()
        buffers[_key(device, dtype)] = HostStaging(device, dtype, max(count, 1))


def reserved(device: torch.device | str, dtype: torch.dtype) -> HostStaging | None:
    """This thread's buffer of `dtype` for `device`, if `reserve` made one."""
    return _local.__dict__.get("buffers", {}).get(_key(torch.device(device), dtype))


def reserves() -> bool:
    """Whether this thread reserved any buffer (it then never allocates page-locked memory again)."""
    return bool(_local.__dict__.get("buffers"))

