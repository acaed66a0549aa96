"""The decode worker's engine: PD requests (KV from a prefill worker) and colocated ones.

PD request (`disagg` set):
    admit    -> pages for the prompt + a decode reserve (PageBudget), or wait / RESOURCE_EXHAUSTED
    pull     -> handshake with the prefill bootstrap for the room; KV lands in the prompt pages;
                TransferDone brings the first token (and the seeded generator's state)
    decode   -> joins the continuous batch: every round runs one `runner.decode` (absorbed MLA)
                over up to max_running_requests requests; tokens stream as they come
Colocated request (`disagg` None): the same, with the prompt prefilled here in chunked rounds
that alternate with decode rounds; it is the single-worker reference for PD parity.

Every request ends with one Finished or Failed; its pages go back on every path (after the
transport's late-write grace when a one-sided transfer failed). Abort frees at once, or right
after the forward that is using the pages.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from deepseek_pd.errors import UserError
from deepseek_pd.model.runner import DecodeSeq, ModelRunner
from deepseek_pd.model.sampling import Sampler, SamplingState, StopChecker
from deepseek_pd.workers.common.api import (
    Event, Failed, FailureCode, Finished, GenerateRequest, Loads, TokenChunk)
from deepseek_pd.workers.common.kv_transfer import TransferError, build_receiver
from deepseek_pd.workers.common.scheduler import (
    ModelThread, PromptProgress, Sampled, check_prompt, plan_extend_batch, run_decode, run_extend)
from deepseek_pd.workers.common.worker_config import WorkerConfig
from deepseek_pd.workers.decode.bootstrap_client import BootstrapClient
from deepseek_pd.workers.decode.kv_pull import pull_kv
from deepseek_pd.workers.decode.page_budget import PageBudget, Reservation

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    request: GenerateRequest
    sampling: SamplingState
    stop: StopChecker
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    aborted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    reservation: Reservation | None = None
    progress: PromptProgress | None = None  # colocated prefill
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    in_forward: bool = False
    finished: bool = False
    ended: bool = False

    @property
    def position(self) -> int:
        """Tokens already in the KV cache = where the next decode step writes."""
        return len(self.request.input_ids) + len(self.output_ids) - 1


class DecodeEngine:
    """`WorkerEngine` of a decode (or colocated) worker."""

    def __init__(self, runner: ModelRunner, config: WorkerConfig, tokenizer=None) -> None:
        """`tokenizer` (a `tokenizers.Tokenizer`, for stop strings) defaults to the model's own."""
        self.runner = runner
        self.config = config
        self.pool = runner.kv_pool
        self.tokenizer = tokenizer if tokenizer is not None else _model_tokenizer(runner)
        self.max_context = runner.model_config.max_position_embeddings
        self.sampler = Sampler()
        self.model_thread = ModelThread("decode-model")
        self._requests: dict[str, _Request] = {}
        self._prefilling: list[_Request] = []
        self._running: list[_Request] = []
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.budget: PageBudget | None = None
        self.receiver = None
        self.client: BootstrapClient | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.budget = PageBudget(self.pool, self.config.scheduler.admission_timeout_s)
        self.receiver = build_receiver(self.config.kv_transport, self.pool, self.config.transport)
        self.client = BootstrapClient(self.config.bootstrap)
        self._loop_task = asyncio.create_task(self._schedule_loop(), name="decode-scheduler")
        log.info("decode engine: KV transport %s, %d bytes of latent KV per token",
                 self.config.kv_transport, self.pool.bytes_per_token)

    async def stop(self) -> None:
        for rid in list(self._requests):
            await self.abort(rid)
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
        if self.receiver is not None:
            self.receiver.close()
        self.model_thread.close()

    # ---- WorkerEngine ----------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        prompt_len = len(request.input_ids)
        if request.rid in self._requests:
            yield Failed(FailureCode.INVALID_ARGUMENT, f"request id {request.rid!r} is already running")
            return
        model_config = self.runner.model_config
        try:
            check_prompt(request.input_ids, model_config.vocab_size, self.max_context)
            request.sampling.validate(model_config.vocab_size)
            max_new = min(request.sampling.max_new_tokens, self.max_context - prompt_len)
            stop = StopChecker(request.sampling, model_config.eos_token_ids, self.tokenizer, max_new_tokens=max_new)
        except UserError as exc:  # bad values; stop strings without a tokenizer
            yield Failed(FailureCode.INVALID_ARGUMENT, str(exc))
            return
        state = _Request(request, SamplingState.create(request.sampling, request.input_ids, model_config.vocab_size,
                                                       device=self.runner.model.options.device), stop)
        self._requests[request.rid] = state
        transfer_failed = False
        transfer_done = request.disagg is None
        try:
            pool = self.pool
            prompt_pages = pool.pages_for_tokens(prompt_len)
            reserve_tokens = min(max_new, self.config.scheduler.decode_reserve_tokens)
            reserve = max(0, pool.pages_for_tokens(prompt_len + reserve_tokens - 1) - prompt_pages)
            state.reservation = await self._watch(state, self.budget.admit(prompt_pages, reserve))
            if request.disagg is not None:
                try:
                    done = await self._watch(state, pull_kv(self.client, self.receiver, request.disagg, request.rid,
                                                            prompt_len, state.reservation.pages[:prompt_pages]))
                except TransferError as exc:
                    transfer_failed = True
                    transfer_done = exc.peer_knows  # nothing to tell the prefill side then
                    raise
                transfer_done = True
                state.cached_tokens = done.cached_tokens
                if done.generator_state and state.sampling.generator is not None:
                    state.sampling.generator.set_state(
                        torch.frombuffer(bytearray(done.generator_state), dtype=torch.uint8))
                self._accept(state, done.first_token_id, done.first_token_logprob)
                if not state.finished:
                    self._running.append(state)
            else:
                state.progress = PromptProgress(request.input_ids, state.reservation.pages, 0, state.sampling)
                self._prefilling.append(state)
            self._wakeup.set()
            while True:
                event = await self._watch(state, state.events.get())
                if isinstance(event, (Finished, Failed)):
                    terminal = event
                    break
                yield event
        except TransferError as exc:
            terminal = Failed(exc.code, exc.message)
        except Exception as exc:
            log.exception("decode request %s failed", request.rid)
            terminal = Failed(FailureCode.INTERNAL, f"decode failed: {exc!r}")
        finally:
            # Pages go back before the terminal event is out, whatever the consumer does next.
            self._end(state, transfer_failed)
            if not transfer_done:
                self._tell_prefill(request, "decode request ended before its KV arrived")
        yield terminal

    def _tell_prefill(self, request: GenerateRequest, reason: str) -> None:
        """Best effort, in the background: the prefill side drops the room now, not at its timeout."""
        task = asyncio.create_task(self.client.abort(request.disagg, reason))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, rid: str) -> bool:
        state = self._requests.get(rid)
        if state is None:
            return False
        if not state.aborted.done():
            state.aborted.set_result(f"request {rid} aborted")
        return True

    def loads(self) -> Loads:
        # Waiting: admitted or not, every request that is not in the decode batch yet.
        return Loads(num_running=len(self._running), num_waiting=len(self._requests) - len(self._running),
                     kv_used_pages=self.pool.num_used_pages, kv_total_pages=self.pool.num_pages,
                     extra={"reserved_pages": self.budget.reserved if self.budget else 0,
                            "page_size": self.pool.page_size})

    def is_healthy(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    # ---- internals -------------------------------------------------------------------------
    async def _watch(self, state: _Request, awaitable):
        """Awaits `awaitable` unless the request is aborted first (then cancels it: the bootstrap
        stream closes, which the prefill side sees)."""
        if state.aborted.done():
            # Checked first: a lagging consumer always finds a queued event, and asyncio.wait
            # would hand it over instead of the abort, which then waited on the whole backlog.
            awaitable.close()  # never started: nothing to undo
            raise TransferError(FailureCode.ABORTED, state.aborted.result())
        task = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({task, state.aborted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise TransferError(FailureCode.ABORTED, state.aborted.result())
        return task.result()

    def _accept(self, state: _Request, token: int, logprob: float) -> None:
        """Records a sampled token, streams it, and ends the request if it stops here."""
        state.output_ids.append(token)
        state.sampling.append(token)
        finish = state.stop.append(token)
        logprobs = (logprob,) if state.request.return_logprob else ()
        state.events.put_nowait(TokenChunk((token,), logprobs))
        if finish is not None:
            state.finished = True
            state.events.put_nowait(Finished(finish.reason, len(state.request.input_ids), len(state.output_ids),
                                             cached_tokens=state.cached_tokens, matched_stop=finish.matched_stop))

    def _fail(self, state: _Request, code: FailureCode, message: str) -> None:
        state.finished = True
        state.events.put_nowait(Failed(code, message))

    def _end(self, state: _Request, transfer_failed: bool) -> None:
        if state.ended:
            return
        state.ended = True
        self._requests.pop(state.request.rid, None)
        if not state.in_forward:
            self._release(state, transfer_failed)

    def _release(self, state: _Request, transfer_failed: bool = False) -> None:
        for queue in (self._running, self._prefilling):
            if state in queue:
                queue.remove(state)
        if state.reservation is not None:
            grace = self.receiver.late_write_grace_s if transfer_failed else 0.0
            self.budget.release(state.reservation, delay_s=grace)

    async def _schedule_loop(self) -> None:
        while True:
            if not self._prefilling and not self._running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                if self._prefilling:
                    await self._prefill_round()
                if self._running:
                    await self._decode_round()
            except Exception:  # a bug in a round must fail the requests it held, never strand them
                log.exception("decode scheduler round failed; failing the requests in flight")
                self._fail_in_flight("decode scheduler error (see the worker log)")
            await asyncio.sleep(0)  # let transfers, new requests and aborts in between rounds

    def _fail_in_flight(self, message: str) -> None:
        """Ends every scheduled request with INTERNAL; their consumers then free the pages (`_end`)."""
        states = self._running + self._prefilling
        self._running.clear()
        self._prefilling.clear()
        for state in states:
            state.in_forward = False
            if not state.finished:
                self._fail(state, FailureCode.INTERNAL, message)

    async def _forward(self, batch: list[_Request], fn, *args) -> Sampled | None:
        for state in batch:
            state.in_forward = True
        try:
            return await self.model_thread.run(fn, *args)
        except Exception as exc:
            log.exception("forward failed")
            for state in batch:
                if not state.ended:
                    self._fail(state, FailureCode.INTERNAL, f"forward failed: {exc!r}")
            return None
        finally:
            for state in batch:
                state.in_forward = False
                if state.ended:
                    self._release(state)

    async def _prefill_round(self) -> None:
        plan = plan_extend_batch([s.progress for s in self._prefilling], self.config.scheduler.chunked_prefill_size)
        owners = {id(s.progress): s for s in self._prefilling}
        batch = [owners[id(item)] for item in plan.items]
        rows = plan.finishing
        sampled = await self._forward(batch, run_extend, self.runner, self.sampler, plan.seqs, rows,
                                      [batch[r].sampling for r in rows])
        if sampled is None:
            self._prefilling = [s for s in self._prefilling if not s.finished]
            return
        for state, seq in zip(batch, plan.seqs):
            if state.progress is not None:
                state.progress.computed += len(seq.token_ids)
        for row, token, logprob in zip(rows, sampled.token_ids, sampled.logprobs):
            state = batch[row]
            if state.ended:
                continue
            self._prefilling.remove(state)
            self._accept(state, token, logprob)
            if not state.finished:
                self._running.append(state)

    async def _decode_round(self) -> None:
        batch: list[_Request] = []
        for state in self._running[:self.config.scheduler.max_running_requests]:
            needed = self.pool.pages_for_tokens(state.position + 1) - len(state.reservation.pages)
            if needed > 0:
                try:
                    self.budget.grow(state.reservation, needed)
                except TransferError as exc:
                    self._running.remove(state)
                    self._fail(state, exc.code, exc.message)
                    continue
            batch.append(state)
        if not batch:
            return
        seqs = [DecodeSeq(s.output_ids[-1], s.position, s.reservation.pages) for s in batch]
        sampled = await self._forward(batch, run_decode, self.runner, self.sampler, seqs, [s.sampling for s in batch])
        if sampled is None:
            self._running = [s for s in self._running if not s.finished]
            return
        for state, token, logprob in zip(batch, sampled.token_ids, sampled.logprobs):
            if state.ended:
                continue
            self._accept(state, token, logprob)
            if state.finished:
                self._running.remove(state)


def _model_tokenizer(runner: ModelRunner):
    """The checkpoint's tokenizer.json, or None (then stop strings are refused per request)."""
    from tokenizers import Tokenizer

    from deepseek_pd.errors import UserError
    from deepseek_pd.model.tiny import resolve_model_path

    try:
        path = resolve_model_path(runner.config.model) / "tokenizer.json"
    except UserError:  # an in-memory model (tests, tools) has no directory
        return None
    return Tokenizer.from_file(str(path)) if path.is_file() else None
