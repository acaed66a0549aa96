"""The prefill worker's engine: PD requests in, KV out to the decode side, first token back.

A request's way through this engine (ARCHITECTURE §2):

    generate(req)  -> KVPush claims the bootstrap room, waits for decode's handshake
    admission      -> radix-cache prefix match (pinned) + pages for the rest of the prompt;
                      the cached pages go to decode at once
    scheduler loop -> chunked prefill rounds (`PrefillRounds`, workers/engine/prefill_round.py; the
                      forward in the model thread, this role's `_PushHooks`); as each layer's KV is written
                      (layer-wise streaming, `layerwise_transfer`, on channels that stream
                      layers), or after the round (all layers), the pages it completed are
                      pushed; the round that completes the
                      prompt samples token 1
    finish         -> remaining pages + TransferDone(first token) to decode; this request yields
                      TokenChunk([first]) and Finished("length", completion_tokens=1)
    always         -> full pages go to the prefix cache, the rest are freed, the room is released

Any failure (handshake timeout, decode gone, transfer error, abort) ends the request with one
`Failed` here and a TransferFailed (or a closed stream) there.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Sequence

from deepseek_pd.errors import UserError
from deepseek_pd.model.kv.layer_progress import LayerEvents, kv_written_event
from deepseek_pd.workers.engine.prefill_planner import ExtendPlan, PromptProgress
from deepseek_pd.model.runner import ModelRunner
from deepseek_pd.workers.engine.interface import (
    Event, Failed, FailureCode, Finished, GenerateRequest, Loads, TokenChunk)
from deepseek_pd.workers.transport.bootstrap_protocol import code_from_pb
from deepseek_pd.workers.transport.bootstrap_routes import RouteTable
from deepseek_pd.workers.transport import build_sender
from deepseek_pd.workers.metrics.worker_metrics import WorkerMetrics
from deepseek_pd.workers.engine.prefill_round import FirstToken, PrefillRounds, RoundHooks
from deepseek_pd.workers.engine.request_failure import AdmissionRefused, RequestFailure, failure_for
from deepseek_pd.workers.engine.request_lifecycle import EngineCore, RequestRecord
from deepseek_pd.workers.transport.worker_config import WorkerConfig
from deepseek_pd.workers.prefill.bootstrap_service import BootstrapServer, RoomRegistry
from deepseek_pd.workers.prefill.kv_push import KVPush
from deepseek_pd.workers.prefill.layer_relay import LayerRelay, layers_per_send
from deepseek_pd.workers.prefill.radix_cache import CacheHit, RadixCache
from deepseek_pd.workers.prefill.round_budget import RoundBudget, RoundBudgetConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request(RequestRecord):
    """A prefill request: its room's `push`, and the futures the scheduler completes.

    Its waits end early when the room fails: decode is gone or gave up, or an abort."""

    push: KVPush
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    first_token: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    progress: PromptProgress | None = None
    hit: CacheHit | None = None
    in_flight: int = 0  # prefill rounds using its pages (0 or 1)

    def stops(self) -> tuple[asyncio.Future, ...]:
        return self.push.room.peer_gone, self.push.room.failure

    def interruption(self, stop: asyncio.Future) -> RequestFailure:
        room = self.push.room
        if room.peer_gone.done():
            return failure_for(*room.peer_gone.result())
        failure = room.failure.result()
        return failure_for(code_from_pb(failure.code), failure.reason)

    def abort(self, message: str) -> None:
        self.push.fail(FailureCode.ABORTED, f"{message} on the prefill worker")
        self.push.room.mark_peer_gone(FailureCode.ABORTED, message)


class PrefillEngine(EngineCore[_Request]):
    """`WorkerEngine` of a prefill worker; serves the bootstrap port while started."""

    def __init__(self, runner: ModelRunner, config: WorkerConfig, model_thread=None,
                 metrics: WorkerMetrics | None = None) -> None:
        """`model_thread` (default: a `ModelThread`) is a `LockstepModelThread` when this engine is
        one rank of a group. `metrics` hears of every step, prefix-cache lookup and KV push."""
        super().__init__(runner, config, model_thread, metrics, "prefill-model")
        self.cache = RadixCache(self.pool) if config.scheduler.prefix_cache else None
        # Pages the runner already holds (its CUDA-graph scratch page) never come back.
        self.usable_pages = self.pool.num_free_pages
        self._waiting: list[_Request] = []  # handshake done, no pages yet (FIFO)
        self._running: list[_Request] = []  # pages allocated, prompt not yet computed
        self.registry: RoomRegistry | None = None
        self.server: BootstrapServer | None = None
        self.sender = None
        self._routes: RouteTable | None = RouteTable()  # one rank until a group publishes its table
        scheduler = config.scheduler  # round_budget.py: rounds sized for decode sharing the GPU
        self.round_budget = RoundBudget(RoundBudgetConfig(scheduler.chunked_prefill_size,
                                                          scheduler.prefill_round_target_ms / 1000))
        self.rounds = PrefillRounds(runner, self.sampler, scheduler.chunked_prefill_size, _PushHooks(self),
                                    on_step=self._observe_round, on_phases=self.metrics.observe_round_phases,
                                    aligned=scheduler.deterministic,
                                    round_tokens=self.round_budget.tokens)

    def _observe_round(self, seconds: float, prompts: int, tokens: int) -> None:
        self.metrics.observe_step("prefill", seconds, prompts, tokens)
        self.round_budget.observe(tokens, seconds)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self._warm_up_model(self.rounds)  # before the transport's threads can send (model_warm_up.py)
        self.registry = RoomRegistry(self.config.bootstrap)
        self.sender = build_sender(self.config.kv_transport, self.pool, self.config.transport)
        transport = self.config.transport
        self.server = BootstrapServer(self.registry, self.config.bootstrap, transport.max_chunk_bytes,
                                      transport.advertise_host,
                                      kv_streams=transport.grpc_streams if self.config.kv_transport == "grpc" else 1,
                                      metrics=self.metrics)
        self.server.servicer.routes = self._routes
        self.server.servicer.answer = self.sender.answer_handshake  # (a pulled mooncake transfer's source)
        await self.server.start()
        self._start_scheduler(self._schedule_loop(), "prefill-scheduler")
        log.info("prefill engine: KV transport %s, %d bytes of latent KV per token (%d layers x %d x %d B)",
                 self.config.kv_transport, self.pool.bytes_per_token, self.pool.num_layers, self.pool.kv_dim,
                 self.pool.buffers[0].element_size())

    @property
    def bootstrap_port(self) -> int:
        assert self.server is not None, "start() first"
        return self.server.port

    def publish_routes(self, routes: RouteTable | None) -> None:
        """Rank 0 of a prefill group: every DP rank's bootstrap endpoint, for decode's `Route` calls
        (None before the group has formed: `Route` answers UNAVAILABLE, and decode retries)."""
        self._routes = routes
        if self.server is not None:
            self.server.servicer.routes = routes

    async def _close(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
        if self.sender is not None:
            self.sender.close()

    # ---- WorkerEngine ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        if request.disagg is None:
            yield Failed(FailureCode.INVALID_ARGUMENT,
                         "this is a prefill worker: requests need disaggregated_params (bootstrap room)")
            return
        try:
            sampling = self.open_request(request)
        except UserError as exc:
            yield Failed(FailureCode.INVALID_ARGUMENT, str(exc))
            return
        try:
            push = KVPush(self.registry, self.sender, request.disagg.bootstrap_room, request.rid,
                          len(request.input_ids))
        except RequestFailure as exc:
            yield Failed(exc.code, exc.message)
            return
        state = _Request(request, sampling, push)
        self._requests[request.rid] = state
        # Where this request's time on this worker goes (its TTFT here): prefill_request_phase_seconds.
        arrived = time.perf_counter()
        try:
            await state.watch(push.handshake(self.config.bootstrap.handshake_timeout_s))
            handshaken = time.perf_counter()
            self._waiting.append(state)
            self._wakeup.set()
            await state.watch(self._admission(state))
            token, logprob, top, draft = await state.watch(asyncio.shield(state.first_token))
            sampled = time.perf_counter()
            # Seeded draws depend only on (seed, step): decode continues at step 1 with no state from here.
            # The first token's top logprobs travel with it in TransferDone (first_token_wire.py), and
            # with the MTP layer the first draft.
            await state.watch(push.finish(token, logprob, cached_tokens=state.hit.num_tokens if state.hit else 0,
                                          top=top, draft=draft))
            self.metrics.observe_request_phases({"handshake": handshaken - arrived, "prefill": sampled - handshaken,
                                                 "finish": time.perf_counter() - sampled})
            self.metrics.observe_kv_transfer(self.config.kv_transport, push.bytes_sent,
                                             push.send_seconds)
            cached = state.hit.num_tokens if state.hit else 0
            outcome: list[Event] = [TokenChunk((token,), (logprob,) if request.return_logprob else (),
                                               (top,) if top is not None else ()),
                                    Finished("length", len(request.input_ids), 1, cached_tokens=cached)]
        except RequestFailure as exc:
            push.fail(exc.code, exc.message)
            outcome = [Failed(exc.code, exc.message)]
        except Exception as exc:  # a bug must still end the request once and free its pages
            log.exception("prefill request %s failed", request.rid)
            push.fail(FailureCode.INTERNAL, repr(exc))
            outcome = [Failed(FailureCode.INTERNAL, f"prefill failed: {exc!r}")]
        finally:
            push.close()
            self._end(state)
        for event in outcome:
            yield event

    def loads(self) -> Loads:
        cached = self.cache.num_pages if self.cache else 0
        return Loads(num_running=len(self._running), num_waiting=len(self._waiting),
                     kv_used_pages=self.pool.num_used_pages - cached, kv_total_pages=self.pool.num_pages,
                     cached_pages=cached)

    # ---- internals -------------------------------------------------------------------------
    async def _admission(self, state: _Request) -> None:
        """Waits for the scheduler to give `state` its pages; AdmissionRefused after the timeout."""
        timeout = self.config.scheduler.admission_timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(state.admitted), timeout)
        except asyncio.TimeoutError:
            raise AdmissionRefused(f"request {state.rid}: no KV pages within {timeout}s") from None

    def _end(self, state: _Request) -> None:
        state.ended = True
        self._requests.pop(state.rid, None)
        if state in self._waiting:
            self._waiting.remove(state)
        if state.in_flight == 0:
            self._release_pages(state)

    def _release_pages(self, state: _Request) -> None:
        if state in self._running:
            self._running.remove(state)
        progress, state.progress = state.progress, None
        if progress is None:
            return
        pages = progress.pages
        if self.cache is not None and state.hit is not None:
            done = progress.computed == len(progress.token_ids) and state.first_token.done()
            own = pages[len(state.hit.pages):]
            if done:
                self.pool.free(self.cache.insert(progress.token_ids, pages))
            else:
                self.pool.free(own)
            self.cache.release(state.hit)
        else:
            self.pool.free(pages)
        self._wakeup.set()  # waiting requests may fit now

    def _admit_waiting(self) -> None:
        """Gives pages to waiting requests in arrival order while the pool (after eviction) allows."""
        while self._waiting:
            state = self._waiting[0]
            ids = state.request.input_ids
            need_total = self.pool.pages_for_tokens(len(ids))
            if need_total > self.usable_pages:
                self._waiting.pop(0)
                state.admitted.set_exception(AdmissionRefused(
                    f"prompt of {len(ids)} tokens needs {need_total} KV pages, "
                    f"the pool has {self.usable_pages} usable"))
                continue
            hit = self.cache.match(ids) if self.cache is not None else None
            cached = hit.pages if hit is not None else []
            try:
                own = (self.cache.alloc if self.cache is not None else self.pool.alloc)(need_total - len(cached))
            except Exception:
                if hit is not None:
                    self.cache.release(hit)
                return  # stays first in line until pages come back
            if self.cache is not None:
                self.metrics.observe_prefix_cache(len(ids), len(cached) * self.pool.page_size)
            self._waiting.pop(0)
            state.hit = hit
            state.progress = self.rounds.start(state, ids, cached + own, len(cached) * self.pool.page_size)
            self._running.append(state)
            state.push.pages_ready(state.progress.computed, state.progress.pages,
                                   self._written() if state.progress.computed else None)
            state.admitted.set_result(True)

    def _written(self) -> "torch.cuda.Event | None":
        """`ready` of the pages sent between forwards: the KV of every forward so far is in the pool
        (`run_extend` syncs before it returns), but the copy that sends them runs later, in a
        transport thread, when the next forward may already be queued; without an event it would
        wait for that one too (a whole prefill round)."""
        return kv_written_event(self.runner.model.options.device)

    async def _schedule_loop(self) -> None:
        while True:
            self._admit_waiting()
            plan = await self.rounds.run_in(self.model_thread, [s.progress for s in self._running])
            if not plan.items:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._running = [s for s in self._running
                             if s.progress is not None and s.progress.remaining > 0 and not s.first_token.done()]
            await asyncio.sleep(0)  # let handshakes and the bootstrap stream run between rounds


class _PushHooks(RoundHooks[_Request]):
    """The prefill worker's side of a round: each chunk's pages go to decode (layer by layer while
    the forward writes them, on channels that stream layers), the first token completes the request."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    def layer_progress(self, plan: ExtendPlan[_Request]) -> LayerEvents | None:
        """Layer-wise KV streaming: as the forward (model thread) writes each layer's KV, that
        layer's newly complete pages of every request in the batch whose channel streams layers
        go to the transport (event loop), in groups of layers that hold `layerwise_min_bytes`, so
        the transfer overlaps the remaining layers. None when no request's channel does (direct
        copies), or when one group would hold every layer (a short round): the forward then
        records no events and makes no hand-offs, and the pages go after it (`pages_ready`).

        Chunked prompts stay exact: each chunk hands over the pages its tokens complete, per
        layer, and `SendPlan` sends every (layer, page) cell once; only the chunk that completes
        the prompt sends the last, partial page, and `finish` (TransferDone) needs every cell.
        """
        if not self.engine.config.scheduler.layerwise_transfer:
            return None
        loop = asyncio.get_running_loop()
        streamed = [(item, seq) for item, seq in zip(plan.items, plan.seqs) if item.owner.push.streams_layers]
        if not streamed:
            return None
        targets = [(item.owner, item.computed + len(seq.token_ids)) for item, seq in streamed]

        # One wake-up of the loop per group of layers that holds `layerwise_min_bytes` of this round's
        # streamed KV, not per layer (layer_relay.py: each is Python the forward waits for).
        pool, num_layers = self.engine.pool, len(self.engine.runner.model.layers)
        layer_bytes = sum(len(seq.token_ids) for _, seq in streamed) * pool.bytes_per_page // pool.page_size
        every = layers_per_send(layer_bytes, self.engine.config.scheduler.layerwise_min_bytes, num_layers)
        if every >= num_layers:  # one group of every layer: the round's sends go after it, per chunk
            return None

        def on_loop(layer: int, ready) -> None:
            for state, computed in targets:
                if not state.ended and state.progress is not None and state.push.failed is None:
                    state.push.layers_ready(computed, state.progress.pages, layer, layer + 1, ready)

        relay = LayerRelay(loop, on_loop, every=every, last_layer=num_layers - 1)
        return LayerEvents(self.engine.runner.model.options.device, relay.notice)

    def chunk_done(self, owners: Sequence[_Request]) -> None:
        written = self.engine._written()
        for state in owners:
            # Layer-wise, every layer went out during the forward and this finds nothing left.
            state.push.pages_ready(state.progress.computed, state.progress.pages, written)

    def first_token(self, owner: _Request, first: FirstToken) -> None:
        if not owner.first_token.done():
            draft = first.draft and (first.draft[0], first.draft[1].float().tolist())
            owner.first_token.set_result((first.token_id, first.logprob, first.top, draft))

    def release(self, owner: _Request) -> None:
        self.engine._release_pages(owner)

    def failed(self, owners: Sequence[_Request], error: Exception) -> None:
        for state in owners:
            state.push.fail(FailureCode.INTERNAL, f"prefill forward failed: {error!r}")
            if not state.first_token.done():
                state.first_token.set_exception(RequestFailure(FailureCode.INTERNAL, repr(error)))
