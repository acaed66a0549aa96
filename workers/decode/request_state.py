"""A decode (or colocated) request's state in the decode engine (workers/decode/engine.py): its
stop rule, its pages, its token queue, and the counters by which the engine knows when its pages
may go back (`in_flight`: launched steps that still use them)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from deepseek_pd.model.sampling.sampler import StopChecker
from deepseek_pd.workers.decode.page_budget import Reservation
from deepseek_pd.workers.decode.speculative_step import SpecRow
from deepseek_pd.workers.engine.prefill_planner import PromptProgress
from deepseek_pd.workers.engine.request_failure import RequestAborted, RequestFailure
from deepseek_pd.workers.engine.request_lifecycle import RequestRecord
from deepseek_pd.workers.transport.exposure import PageExposure


@dataclass(eq=False)
class DecodeRequest(RequestRecord):
    """A decode (or colocated) request: its stop rule, pages, token queue and step counters.

    Its waits end early on an abort only; the wait it cuts short is cancelled (a bootstrap stream
    closes, which the prefill side sees)."""

    stop: StopChecker
    max_new: int
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    reservation: Reservation | None = None
    progress: PromptProgress | None = None  # colocated prefill
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    launched: int = 0  # output tokens sampled or being sampled (collected + in flight)
    in_flight: int = 0  # launched steps (or a prefill round) that still use the pages
    finished: bool = False
    # While the prompt pages may hold a transfer's bytes that did not pass its checks: what it exposed.
    unchecked_kv: PageExposure | None = None
    last_token_at: float = 0.0  # perf_counter when its latest token was streamed (inter-token latency)
    spec: SpecRow | None = None  # with speculative decoding: its row in the speculative steps

    @property
    def next_position(self) -> int:
        """Where the next launched decode step writes: tokens already in (or going into) the cache."""
        return len(self.request.input_ids) + self.launched - 1

    def stops(self) -> tuple[asyncio.Future, ...]:
        return (self.aborted,)

    def interruption(self, stop: asyncio.Future) -> RequestFailure:
        return RequestAborted(stop.result())

    def abort(self, message: str) -> None:
        if not self.aborted.done():
            self.aborted.set_result(message)
