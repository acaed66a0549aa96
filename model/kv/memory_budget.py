"""A worker's GPU memory budget and how the workers sharing one GPU split it. Torch-free: the
worker's pool sizing (model/kv/pool_sizing.py), `up` (launcher/gpu_share.py) and the operator's
memory plan (operator/memory_plan.py) all apply this one rule.

The budget is `mem_fraction_static x the GPU's total memory`. Every worker on the GPU holds its own
copy of the weights and keeps its own activation headroom (its *reserve*); what the budget leaves
after every worker's reserve is the KV room, and each worker's pool gets its share of that room:

    kv_bytes = share x (fraction x total - workers x reserve)

A worker alone on its GPU (`serve`, a pod: workers = 1, share = 1) gets `budget - reserve`. The
workers `up` starts on one GPU load the same checkpoint, so each counts its own reserve once per
worker: their budgets then sum to the GPU's budget, whatever order they start in.

Worked example, the V2-Lite shape in bf16 (28.5 GiB of weights, 2 GiB headroom each) on an 80 GB
H100 (85,017,493,504 bytes = 79.2 GiB as torch reads it), fraction 0.88, 1 prefill + 1 decode
(shares 2:3): budget 69.7 GiB - 2 x 30.5 GiB = 8.7 GiB of KV room; prefill 3.5 GiB, decode 5.2 GiB.
Splitting the fraction instead (0.352 and 0.528 of the card, weights included) left prefill 27.9
GiB, less than its weights.
"""
from __future__ import annotations

from dataclasses import dataclass

# The budget of the workers on one GPU; the rest of the GPU is the CUDA contexts, NCCL and
# transfer buffers, other tenants (SGLang's default when it does not know the GPU).
DEFAULT_MEM_FRACTION_STATIC = 0.88
# The decode batch cap; the largest CUDA-graph batch follows it, and so does the graphs' headroom
# (model/kv/memory_headroom.py).
DEFAULT_MAX_RUNNING_REQUESTS = 128


@dataclass(frozen=True)
class GpuShare:
    """This worker's place on a GPU it may share: `workers` workers (this one included) each
    reserve what this one does, and this one's pool gets `share` of the KV room they leave."""

    workers: int = 1
    share: float = 1.0

    def __post_init__(self) -> None:
        if self.workers < 1 or not 0 < self.share <= 1:
            raise ValueError(f"a GPU is shared by >= 1 workers and a share is in (0, 1]; got "
                             f"{self.workers} workers, share {self.share}")

    @property
    def shared(self) -> bool:
        return self.workers > 1 or self.share < 1

    def worker_budget(self, budget_bytes: int, reserve_bytes: int) -> int:
        """All this worker may hold: its reserve (weights + headroom) plus its share of what
        `budget_bytes` leaves after every worker's reserve; less than the reserve when nothing is left.
        Alone on its GPU: `budget_bytes` itself."""
        return reserve_bytes + int(self.share * (budget_bytes - self.workers * reserve_bytes))

    def kv_bytes(self, budget_bytes: int, reserve_bytes: int) -> int:
        """This worker's KV bytes: its budget beyond its reserve, at least 0."""
        return max(self.worker_budget(budget_bytes, reserve_bytes) - reserve_bytes, 0)

    def describe(self) -> str:
        return f"{self.share:.3g} of the KV room of {self.workers} workers" if self.shared else "alone"


def budget_bytes(mem_fraction_static: float, total_bytes: int) -> int:
    """The budget of the workers on a GPU of `total_bytes`."""
    return int(mem_fraction_static * total_bytes)
