"""`StagingArea`: where a one-sided writer (Mooncake) puts a transfer's KV, never the pages the model reads.

Mooncake authenticates no peer, and its TCP server checks a write's range only when the write's
header arrives; the body may follow at any pace, after the transfer is over (issue 20). So the decode
side never registers its KV pool: each transfer gets slots of a small staging area, the only memory a
writer (honest or not) can reach; once the prefill side's TransferDone arrived, decode copies the
slots into the request's own pages (`copy_into`) and checks the KV MAC on that private copy
(kv_mac.py). A byte that reaches the staging after the copy changes nothing the model reads; one
that lands before it fails that request's MAC check. Either way no other request's pages change.
With a deployment secret what the slots hold is ciphertext (kv_cipher.py): the sender's
`fill_from` encrypts as it gathers each send into its own staging, `copy_into` decrypts as it lands
the slots, so a reader of the registered staging gets no KV. With pulled transfers (the default,
mooncake_pull_channel.py / mooncake_pull_sink.py) the roles turn: the prefill side's send staging is
what a peer reaches (each piece's slots registered from its report until decode read them), and
decode's slots are where decode's own reads land, registered only over RDMA.

    decode pool (never registered)        staging (registered: per transfer over TCP, for good over RDMA)
    request A pages [7, 2, 9]   <- copy -- slots [0, 1, 2]   <- prefill of A writes, then its done
    request B pages [4, 5]      <- copy -- slots [3, 4]      <- prefill of B (a late stranger's body
                                                                lands here after B's copy: B unharmed)

Slots are taken lowest first (so a transfer's slots tend to form one run: fewer registrations and
fewer Mooncake write requests) and go back at once after the copy, zeroed: every write of the
prefill side completed before its TransferDone, and a registered slot (over RDMA all of them, for
good; over TCP the next transfer's, from before its prefill writes them) never shows a reader an
earlier request's KV. A transfer that failed or was cancelled after its handshake went out may
still be written by its prefill side for up to `send_timeout_s`, so its slots cool that long before
they are reused, and are zeroed as the grace ends (by the area's cooling thread, `_cool`: over RDMA
they stay registered, so waiting for the next transfer to take them would leave the failed one's KV
readable until then); a write that lands in a reused slot then fails the new owner's MAC check,
never its output. A transfer waits for slots on the event loop while
the staging is full (first come first served, up to its timeout, then RESOURCE_EXHAUSTED naming the
setting). A prompt longer than the whole staging takes half of it as a window and moves through it
(`MooncakeSink` in mooncake.py): page i goes into slot i mod W, the prefill side writes it only
after decode copied page i - W out (`copy_into`, which zeroes the slots), as the credits of the
window reports on the transfer's stream say:

    staging of 4 slots, a 10-page prompt: window W = 2, slots [0, 1]
    prefill writes pages 0     -> slot 0, reports [0, 1)   decode copies slot 0 -> page of 0, credits landed 1
    prefill writes page 1      -> slot 1, reports [1, 2)   decode copies, credits landed 2
    prefill waits for landed >= 1, writes page 2 -> slot 0 ... (the MAC covers all 10 pages at the end)
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Sequence

import numpy as np
import torch

from deepseek_pd.model.host_copy import upload
from deepseek_pd.model.kv.pool import KVPool, copy_pages_
from deepseek_pd.workers.engine.interface import FailureCode
from deepseek_pd.workers.engine.request_failure import TransferError
from deepseek_pd.workers.transport.kv_cipher import CellCipher
from deepseek_pd.workers.transport.page_io import consecutive_runs, page_index, side_stream
from deepseek_pd.workers.transport.plan import merge_page_runs

log = logging.getLogger(__name__)

# Up to this many runs (contiguous in the slots and in the pages) a copy goes run by run, as plain
# memory copies (on a CPU pool several times faster than indexed copies of bf16 pages); past it, one indexed
# copy per layer (one kernel each, however fragmented).
SLICE_RUNS = 8


class StagingArea:
    """`num_pages` pages of every layer of `pool`'s KV, on its device, in buffers of their own."""

    def __init__(self, pool: KVPool, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a staging area needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.page_bytes = pool.bytes_per_page
        self.buffers = [torch.zeros((num_pages, pool.page_size, pool.kv_dim), dtype=pool.dtype, device=pool.device)
                        for _ in range(pool.num_layers)]
        self.base_addrs = [buffer.data_ptr() for buffer in self.buffers]
        self._free = list(range(num_pages))
        self._cooling: list[tuple[float, list[int]]] = []  # (usable at, slots) of failed transfers
        self._dirty: set[int] = set()  # free slots that may hold a failed transfer's bytes
        self._tickets = 0  # acquire's order of arrival
        self._queue: collections.deque[int] = collections.deque()  # waiting tickets, oldest first
        self._lock = threading.Lock()
        self._cooled = threading.Condition(self._lock)  # `_cool`'s wake-up: a slot began cooling
        self._cooler: threading.Thread | None = None  # runs while any slot cools
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []  # acquires waiting for room

    @property
    def num_used(self) -> int:
        """Slots held by transfers or cooling after a failed one."""
        with self._lock:
            return self.num_pages - len(self._free)

    async def acquire(self, count: int, timeout_s: float) -> tuple[list[int], list[int]]:
        """`count` slots, lowest first, and which of them must be zeroed (`scrub`) before anything
        registers or names them. Waits on the event loop while the staging is full (never in a
        worker thread: the copies that free slots run there), first come first served (a big prompt
        is not passed over forever by small ones, and slots go out in about the order the prefill
        side gets the requests: it computes only those whose handshake came). Raises TransferError
        when `count` exceeds the staging (a caller asks for at most all of it: longer prompts go in
        windows) or after `timeout_s` without room; cancelling the task gives up its place."""
        if count > self.num_pages:
            raise TransferError(FailureCode.RESOURCE_EXHAUSTED,
                                f"the prompt's KV takes {count} pages, the mooncake staging area holds "
                                f"{self.num_pages}: raise the decode worker's --engine-opt mooncake_staging_tokens")
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            ticket = self._tickets
            self._tickets += 1
            self._queue.append(ticket)
        try:
            while True:
                changed = asyncio.Event()
                with self._lock:
                    now = time.monotonic()
                    if self._queue[0] == ticket and len(self._free) >= count:
                        self._free.sort()
                        taken, self._free = self._free[:count], self._free[count:]
                        dirty = [slot for slot in taken if slot in self._dirty]
                        self._dirty.difference_update(dirty)
                        return taken, dirty
                    wait = deadline - now
                    if wait <= 0:
                        raise TransferError(FailureCode.RESOURCE_EXHAUSTED,
                                            f"no room for {count} pages in the mooncake staging area "
                                            f"({self.num_pages} pages) within {timeout_s}s; raise the decode "
                                            f"worker's --engine-opt mooncake_staging_tokens")
                    self._waiters.append((loop, changed))
                try:
                    await asyncio.wait_for(changed.wait(), wait)
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._lock:
                self._queue.remove(ticket)
                self._notify()  # the next in line may fit now

    def release(self, slots: Sequence[int], delay_s: float = 0.0, scrubbed: bool = False) -> None:
        """Gives `slots` back, usable after `delay_s` (a late write of a failed transfer). Unless
        `scrubbed` (zeroed by the caller) they are zeroed: as the delay ends (`_cool`), or, given
        back at once, when next taken."""
        if not slots:
            return
        with self._lock:
            if not scrubbed:
                self._dirty.update(slots)
            if delay_s > 0:
                self._cooling.append((time.monotonic() + delay_s, list(slots)))
                if self._cooler is None:
                    self._cooler = threading.Thread(target=self._cool, name="kv-staging-cool", daemon=True)
                    self._cooler.start()
                self._cooled.notify()
            else:
                self._free.extend(slots)
            self._notify()

    def _cool(self) -> None:
        """The cooling thread, while any slot cools: as each failed transfer's grace ends, zeroes
        its slots (unless scrubbed already) and only then frees them; wakes the waiting `acquire`s.
        Slots whose zeroing fails never go back (logged), as the pool's pages."""
        while True:
            with self._lock:
                if not self._cooling:
                    self._cooler = None
                    return
                now = time.monotonic()
                due = [slot for at, slots in self._cooling if at <= now for slot in slots if slot in self._dirty]
                if not due and all(at > now for at, _ in self._cooling):
                    self._cooled.wait(min(at for at, _ in self._cooling) - now)
                    continue
            try:
                self.scrub(due)
            except Exception:  # noqa: BLE001 - this thread must go on cooling the others
                log.exception("could not zero %d mooncake staging slots of a failed transfer: they are "
                              "not used again", len(due))
                with self._lock:
                    self._cooling = [(at, [s for s in slots if s not in due]) for at, slots in self._cooling]
                continue
            with self._lock:
                self._dirty.difference_update(due)
                self._thaw(now)
                self._notify()

    def _notify(self) -> None:
        """Wakes every waiting `acquire` (from any thread); under `_lock`."""
        for loop, changed in self._waiters:
            try:
                loop.call_soon_threadsafe(changed.set)
            except RuntimeError:  # that waiter's loop is gone (it gave up)
                pass
        self._waiters.clear()

    def _thaw(self, now: float) -> None:
        ready = [entry for entry in self._cooling if entry[0] <= now]
        if ready:
            self._cooling = [entry for entry in self._cooling if entry[0] > now]
            for _, slots in ready:
                self._free.extend(slots)

    def copy_into(self, pool: KVPool, slots: Sequence[int], pages: Sequence[int], layers: range | None = None,
                  cipher: CellCipher | None = None, first_page: int = 0) -> None:
        """Copies staging `slots` into `pool`'s `pages` (same order), in `layers` (default every
        layer), then zeroes those cells of the slots; returns once both are in memory (on CUDA: on a
        side stream, then synchronised, as the pool's scrub does), so what a writer puts into the
        slots afterwards can never reach the pages. `cipher`: the slots hold ciphertext, decrypted
        on the way (`pages` are the request's pages `first_page`, `first_page + 1`, ...: kv_cipher.py)."""
        if not pages:
            return
        chosen = range(len(self.buffers)) if layers is None else layers
        runs = merge_page_runs(slots, pages)

        def decrypt() -> None:
            for layer in chosen:
                cipher.copy(self.buffers[layer], slots, pool.buffers[layer], pages, layer, first_page)
            if pool.device.type == "cpu" or len(runs) <= SLICE_RUNS:
                for layer in chosen:  # (numpy's fill on a CPU pool, as in `copy`)
                    staged = _host(self.buffers[layer]) if pool.device.type == "cpu" else self.buffers[layer]
                    for run in runs:
                        cells = staged[run.src:run.src + run.length]
                        cells.fill(0) if pool.device.type == "cpu" else cells.zero_()
                return
            # Scattered slots: one fill per layer, not one per run (a 4k-token prompt in 256 scattered
            # slots took 87 ms to decrypt on an H100, 7,000 launches, against 2 ms to encrypt).
            self._zero_rows(self._slot_index(slots), chosen)

        def copy() -> None:
            if pool.device.type == "cpu":  # numpy's plain copies: torch's fork OpenMP teams per call
                for layer in chosen:  # (page_io.py: 10x slower on shared cores, per layer)
                    staged, buffer = _host(self.buffers[layer]), _host(pool.buffers[layer])
                    for run in runs:
                        np.copyto(buffer[run.dst:run.dst + run.length], staged[run.src:run.src + run.length])
                        staged[run.src:run.src + run.length].fill(0)
                return
            if len(runs) <= SLICE_RUNS:  # contiguous blocks: plain memory copies
                for layer in chosen:
                    staged, buffer = self.buffers[layer], pool.buffers[layer]
                    for run in runs:
                        buffer[run.dst:run.dst + run.length].copy_(staged[run.src:run.src + run.length])
                        staged[run.src:run.src + run.length].zero_()
                return
            src, dst = self._slot_index(slots), page_index(pool, pages)
            for layer in chosen:
                copy_pages_(pool.buffers[layer], dst, self.buffers[layer].index_select(0, src))
            self._zero_rows(src, chosen)
        self._on_device(copy if cipher is None else decrypt)

    def fill_from(self, pool: KVPool, layers: range, pages: Sequence[int], slots: Sequence[int],
                  cipher: CellCipher | None = None, first_page: int = 0) -> None:
        """The other direction, for a sender (prefill over mooncake: its NIC reads only registered
        memory, and the KV is encrypted here): copies `pool`'s `pages` of `layers` into `slots`;
        returns once they are there. `cipher`: encrypted on the way (`pages` are the request's
        pages `first_page`, `first_page + 1`, ...: kv_cipher.py)."""
        runs = merge_page_runs(pages, slots)

        def encrypt() -> None:
            for layer in layers:
                cipher.copy(pool.buffers[layer], pages, self.buffers[layer], slots, layer, first_page)

        def copy() -> None:
            if pool.device.type == "cpu":  # numpy's plain copies, as `copy_into`'s: torch's indexed copy
                for layer in layers:  # forks an OpenMP team per layer (2.6x the time of a numpy copy
                    source, staged = _host(pool.buffers[layer]), _host(self.buffers[layer])  # per run here)
                    for run in runs:
                        np.copyto(staged[run.dst:run.dst + run.length], source[run.src:run.src + run.length])
                return
            if len(runs) <= SLICE_RUNS:
                for layer in layers:
                    for run in runs:
                        self.buffers[layer][run.dst:run.dst + run.length].copy_(
                            pool.buffers[layer][run.src:run.src + run.length])
                return
            src = page_index(pool, pages)
            dst = self._slot_index(slots)
            for layer in layers:
                copy_pages_(self.buffers[layer], dst, pool.buffers[layer].index_select(0, src))
        self._on_device(copy if cipher is None else encrypt)

    def scrub(self, slots: Sequence[int], layers: Sequence[int] | None = None) -> None:
        """Zeroes `slots` in `layers` (default every layer); returns once the zeros are in memory."""
        if not slots:
            return
        chosen = range(len(self.buffers)) if layers is None else layers

        self._on_device(lambda: self._zero_rows(self._slot_index(slots), chosen))

    def _slot_index(self, slots: Sequence[int]) -> torch.Tensor:
        """`slots` as a long tensor on the staging's device, enqueued on the current stream by
        `host_copy.upload`'s rule (page-locked, never a pageable copy through the driver's staging)."""
        return upload(torch.as_tensor(list(slots), dtype=torch.long), self.buffers[0].device)

    def _zero_rows(self, index: torch.Tensor, layers: Sequence[int]) -> None:
        """Zeroes the slots at `index` in `layers`, as bytes (CUDA has no float8 fill kernel). On
        CPU numpy's fill per run of slots: torch's index_fill_ forks an OpenMP team per call, whose
        threads spin on shared cores (a quarter of a transfer's CPU on the 2-core machine)."""
        if index.device.type == "cpu":
            runs = consecutive_runs(index.tolist())
            for layer in layers:
                staged = _host(self.buffers[layer])
                for begin, end, first in runs:
                    staged[first:first + end - begin].fill(0)
            return
        for layer in layers:
            self.buffers[layer].view(torch.uint8).index_fill_(0, index, 0)

    def _on_device(self, work) -> None:
        device = self.buffers[0].device
        if device.type != "cuda":
            work()
            return
        stream = side_stream(device)
        with torch.cuda.stream(stream):
            work()
        stream.synchronize()


def _host(buffer: torch.Tensor) -> np.ndarray:
    """A CPU layer buffer as uint8 `[pages, page bytes]`, no copy."""
    return buffer.view(buffer.shape[0], -1).view(torch.uint8).numpy()
