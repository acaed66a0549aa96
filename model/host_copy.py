"""`HostCopy`: a device tensor's values on the host, copied without blocking the thread that asked;
`upload`: the other way; `upload_parts`: several host tensors the other way in one copy.

A decode step ends with ONE device-to-host copy (the sampled token ids and their logprobs packed in
one tensor). `start` queues the copy into a pinned buffer behind the work that produces the
values and records an event; `wait` blocks only until that event, so the thread that launched the
step can launch the next one first (the overlap scheduler) and read these values later.

On CPU the copy is a plain synchronous one and `wait` returns at once.
"""
from __future__ import annotations

import torch


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
    """A host tensor on `device` without waiting: pinned, so the copy is asynchronous (queued on the
    current stream, behind nothing the thread waits for) and the caching host allocator keeps the
    buffer until it has run. On the CPU, `host` itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


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
