"""Admission control over the decode worker's KV pool.

A request is admitted only when the pool can hold its prompt now AND a reserve for the tokens
it will decode (`min(max_new_tokens, decode_reserve_tokens)`), counting what earlier requests
reserved but have not allocated yet. So an admitted request never runs out of pages within its
reserve; beyond it (only when max_new_tokens exceeds the reserve cap) growth can fail, and the
request then ends with RESOURCE_EXHAUSTED.

    pool 100 pages, 30 free, 20 reserved by running requests -> 10 admissible
    a request needing 4 prompt pages + 8 reserved waits (FIFO) until 12 are admissible,
    or fails with RESOURCE_EXHAUSTED after admission_timeout_s; one needing > 100 fails at once.
"""
from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from deepseek_pd.model.kv.pool import KVPool
from deepseek_pd.workers.engine.request_rules import kv_tokens_needed
from deepseek_pd.workers.engine.request_failure import AdmissionRefused

log = logging.getLogger(__name__)


def decode_reserve_pages(pool: KVPool, prompt_len: int, max_new: int, reserve_tokens: int) -> int:
    """Pages a request reserves beyond its prompt's: enough KV for min(max_new, reserve_tokens)
    output tokens (the last sampled token is never written)."""
    tokens = kv_tokens_needed(prompt_len, min(max_new, reserve_tokens))
    return max(0, pool.pages_for_tokens(tokens) - pool.pages_for_tokens(prompt_len))


@dataclass(eq=False)
class Reservation:
    pages: list[int]
    reserved: int  # pages promised but not allocated yet
    released: bool = field(default=False)


class PageBudget:
    def __init__(self, pool: KVPool, admission_timeout_s: float) -> None:
        self.pool = pool
        self.admission_timeout_s = admission_timeout_s
        self.reserved = 0
        self._changed = asyncio.Event()
        # Built before any request: pages already taken (the runner's CUDA-graph scratch page)
        # never come back, so a request is measured against what is usable, not pool.num_pages.
        self.capacity = pool.num_free_pages
        self._waiters: deque[object] = deque()  # admit() calls in arrival order
        self._held: set[asyncio.Task] = set()  # released pages on their way back (grace, scrub)

    @property
    def admissible(self) -> int:
        return self.pool.num_free_pages - self.reserved

    async def admit(self, now_pages: int, reserve_pages: int) -> Reservation:
        total = now_pages + reserve_pages
        if total > self.capacity:
            raise AdmissionRefused(f"request needs {total} KV pages ({now_pages} for the prompt, {reserve_pages} "
                                   f"reserved for decoding), the pool has {self.capacity} usable")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.admission_timeout_s
        ticket = object()
        self._waiters.append(ticket)
        try:
            # FIFO: only the oldest waiter may take pages, so small requests cannot starve a big one.
            while self._waiters[0] is not ticket or self.admissible < total:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise AdmissionRefused(f"no room for {total} KV pages within {self.admission_timeout_s}s "
                                           f"({self.pool.num_free_pages} free, {self.reserved} reserved)")
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
            self.reserved += reserve_pages
            return Reservation(self.pool.alloc(now_pages), reserve_pages)
        finally:
            self._waiters.remove(ticket)
            self._changed.set()  # the next in line looks again

    def grow(self, reservation: Reservation, num_pages: int) -> None:
        """Appends `num_pages` pages to the request, from its reserve first."""
        from_reserve = min(num_pages, reservation.reserved)
        extra = num_pages - from_reserve
        if extra > self.admissible:
            raise AdmissionRefused(f"KV pool full: the request outgrew its {len(reservation.pages)} pages")
        reservation.pages += self.pool.alloc(num_pages)
        reservation.reserved -= from_reserve
        self.reserved -= from_reserve

    def release(self, reservation: Reservation, delay_s: float = 0.0,
                scrub: Callable[[list[int]], Awaitable[None]] | None = None) -> None:
        """Gives the unused reserve back now and the pages after `delay_s` (if > 0) and `scrub`.

        `scrub(pages)` (zeroing their contents, off the event loop) must have returned before the
        pages go back: their next owner's KV may arrive by a NIC or on another stream. If it
        raises, the pages stay out of the pool for good, logged: a leak, never a leak of data."""
        if reservation.released:
            return
        reservation.released = True
        self.reserved -= reservation.reserved
        reservation.reserved = 0
        pages, reservation.pages = reservation.pages, []
        self._changed.set()
        if delay_s <= 0 and scrub is None:
            self._free(pages)
            return
        task = asyncio.get_running_loop().create_task(self._free_later(pages, delay_s, scrub))
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    async def _free_later(self, pages: list[int], delay_s: float,
                          scrub: Callable[[list[int]], Awaitable[None]] | None) -> None:
        if delay_s > 0:
            await asyncio.sleep(delay_s)
        if scrub is not None:
            try:
                await scrub(pages)
            except Exception:
                log.exception("zeroing %d released KV pages %s failed: they stay out of the pool until "
                              "the worker restarts", len(pages), pages[:8])
                self.capacity -= len(pages)  # a request measured against them could never be admitted
                self._changed.set()
                return
        self._free(pages)

    def _free(self, pages: list[int]) -> None:
        self.pool.free(pages)
        self._changed.set()
