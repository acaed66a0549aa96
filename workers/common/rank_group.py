"""`RankGroup`: this process's place in its worker group, and the process groups it talks over.

    world    torch.distributed's default group (gloo on CPU, NCCL on GPU), joined with the long
             `startup_timeout_s` (pods start minutes apart, weights load at different speeds);
             used once at start-up to exchange every rank's endpoints (`exchange`)
    step     the ranks' per-step process group, with `collective_timeout_s`: the MoE all-to-alls
             (through `ParallelInfo`) and, on CPU, the lockstep ticks
    control  on GPU a gloo group for the ticks (CPU tensors, no device sync); on CPU it is `step`
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

from deepseek_pd.errors import UserError
from deepseek_pd.model.device import is_cuda
from deepseek_pd.model.parallel import ParallelInfo
from deepseek_pd.workers.common.group_layout import GroupLayout

log = logging.getLogger(__name__)


@dataclass
class RankGroup:
    layout: GroupLayout
    rank: int
    step: Any
    control: Any

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.rank  # attention is data-parallel over every rank (see group_layout.py)

    def parallel(self) -> ParallelInfo:
        """The EP group the model's dispatcher uses (a single rank without expert parallelism)."""
        if self.layout.ep == 1:
            return ParallelInfo()
        return ParallelInfo(self.layout.ep, self.rank, self.step)

    def exchange(self, mine: Any) -> list[Any]:
        """Every rank's `mine` (small, picklable), in rank order; waits for all (start-up timeout)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.layout.world
        dist.all_gather_object(out, mine)
        return out

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(layout: GroupLayout, rank: int, device: str) -> RankGroup:
    """Joins the group as `rank` (blocks until every rank has joined, or the start-up timeout)."""
    import torch
    import torch.distributed as dist

    host, port = layout.init_host_port()
    backend = "nccl" if is_cuda(device) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    log.info("rank %d/%d: joining the group at %s:%d (%s)", rank, layout.world, host, port, backend)
    try:
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=layout.world,
                                timeout=datetime.timedelta(seconds=layout.startup_timeout_s))
    except Exception as exc:  # a wrong address, or the other ranks never came
        raise UserError(f"rank {rank}: cannot join the worker group at {host}:{port}: {exc}") from exc
    timeout = datetime.timedelta(seconds=layout.collective_timeout_s)
    step = dist.new_group(backend=backend, timeout=timeout)
    control = step if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return RankGroup(layout, rank, step, control)
