"""`RankGroup`: this process's place in its worker group, and the process groups it talks over.

    world    torch.distributed's default group (gloo on CPU, NCCL on GPU), joined with the long
             `startup_timeout_s` (pods start minutes apart, weights load at different speeds);
             used once at start-up to exchange every rank's endpoints (`exchange`)
    step     the ranks' per-step process group, with `collective_timeout_s`: the MoE all-to-alls
             (through `ParallelInfo`) and, on CPU, the lockstep ticks
    control  on GPU a gloo group for the ticks (CPU tensors, no device sync); on CPU it is `step`
    tp       (attention TP, tp > 1) this rank's DP group's `tp` ranks: o_proj's reduce-scatter (or
             all-reduce), the rows' all-gathers (model/distributed/layer_communicator.py) and the leader's
             replayed calls (`tp_host`: their gloo twin on GPU)
    waker    the lockstep thread's wake-up channel while the group sleeps (`StoreWaker`: keys in
             rank 0's TCPStore, which torch.distributed already runs for the rendezvous)
"""
from __future__ import annotations

import datetime
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from deepseek_pd.errors import UserError
from deepseek_pd.model.device import is_cuda
from deepseek_pd.model.distributed.parallel import ParallelInfo
from deepseek_pd.model.distributed.tp_replay import TpReplay
from deepseek_pd.workers.group.layout import GroupLayout

log = logging.getLogger(__name__)


class StoreWaker:
    """`lockstep.Waker` over the group's TCPStore: `wake(e)` sets key e, `wait(e)` blocks on it.

    Two clients of their own (a blocked `wait` holds its connection): one for the model thread's
    waits, one for the wakes that come from the event loop. TCPStore's `wait` is answered by the
    server when the key appears (no polling). Old keys are deleted by the next wake: once any rank
    wakes epoch e, every rank is past its wait for e - 1.
    """

    _PREFIX = "deepseek_pd/lockstep/wake/"

    # Long: each wait that times out makes c10d log two warnings, and a store that is gone ends a
    # wait at once (the connection resets), so the poll only bounds how long an idle wait lasts.
    def __init__(self, host: str, port: int, poll_s: float = 600.0) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=poll_s)
        self._waits = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self._wakes = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self._wake_lock = threading.Lock()
        self._poll = timeout

    def wait(self, epoch: int) -> None:
        key = f"{self._PREFIX}{epoch}"
        while True:
            started = time.monotonic()
            try:
                self._waits.wait([key], self._poll)
                return
            except Exception:  # noqa: BLE001 - torch raises its store errors under several names
                if time.monotonic() - started < 0.9 * self._poll.total_seconds():
                    raise  # not a timeout: the store (rank 0) is gone
                # a long idle period: wait again

    def wake(self, epoch: int) -> None:
        with self._wake_lock:
            self._wakes.set(f"{self._PREFIX}{epoch}", b"1")
            if epoch > 1:
                self._wakes.delete_key(f"{self._PREFIX}{epoch - 1}")


@dataclass
class RankGroup:
    layout: GroupLayout
    rank: int
    step: Any
    control: Any
    waker: StoreWaker | None = None
    tp: Any = None
    tp_host: Any = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank_of(self.rank)

    @property
    def is_tp_follower(self) -> bool:
        """A TP rank > 0: it runs no engine, only its DP group leader's forwards."""
        return self.layout.tp_rank_of(self.rank) > 0

    def parallel(self) -> ParallelInfo:
        """The EP group the model's dispatcher uses and this rank's TP group (single rank: neither)."""
        ep = (self.layout.ep, self.rank, self.step) if self.layout.ep > 1 else (1, 0, None)
        return ParallelInfo(*ep, self.layout.tp, self.layout.tp_rank_of(self.rank), self.tp)

    def tp_replay(self) -> TpReplay | None:
        """This rank's end of its TP group's replay channel (model/distributed/tp_replay.py); None at tp 1."""
        if self.layout.tp == 1:
            return None
        return TpReplay(self.layout.tp_leader_of(self.rank), not self.is_tp_follower, self.tp_host, self.tp)

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
    tp = tp_host = None
    if layout.tp > 1:  # every rank creates every DP group's TP group, in the same order
        for leader in layout.dp_leaders:
            members = list(range(leader, leader + layout.tp))
            device_group = dist.new_group(members, backend=backend, timeout=timeout)
            host_group = device_group if backend == "gloo" else dist.new_group(members, backend="gloo",
                                                                                timeout=timeout)
            if leader == layout.tp_leader_of(rank):
                tp, tp_host = device_group, host_group
    return RankGroup(layout, rank, step, control, StoreWaker(host, port), tp, tp_host)
