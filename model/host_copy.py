"""`HostCopy`: a device tensor's values on the host, copied without blocking the thread that asked;
`upload`: the other way, the one rule for every host tensor that goes to the device without a sync
(the model thread's per-step inputs and the KV transports' page ids and bytes alike);
`upload_into`: into an existing device tensor; `upload_parts`: several host tensors in one copy.

A decode step ends with ONE device-to-host copy (the sampled token ids and their logprobs packed in
one tensor). `start` queues the copy into a pinned buffer behind the work that produces the
values and records an event; `wait` blocks only until that event, so the thread that launched the
step can launch the next one first (the overlap scheduler) and read these values later.

On CPU the copy is a plain synchronous one and `wait` returns at once.
"""
from __future__ import annotations

import torch

from deepseek_pd.model import host_copy_staging


class HostCopy:
    def __init__(self, values: torch.Tensor) -> None:
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._event: torch.cuda.Event | None = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(values.device))
        else:
            self._host = values.detach().clone()
            self._event = None

    def ready(self) -> bool:
        """Whether `wait` would return without blocking."""
        return self._event is None or self._event.query()

    def wait(self) -> torch.Tensor:
        """The host tensor, once the copy has landed."""
        if self._event is not None:
            self._event.synchronize()
        return self._host


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, queued on the current stream, without waiting. The copy reads
    page-locked memory, so it is a plain DMA on the caller's stream (a pageable copy goes through the
    driver's staging, which every thread shares and holds until the copy has run, behind the forward
    queued before it). Which page-locked memory:

    - a thread that reserved buffers (`host_copy_staging.reserve`: each KV transport thread, at its
      warm-up) copies through its own buffer of `host`'s dtype; one too small, or of another dtype,
      copies from pageable memory instead, since making page-locked memory can wait for the whole
      device, the forward queued meanwhile included;
    - any other thread (the model thread) takes a block from torch's caching host allocator, which
      keeps it until the copy has run and hands out another meanwhile: no wait for a queued forward.

    On the CPU, `host` itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if not host_copy_staging.reserves():
        return host.pin_memory().to(device, non_blocking=True)
    staging = host_copy_staging.reserved(device, host.dtype)
    if staging is None or staging.host.numel() < host.numel():
        return host.to(device, non_blocking=True)
    return staging.upload(host.reshape(-1)).view(host.shape)


def upload_into(target: torch.Tensor, host: torch.Tensor) -> None:
    """`host`'s values written into the device tensor `target` (a captured graph's static inputs),
    by `upload`'s rule, queued on the current stream; on the CPU a plain copy."""
    if target.device.type != "cpu" and not host_copy_staging.reserves():
        target.copy_(host.pin_memory(), non_blocking=True)  # no device temporary in the model thread
    else:
        target.copy_(upload(host, target.device), non_blocking=True)


_ALIGN = 16  # bytes: each packed part starts here, as torch's own allocations (kernels specialise on it)


def upload_parts(device: torch.device | str, *parts: torch.Tensor) -> list[torch.Tensor]:
    """Host tensors on `device` in ONE `upload`; returns their device views, in order, each of its
    part's shape and dtype and starting on a 16-byte boundary. One copy instead of one per tensor:
    on CUDA each copy is a launch and a pinned staging block.

    Example: `ids, table = upload_parts(dev, torch.tensor([5, 7]), torch.zeros(2, 3, dtype=torch.int32))`
    gives `ids` `[2]` long and `table` `[2, 3]` int32, views of one 48-byte device buffer."""
    if not parts:
        return []
    # Parts of one dtype are packed as they are (a forward batch's: few host ops, each costs
    # microseconds); mixed ones as their bytes.
    same = all(p.dtype == parts[0].dtype for p in parts)
    flat = [(p if p.dim() == 1 else p.reshape(-1)) if same else p.contiguous().reshape(-1).view(torch.uint8)
            for p in parts]
    per = max(1, _ALIGN // flat[0].element_size())
    pieces, sizes = [], []
    for piece in flat:
        pieces.append(piece)
        pad = -piece.numel() % per
        if pad:
            pieces.append(piece.new_zeros(pad))
        sizes.append(piece.numel() + pad)
    packed = upload(torch.cat(pieces), device)
    views = []
    for part, piece, chunk in zip(parts, flat, packed.split(sizes)):
        if chunk.numel() != piece.numel():
            chunk = chunk[:piece.numel()]
        if not same:
            chunk = chunk.view(part.dtype)
        views.append(chunk if part.dim() == 1 else chunk.view(part.shape))
    return views
