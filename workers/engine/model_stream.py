"""The CUDA stream a worker's model thread issues its kernels on, by the priority its role asks for.

When two workers share one GPU (`up`'s 1P1D on one card), a decode step is a few milliseconds of
small kernels that every running request waits for, while a prefill round is tens of milliseconds
of large GEMMs. With CUDA stream priorities the GPU's block scheduler starts a waiting block of a
higher-priority stream before one of a lower: decode's kernels go first as SMs free up, rather than
queue behind a whole prefill GEMM's waves.

`priority` is a role's choice (workers/serve/roles.py `RoleDefaults.kernel_priority`; this module
knows no role):
- `GREATEST`: a stream of the device's greatest priority, made for the model thread
  (`torch.cuda.Stream(priority=...)` at `torch.cuda.Stream.priority_range()`'s greatest, which
  torch may clamp to fewer levels than CUDA's; the stream's `.priority` says which one it got).
- `LEAST`: the default stream, which has the least priority (0) already. A thread that asks for it
  stays where it was: prefill's KV senders order their reads after the default stream
  (workers/transport/page_io.py `wait_ready`, model/kv/layer_progress.py `kv_written_event`).

Where the priority acts: CUDA orders blocks by stream priority within one context. Two worker
processes share the GPU by time slices unless the MPS daemon runs (then their kernels run side by
side and the priorities compete); bench/stream_priority.py measures both arrangements. A rank of
a group (`LockstepModelThread`, TP/EP/DP > 1) stays on the default stream: its collectives order
themselves after it, and no measurement says a priority there is worth changing that.

A thread on its own stream keeps the ordering it had on the default stream (`issuing_on`): each
call waits for what other threads of the process queued on the default stream, and the default
stream waits for the call's work, both device-side (no host block); what the thread hands over
through events or synchronised streams (model/host_copy.py, model/kv/layer_progress.py) is as before. On the CPU there
is no stream: everything here is a no-op.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Iterator

import torch


class KernelPriority(enum.Enum):
    """The stream priority a model thread's kernels get on a shared GPU.

    Example: decode's model thread asks for GREATEST and issues on a stream of torch's greatest
    priority (a negative number: lower is more urgent); prefill's asks for LEAST and stays on the
    default stream (priority 0).
    """

    GREATEST = "greatest"
    LEAST = "least"


def model_stream(device: torch.device | str, priority: KernelPriority | None) -> "torch.cuda.Stream | None":
    """The stream a model thread on `device` issues on; None where it stays on the default stream:
    the CPU, no priority asked (`stream_priority` off), or the least (the default stream's own)."""
    device = torch.device(device)
    if device.type != "cuda" or priority in (None, KernelPriority.LEAST):
        return None
    _least, greatest = torch.cuda.Stream.priority_range()
    return torch.cuda.Stream(device, priority=greatest)


@contextlib.contextmanager
def issuing_on(stream: "torch.cuda.Stream | None") -> Iterator[None]:
    """Runs the body with `stream` as this thread's current stream, ordered as if it ran on the
    default stream: after what is queued there, and before what is queued there next (a tensor
    the body returns may be read on another thread's default stream). Both waits are device-side:
    the host blocks on neither, and the default stream, empty in a decode worker, delays nothing.
    Nothing for None."""
    if stream is None:
        yield
        return
    default = torch.cuda.default_stream(stream.device)
    stream.wait_stream(default)
    try:
        with torch.cuda.stream(stream):
            yield
    finally:
        default.wait_stream(stream)
