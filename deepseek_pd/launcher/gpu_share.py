"""How `deepseek-pd up` splits one GPU between the workers it starts on it.

Every worker of a local cluster runs on the same device, so each gets a slice of the GPU memory
budget (`--mem-fraction-static`, the fraction of the GPU's total memory all of them may use) in
proportion to its role's `gpu_memory_share` (workers/roles.py). Each worker then sizes its KV pool
from its own slice after loading its own copy of the weights, so the slices must sum to the
budget, never more, whatever order the workers start in.

Example: `up --prefill 1 --decode 1` with the default budget 0.88 gives prefill 0.352 and decode
0.528; `--prefill 1 --decode 2` gives 0.22, 0.33, 0.33.
"""
from __future__ import annotations

from typing import Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.device import is_cuda
from deepseek_pd.model.kv_pool_sizing import DEFAULT_MEM_FRACTION_STATIC
from deepseek_pd.workers.roles import role_defaults


def memory_fractions(roles: Sequence[str], budget: float = DEFAULT_MEM_FRACTION_STATIC) -> list[float]:
    """Each worker's `--mem-fraction-static`, in the order of `roles`; they sum to `budget`."""
    if not 0 < budget <= 1:
        raise UserError(f"--mem-fraction-static {budget} must be in (0, 1]")
    if not roles:
        return []
    shares = [role_defaults(role).gpu_memory_share for role in roles]
    total = sum(shares)
    return [budget * share / total for share in shares]


def worker_memory_args(device: str, roles: Sequence[str], budget: float | None = None) -> list[list[str]]:
    """The `serve` flags that give each worker its slice: `--mem-fraction-static F` on CUDA; nothing
    on the CPU, where every worker keeps its fixed default pool."""
    if not is_cuda(device):
        return [[] for _ in roles]
    fractions = memory_fractions(roles, DEFAULT_MEM_FRACTION_STATIC if budget is None else budget)
    return [["--mem-fraction-static", str(fraction)] for fraction in fractions]


def check_gpus_for_groups(device: str, ranks: int) -> None:
    """On CUDA rank r of every multi-rank worker runs on GPU r (workers/group_main.py), so the
    largest group (`ranks`) needs that many GPUs; refused before anything starts, not rank by rank."""
    if not is_cuda(device) or ranks <= 1:
        return
    import torch

    available = torch.cuda.device_count()
    if ranks > available:
        raise UserError(f"--prefill-ranks/--decode-ranks: a group of {ranks} ranks runs one rank per GPU, "
                        f"but this machine has {available} GPU(s)")
