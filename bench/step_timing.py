"""Seconds per call of a step, timed the way the micro-benches time theirs (bench/sampling.py,
bench/top_logprobs.py): warm-up calls first, then one device sync before and after the timed calls,
so the time is the calls' own and queued device work is counted once, at the end."""
from __future__ import annotations

import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    """Waits for `device`'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_step(run: Callable[[], None], steps: int, warmup: int, device: torch.device) -> float:
    """Seconds per call of `run` over `steps` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        run()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        run()
    sync(device)
    return (time.perf_counter() - start) / steps
