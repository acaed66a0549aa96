"""How `deepseek-pd up` splits one GPU between the workers it starts on it.

Every worker of a local cluster runs on the same device and loads its own copy of the weights.
The budget (`--mem-fraction-static`, the fraction of the GPU's total memory all of them may use)
first holds every worker's weights and headroom; what is left is the KV room, split in proportion
to each role's `gpu_memory_share` (workers/serve/roles.py). The rule is model/kv/memory_budget.py's: each
worker is told the budget, how many workers share the GPU, and its share of the room
(`--mem-fraction-static B --gpu-workers N --kv-share S`), and sizes its pool after loading.

Example: `up --prefill 1 --decode 1` gives both the budget 0.88, 2 workers, and shares 0.4 and 0.6;
`--prefill 1 --decode 2` gives shares 0.25, 0.375, 0.375.
"""
from __future__ import annotations

from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.device import is_cuda
from deepseek_pd.model.kv.memory_budget import GpuShare
from deepseek_pd.workers.serve.roles import role_defaults


def kv_shares(roles: Sequence[str]) -> list[GpuShare]:
    """Each worker's place on the GPU, in the order of `roles`; the shares sum to 1."""
    shares = [role_defaults(role).gpu_memory_share for role in roles]
    total = sum(shares)
    return [GpuShare(len(roles), share / total) for share in shares]


def worker_gpu_shares(device: str, roles: Sequence[str]) -> list[GpuShare | None]:
    """Each worker's `GpuShare` on CUDA; None on the CPU, where every worker keeps its fixed default
    pool. Every worker gets the whole budget (`up --mem-fraction-static`)."""
    if not is_cuda(device):
        return [None for _ in roles]
    return list(kv_shares(roles))


def check_gpus_for_groups(device: str, ranks: int) -> None:
    """On CUDA rank r of every multi-rank worker runs on GPU r (workers/serve/group_main.py), so the
    largest group (`ranks`) needs that many GPUs; refused before anything starts, not rank by rank."""
    if not is_cuda(device) or ranks <= 1:
        return
    import torch

    available = torch.cuda.device_count()
    if ranks > available:
        raise UserError(f"--prefill-ranks/--decode-ranks: a group of {ranks} ranks runs one rank per GPU, "
                        f"but this machine has {available} GPU(s)")
