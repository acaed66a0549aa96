"""`GroupFront`: rank 0's `WorkerEngine`, spreading a group's requests over its DP ranks.

Rank 0 serves SglangScheduler for the whole group. Each request runs on one DP rank, whose
engine holds its KV pages (DP attention); rank 0's own engine is DP rank 0, the others are
`RemoteEngine`s. The choice (`dp_rank_for`), as SGLang's data-parallel controller makes it:

    PD request      bootstrap_room % dp    (both sides of a transfer compute the same rank, so
                                            the decode side knows which prefill rank holds the KV)
    colocated       the rank with the fewest requests in flight (ties: the lowest rank)

The ranks then step in lockstep by themselves (workers/group/lockstep.py).
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Sequence

from deepseek_pd.workers.engine.interface import Event, GenerateRequest, Loads, WorkerEngine
from deepseek_pd.workers.transport.bootstrap_routes import dp_rank_for_room

log = logging.getLogger(__name__)

__all__ = ["GroupFront", "dp_rank_for_room"]


class GroupFront:
    def __init__(self, ranks: Sequence[WorkerEngine]) -> None:
        """`ranks[d]` runs DP rank d's requests; ranks[0] is this process's own engine."""
        self.ranks = list(ranks)
        self._in_flight = [0] * len(self.ranks)
        self._where: dict[str, int] = {}
        self._remote_loads: dict[int, Loads] = {}
        self._poll_task: asyncio.Task | None = None

    def dp_rank_for(self, request: GenerateRequest) -> int:
        if request.disagg is not None:
            return dp_rank_for_room(request.disagg.bootstrap_room, len(self.ranks))
        return min(range(len(self.ranks)), key=lambda d: (self._in_flight[d], d))

    async def start(self) -> None:
        self._poll_task = asyncio.create_task(self._poll_loads(), name="group-loads")

    async def stop(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            await asyncio.gather(self._poll_task, return_exceptions=True)
        for engine in self.ranks[1:]:
            close = getattr(engine, "close", None)
            if close is not None:
                await close()
        stop = getattr(self.ranks[0], "stop", None)
        if stop is not None:
            await stop()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        dp_rank = self.dp_rank_for(request)
        self._in_flight[dp_rank] += 1
        self._where[request.rid] = dp_rank
        try:
            async for event in self.ranks[dp_rank].generate(request):
                yield event
        finally:
            self._in_flight[dp_rank] -= 1
            if self._where.get(request.rid) == dp_rank:
                del self._where[request.rid]

    async def abort(self, rid: str) -> bool:
        dp_rank = self._where.get(rid)
        if dp_rank is None:
            return False
        return await self.ranks[dp_rank].abort(rid)

    def loads(self) -> Loads:
        """The group's sum: rank 0's own engine, and each follower's last reported loads (polled)."""
        own = self.ranks[0].loads()
        total = [own.num_running, own.num_waiting, own.kv_used_pages, own.kv_total_pages]
        for dp_rank in range(1, len(self.ranks)):
            theirs = self._remote_loads.get(dp_rank)
            if theirs is None:  # not polled yet: what this process knows
                total[0] += self._in_flight[dp_rank]
                total[3] += own.kv_total_pages  # every rank builds the same pool
                continue
            total[0] += theirs.num_running
            total[1] += theirs.num_waiting
            total[2] += theirs.kv_used_pages
            total[3] += theirs.kv_total_pages
        return Loads(*total, in_flight_per_dp_rank=tuple(self._in_flight))

    def is_healthy(self) -> bool:
        return self.ranks[0].is_healthy()

    async def _poll_loads(self, period_s: float = 1.0) -> None:
        while True:
            for dp_rank in range(1, len(self.ranks)):
                fetch = getattr(self.ranks[dp_rank], "fetch_loads", None)
                if fetch is None:
                    continue
                loads = await fetch()
                if loads is not None:
                    self._remote_loads[dp_rank] = loads
            await asyncio.sleep(period_s)
